"""Step metrics: merging token statistics across micro-batches and ranks, weighted by how many items each one
averaged over (`MetricMerger`), and the step's per-sample statistics gathered in one collective.

A mean of per-micro-batch means is wrong whenever micro-batches hold different numbers of tokens (and
padding micro-batches, which hold none, would dilute it). `MetricMerger` keeps sum(value * weight) and
sum(weight) per key instead, so the merged value equals the metric computed on the concatenated data.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from rlkit.batch import ScoredBatch
from rlkit.collectives import all_gather_cat, all_reduce

__all__ = ["MetricMerger", "per_task", "reduction", "step_statistics", "to_host", "without_absent_tasks"]

_MAX_SUFFIXES = ("/max", "_max")
_MIN_SUFFIXES = ("/min", "_min")


def reduction(key: str) -> str:
    """How `key` is merged: "max", "min", or "mean" (weighted by the item counts)."""
    if key.endswith(_MAX_SUFFIXES):
        return "max"
    if key.endswith(_MIN_SUFFIXES):
        return "min"
    return "mean"


class MetricMerger:
    """Accumulates per-micro-batch metric dicts and merges them, across ranks too.

    Usage (in the learner)::

        merger = MetricMerger()
        for micro in micro_batches:
            _, metrics = losses.ppo_clip(..., micro.mask)
            merger.add(metrics, micro.mask.sum())
        merged = merger.compute()  # all-reduced when torch.distributed is initialised

    Keys ending in `/max` or `_max` reduce by max, `/min` or `_min` by min (over entries with weight > 0),
    everything else is `sum(v * w) / sum(w)`. A key whose total weight is 0 gives 0. Sums are kept in
    float64 on the metrics' device; there is no `.item()`, so nothing synchronises with the GPU.
    """

    def __init__(self) -> None:
        self._sum: dict[str, Tensor] = {}
        self._weight: dict[str, Tensor] = {}
        self._max: dict[str, Tensor] = {}
        self._min: dict[str, Tensor] = {}
        self._device: torch.device | None = None

    def add(self, metrics: dict[str, Tensor], weight: Tensor | float) -> None:
        """Record one micro-batch: every value in `metrics` is a mean over `weight` items (e.g. tokens).

        `weight` may be a number or a 0-dim tensor, and may be 0: such an entry (a padding micro-batch)
        changes nothing, even if its values are NaN.
        """
        for key, value in metrics.items():
            value = torch.as_tensor(value).detach()
            if value.dim() != 0:
                raise ValueError(
                    f"metric {key!r} has shape {tuple(value.shape)}; metrics must be 0-dim tensors"
                )
            if self._device is None:
                self._device = value.device
            value = value.to(self._device, torch.float64)
            w = torch.as_tensor(weight, device=self._device).detach().to(torch.float64)
            has_weight = w > 0
            kind = reduction(key)
            if kind == "mean":
                # where, not v * w: a NaN value with weight 0 must not poison the sum.
                contribution = torch.where(has_weight, value * w, torch.zeros_like(value))
                self._sum[key] = self._sum.get(key, 0.0) + contribution
                self._weight[key] = self._weight.get(key, 0.0) + torch.where(
                    has_weight, w, torch.zeros_like(w)
                )
            else:
                store, fill, pick = (
                    (self._max, float("-inf"), torch.maximum)
                    if kind == "max"
                    else (self._min, float("inf"), torch.minimum)
                )
                candidate = torch.where(has_weight, value, torch.full_like(value, fill))
                store[key] = pick(store[key], candidate) if key in store else candidate

    def keys(self) -> list[str]:
        return sorted([*self._sum, *self._max, *self._min])

    def compute(self, group=None, *, check_keys: bool = True) -> dict[str, Tensor]:
        """The merged metrics, float32 0-dim tensors.

        When torch.distributed is initialised, the result is merged over the ranks of `group` (default:
        the world): every rank must call `compute` (it is a collective) and must have added the same keys
        (with `check_keys`, the sorted key lists are compared first with one small collective and one host
        sync; a mismatch raises ValueError on every rank instead of a hang or a silently wrong merge). Then one all-reduce for the weighted sums and one for max and min
        together (min is taken as -max(-x)), in the same order on every rank. With the NCCL backend the
        reductions run on the current CUDA device.
        """
        device = self._device or torch.device("cpu")
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        zero = torch.zeros((), dtype=torch.float64, device=device)
        mean_keys, max_keys, min_keys = sorted(self._sum), sorted(self._max), sorted(self._min)

        sums = torch.stack([self._sum[k].to(device) for k in mean_keys] + [zero])
        weights = torch.stack([self._weight[k].to(device) for k in mean_keys] + [zero])
        extremes = torch.stack(
            [self._max[k].to(device) for k in max_keys]
            + [-self._min[k].to(device) for k in min_keys]
            + [zero]
        )
        if distributed:
            if check_keys:
                self._check_same_keys(device, group)
            world = dist.get_world_size(group)
            totals = all_reduce(torch.cat([sums, weights]), world, device, group=group)
            sums, weights = totals[: len(sums)], totals[len(sums) :]
            extremes = all_reduce(extremes, world, device, op=dist.ReduceOp.MAX, group=group)

        out: dict[str, Tensor] = {}
        ok = weights > 0
        means = torch.where(
            ok, sums / torch.where(ok, weights, torch.ones_like(weights)), torch.zeros_like(sums)
        )
        for i, k in enumerate(mean_keys):
            out[k] = means[i]
        for i, k in enumerate(max_keys + min_keys):
            v = extremes[i] if i < len(max_keys) else -extremes[i]
            # +-inf means no entry had weight > 0 on any rank.
            out[k] = torch.where(torch.isinf(v), torch.zeros_like(v), v)
        return {k: out[k].to(torch.float32) for k in sorted(out)}

    def _check_same_keys(self, device, group) -> None:
        digest = float(zlib.crc32("\n".join(self.keys()).encode()))
        probe = torch.tensor([digest, -digest], dtype=torch.float64, device=device)
        probe = all_reduce(probe, dist.get_world_size(group), device, op=dist.ReduceOp.MAX, group=group)
        # max(d) == d and max(-d) == -d on every rank only if all digests are equal.
        if not bool((probe[0] == digest) & (probe[1] == -digest)):
            raise ValueError(
                "MetricMerger.compute: ranks added different metric keys; every rank must add the same keys "
                f"(this rank has {self.keys()})"
            )


def step_statistics(
    produced: ScoredBatch, mask: Tensor, zero_std: Tensor, *, staleness: int, world: int, device
) -> dict:
    """The step's global per-sample statistics and counters (reward, accuracy, lengths, reward terms, environment
    counts), gathered in one collective (ranks hold equal numbers of samples); 0-dim tensors, plus the
    generation counters over all ranks (`gen_tokens`, `gen_seq_tokens`, `gen_seq_tokens_sq`) for throughput
    and MFU."""
    rb = produced.rollout
    columns = {
        "reward": produced.rewards,
        "correct": produced.correct,
        "zero_std": zero_std.float(),
        "length": mask.sum(-1).float(),
        "clipped": torch.tensor([f == "length" for f in rb.finish_reasons], dtype=torch.float32),
        **{f"per_fn/{k}": v for k, v in produced.per_fn.items()},
        **{f"env/{k}": v for k, v in produced.env_stats.items()},
        **{f"task/{k}": v for k, v in produced.tasks.items()},
    }
    counters = {
        "reward/errors": produced.errors, "reward/timeouts": produced.timeouts,
        "env/errors": produced.env_errors, "env/timeouts": produced.env_timeouts,
        "gen_tokens": rb.stats.get("gen_tokens", mask.sum()),
        "gen_seq_tokens": rb.stats.get("gen_seq_tokens", 0.0),
        "gen_seq_tokens_sq": rb.stats.get("gen_seq_tokens_sq", 0.0),
    }  # fmt: skip
    n = rb.num_samples
    local = torch.cat(
        [torch.stack([v.to(device, torch.float32) for v in columns.values()], 1).flatten()]
        + [torch.tensor([float(c) for c in counters.values()], device=device)]
    )
    rows = all_gather_cat(local[None], world, device)  # [world, n * K + C]: the one collective
    per_sample = rows[:, : n * len(columns)].reshape(world, n, len(columns)).flatten(0, 1)
    col = {k: per_sample[:, i] for i, k in enumerate(columns)}
    sums = rows[:, n * len(columns) :].sum(0)
    count = dict(zip(counters, sums))
    all_rewards = col["reward"]
    stats = {
        "reward/mean": all_rewards.mean(),
        "reward/std": all_rewards.std(unbiased=False) if all_rewards.numel() > 1 else torch.zeros(()),
        "reward/max": all_rewards.max(),
        "reward/min": all_rewards.min(),
        "accuracy": col["correct"].mean(),
        "frac_reward_zero_std": col["zero_std"].mean(),
        "response_length/mean": col["length"].mean(),
        "response_length/max": col["length"].max(),
        "response_length/clip_ratio": col["clipped"].mean(),
        "reward/errors": count["reward/errors"],
        "reward/timeouts": count["reward/timeouts"],
        "gen_tokens": count["gen_tokens"],
        "gen_seq_tokens": count["gen_seq_tokens"],
        "gen_seq_tokens_sq": count["gen_seq_tokens_sq"],
    }
    for name in produced.per_fn:
        short = name.split(":")[-1].split(".")[-1]  # module:fn -> fn
        stats[f"reward/{short}"] = col[f"per_fn/{name}"].mean()
    for name in produced.env_stats:  # env/turns, env/tool_calls: means per episode
        stats[f"env/{name}"] = col[f"env/{name}"].mean()
    stats["env/errors"], stats["env/timeouts"] = count["env/errors"], count["env/timeouts"]
    stats.update(per_task(col["reward"], col["correct"], {k: col[f"task/{k}"] for k in produced.tasks}))
    stats["staleness/mean"] = stats["staleness/max"] = float(staleness)
    stats["staleness/dropped"] = 0.0
    stats.update(produced.stats)
    return stats


def per_task(rewards: Tensor, correct: Tensor, tasks: dict[str, Tensor]) -> dict[str, Tensor]:
    """`reward/<task>`, `accuracy/<task>` (means over the task's samples) and `task_samples/<task>` (how many),
    from [N] rewards, correct flags and 1/0 task masks; a task without samples gets means of 0, which
    `without_absent_tasks` removes once the values are on the host."""
    out = {}
    for name, m in tasks.items():
        n = m.sum()
        out[f"reward/{name}"] = (rewards * m).sum() / n.clamp(min=1)
        out[f"accuracy/{name}"] = (correct * m).sum() / n.clamp(min=1)
        out[f"task_samples/{name}"] = n
    return out


def without_absent_tasks(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` without the `reward/<task>` / `accuracy/<task>` of tasks that had no sample this step."""
    absent = [
        k.removeprefix("task_samples/")
        for k, v in metrics.items()
        if k.startswith("task_samples/") and v == 0
    ]
    drop = {f"{kind}/{task}" for task in absent for kind in ("reward", "accuracy")}
    return {k: v for k, v in metrics.items() if k not in drop}


def to_host(stats: dict) -> dict[str, float]:
    """Every statistic (tensors or numbers) to host floats at once: one device-to-host copy."""
    names = list(stats)
    values = torch.stack(
        [torch.as_tensor(stats[k], dtype=torch.float32).reshape(()).cpu() for k in names]
    ).tolist()
    return dict(zip(names, values))


def run_summary(history: list[dict[str, float]]) -> list[str]:
    """Lines that sum up what the run counted step by step instead of logging it every step (rank 0 logs them
    at the end): the steps where dynamic sampling fell short (`dynamic/shortfall_groups`)."""
    lines = []
    short = [m["dynamic/shortfall_groups"] for m in history if m.get("dynamic/shortfall_groups", 0) > 0]
    if short:
        lines.append(
            f"dynamic sampling fell short on {len(short)} of {len(history)} steps: {int(sum(short))} groups without "
            "signal were trained (masked out of the loss); more generation batches (algo.max_gen_batches) would "
            "fill more of them"
        )
    return lines
