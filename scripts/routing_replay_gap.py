"""Routing replay's effect on the engine/learner mismatch, with transformers alone: a bf16 copy of an MoE model
plays the engine (it scores the sequences and records its routes), the fp32 model is the learner; the learner's
log-probs are compared with the engine's without and with replaying the engine's routes
(rlkit.learner.routing). vLLM's CPU build cannot return routes (no Model Runner V2 without Triton), so this is the
CPU stand-in for a bf16 vLLM engine.

    python scripts/routing_replay_gap.py MODEL_DIR [MODEL_DIR ...] [--rows 16 --length 64]

Prints, per model: the share of (token, MoE layer) whose expert set differs between engine and learner, and
mean |dlogp| and the k3 KL estimate (mean of exp(d) - d - 1, d = engine - learner log-prob) over the tokens,
without and with replay.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from rlkit.learner.routing import RouterHooks


def logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def gap(engine_lp: torch.Tensor, learner_lp: torch.Tensor) -> tuple[float, float]:
    d = engine_lp - learner_lp
    return float(d.abs().mean()), float((d.exp() - d - 1).mean())


@torch.no_grad()
def measure(path: str, rows: int, length: int, seed: int) -> dict:
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    torch.manual_seed(seed)
    tokens = torch.randint(0, learner.config.vocab_size, (rows, 8))
    tokens = engine.generate(tokens, do_sample=True, max_new_tokens=length - 8, min_new_tokens=length - 8,
                             pad_token_id=0)  # fmt: skip
    e_hooks, l_hooks = RouterHooks(engine), RouterHooks(learner)
    with e_hooks.record() as e_rec:
        engine_lp = logprobs(engine, tokens)
    routes = e_rec.tensor(*tokens.shape)
    with l_hooks.record() as l_rec:
        plain_lp = logprobs(learner, tokens)
    own = l_rec.tensor(*tokens.shape)
    differ = (own.sort(-1).values != routes.sort(-1).values).any(-1).float().mean()
    with l_hooks.replay(routes):
        replay_lp = logprobs(learner, tokens)
    (abs0, kl0), (abs1, kl1) = gap(engine_lp, plain_lp), gap(engine_lp, replay_lp)
    return dict(model=learner.config.model_type, routes_differ=float(differ), dlogp=abs0, kl=kl0,
                dlogp_replay=abs1, kl_replay=kl1)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print("| model | routes differ | mean abs dlogp | k3 KL | mean abs dlogp, replay | k3 KL, replay |")
    print("|---|---|---|---|---|---|")
    for path in a.models:
        r = measure(path, a.rows, a.length, a.seed)
        print(f"| {r['model']} | {r['routes_differ']:.3f} | {r['dlogp']:.2e} | {r['kl']:.2e} | "
              f"{r['dlogp_replay']:.2e} | {r['kl_replay']:.2e} |")  # fmt: skip


if __name__ == "__main__":
    main()
