"""Generation throughput of the HF and vLLM engines on the same prompts, alternating A/B rounds in one
process so both see the same machine load (a shared CPU makes separate runs incomparable).

    python scripts/bench_engines.py --model smollm2-135m --prompts 4 --group 4 --max-new-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import random

    from rlkit.data.arithmetic import arithmetic_problem
    from rlkit.models import load_tokenizer
    from rlkit.rollout.engines import make_engine
    from rlkit.rollout.engines.base import Sampling

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
    for name in ("vllm", "hf"):
        t0 = time.perf_counter()
        engines[name] = make_engine(name, args.model, dtype=args.dtype, device="cpu", seed=0)
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    rates = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            s = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=r)
            batch = engine.generate(prompts, args.group, s)
            rates[name].append(batch.stats["gen_tokens_per_s"])
            print(
                f"round {r} {name}: {batch.stats['gen_tokens']:.0f} tokens, {rates[name][-1]:.1f} tok/s",
                flush=True,
            )
    for name, xs in rates.items():
        print(f"{name}: median {statistics.median(xs):.1f} tok/s over {len(xs)} rounds")


if __name__ == "__main__":
    main()
