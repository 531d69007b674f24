"""A vision-language-configured Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration`, the hub's default for the
family) trained on text: rlkit loads its language model (transformers' `AutoModelForCausalLM` maps the VL config
to `Qwen3_5ForCausalLM` and the checkpoint's `model.language_model.*` weights onto it), which computes exactly
what the VL model computes on text, is a hybrid (its gated DeltaNet layers read from the text config), and samples
on the HF engine with the learner's log-probs. What a run saves is that language model alone: the vision tower
is not carried into rlkit's checkpoints (docs: Supported models)."""

import pytest
import torch
from model_families import _DENSE, _LINEAR_ATTN, HEAD_DIM, sampled_gap

from rlkit.models import load_causal_lm, load_tokenizer, stateful_layers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    tokenizer = load_tokenizer("smollm2-135m")
    text = dict(
        _DENSE, head_dim=HEAD_DIM, **_LINEAR_ATTN, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(Qwen3_5Config(text_config=text, vision_config=vision))
    directory = tmp_path_factory.mktemp("qwen3.5-vl")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model.eval()


def test_the_language_model_is_loaded_and_computes_what_the_vl_model_computes_on_text(vl_checkpoint):
    directory, vl = vl_checkpoint
    model = load_causal_lm(directory)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in n for n, _ in model.named_parameters())
    assert stateful_layers(model.config) == ["linear_attention"] == stateful_layers(vl.config)
    ids = torch.tensor([[1, 5, 9, 200, 300, 7, 11, 12]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, vl(input_ids=ids).logits)


def test_the_hf_engine_samples_it_with_the_learners_logprobs(vl_checkpoint):
    from rlkit.rollout.engines.hf import HFEngine
    from rlkit.verify import probe_bound

    directory, _ = vl_checkpoint
    assert sampled_gap(
        HFEngine(str(directory), dtype=torch.float32), load_causal_lm(directory)
    ) <= probe_bound(torch.float32)


def test_vllm_takes_or_refuses_it_as_it_does_the_text_qwen3_5(vl_checkpoint):
    """vLLM reads the checkpoint's own architecture (`Qwen3_5ForConditionalGeneration`), in the same module as the
    text model's: on vLLM's CPU build, without torchvision, that module does not import, and the refusal names
    the architecture and the cause before anything loads; with it, the gated-DeltaNet CPU kernel's dtype rule
    applies (fp32 refused)."""
    import importlib.util

    from vllm_import import import_vllm

    import_vllm()
    from vllm.platforms import current_platform

    from rlkit.rollout.engines import resolve_engine, vllm_usable

    directory, _ = vl_checkpoint
    usable, why = vllm_usable(str(directory), "float32")
    if importlib.util.find_spec("torchvision") is None:
        assert not usable
        assert why.startswith(
            "vLLM's module for Qwen3_5ForConditionalGeneration (vllm/model_executor/models/qwen3_5"
        )
        assert "No module named 'torchvision'" in why
    elif current_platform.is_cpu():
        assert not usable and "bfloat16 only" in why
    if not usable:
        assert resolve_engine("auto", str(directory), dtype="float32", log_pick=False) == "hf"
