"""Predict sync versus async step time from a sync run's measured phases (a model, not a measurement).

    python scripts/plan_async.py --run runs/my-sync-run --gpus 8              # every split of 8 GPUs
    python scripts/plan_async.py --gen-tokens-per-s 20000 --gen-tokens 400000 \
        --learner-tokens-per-s 60000 --learner-tokens 900000 --push-s 4 --gpus 8 --rollout-gpus 2
    python scripts/plan_async.py --run runs/sync --gpus 2 --check runs/async   # against a measured async run

The model. A sync step on N devices runs generation (generation + reward phases, `g` seconds), learning
(log-probs + advantages + correction + update, `l`) and the weight push (`p`) one after the other:
    sync step  = g + l + p
In async mode (rlkit/rollout/remote/) R devices generate and N - R learn. A phase that takes t seconds
on N devices takes t * (N / k) ** a on k devices, where a is its scaling exponent (1 = linear, data
parallel without cost; below 1 when more devices help less, as for decode-bound generation):
    g_R = g * (N / R) ** a_gen,   l_L = l * (N / (N - R)) ** a_learn
With max_staleness >= 1 the worker generates batch s + 1 while the learner trains step s, and both meet at
the push, so in steady state
    async step = max(g_R, l_L) + p
With linear scaling (a = 1) async never beats sync: max(g N/R, l N/(N-R)) >= g + l, with equality when
the split balances the two sides. It wins when a phase scales worse than linearly over more devices
(a < 1), or when what the model leaves out dominates (colocated engine sleep/wake and memory pressure,
long-tail generation idling the learner's devices). Measure a by timing a phase on two device counts:
a = log(t_k / t_N) / log(N / k). Throughput is tokens per step over step time.

The long tail (`--lengths`, `--step-ms`). A batch's responses decode together, one token each per engine
step of about `tau` seconds while generation is decode-bound, so a batch generated as one piece (what rlkit
does in every mode) takes tau * max(L) and keeps on average mean(L) / max(L) of its sequence slots busy:
    drained generation    = tau * max(L)       slot use = mean(L) / max(L)
A generator that never drains (the next batch's requests fill the slots the finished ones leave, as
PipelineRL-style streaming does; not rlkit's producer) would take about tau * mean(L) per batch: the ratio
max(L) / mean(L) bounds what overlapping batches can win on the generation phase. In-flight weight updates
(trainer.inflight_updates) do not change rlkit's step time; they change staleness. At max_staleness=1 the
learner pushes about l + p seconds into the next batch's generation, so a row's tokens from index
k* = (l + p) / tau on are sampled by the new weights:
    mean token staleness = sum_i min(L_i, k*) / sum_i L_i     (1 without in-flight updates)
and 1 for every token when generation finishes before the push (tau * max(L) <= l + p).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GEN_PHASES = ("generate", "reward", "filter")
LEARN_PHASES = ("logprobs", "advantages", "correction", "update")


def predict(
    gen_s: float, learn_s: float, push_s: float, gpus: int, rollout_gpus: int, *, a_gen: float = 1.0,
    a_learn: float = 1.0,
) -> dict[str, float]:  # fmt: skip
    """Step seconds of sync and async (R = rollout_gpus of N = gpus devices) for the same batch."""
    if not 0 < rollout_gpus < gpus:
        raise ValueError(f"rollout_gpus={rollout_gpus} must be between 1 and gpus - 1 = {gpus - 1}")
    gen_r = gen_s * (gpus / rollout_gpus) ** a_gen
    learn_l = learn_s * (gpus / (gpus - rollout_gpus)) ** a_learn
    sync = gen_s + learn_s + push_s
    asyn = max(gen_r, learn_l) + push_s
    return {"sync_s": sync, "async_s": asyn, "speedup": sync / asyn, "gen_s": gen_r, "learn_s": learn_l}


def long_tail(lengths: list[int], step_s: float, learn_s: float, push_s: float = 0.0) -> dict[str, float]:
    """The long-tail model of one generation batch (module docstring): `lengths` are its response lengths
    (tokens), `step_s` the decode seconds per engine step, `learn_s` + `push_s` when the learner's push lands
    (max_staleness=1). Returns drained / streaming generation seconds, slot use, and the mean token staleness
    without and with in-flight updates."""
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be one or more response lengths >= 1")
    longest, total = max(lengths), sum(lengths)
    mean = total / len(lengths)
    drained = step_s * longest
    swap = (learn_s + push_s) / step_s  # token index from which the new weights sample
    inflight = sum(min(n, swap) for n in lengths) / total if drained > learn_s + push_s else 1.0
    return {
        "drained_s": drained,
        "streaming_s": step_s * mean,
        "slot_use": mean / longest,
        "staleness_off": 1.0,
        "staleness_inflight": inflight,
    }


def tail_lengths(count: int, short: int, long: int, long_frac: float) -> list[int]:
    """A long-tailed batch: round(count * long_frac) responses of `long` tokens, the rest of `short`."""
    n_long = round(count * long_frac)
    return [long] * n_long + [short] * (count - n_long)


def phases_from_run(run_dir: str | Path, skip: int = 1) -> dict[str, float]:
    """Mean per-step phase seconds of a run's metrics.jsonl (training lines; the first `skip` dropped)."""
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "timing/step_s" in m][skip:]
    if not steps:
        raise ValueError(f"{run_dir}/metrics.jsonl has no training steps after the first {skip}")

    def mean(key):
        return sum(m.get(key, 0.0) for m in steps) / len(steps)

    gen = sum(mean(f"timing/{p}_s") for p in GEN_PHASES)
    learn = sum(mean(f"timing/{p}_s") for p in LEARN_PHASES)
    return {
        "gen_s": gen,
        "learn_s": learn,
        "push_s": mean("timing/weight_push_s"),
        "step_s": mean("timing/step_s"),
        "steps": len(steps),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a sync run directory (its metrics.jsonl gives the phases)")
    ap.add_argument("--gen-tokens-per-s", type=float, help="sync generation throughput, all devices")
    ap.add_argument("--gen-tokens", type=float, help="tokens generated per step")
    ap.add_argument("--learner-tokens-per-s", type=float, help="sync learner throughput (log-probs + update)")
    ap.add_argument("--learner-tokens", type=float, help="tokens the learner processes per step")
    ap.add_argument("--push-s", type=float, default=0.0, help="weight push seconds")
    ap.add_argument("--gpus", type=int, required=True, help="devices of the machine (N)")
    ap.add_argument("--rollout-gpus", type=int, help="devices for rollouts (R); default: every split")
    ap.add_argument("--gen-scaling", type=float, default=1.0, help="a_gen (1 = linear)")
    ap.add_argument("--learn-scaling", type=float, default=1.0, help="a_learn (1 = linear)")
    ap.add_argument("--check", help="a measured async run directory to compare the prediction with")
    ap.add_argument(
        "--lengths",
        help="the long tail: response lengths of one batch, comma-separated, or "
        "COUNT:SHORT:LONG:FRACTION (FRACTION of COUNT responses run to LONG tokens, the rest SHORT)",
    )
    ap.add_argument("--step-ms", type=float, help="the long tail: decode milliseconds per engine step")
    args = ap.parse_args(argv)
    if args.lengths:
        if args.step_ms is None:
            ap.error("--lengths needs --step-ms (decode milliseconds per engine step)")
        print_long_tail(args)
        if not (args.run or args.gen_tokens_per_s):
            return

    if args.run:
        ph = phases_from_run(args.run)
        gen_s, learn_s, push_s = ph["gen_s"], ph["learn_s"], ph["push_s"]
        print(f"sync run {args.run}: {ph['steps']} steps, measured step {ph['step_s']:.2f} s")
    else:
        need = ("gen_tokens_per_s", "gen_tokens", "learner_tokens_per_s", "learner_tokens")
        missing = [f"--{k.replace('_', '-')}" for k in need if getattr(args, k) is None]
        if missing:
            ap.error(f"give --run, or all of {missing}")
        gen_s = args.gen_tokens / args.gen_tokens_per_s
        learn_s = args.learner_tokens / args.learner_tokens_per_s
        push_s = args.push_s
    print(
        f"phases (sync, {args.gpus} devices): generate {gen_s:.2f} s, learn {learn_s:.2f} s, push {push_s:.2f} s"
    )
    splits = [args.rollout_gpus] if args.rollout_gpus else range(1, args.gpus)
    print("| rollout devices | learner devices | sync s/step | async s/step (predicted) | speed-up |")
    print("|---|---|---|---|---|")
    for r in splits:
        p = predict(gen_s, learn_s, push_s, args.gpus, r, a_gen=args.gen_scaling, a_learn=args.learn_scaling)
        print(f"| {r} | {args.gpus - r} | {p['sync_s']:.2f} | {p['async_s']:.2f} | {p['speedup']:.2f}x |")
    if args.check:
        measured = phases_from_run(args.check)
        r = args.rollout_gpus or 1
        p = predict(gen_s, learn_s, push_s, args.gpus, r, a_gen=args.gen_scaling, a_learn=args.learn_scaling)
        print(
            f"check: async run {args.check} measured {measured['step_s']:.2f} s/step over {measured['steps']} "
            f"steps; predicted {p['async_s']:.2f} (ratio measured/predicted {measured['step_s'] / p['async_s']:.2f})"
        )


def print_long_tail(args) -> None:
    if args.lengths.count(":") == 3:
        count, short, long, frac = args.lengths.split(":")
        lengths = tail_lengths(int(count), int(short), int(long), float(frac))
    else:
        lengths = [int(x) for x in args.lengths.split(",")]
    learn_s = phases_from_run(args.run)["learn_s"] if args.run else 0.0
    t = long_tail(lengths, args.step_ms / 1000, learn_s, args.push_s)
    print(
        f"long tail ({len(lengths)} responses, mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)} tokens): "
        f"drained generation {t['drained_s']:.2f} s (slot use {t['slot_use']:.0%}); a generator that never drains "
        f"{t['streaming_s']:.2f} s ({t['drained_s'] / t['streaming_s']:.2f}x, not rlkit's producer); mean token "
        f"staleness at max_staleness=1: {t['staleness_off']:.2f} without in-flight updates, "
        f"{t['staleness_inflight']:.2f} with them"
    )


if __name__ == "__main__":
    main()
