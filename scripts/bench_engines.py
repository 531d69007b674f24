"""Generation throughput of rollout engines (HF, vLLM; fp32, bf16) on the same prompts, alternating A/B rounds
in one process so all see the same machine load (a shared CPU makes separate runs incomparable). With `--push`,
each round also pushes an fp32 copy of the weights into every engine and verifies the push, as the trainer
does every step (`rlkit.weights.push_weights`, `verify_push`), and times both.

    python scripts/bench_engines.py --model smollm2-135m --prompts 4 --group 4 --max-new-tokens 32 --rounds 3
    python scripts/bench_engines.py --engines vllm --dtypes float32,bfloat16 --push --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--engines", default="vllm,hf", help="comma-separated: vllm, hf")
    p.add_argument("--dtypes", default="float32", help="comma-separated engine dtypes: float32, bfloat16")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--push", action="store_true", help="also time a weight push and its verification per round"
    )
    args = p.parse_args()

    import random

    from rlkit.data.arithmetic import arithmetic_problem
    from rlkit.models import load_causal_lm, load_tokenizer
    from rlkit.rollout.engines import make_engine
    from rlkit.rollout.engines.base import Sampling
    from rlkit.verify import verify_push
    from rlkit.weights import Export, iter_full_parameters, module_manifest, push_weights

    tok = load_tokenizer(args.model)
    rng = random.Random(0)
    questions = [arithmetic_problem(rng, ("plain_add",))["question"] for _ in range(args.prompts)]
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]
    engines = {}
    for name in args.engines.split(","):
        for dtype in args.dtypes.split(","):
            t0 = time.perf_counter()
            engines[f"{name} {dtype}"] = make_engine(name, args.model, dtype=dtype, device="cpu", seed=0)
            print(f"{name} {dtype}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    export = digests = None
    if args.push:  # the learner's side: fp32 weights, pushed as the trainer pushes them
        model = load_causal_lm(args.model)
        export = Export(module_manifest(model), lambda: iter_full_parameters(model))
        digests = {key: verify_push(export, engine) for key, engine in engines.items()}
    times = {key: {"tok/s": [], "push s": [], "verify s": []} for key in engines}
    for r in range(args.rounds):
        for key, engine in engines.items():
            s = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=r)
            batch = engine.generate(prompts, args.group, s)
            times[key]["tok/s"].append(batch.stats["gen_tokens_per_s"])
            line = f"round {r} {key}: {batch.stats['gen_tokens']:.0f} tokens, {times[key]['tok/s'][-1]:.1f} tok/s"
            if args.push:
                t0 = time.perf_counter()
                push_weights(export, engine, dtype=engine.weight_dtype)  # as rlkit.rollout.local pushes
                t1 = time.perf_counter()
                digests[key] = verify_push(export, engine, digests[key])
                times[key]["push s"].append(t1 - t0)
                times[key]["verify s"].append(time.perf_counter() - t1)
                line += f", push {times[key]['push s'][-1]:.3f} s, verify {times[key]['verify s'][-1]:.3f} s"
            print(line, flush=True)
    for key, measured in times.items():
        cells = ", ".join(f"{what} {statistics.median(xs):.3f}" for what, xs in measured.items() if xs)
        print(f"{key}: medians over {args.rounds} rounds: {cells}")


if __name__ == "__main__":
    main()
