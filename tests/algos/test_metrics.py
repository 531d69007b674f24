import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from algos_helpers import ragged_mask

from rlkit.algos import losses
from rlkit.collectives import free_port
from rlkit.metrics import MetricMerger, reduction


def _batch(seed=0, n=10, t=7):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(n, t, gen)
    old = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 2
    logp = old + 0.4 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, t, generator=gen, dtype=torch.float64)
    return logp, old, adv, mask


def _metrics(logp, old, adv, mask):
    return losses.ppo_clip(logp, old, adv, mask, clip_high=0.28, dual_clip=2.0)[1]


CHUNKS = [(0, 2), (2, 3), (3, 8), (8, 10)]


def test_reduction_by_suffix():
    assert reduction("ratio_max") == reduction("rollout_is/max") == "max"
    assert reduction("ratio_min") == reduction("rollout_is/min") == "min"
    assert reduction("clip_frac") == reduction("maximum") == "mean"


def test_by_hand():
    merger = MetricMerger()
    merger.add({"a": torch.tensor(1.0), "x_max": torch.tensor(3.0), "x_min": torch.tensor(3.0)}, 1)
    merger.add(
        {"a": torch.tensor(4.0), "x_max": torch.tensor(5.0), "x_min": torch.tensor(-1.0)}, torch.tensor(3)
    )
    # a = (1*1 + 4*3) / 4 = 3.25, never the mean of means 2.5.
    got = merger.compute()
    assert got == {"a": torch.tensor(3.25), "x_max": torch.tensor(5.0), "x_min": torch.tensor(-1.0)}


def test_merge_of_micro_batches_equals_metrics_of_concatenation():
    logp, old, adv, mask = _batch()
    merger = MetricMerger()
    for a, b in CHUNKS:
        merger.add(_metrics(logp[a:b], old[a:b], adv[a:b], mask[a:b]), mask[a:b].sum())
    # A padding micro-batch: weight 0 and garbage values (NaN, a huge max, a tiny min) change nothing.
    merger.add({k: torch.tensor(float("nan")) for k in _metrics(logp, old, adv, mask)}, torch.tensor(0))
    merger.add({"ratio_max": torch.tensor(1e9), "ratio_min": torch.tensor(-1e9)}, 0.0)
    merged = merger.compute()
    whole = _metrics(logp, old, adv, mask)
    assert merged.keys() == whole.keys()
    for k in whole:
        torch.testing.assert_close(merged[k], whole[k].float(), msg=k)


def test_all_zero_weight_gives_zero_and_bad_shapes_raise():
    merger = MetricMerger()
    merger.add({"a": torch.tensor(float("nan")), "b_max": torch.tensor(2.0)}, 0)
    assert merger.compute() == {"a": torch.tensor(0.0), "b_max": torch.tensor(0.0)}
    with pytest.raises(ValueError, match="0-dim"):
        merger.add({"a": torch.ones(2)}, 1)


def _worker(rank, world, port, chunks, result_queue):
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        logp, old, adv, mask = _batch()
        merger = MetricMerger()
        for a, b in chunks[rank]:
            merger.add(_metrics(logp[a:b], old[a:b], adv[a:b], mask[a:b]), mask[a:b].sum())
        merged = {k: v.tolist() for k, v in merger.compute().items()}
        # Second round: rank 1 adds a key rank 0 does not have; both ranks must raise, not hang.
        if rank == 1:
            merger.add({"only_on_rank_1": torch.tensor(1.0)}, 1)
        try:
            merger.compute()
            error = None
        except ValueError as e:
            error = str(e)
        result_queue.put((rank, (merged, error)))
        dist.destroy_process_group()
    except Exception:
        result_queue.put((rank, "worker crashed:\n" + traceback.format_exc()))


def _spawn():
    port = free_port()
    # Rank 0 has one real micro-batch and a zero-row one; rank 1 has three (uneven, as in the learner).
    chunks = [[(0, 3), (3, 3)], [(3, 6), (6, 7), (7, 10)]]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, chunks, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    for r in (0, 1):
        assert not (isinstance(results[r], str) and results[r].startswith("worker crashed")), results[r]
    return results


def test_two_process_gloo_merge_equals_single_process_and_key_mismatch_raises():
    results = _spawn()
    logp, old, adv, mask = _batch()
    whole = _metrics(logp, old, adv, mask)
    for rank in (0, 1):
        merged, error = results[rank]
        assert merged.keys() == whole.keys()
        for k in whole:
            torch.testing.assert_close(torch.tensor(merged[k]), whole[k].float(), msg=f"rank {rank} {k}")
        assert error is not None and "different metric keys" in error
