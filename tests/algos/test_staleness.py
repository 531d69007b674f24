"""rlkit.algos.staleness against naive loops over rows and tokens."""

import torch

from rlkit.algos import staleness
from rlkit.batch import NO_VERSION


def _case():
    versions = torch.tensor(
        [[3, 3, 4, 4, NO_VERSION], [2, 2, 2, NO_VERSION, NO_VERSION], [4, NO_VERSION, 5, 5, 5]]
    )
    mask = versions != NO_VERSION
    mask[2, 1] = False  # an environment token
    return versions, mask


def test_metrics_equal_a_naive_loop():
    versions, mask = _case()
    current = 5
    lags, mixed = [], 0
    for i in range(3):
        seen = {int(versions[i, t]) for t in range(5) if mask[i, t]}
        lags += [current - v for v in (int(versions[i, t]) for t in range(5) if mask[i, t])]
        mixed += len(seen) > 1
    per_token, per_row = staleness.staleness_metrics(versions, mask, current)
    assert float(per_token["staleness/token_mean"]) == sum(lags) / len(lags)
    assert float(per_token["staleness/token_max"]) == max(lags) == 3
    assert float(per_row["inflight/mixed_rows"]) == mixed / 3 == 2 / 3
    before = versions.clone()
    staleness.fresh_tokens(versions, mask, current, 1)
    assert torch.equal(versions, before)  # inputs untouched


def test_fresh_tokens_drops_exactly_the_tokens_older_than_the_bound():
    versions, mask = _case()
    for bound in (None, 0, 1, 2, 3):
        got = staleness.fresh_tokens(versions, mask, 5, bound)
        for i in range(3):
            for t in range(5):
                keep = bool(mask[i, t]) and (bound is None or 5 - int(versions[i, t]) <= bound)
                assert bool(got[i, t]) == keep, (bound, i, t)
