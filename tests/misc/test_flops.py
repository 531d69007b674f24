"""The FLOP count (rlkit/flops.py) against a hand count on a tiny config."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlkit.flops import ModelShape, measured_cpu_peak, sequence_flops


def _tiny(tie: bool):
    cfg = LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_model_shape_counts_every_matmul_weight_by_hand():
    # Per layer: q 16x16, k 16x8 and v 16x8 (2 kv heads of dim 4), o 16x16, gate/up 16x40 each, down 40x16.
    per_layer = 16 * 16 + 16 * 8 + 16 * 8 + 16 * 16 + 2 * 16 * 40 + 40 * 16
    head = 100 * 16  # the LM head is a matmul whether or not it shares the embedding's weight
    for tie in (True, False):
        shape = ModelShape.of(_tiny(tie))
        assert shape.matmul_params == 2 * per_layer + head
        assert shape.layers == 2 and shape.attention_width == 16


def test_sequence_flops_by_hand():
    shape = ModelShape(matmul_params=1000, layers=3, attention_width=8)
    # forward: T (2 N + 4 L d T); training: T (6 N + 12 L d T)
    assert sequence_flops(shape, 10, training=False) == 10 * (2 * 1000 + 4 * 3 * 8 * 10)
    assert sequence_flops(shape, 10, training=True) == 10 * (6 * 1000 + 12 * 3 * 8 * 10)
    assert sequence_flops(shape, 10, training=True) == 3 * sequence_flops(shape, 10, training=False)


def test_measured_peak_is_a_plausible_rate():
    peak = measured_cpu_peak(torch.float32, seconds=0.05, size=256)
    assert 1e8 < peak < 1e14
