"""Write docs/supported-models.md from docs/supported-models.json, the outcomes of the family matrix
(tests/rollout/test_families.py; `RLKIT_WRITE_SUPPORTED=1` makes it rewrite the JSON).

    python scripts/supported_models.py        # rewrite the page
tests/docs/test_supported_models.py holds the page to the JSON, and the matrix holds the JSON to what runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "docs" / "supported-models.json"
PAGE = REPO / "docs" / "supported-models.md"
sys.path.insert(0, str(REPO / "tests"))

INTRO = """# Supported models

Which model families rlkit trains, with which rollout engine. Every row is a tiny random checkpoint of the
family built from transformers' own config class (hidden 128, 2 layers, head_dim 32, the SmolLM2 tokenizer,
the family's features on: tied and untied heads, q/k norms, soft-capping, sliding windows, rope scaling,
Granite's multipliers; mixture-of-experts with 4 experts, top-2: `tests/model_families.py`), pushed into each
engine by the CI matrix (`tests/rollout/test_families.py`), which writes the table's data
(`docs/supported-models.json`; this page: `python scripts/supported_models.py`).

What "trains" means on vLLM: the engine as loaded computes the learner's log-probs (the probe's mean |dlogp| on
fixed tokens, fp32 bound 1e-4 on the CPU); the same weights pushed again, then changed ones, leave every engine
tensor holding what the push wrote (checked by content) and the probe still agrees. "refused" means rlkit stops at start-up
(the step-0 probe, or the push of the same weights that `LocalRollouts.start` makes) with an error naming the
cause and the alternative, never trains with a drift. The HF engine is checked tensor for tensor after a push.

The vLLM async column is the colocated one: in `trainer.mode=async` each rollout worker runs the same engine,
the same push and the same checks (digests and probe) in its own process. Whole 2-step training runs
(`tests/trainer/test_families_train.py`): Qwen3-MoE on vLLM colocated and async, with `|mismatch/kl|` below
1e-5 after every push, and DeepSeek-V2 refused at start-up with its measured gap.

Where it was measured: every column on CPU (vLLM's CPU build, in eager mode, its CPU default; no GPU has run
it). On CUDA vLLM compiles the model by default, and the families it runs through its Transformers backend
(OLMo 2/3, SmolLM3, Starcoder2, GPT-NeoX, Phi-2, GLM) then need the transformers classes it decorates in the
engine's process: colocated (`trainer.mode=sync`) such an engine is refused before it is built, naming the ways
out (`rollout.engine_kwargs.enforce_eager=true`, or `trainer.mode=async`, whose workers build it compiled in
their own process: `rlkit/rollout/engines/vllm/classes.py`, `tests/rollout/test_vllm_gpu_paths.py`). The
log-prob gaps of the table are CPU ones; on a GPU the start-up probe measures its own.

Mixture-of-experts models train without the router's auxiliary (load-balancing) loss: rlkit's loss is built
from the log-probs alone, and the learner turns `output_router_logits` off, so no router logits are computed.
The experts are sharded by FSDP2 like every parameter (`tests/learner/test_fsdp2_moe.py`).

Routing replay (`algo.routing_replay`, Rollout Routing Replay): the learner's routers take the experts the
engine routed each token to, their weights still the learner's router's. Replayable routers: Qwen3-MoE and
Mixtral (`rlkit/learner/routing.py`; the other MoE rows and the hybrids are refused at start-up). It needs vLLM's
Model Runner V2 (Triton: a CUDA build); vLLM's CPU build cannot return routes, so no CPU column has run it, and
LoRA, FSDP2 and multi-turn environments are refused with it for now (docs/benchmarks.md: its effect measured).

Hybrid families (Qwen3.5 text, dense and MoE; Qwen3-Next; LFM2; Nemotron-H: 2 layers, one with a gated DeltaNet,
a short convolution or a Mamba-2 mixer, one with attention) carry a recurrent or convolution state from one
position to the next. The HF engine samples them (the prompt is prefilled once per sample: transformers cannot
repeat such a cache) with the learner's log-probs on left-padded prompts; vLLM is refused before it builds
anything (the reason in the table), and `rollout.engine=auto` picks the HF engine for them. Routing replay is
not implemented yet. A vision-language Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration`, the hub's default)
trains on text as its language model: transformers loads it as `Qwen3_5ForCausalLM`, which computes exactly what
the VL model computes on text; rlkit's checkpoints then hold the language model alone, without the vision tower
(`tests/rollout/test_vl_checkpoint_text.py`).

Packing (`trainer.pack_sequences`): for every family the learner's packed and padded layouts give each row's
log-probs and gradients as the row run alone (`tests/learner/test_packing_families.py`), or packing is off for
the model, said once at start-up: the hybrids (a packed row would start from the previous row's state, which
the test shows), and any model whose two short rows packed score differently from each alone, measured on the
model at start-up (gpt-oss: its eager attention with sinks misses the restarting positions in transformers 5.19).
"""

STATUS = {"trains": "trains", "refused": "refused at start-up"}


def render(data: dict) -> str:
    from model_families import FAMILIES

    v = data["versions"]
    lines = [
        INTRO,
        f"Matrix of {data['date']}: vLLM {v['vllm']} (CPU build), transformers {v['transformers']}, "
        f"torch {v['torch']}.\n",
        "| family | transformers config | HF engine | vLLM colocated | vLLM async | mean abs dlogp (load / after push) "
        "| refused because |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (cls, _) in FAMILIES.items():
        row = data["families"][name]
        gaps = f"{row['load_gap']:.1e}" if "load_gap" in row else "-"  # refused before vLLM loaded it
        gaps += f" / {row['push_gap']:.1e}" if "push_gap" in row else ""
        vllm = STATUS[row["vllm"]]
        why = row.get("reason", "").replace("|", "/") + (
            "; else rollout.engine=hf" if row["vllm"] != "trains" else ""
        )
        lines.append(f"| {name} | `{cls}` | {STATUS[row['hf']]} | {vllm} | {vllm} | {gaps} | {why.strip()} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render(json.loads(DATA.read_text())))
    print(PAGE)
