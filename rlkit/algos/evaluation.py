"""Evaluation statistics from n samples per prompt: pass@k, maj@k, standard errors, paired differences.

Pure functions on per-prompt counts (no model, no I/O). `rlkit/rollout/evaluation.py` feeds them the
samples of an evaluation; `scripts/compare_evals.py` the per-prompt values two `eval.json` files keep.

- pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374, eq. 1):
  with n samples of which c are correct, the probability that a random k-subset holds a correct one,
  `1 - C(n-c, k) / C(n, k)`, is an unbiased estimate of pass@k for every k <= n. It is computed as the
  product `1 - prod_{i=n-c+1}^{n} (1 - k/i)` (no huge binomials); `n - c < k` gives 1 exactly.
  The score of a set of prompts is the mean over prompts.
- maj@k (majority voting, "self-consistency", Wang et al. 2022, arXiv:2203.11171): the answers extracted
  from the FIRST k samples of a prompt vote; the most frequent answer wins, a tie goes to the answer that
  appears first among those k samples; samples without an extracted answer (None) do not vote. The
  prompt scores 1 when the winning answer's first sample is correct, 0 otherwise (or when nobody voted).
  "The first k" (not an expectation over k-subsets) keeps maj@k a plain count on the samples that
  eval.json stores; with the samples drawn i.i.d. it is an unbiased, if noisier, estimate of the same
  quantity.
- standard error over prompts: `std(values, unbiased) / sqrt(#prompts)` (as lm-evaluation-harness
  reports beside a mean); NaN with fewer than two prompts.
- paired difference: two evaluations of the same prompts; the mean of the per-prompt differences `b - a`
  and its standard error `std(b - a) / sqrt(#prompts)`, smaller than the unpaired one when the two
  scores are correlated across prompts (the hard prompts stay hard).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["pass_at_k", "maj_at_k", "majority_vote", "stderr", "paired_difference", "mean_and_spread"]


def pass_at_k(n: Tensor | Sequence[int], c: Tensor | Sequence[int], k: int) -> Tensor:
    """[P] float64: the unbiased pass@k of each prompt, from its samples `n[p]` and correct samples `c[p]`.

    Raises ValueError when k < 1, k > n[p] for some prompt, or c is outside [0, n].
    """
    n = torch.as_tensor(n, dtype=torch.long)
    c = torch.as_tensor(c, dtype=torch.long)
    if n.shape != c.shape or n.dim() != 1:
        raise ValueError(f"n and c must be 1-D of the same length, got {tuple(n.shape)} and {tuple(c.shape)}")
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    if bool((n < k).any()):
        raise ValueError(f"k={k} is larger than the samples of a prompt (min n = {int(n.min())})")
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError("every c must be in [0, n]")
    out = torch.empty(n.shape, dtype=torch.float64)
    for p, (n_p, c_p) in enumerate(zip(n.tolist(), c.tolist())):
        if n_p - c_p < k:
            out[p] = 1.0
            continue
        i = torch.arange(n_p - c_p + 1, n_p + 1, dtype=torch.float64)  # empty when c = 0: product 1
        out[p] = 1.0 - torch.prod(1.0 - k / i)
    return out


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index (into `answers`) of the first sample holding the winning answer; None when nobody voted.

    The most frequent non-None answer wins; a tie goes to the answer whose first occurrence comes first.
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return None
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best]


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]], k: int) -> Tensor:
    """[P] float64: 1 where the majority answer of prompt p's first k samples is correct (module doc)."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    out = torch.zeros(len(answers), dtype=torch.float64)
    for p, (a, ok) in enumerate(zip(answers, correct)):
        if len(a) < k or len(ok) != len(a):
            raise ValueError(f"prompt {p}: {len(a)} answers and {len(ok)} verdicts for maj@{k}")
        winner = majority_vote(list(a[:k]))
        out[p] = float(winner is not None and bool(ok[winner]))
    return out


def stderr(values: Tensor | Sequence[float]) -> float:
    """Standard error of the mean over prompts: unbiased std / sqrt(#values); NaN for fewer than 2."""
    v = torch.as_tensor(values, dtype=torch.float64)
    if v.numel() < 2:
        return math.nan
    return float(v.std(unbiased=True) / math.sqrt(v.numel()))


def paired_difference(a: Tensor | Sequence[float], b: Tensor | Sequence[float]) -> tuple[float, float]:
    """(mean of b - a, its paired standard error) over prompts scored by two evaluations, in the same order."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    d = b - a
    return float(d.mean()) if d.numel() else math.nan, stderr(d)


def mean_and_spread(values: Sequence[float]) -> tuple[float, float]:
    """(mean, unbiased std) of one metric over seeds; the std is NaN for a single seed."""
    v = torch.as_tensor(list(values), dtype=torch.float64)
    if v.numel() == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(unbiased=True)) if v.numel() > 1 else math.nan
