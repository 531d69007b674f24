"""reasoning-gym task weights (data.tasks) are checked at start-up: each positive and finite, and their total
finite (reasoning-gym's composite dataset refuses an infinite total only when the data is generated, after
the model loaded)."""

import pytest

from rlkit.config.schema import ConfigError
from rlkit.data.reasoning_gym import check_tasks

pytest.importorskip("reasoning_gym")


@pytest.mark.parametrize(
    "tasks, expected",
    [
        (
            [{"chain_sum": {"weight": float("inf")}}, "leg_counting"],
            "data.tasks.chain_sum.weight=inf must be a",
        ),
        ([{"chain_sum": {"weight": 1e308}}, {"leg_counting": {"weight": 1e308}}], "add up to inf"),
    ],
)
def test_infinite_weights_or_an_infinite_total_are_refused_at_start_up(tasks, expected):
    with pytest.raises(ConfigError, match=expected):
        check_tasks(tasks)
    check_tasks([{"chain_sum": {"weight": 1e300}}, {"leg_counting": {"weight": 1e300}}])  # finite: fine
