"""Evaluation of the engine's current weights on a prompt set: the one code path of training's periodic
evaluation (`LocalRollouts.evaluate`) and of `python -m rlkit.eval`.

    evaluate_prompts(producer, prompts, settings, rank, world)  -> [PromptResult] of every prompt (all ranks)
    summarize(results, ks, task_key)                            -> {"total": {...}, "<task>": {...}}
    training_metrics(summary, ks)                               -> {"eval/pass@1": ..., "eval/pass@1/<task>": ...}

n samples per prompt are drawn with the evaluation sampling (never masked, whatever n), scored by the
configured reward functions; "correct" is the main reward function's verdict (or its route's), as in
training, and a failed episode (an environment step that raised or hung) scores 0 and is not correct.
Every rank takes every `world`-th prompt; the per-prompt results are gathered so every rank returns the
same numbers. The statistics are rlkit/algos/evaluation.py's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rlkit.algos.evaluation import maj_at_k, pass_at_k, stderr
from rlkit.collectives import gather_objects
from rlkit.config.rules import local_path_exists
from rlkit.config.schema import ConfigError
from rlkit.rewards import extract_answer
from rlkit.rollout.producer import sampling_seed
from rlkit.rundir import unwritable_file


@dataclass(frozen=True)
class EvalSettings:
    """What one evaluation draws."""

    n: int
    """Samples per prompt."""
    temperature: float
    """0 = greedy."""
    seed: int
    """The base seed; the engine's seed is `sampling_seed(seed, 0, rank, salt=1)` at every evaluation
    (common random numbers: two evaluations of different weights draw the same random numbers)."""


@dataclass
class PromptResult:
    """One prompt's n samples (eval.json keeps these, so any pass@k can be recomputed)."""

    index: int
    """Position in the evaluation prompt set."""
    prompt: str
    task: str | None
    n: int
    correct: list[bool]
    rewards: list[float]
    """Total reward of each sample (reward functions with their weights + environment rewards)."""
    answers: list[str | None]
    """The answer each sample gives, as the main reward function parses it (maj@k votes on these)."""
    responses: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    parts: list[dict[str, float]] = field(default_factory=list)
    """Each sample's reward terms (per function, `env`)."""
    tool_calls: float = 0.0
    """Tool calls summed over the n samples."""
    image: str | None = None
    """The digest of the prompt's images (rlkit.batch.Images.digest), None for a text prompt."""

    @property
    def num_correct(self) -> int:
        return sum(bool(c) for c in self.correct)

    def record(self, *, with_samples: bool = False) -> dict:
        """The JSON form eval.json keeps: counts, verdicts, rewards and answers (and the responses)."""
        out = asdict(self)
        out["num_correct"] = self.num_correct
        if self.image is None:
            out.pop("image")
        if not with_samples:
            for key in ("responses", "finish_reasons", "lengths", "parts"):
                out.pop(key)
        return out


def evaluate_prompts(producer, prompts, settings: EvalSettings, *, rank: int = 0, world: int = 1,
                     task_key: str = "task") -> list[PromptResult]:  # fmt: skip
    """Evaluate every prompt of `prompts` (a PromptSet) with `producer`'s engine, environment and scorer;
    this rank draws prompts rank, rank + world, ...; returns every prompt's result on every rank."""
    import dataclasses

    mine = list(range(rank, len(prompts), world))
    results: list[PromptResult] = []
    if mine:
        n = settings.n
        sampling = dataclasses.replace(producer.sampling(eval=True), temperature=settings.temperature)
        episodes = producer.episodes(
            prompts, mine, n, sampling, sampling_seed(settings.seed, 0, rank, salt=1)
        )
        results = _score(producer.scorer, prompts, mine, n, episodes, task_key)
    if world > 1:
        gathered = gather_objects(results, world)
        results = sorted((r for part in gathered for r in part), key=lambda r: r.index)
    return results


def _score(scorer, prompts, mine: list[int], n: int, episodes, task_key: str) -> list[PromptResult]:
    rb = episodes.rollout
    expand = lambda xs: [xs[i] for i in mine for _ in range(n)]  # noqa: E731
    rows = expand(prompts.rows)
    responses = list(rb.response_texts)
    scores = scorer.score(expand(prompts.texts), responses, expand(prompts.answers), rows=rows)
    failed = episodes.failed.bool().tolist()
    env = episodes.env_rewards.float().tolist()
    total = [0.0 if f else t + e for t, e, f in zip(scores.total, env, failed)]
    correct = [bool(c) and not f for c, f in zip(scores.correct, failed)]
    parts = [
        {**{k: (0.0 if f else v[i]) for k, v in scores.per_fn.items()}, "env": 0.0 if f else env[i]}
        for i, f in enumerate(failed)
    ]
    answers = [extract_answer(scorer.spec_for(row), r) for row, r in zip(rows, responses)]
    lengths = rb.response_lengths.tolist()
    tools = (
        episodes.stats["tool_calls"].float().tolist() if "tool_calls" in episodes.stats else [0.0] * len(rows)
    )
    out = []
    for j, i in enumerate(mine):
        s = slice(j * n, (j + 1) * n)
        task = prompts.rows[i].get(task_key) if prompts.rows else None
        out.append(
            PromptResult(
                index=i,
                prompt=prompts.texts[i],
                task=None if task is None else str(task),
                n=n,
                correct=correct[s],
                rewards=total[s],
                answers=answers[s],
                responses=responses[s],
                finish_reasons=list(rb.finish_reasons[s]),
                lengths=lengths[s],
                parts=parts[s],
                tool_calls=float(sum(tools[s])),
                image=prompts.images[i].digest if prompts.images and prompts.images[i] is not None else None,
            )  # fmt: skip
        )
    return out


def default_ks(ks, n: int) -> list[int]:
    """The k of pass@k / maj@k: `ks` (eval.ks) up to n, or 1 and n when empty."""
    return sorted({k for k in (ks or [1, n]) if k <= n})


def per_prompt(results: list[PromptResult], ks: list[int]) -> dict[str, torch.Tensor]:
    """[P] per-prompt values of every metric: pass@k, maj@k, reward (mean over samples), tool_calls."""
    n = [r.n for r in results]
    c = [r.num_correct for r in results]
    out = {}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, c, k)
    for k in ks:
        out[f"maj@{k}"] = maj_at_k([r.answers for r in results], [r.correct for r in results], k)
    out["reward"] = torch.tensor([sum(r.rewards) / r.n for r in results], dtype=torch.float64)
    out["tool_calls"] = torch.tensor([r.tool_calls / r.n for r in results], dtype=torch.float64)
    return out


def summarize(results: list[PromptResult], ks: list[int]) -> dict[str, dict[str, float]]:
    """{"total": {metric: mean, metric_stderr: standard error over prompts, "prompts": P}, task: {...}}:
    one row per task (PromptResult.task) when any prompt has one, and the total."""
    groups = {"total": results}
    for r in results:
        if r.task is not None:
            groups.setdefault(r.task, []).append(r)
    table = {}
    for name, rs in groups.items():
        if not rs:
            continue
        row: dict[str, float] = {"prompts": float(len(rs)), "samples": float(sum(r.n for r in rs))}
        for key, values in per_prompt(rs, ks).items():
            row[key] = float(values.mean())
            row[f"{key}_stderr"] = stderr(values)
        table[name] = row
    return table


def training_metrics(summary: dict[str, dict[str, float]], ks: list[int]) -> dict[str, float]:
    """The `eval/*` keys training logs: every metric of the total, and `eval/pass@1/<task>` per task."""
    if "total" not in summary:
        return {}
    total = summary["total"]
    # A standard error needs two prompts: an undefined one is left out rather than logged as NaN.
    out = {f"eval/{k}": v for k, v in total.items() if k not in ("prompts", "samples") and not math.isnan(v)}
    for task, row in summary.items():
        if task != "total":
            out[f"eval/pass@1/{task}"] = row["pass@1"]
    return out


def check_config(cfg) -> None:
    """The `eval.*` keys: each k >= 1, seeds >= 0, several greedy samples refused, local paths exist, the
    output is a file (raises ConfigError)."""
    e = cfg.eval
    for k in e.ks:
        if k is None or k < 1:
            raise ConfigError(f"eval.ks={list(e.ks)!r}: every k must be an integer >= 1")
    for s in e.seeds:
        if s is None or s < 0:
            raise ConfigError(f"eval.seeds={list(e.seeds)!r}: every seed must be an integer >= 0")
    n = e.n if e.n is not None else cfg.rollout.eval_group_size
    temperature = e.temperature if e.temperature is not None else cfg.rollout.eval_temperature
    if n > 1 and temperature == 0:
        raise ConfigError(
            f"eval.n={n} samples per prompt with temperature 0 (greedy, eval.temperature={e.temperature}, "
            f"rollout.eval_temperature={cfg.rollout.eval_temperature}) draws the same sample {n} times: "
            "set eval.temperature > 0 or eval.n=1"
        )
    over = [k for k in e.ks if k > n]
    if over:
        source = (
            f"eval.n={e.n}" if e.n is not None else f"rollout.eval_group_size={cfg.rollout.eval_group_size}"
        )
        raise ConfigError(
            f"eval.ks={list(e.ks)!r}: k={over[0]} is above the {n} samples per prompt ({source}), so pass@{over[0]} "
            f"and maj@{over[0]} cannot be estimated: use k <= {n}, or draw more samples"
        )
    if not e.task_key:
        raise ConfigError("eval.task_key='' must name a dataset column (absent columns are fine)")
    local_path_exists("eval.model", e.model)
    local_path_exists("eval.base", e.base)
    if e.output is not None and Path(e.output).expanduser().is_dir():
        raise ConfigError(
            f"eval.output={e.output!r} is a directory: name the JSON file to write (e.g. {e.output}/eval.json)"
        )
    if e.output is not None and (why := unwritable_file(Path(e.output).expanduser())) is not None:
        raise ConfigError(f"eval.output={e.output!r} cannot be written: {why}")
