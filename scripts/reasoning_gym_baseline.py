"""Step-0 accuracy of a model on reasoning-gym tasks, with the prompts, sampling and reward that
`+recipe=reasoning_gym` trains with: to pick tasks and difficulties a small model scores 5-30% on.

    python scripts/reasoning_gym_baseline.py --model smollm2-135m --prompts 64 --samples 4 \
        'chain_sum={"min_terms": 2, "max_terms": 2, "max_digits": 1}' 'leg_counting={"max_animals": 1}'

Each argument is a task name, or `name=<JSON reasoning-gym config>`. Prints, per task, the mean reward
and the accuracy (score 1) over prompts x samples (`--reward reasoning_gym_lenient`: a response without answer
tags scored on its last number), sampled at `--temperature` (the recipe's 1.0) from one engine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rlkit.config.schema import DataConfig
from rlkit.data import reasoning_gym
from rlkit.data.prompts import render_prompt
from rlkit.learner.strategy import fast_dtype
from rlkit.models import load_tokenizer
from rlkit.rewards.functions import call_reward
from rlkit.rollout.engines import make_engine
from rlkit.rollout.engines.base import Sampling


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tasks", nargs="+")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--engine", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--system-prompt", default="reasoning_gym:direct")
    p.add_argument("--instruction", default="")
    p.add_argument("--reward", default="reasoning_gym", choices=["reasoning_gym", "reasoning_gym_lenient"])
    args = p.parse_args()
    cfg = DataConfig(system_prompt=args.system_prompt, instruction=args.instruction)
    tok = load_tokenizer(args.model)
    dtype = fast_dtype("cpu") if args.dtype == "auto" else args.dtype
    engine = make_engine(args.engine, args.model, dtype=dtype, device="cpu")
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    for spec in args.tasks:
        name, _, config = spec.partition("=")
        tasks = {name: json.loads(config) if config else {}}
        with tempfile.TemporaryDirectory() as d:
            path = reasoning_gym.generate(
                Path(d) / "rg", tasks, num_train=4 * args.prompts, num_eval=args.prompts
            )
            rows = [json.loads(line) for line in open(path / "test.jsonl")]
        prompts = [render_prompt(r["question"], tok, cfg) for r in rows]
        rb = engine.generate([ids for _, ids in prompts], args.samples, sampling)
        items = [
            (prompts[i // args.samples][0], text, rows[i // args.samples]["answer"], rows[i // args.samples])
            for i, text in enumerate(rb.response_texts)
        ]
        scores = [call_reward(args.reward, [it])[0][0] for it in items]
        acc = sum(s >= 1.0 for s in scores) / len(scores)
        print(
            json.dumps(
                {
                    "task": spec,
                    "accuracy": round(acc, 4),
                    "reward": round(sum(scores) / len(scores), 4),
                    "samples": len(scores),
                    "example": rb.response_texts[0][:120],
                }
            ),
            flush=True,
        )
    engine.close()


if __name__ == "__main__":
    main()
