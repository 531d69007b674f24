"""A mixture-of-experts push into vLLM is right or loud, on a tiny Qwen3-MoE (4 experts, top-2):

- a push that never reaches one expert layer's tensor (dropped after the manifest check, as a loader that
  skips it would) fails, naming the layer, and leaves an engine that refuses to generate;
- a push that brings one stale expert tensor (the learner's changed, the engine's not) fails the digest check,
  naming the tensor the engine received other than the learner holds it;
- without the CPU expert prepack vLLM skips on a weight update, pushing the very same weights changes the
  experts' bytes (the digest check fails) and the log-probs (the probe fails): both detectors catch the drift
  once found in vLLM's CPU MoE path, and with it the engine agrees with the learner after every push."""

import pytest
import torch
from model_families import build_family
from vllm_import import import_vllm

import_vllm()

from rlkit.models import load_causal_lm  # noqa: E402
from rlkit.rollout.engines.base import Sampling  # noqa: E402
from rlkit.rollout.engines.vllm import push as vllm_push  # noqa: E402
from rlkit.rollout.engines.vllm import reload as vllm_reload  # noqa: E402
from rlkit.verify import probe_bound, probe_gap, probe_tokens, verify_push  # noqa: E402
from rlkit.weights import Export, WeightSyncError, iter_full_parameters, module_manifest  # noqa: E402

pytestmark = pytest.mark.slow  # builds a vLLM engine: `make test-fast` leaves it out

DOWN = "model.layers.1.mlp.experts.down_proj"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from rlkit.rollout.engines.vllm import VLLMEngine

    ckpt = build_family("qwen3-moe", tmp_path_factory.mktemp("qwen3moe"))
    engine = VLLMEngine(ckpt, dtype="float32", seed=0, kv_cache_gib=0.05, max_model_len=256)
    yield ckpt, engine
    engine.close()


def _learner(model, tokens):
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _gap(engine, model) -> float:
    tokens = probe_tokens()
    return probe_gap(engine.prompt_logprobs(tokens), _learner(model, tokens))


def test_a_push_that_misses_an_expert_layer_fails_naming_it(moe, monkeypatch):
    ckpt, engine = moe
    model = load_causal_lm(ckpt)
    manifest = module_manifest(model)
    real = vllm_push.to_checkpoint

    def skipping(named, meta):  # the checkpoint tensors of layer 1's experts never reach vLLM's loaders
        return ((n, t) for n, t in real(named, meta) if not n.startswith("model.layers.1.mlp.experts."))

    monkeypatch.setattr(vllm_push, "to_checkpoint", skipping)
    with pytest.raises(WeightSyncError, match=r"model\.layers\.1\.mlp\.experts"):
        engine.load_weights(iter_full_parameters(model), manifest=manifest)
    with pytest.raises(RuntimeError, match="refuses to generate"):
        engine.generate([[1, 2, 3]], 1, Sampling(max_new_tokens=2, seed=0))
    monkeypatch.setattr(vllm_push, "to_checkpoint", real)
    engine.load_weights(iter_full_parameters(model), manifest=manifest)  # a whole push: usable again
    assert _gap(engine, model) <= probe_bound(torch.float32)


def test_one_stale_expert_tensor_fails_the_digest_check(moe):
    ckpt, engine = moe
    model = load_causal_lm(ckpt)
    export = Export(module_manifest(model), lambda: iter_full_parameters(model))
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
    before = verify_push(export, engine)
    old_down = dict(model.named_parameters())[DOWN].detach().clone()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)

    def stale(named):  # every tensor new but layer 1's experts' down projections
        for n, t in named:
            yield n, (old_down if n == DOWN else t)

    engine.load_weights(stale(iter_full_parameters(model)), manifest=export.manifest)
    with pytest.raises(WeightSyncError, match=rf"\['{DOWN}'\].*not received as the learner pushed"):
        verify_push(export, engine, before)
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
    verify_push(export, engine, before)  # the whole push passes
    assert _gap(engine, model) <= probe_bound(torch.float32)


def test_without_the_expert_prepack_the_same_weights_drift_and_both_checks_catch_it(moe, monkeypatch):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the expert prepack vLLM skips on a weight update is its CPU platform's")
    ckpt, engine = moe
    model = load_causal_lm(ckpt)
    export = Export(module_manifest(model), lambda: iter_full_parameters(model))
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
    before = verify_push(export, engine)
    assert _gap(engine, model) <= probe_bound(torch.float32)  # fp32 noise: ~2e-7
    monkeypatch.setattr(vllm_reload, "_redo_cpu_expert_prepack", lambda model, touched: [])
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)  # the very same weights
    with pytest.raises(
        WeightSyncError, match=r"experts\.\S*w13_weight.*changed although the learner's weights did not"
    ):
        verify_push(export, engine, before)
    assert _gap(engine, model) > 100 * probe_bound(torch.float32)  # the drift measured when found: 2e-2
    monkeypatch.undo()
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
    verify_push(export, engine, before)
    assert _gap(engine, model) <= probe_bound(torch.float32)
