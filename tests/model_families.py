"""Tiny random checkpoints of every model family users train, built from transformers' own config
classes at test time: hidden 128, 2 layers, head_dim 32 (the smallest vLLM's CPU attention runs; MLA: 64), the SmolLM2
tokenizer, each family's features on (tied and untied heads, q/k norms, soft-capping, sliding windows, rope
scaling, Granite's multipliers; mixture-of-experts with 4 experts, top-2).

`FAMILIES` maps a family's display name to (config class name, its keywords); `build_family` writes one
checkpoint and returns its directory. Shared by the rollout, learner and matrix tests (imported by name, as
cfg_helpers.py is)."""

from __future__ import annotations

from pathlib import Path

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 2, 4, 2, 32
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 64
MAX_POSITIONS = 1024

_ATTN = dict(
    hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
    max_position_embeddings=MAX_POSITIONS,
)  # fmt: skip
_DENSE = dict(_ATTN, intermediate_size=2 * HIDDEN)
# MLA: vLLM's CPU MLA decode kernel runs only DeepSeek's latent shape, kv_lora_rank 512 + qk_rope_head_dim 64.
_MLA = dict(
    _ATTN, intermediate_size=2 * HIDDEN, num_key_value_heads=HEADS, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=EXPERT_FFN, n_routed_experts=EXPERTS,
    num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=1,
)  # fmt: skip

# Hybrid families: a gated DeltaNet (linear attention) layer, then a gated full-attention layer. Linear-attention
# head size 64: the smallest vLLM's CPU gated-DeltaNet kernel takes (32 raises there; rlkit refuses it up front).
_LINEAR_ATTN = dict(
    layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
)  # fmt: skip
_SHARED_MOE = dict(
    moe_intermediate_size=EXPERT_FFN, shared_expert_intermediate_size=EXPERT_FFN, num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
)  # fmt: skip

# display name -> (transformers config class, keywords). Each family's own features are on.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama3": ("LlamaConfig", dict(
        _DENSE, head_dim=HEAD_DIM, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=256),
    )),
    "qwen2.5": ("Qwen2Config", dict(_DENSE, tie_word_embeddings=True)),  # q/k/v biases
    "qwen3-tied": ("Qwen3Config", dict(_DENSE, head_dim=HEAD_DIM, tie_word_embeddings=True)),  # q/k norms
    "qwen3-untied": ("Qwen3Config", dict(_DENSE, head_dim=HEAD_DIM, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(_DENSE, head_dim=HEAD_DIM, sliding_window=16, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(  # soft-capping, sliding window on every other layer, tied head
        _DENSE, head_dim=HEAD_DIM, sliding_window=16, query_pre_attn_scalar=HEAD_DIM,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    )),
    "gemma3-text": ("Gemma3TextConfig", dict(
        _DENSE, head_dim=HEAD_DIM, sliding_window=16, query_pre_attn_scalar=HEAD_DIM,
        layer_types=["sliding_attention", "full_attention"],
    )),
    "phi3": ("Phi3Config", dict(_DENSE, tie_word_embeddings=False)),  # fused qkv and gate_up in the checkpoint
    "granite": ("GraniteConfig", dict(
        _DENSE, tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.03125, logits_scaling=8.0,
    )),
    "olmo2": ("Olmo2Config", dict(_DENSE, tie_word_embeddings=False)),  # vLLM: its Transformers backend
    "qwen3-moe": ("Qwen3MoeConfig", dict(
        _ATTN, head_dim=HEAD_DIM, intermediate_size=2 * HIDDEN, moe_intermediate_size=EXPERT_FFN,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, tie_word_embeddings=False,
    )),
    "mixtral": ("MixtralConfig", dict(
        _ATTN, head_dim=HEAD_DIM, intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, tie_word_embeddings=False,
    )),
    "gpt-oss": ("GptOssConfig", dict(  # expert biases, attention sinks, sliding window, yarn rope
        _ATTN, head_dim=HEAD_DIM, intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=256),
    )),
    # V2-Lite's shape: no q compression, greedy routing in one group
    "deepseek-v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1)),
    "deepseek-v3": ("DeepseekV3Config", dict(_MLA, q_lora_rank=64, n_group=2, topk_group=1, topk_method="noaux_tc")),  # noaux_tc
    # Hybrids: layers that carry a recurrent or convolution state beside attention layers (HYBRID below).
    "qwen3.5-text": ("Qwen3_5TextConfig", dict(_DENSE, head_dim=HEAD_DIM, **_LINEAR_ATTN)),  # gated DeltaNet
    "qwen3.5-moe-text": ("Qwen3_5MoeTextConfig", dict(_ATTN, head_dim=HEAD_DIM, **_LINEAR_ATTN, **_SHARED_MOE)),
    "qwen3-next": ("Qwen3NextConfig", dict(_DENSE, head_dim=HEAD_DIM, **_LINEAR_ATTN, **_SHARED_MOE)),
    # Short convolutions. conv_dim and block_dim: the hub's LFM2 configs carry them (= hidden size) and vLLM reads
    # them; transformers' Lfm2Config has no such fields (it keeps them as extra keys).
    "lfm2": ("Lfm2Config", dict(_DENSE, layer_types=["conv", "full_attention"], conv_dim=HIDDEN, block_dim=HIDDEN)),
    "nemotron-h": ("NemotronHConfig", dict(  # Mamba-2 + attention
        _DENSE, head_dim=HEAD_DIM, hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=32,
        ssm_state_size=16, n_groups=1,
    )),
}  # fmt: skip
MOE = ("qwen3-moe", "mixtral", "gpt-oss", "deepseek-v2", "deepseek-v3")
HYBRID = ("qwen3.5-text", "qwen3.5-moe-text", "qwen3-next", "lfm2", "nemotron-h")


def family_config(name: str, tokenizer=None):
    """The transformers config of family `name` with the tokenizer's vocabulary and special tokens (without
    one: a 512-token vocabulary, for tests that never tokenise)."""
    import transformers

    cls_name, kwargs = FAMILIES[name]
    if tokenizer is None:
        vocab = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    else:
        vocab = dict(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    return getattr(transformers, cls_name)(**vocab, **kwargs)


def build_family(name: str, directory, *, tokenizer_path: str = "smollm2-135m", seed: int = 0) -> str:
    """Write a random tiny checkpoint of family `name` (fp32, save_pretrained: the checkpoint's own names)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rlkit.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    config = family_config(name, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def learner_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """The learner's arithmetic, written out: log_softmax of a transformers forward at the next tokens."""
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def sampled_gap(engine, model) -> float:
    """Mean |dlogp| between the engine's log-probs of what it sampled (two prompts of different lengths, so one
    is left-padded; two samples each) and the learner's arithmetic on each row alone, unpadded."""
    from rlkit.rollout.engines.base import Sampling

    prompts = [[1, 5, 9, 200, 300], [1, 7, 8]]
    rb = engine.generate(prompts, 2, Sampling(temperature=1.0, max_new_tokens=6, seed=0))
    gaps = []
    for i in range(rb.response_ids.shape[0]):
        prompt, keep = prompts[i // 2], rb.response_mask[i].bool()
        row = torch.tensor([prompt + rb.response_ids[i][keep].tolist()])
        gaps.append((learner_logprobs(model, row)[0, len(prompt) - 1 :] - rb.rollout_logprobs[i][keep]).abs())
    return float(torch.cat(gaps).mean())
