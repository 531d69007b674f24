# ruff: noqa: F811  (the `tiny` fixture is imported from run_helpers and requested by name)
"""The reward-function contract: dataset columns by name or all of them, batched functions called once
per batch (per route), routing by a column, and every failing kind (raising, hanging, non-numeric, wrong
length) counted without stopping anything. Expected values are worked out by hand from the rows."""

import pytest
from run_helpers import tiny  # noqa: F401  (the shared tiny-model fixture)

from rlkit.rewards import RewardScorer

pytestmark = pytest.mark.slow  # a trainer run and reward worker processes: `make test-fast` leaves it out

ROWS = [
    {"question": "q0", "answer": "#### 7", "unit": "kg", "tolerance": 0.25, "data_source": "alpha"},
    {"question": "q1", "answer": "#### 1", "unit": "m", "tolerance": 0.5, "data_source": "beta"},
    {"question": "q2", "answer": "#### 2", "unit": "kg", "tolerance": 0.0, "data_source": "gamma"},
]
RESPONSES = ["it weighs 7 kg", "about 1 km", "2"]


def score(fn, rows=ROWS, **kw):
    scorer = RewardScorer(fn, num_workers=kw.pop("num_workers", 2), **kw)
    try:
        return scorer.score(["p"] * len(rows), RESPONSES[: len(rows)], [r["answer"] for r in rows], rows=rows)
    finally:
        scorer.close()


def test_named_columns_and_all_columns():
    s = score("rlkit_test_rewards:uses_columns")
    # "kg" in "it weighs 7 kg" -> 1 + 0.25; "m" in "about 1 km" -> 1 + 0.5; "kg" not in "2" -> 0 + 0.0
    assert s.total == [1.25, 1.5, 0.0] and s.errors == 0
    s = score("rlkit_test_rewards:all_columns")
    # question, unit, tolerance, data_source: `answer` is a fixed argument, not passed again as a column
    assert s.total == [4.0, 4.0, 4.0]


def test_batched_function_is_called_once_per_batch():
    s = score("rlkit_test_rewards:batch_size_reward")
    assert s.total == [3.5, 3.0, 3.5] and s.errors == 0


def test_routing_by_a_column_and_batched_calls_per_route():
    s = score("rlkit_test_rewards:by_source")
    assert s.total == [10.0, 20.0, -1.0]
    # alpha and gamma (the default) go to the batched function together, beta to by_source alone.
    s = score(
        "rlkit_test_rewards:batch_size_reward",
        route_by="data_source",
        routes={"beta": "rlkit_test_rewards:by_source"},
    )
    assert s.total == [2.5, 20.0, 2.5]
    assert s.per_fn["rlkit_test_rewards:batch_size_reward"] == [2.5, 20.0, 2.5]


@pytest.mark.parametrize(
    "fn, kw, errors, timeouts",
    [
        ("rlkit_test_rewards:non_numeric", {}, 1, 0),  # row 0's answer has a 7: "seven"
        ("rlkit_test_rewards:batched_wrong_length", {}, 3, 0),
        ("rlkit_test_rewards:batched_hanging", {"batch_timeout_s": 1.0}, 3, 3),
    ],
)
def test_failing_kinds_are_counted_and_score_zero(fn, kw, errors, timeouts):
    s = score(fn, **kw)
    assert (s.errors, s.timeouts) == (errors, timeouts)
    if errors == 1:
        assert s.total == [0.0, 1.0, 1.0]
    else:
        assert s.total == [0.0, 0.0, 0.0]


def test_a_missing_route_column_is_a_clear_error():
    with pytest.raises(KeyError, match="reward.route_by='origin' is not a column"):
        score("math", route_by="origin", routes={"x": "format"}, num_workers=1)


def test_training_routes_rewards_by_a_dataset_column(tiny, tmp_path):
    """A local JSONL dataset with a `data_source` column: in training, each sample's reward comes from
    the function its row routes to (by_source gives alpha 10, beta 20; `constant` gives 0.25)."""
    import json

    from run_helpers import overrides

    from rlkit.data.prompts import PromptOrder
    from rlkit.train import compose, load_config
    from rlkit.trainer import Trainer

    data = tmp_path / "data.jsonl"
    rows = [
        {
            "question": f"What is {i} + 1?",
            "answer": f"#### {i + 1}",
            "data_source": ["alpha", "beta", "web"][i % 3],
        }
        for i in range(24)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(
        compose(
            overrides(
                tiny,
                tmp_path / "run",
                "trainer.steps=1",
                f"data.path={data}",
                "data.eval_size=4",
                "reward.fn=rlkit_test_rewards:constant",
                "reward.route_by=data_source",
                "+reward.routes.alpha=rlkit_test_rewards:by_source",
                "+reward.routes.beta=rlkit_test_rewards:by_source",
            )  # fmt: skip
        )
    )
    trainer = Trainer(cfg)
    try:
        sources = [r["data_source"] for r in trainer.rollouts.train_prompts.rows]
        drawn = PromptOrder(len(sources), seed=cfg.trainer.seed).next(2)
        (m,) = trainer.train()
    finally:
        trainer.close()
    want = sum({"alpha": 10.0, "beta": 20.0, "web": 0.25}[sources[i]] for i in drawn) / 2
    assert m["reward/mean"] == pytest.approx(want)
