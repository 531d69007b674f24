"""The push's log-prob probe (rlkit/weights.py): its bound looked up by dtype and the engine's platform (issue 61
item 3: vLLM's fp32 attention on CUDA computes in TF32), and its fixed tokens spread over the whole vocabulary
(issue 56 item 2: ids below 1000 only never read a row near the top of the embedding or the head)."""

import pytest
import torch

from rlkit.verify import probe_bound, probe_tokens, probe_vocab


def test_the_fp32_bound_is_the_cpus_measured_one_on_cpu_and_looser_on_cuda():
    assert probe_bound(torch.float32, torch.float32, platform="cpu") == 1e-4
    cuda = probe_bound(torch.float32, torch.float32, platform="cuda")
    # TF32 dots (10 mantissa bits): a gap near 1e-3 (issue 61) to ~8e-3 (bf16's 0.064 / 8) must pass
    assert 8e-3 < cuda < probe_bound(torch.float16, platform="cuda")
    assert probe_bound(torch.float32, platform="rocm") == cuda  # another accelerator: the CUDA entry


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_bf16_anywhere_gives_bf16s_bound_on_every_platform(platform):
    assert probe_bound(torch.bfloat16, platform=platform) == 0.25
    assert probe_bound(torch.float32, torch.bfloat16, platform=platform) == 0.25
    assert probe_bound(torch.float32, torch.float16, platform=platform) == 0.05


def test_the_default_platform_is_the_cpu():
    assert probe_bound(torch.float32) == 1e-4


def test_the_probe_tokens_reach_every_slice_of_the_vocabulary():
    vocab = 49152
    tokens = probe_tokens(vocab)
    assert tokens.shape == (2, 32) and torch.equal(tokens, probe_tokens(vocab))  # fixed
    ids = sorted(tokens.flatten().tolist())
    width = vocab / 64
    assert [int(i // width) for i in ids] == list(range(64))  # one id in each 64th of the vocabulary
    assert ids[-1] >= vocab - width and ids[-1] < vocab  # the top rows (40000-40001 lie in slice 52)
    assert any(40000 // width == i // width for i in ids)
    assert not torch.equal(tokens.flatten(), torch.tensor(ids))  # shuffled, not a ramp


def test_a_vocabulary_smaller_than_the_probe_stays_inside_it():
    assert probe_tokens(10).max() < 10 and probe_tokens(10).min() >= 0


def test_the_probe_vocabulary_is_what_tokenizer_and_embedding_both_know():
    assert probe_vocab(151665, 151936) == 151665  # Qwen: padding rows beyond the tokenizer
    assert probe_vocab(49152, 49152) == 49152
    assert probe_vocab(32100, 32000) == 32000
