"""scripts/bench.py's report: per-step times, throughput per framework, time to a reward level, and the
tables it prints (pure functions of the runs' results)."""

from __future__ import annotations


def step_seconds(result: dict) -> list[float]:
    ts = [0.0] + [s["seconds"] for s in result["steps"]]
    return [b - a for a, b in zip(ts, ts[1:])]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def mean_after_first(xs: list[float]) -> float:
    """Mean seconds per step, leaving out step 1 (warm-up: lazy imports, first allocations)."""
    rest = xs[1:] or xs
    return sum(rest) / len(rest)


def moving_average(xs: list[float], window: int) -> list[float]:
    """Means of each full window of `window` consecutive values (len(xs) - window + 1 of them)."""
    return [sum(xs[i : i + window]) / window for i in range(len(xs) - window + 1)]


def time_to_reward(result: dict, level: float, window: int = 5) -> float | None:
    """Wall seconds at the end of the first full `window`-step stretch whose mean training reward
    reaches `level` (None if none does): one lucky step does not count."""
    rewards = [s["reward"] if s["reward"] is not None else 0.0 for s in result["steps"]]
    for i, avg in enumerate(moving_average(rewards, window)):
        if avg >= level:
            return result["steps"][i + window - 1]["seconds"]
    return None


def throughput(runs: list[dict]) -> dict:
    """One framework's throughput over its runs (seeds), step 1 of each left out (warm-up).

    Rates are ratios of sums (all tokens over all seconds), not means of per-step rates."""
    steps = [s for run in runs for s in (run["steps"][1:] or run["steps"])]
    secs = [x for run in runs for x in (step_seconds(run)[1:] or step_seconds(run))]

    def total(key):
        return sum(s[key] for s in steps)

    return {
        "steps": len(steps),
        "mean_step_s": sum(secs) / len(secs),
        "median_step_s": median(secs),
        "gen_tokens_per_step": total("gen_tokens") / len(steps),
        "gen_tokens_per_s": total("gen_tokens") / max(total("gen_s"), 1e-9),
        "learner_tokens_per_step": total("learner_tokens") / len(steps),
        "learner_tokens_per_s": total("learner_tokens") / max(total("learner_s"), 1e-9),
        "learner_s_per_step": total("learner_s") / len(steps),
    }


def best_level(run: dict, window: int) -> float:
    """The best `window`-step moving average of a run's training reward."""
    rewards = [s["reward"] if s["reward"] is not None else 0.0 for s in run["steps"]]
    return max(moving_average(rewards, window))


def learning(results: dict[str, list[dict]], level: float | None, window: int) -> dict:
    """Time to a reward level, per framework and seed. Without `level`: the median over TRL's seeds of each
    seed's best `window`-step average (what TRL typically reaches), else rlkit's."""
    if level is None:
        ref = results.get("trl") or results["rlkit"]
        level = median([best_level(run, window) for run in ref])
    table = {"reward_level": level, "reward_window": window}
    for name, runs in results.items():
        times = [time_to_reward(run, level, window) for run in runs]
        reached = [t for t in times if t is not None]
        table[name] = {
            "seeds": [run["seed"] for run in runs],
            "time_to_level_s": times,
            # Never reaching it counts as infinitely late: the median is None when half the seeds never do.
            "median_s": median([t if t is not None else float("inf") for t in times]),
            "reached": f"{len(reached)}/{len(times)}",
        }
        if table[name]["median_s"] == float("inf"):
            table[name]["median_s"] = None
    if "trl" in results:
        r, t = table["rlkit"]["median_s"], table["trl"]["median_s"]
        table["ratio_median_time_to_level"] = r / t if r is not None and t else None
    return table


PHASES = ("generate", "reward", "logprobs", "advantages", "correction", "update", "weight_push")


def rlkit_table(runs: list[dict]) -> str:
    """rlkit's phases per step (mean over every run's steps after the first)."""
    rows = [s["metrics"] for run in runs for s in (run["steps"][1:] or run["steps"])]

    def avg(key):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else float("nan")

    lines = ["phase            s/step   share"]
    total = avg("timing/step_s")
    for p in PHASES:
        v = avg(f"timing/{p}_s")
        if v == v:  # not NaN
            lines.append(f"{p:<16} {v:7.2f}  {100 * v / total:5.1f}%")
    lines.append(f"{'step':<16} {total:7.2f}")
    for key, label in (
        ("learner/run_tokens", "tokens run by the learner"),
        ("perf/gen_mfu", "generation MFU"),
        ("perf/learner_mfu", "learner MFU"),
        ("perf/peak_memory_gb", "peak memory (GB)"),
    ):
        lines.append(f"{label:<26} {avg(key):10.2f}")
    return "\n".join(lines)


def throughput_table(summary: dict) -> str:
    mode = summary["mode"]
    cols = (
        "framework",
        "gen tok/step",
        "gen tok/s",
        "learner tok/step",
        "learner tok/s",
        "learner s",
        "step s",
    )
    lines = [
        f"throughput ({mode}; mean over steps 2.. of every seed; learner tokens counted)",
        " | ".join(cols),
    ]
    for name, t in summary["throughput"].items():
        lines.append(
            f"{name:<9} | {t['gen_tokens_per_step']:12.0f} | {t['gen_tokens_per_s']:9.1f} | "
            f"{t['learner_tokens_per_step']:16.0f} | {t['learner_tokens_per_s']:13.1f} | "
            f"{t['learner_s_per_step']:9.2f} | {t['mean_step_s']:6.2f}"
        )
    if "ratio_step_time" in summary:
        lines.append(f"ratio rlkit/TRL seconds per step: {summary['ratio_step_time']:.2f}")
        if mode != "fixed-length":
            lines.append("(natural lengths: the frameworks generate different amounts; compare tokens/s)")
    return "\n".join(lines)


def learning_table(table: dict) -> str:
    lines = [
        f"learning: wall seconds until the {table['reward_window']}-step mean training reward first reaches "
        f"{table['reward_level']:.3f}",
        "framework | " + " | ".join(f"seed {s}" for s in table["rlkit"]["seeds"]) + " | median | reached",
    ]
    for name in ("rlkit", "trl"):
        if name not in table:
            continue
        row = table[name]
        times = " | ".join(f"{t:6.1f}" if t is not None else " never" for t in row["time_to_level_s"])
        med = f"{row['median_s']:6.1f}" if row["median_s"] is not None else " never"
        lines.append(f"{name:<9} | {times} | {med} | {row['reached']}")
    ratio = table.get("ratio_median_time_to_level")
    if ratio is not None:
        lines.append(f"ratio rlkit/TRL median time to that reward: {ratio:.2f}")
    return "\n".join(lines)
