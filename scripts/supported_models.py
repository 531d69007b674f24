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
(`tests/trainer/test_families_train.py`): Qwen3-MoE and Nemotron-H on vLLM colocated and async, with
`|mismatch/kl|` below 1e-5 after every push, and DeepSeek-V2 refused at start-up with its measured gap.

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
repeat such a cache) with the learner's log-probs on left-padded prompts. vLLM runs them without its prefix cache
(said once at start-up; asking for it is refused): vLLM keeps such a layer's state with its cached blocks, and
after a push a later prompt would start from a state the old weights computed. For these rows the matrix also
samples from vLLM after the push and compares the sampled tokens' log-probs with the learner's (the probe only
prefills). In-flight updates (`trainer.inflight_updates`) are checked on Nemotron-H token by token
(`tests/rollout/test_vllm_inflight.py`): `recompute` rebuilds a running request's state under the new weights,
`keep_kv` keeps the old weights' state as it keeps their KV. Where vLLM's CPU build cannot run a family, rlkit
refuses it before anything loads, with the measured cause in the table, and `rollout.engine=auto` picks the HF
engine: vLLM's gated-DeltaNet CPU kernel runs bfloat16 only (Qwen3-Next is measured with a bf16 engine against the
fp32 learner, bound 0.25; `model.dtype=float32` is refused), and head sizes 64 and 128. On CUDA none of these CPU
refusals applies; the start-up probe measures the gap there. A bf16 engine on the CPU: after a push, a pushed
Qwen3-Next or Nemotron-H engine computes what a fresh engine with the pushed weights computes
(`tests/rollout/test_vllm_hybrid_push.py`; rlkit refreshes the plain conv weight vLLM's Mamba-2 mixer reads beside
its prepacked one, which a push left stale: against the fp32 learner, a tiny bf16 Nemotron-H measured 8.9e-4 at
load and 0.1 after a push before, 2.2e-3 after a push now). A Nemotron-H checkpoint saved in fp32 with a
bf16 engine is refused at the start-up push of the same weights: vLLM keeps `A = -exp(A_log)` in fp32, computed
from the checkpoint's fp32 `A_log` at load and from the push's bf16 one after (a bf16 checkpoint, as on the hub,
or `model.dtype=float32` trains). Routing replay (`algo.routing_replay`) replays the routers of Qwen3-MoE and
Mixtral only (the column below); the hybrids' MoE layers are not among them. A
vision-language Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration`, the hub's default) trains on text as its
language model: transformers loads it as `Qwen3_5ForCausalLM`, which computes exactly what the VL model computes on
text; rlkit's checkpoints then hold the language model alone, without the vision tower
(`tests/rollout/test_vl_checkpoint_text.py`); vLLM refuses it where it refuses the text Qwen3.5.

Images on the vLLM engine (issue 58; the data path, the HF engine and the learner with images are their own
work): a prompt's pictures go to vLLM as multi-modal data, vLLM expands their placeholders itself and the engine
checks that the ids it expanded are the model processor's, the ids the learner trains on; vLLM's prefix cache is
keyed by the pictures' content. Runs on vLLM's CPU build: Idefics3 (tiles and global view), engine against a
transformers forward on the processor's tensors within 1e-6 in fp32, pushes of the vision tower (or, with it
frozen, a push without it, checked unchanged) and the log-prob probe on prompts with a picture
(`tests/rollout/test_vllm_images.py`). Refused at start-up, with the reason: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
SmolVLM where their HF processor does not load (it needs torchvision, which the CPU install removes), every other
vision-language family (Gemma 3, Llava, ...: no placeholder rule yet).

Packing (`trainer.pack_sequences`): for every family the learner's packed and padded layouts give each row's
log-probs and gradients as the row run alone (`tests/learner/test_packing_families.py`), or packing is off for
the model, said once at start-up: the hybrids (a packed row would start from the previous row's state, which
the test shows), and any model whose two short rows packed score differently from each alone, measured on the
model at start-up (gpt-oss: its eager attention with sinks misses the restarting positions in transformers 5.19).
With images (`data.image_key`, docs/guides/vision-language.md) packing follows the same rules: Qwen2.5-VL,
Qwen3-VL, Gemma 3 and SmolVLM / Idefics3 pack (each row's pictures and positions its own, Qwen's 3D positions from
the model's `get_rope_index` on each row; `tests/learner/test_vl_packing.py`: log-probs and gradients as each row
alone), Qwen3.5 with its vision tower does not (its gated-DeltaNet layers carry state).
"""

STATUS = {"trains": "trains", "refused": "refused at start-up"}
# Families whose packed rows score differently from each row alone in transformers 5.19, so `packing()` turns
# packing off for them at start-up (measured for every family by tests/learner/test_packing_families.py).
PACKING_LEAKS = {"gpt-oss": "packed rows differ (eager attention with sinks)"}


def capabilities(name: str) -> tuple[str, str]:
    """(packing, routing replay) of family `name`, read from rlkit's own rules on the family's config and a
    weightless copy of its model: stateful layers turn packing off (`rlkit.models.stateful_layers`), and the learner
    replays routes through the routers `rlkit.learner.routing` knows."""
    import torch
    from model_families import family_config
    from transformers import AutoModelForCausalLM

    from rlkit.learner.routing import moe_routers
    from rlkit.models import stateful_layers

    config = family_config(name)
    stateful = stateful_layers(config)
    if stateful:
        packing = f"off: {'/'.join(stateful)} layers carry state"
    else:
        packing = f"off: {PACKING_LEAKS[name]}" if name in PACKING_LEAKS else "packed = unpacked"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    replay = "learner replays (vLLM returns routes on CUDA only)" if moe_routers(model) else "-"
    return packing, replay


# The vision-language families with images (tests/vl_families.py's tiny checkpoints with their processors): what
# each engine does with pictures and whether rows with pictures pack, as the tests named in each cell hold it.
IMAGES = {
    "Qwen2.5-VL": ("Qwen2_5_VLForConditionalGeneration", "trains (test_hf_images, test_vl_train)",
                   "refused: its vLLM processor imports torchvision", "packed = unpacked (test_vl_packing)"),
    "Qwen3-VL": ("Qwen3VLForConditionalGeneration", "trains (test_hf_images)",
                 "refused: its vLLM processor imports torchvision", "packed = unpacked (test_vl_packing)"),
    "Qwen3.5 with its vision tower": ("Qwen3_5ForConditionalGeneration", "trains (test_hf_images)",
                                      "refused: vLLM's module imports torchvision",
                                      "off: linear_attention layers carry state"),
    "Gemma 3": ("Gemma3ForConditionalGeneration", "trains (test_hf_images)",
                "refused: no placeholder rule yet", "packed = unpacked (test_vl_packing)"),
    "SmolVLM / Idefics3": ("Idefics3ForConditionalGeneration", "trains (test_hf_images, test_env_images)",
                           "trains with images, within 9.5e-7 in fp32 (test_vllm_images)",
                           "packed = unpacked (test_vl_packing)"),
}  # fmt: skip


def render_images() -> list[str]:
    """The images table: one row per vision-language family."""
    lines = [
        "\n## With images\n",
        "| family | transformers class | images on the HF engine | images on vLLM (CPU build) | packing with images |",
        "|---|---|---|---|---|",
    ]
    for name, (cls, hf, vllm, packing) in IMAGES.items():
        lines.append(f"| {name} | `{cls}` | {hf} | {vllm} | {packing} |")
    return lines


def render(data: dict) -> str:
    from model_families import FAMILIES

    v = data["versions"]
    lines = [
        INTRO,
        f"Matrix of {data['date']}: vLLM {v['vllm']} (CPU build), transformers {v['transformers']}, "
        f"torch {v['torch']}.\n",
        "| family | transformers config | HF engine | vLLM colocated | vLLM async | mean abs dlogp (load / after push) "
        "| packing | routing replay | refused because |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (cls, _) in FAMILIES.items():
        row = data["families"][name]
        gaps = f"{row['load_gap']:.1e}" if "load_gap" in row else "-"  # refused before vLLM loaded it
        gaps += f" / {row['push_gap']:.1e}" if "push_gap" in row else ""
        gaps += f" (sampled: {row['sample_gap']:.1e})" if "sample_gap" in row else ""
        gaps += f" ({row['vllm_dtype']} engine)" if "vllm_dtype" in row else ""
        vllm = STATUS[row["vllm"]]
        why = row.get("reason", "").replace("|", "/") + (
            "; else rollout.engine=hf" if row["vllm"] != "trains" else ""
        )
        packing, replay = capabilities(name)
        lines.append(
            f"| {name} | `{cls}` | {STATUS[row['hf']]} | {vllm} | {vllm} | {gaps} | {packing} | {replay} | {why.strip()} |"
        )
    return "\n".join(lines + render_images()) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render(json.loads(DATA.read_text())))
    print(PAGE)
