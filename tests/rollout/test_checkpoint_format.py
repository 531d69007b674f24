"""The push's checkpoint format: transformers 5 converts mixture-of-experts checkpoints when it loads
them (experts fused into one tensor, Mixtral's `block_sparse_moe` renamed `mlp`) and the learner's parameters
carry those in-memory names; vLLM's loaders expect the checkpoint's. `to_checkpoint` must give exactly what
`save_pretrained` writes (names and bytes), layer by layer, and `checkpoint_origins` where each comes from."""

import pytest
import torch
from model_families import FAMILIES, family_config
from safetensors.torch import load_file

from rlkit.rollout.engines.vllm.checkpoint_format import checkpoint_origins, to_checkpoint
from rlkit.weights import exported, iter_full_parameters

CONVERTED = ["qwen3-moe", "mixtral", "deepseek-v2", "deepseek-v3"]


def _model(name):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(name), dtype=torch.float32)


@pytest.mark.parametrize("name", CONVERTED + ["gpt-oss", "llama3", "phi3", "gemma2"])
def test_the_push_brings_what_save_pretrained_writes(name, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model(name)
    model.save_pretrained(tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
    pushed = dict(to_checkpoint(iter_full_parameters(model), meta))
    assert pushed.keys() == written.keys()
    for key, tensor in written.items():
        assert torch.equal(pushed[key], tensor), key
    if name in CONVERTED:  # the in-memory names differ: the conversion did something
        assert set(dict(exported(model))) != set(written)


def test_mixtral_experts_come_back_per_expert_under_block_sparse_moe():
    """Worked out by hand from Mixtral's checkpoint layout: expert e's w1 (gate) and w3 (up) are the two halves
    of row block e of the fused `gate_up_proj` [E, 2I, H], w2 (down) is `down_proj[e]`."""
    from transformers import AutoModelForCausalLM

    model = _model("mixtral")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
    fused = dict(model.named_parameters())
    gate_up = fused["model.layers.1.mlp.experts.gate_up_proj"]
    down = fused["model.layers.1.mlp.experts.down_proj"]
    inter = model.config.intermediate_size
    pushed = dict(to_checkpoint(iter_full_parameters(model), meta))
    for e in range(model.config.num_local_experts):
        prefix = f"model.layers.1.block_sparse_moe.experts.{e}"
        assert torch.equal(pushed[f"{prefix}.w1.weight"], gate_up[e, :inter])
        assert torch.equal(pushed[f"{prefix}.w3.weight"], gate_up[e, inter:])
        assert torch.equal(pushed[f"{prefix}.w2.weight"], down[e])
    origins = checkpoint_origins(meta, dict(exported(meta)))
    assert origins["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == [
        "model.layers.1.mlp.experts.down_proj"
    ]
    assert origins["model.layers.1.block_sparse_moe.gate.weight"] == ["model.layers.1.mlp.gate.weight"]
    assert origins["model.embed_tokens.weight"] == ["model.embed_tokens.weight"]


def test_every_family_is_listed():
    assert len(FAMILIES) == 20  # 15 attention-only families and 5 hybrids
