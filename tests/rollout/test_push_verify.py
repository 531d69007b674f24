"""A verified push exports the learner's weights once (issue 61 item 7): `LocalRollouts` digests each tensor as it
streams into the engine (on its device) and checks the engine against those digests, where it used to export the
whole model a second time (a second FSDP2 all-gather) to hash it on the host. The check keeps its strength: a
tensor changed on its way into the engine is still named. On the HF engine (a tiny model, in this process)."""

from types import SimpleNamespace

import pytest
import torch

from rlkit.models import load_causal_lm, make_tiny_checkpoint
from rlkit.rollout.engines.hf import HFEngine
from rlkit.rollout.local import LocalRollouts
from rlkit.weights import Export, WeightSyncError, iter_full_parameters, module_manifest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, seed=0)


def _rollouts(engine) -> LocalRollouts:
    """The push half of a LocalRollouts (no data, no scorer): verify_push on, no log-prob probe."""
    rollouts = LocalRollouts.__new__(LocalRollouts)
    rollouts.cfg = SimpleNamespace(rollout=SimpleNamespace(verify_push=True, return_logprobs=True))
    rollouts.engine, rollouts.digests = engine, None
    return rollouts


def _counted_export(model, exports: list) -> Export:
    def tensors():
        exports.append(1)
        return iter_full_parameters(model)

    return Export(module_manifest(model), tensors)


def test_a_verified_push_exports_the_model_once(ckpt):
    model, engine = load_causal_lm(ckpt), HFEngine(ckpt, dtype=torch.float32)
    rollouts, exports = _rollouts(engine), []
    export = _counted_export(model, exports)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-6)
    for version in (1, 2, 3):
        stats = rollouts._push(export, version, probe_now=False)
        assert "verify_seconds" in stats
    assert len(exports) == 3  # one export per verified push (it was two: the push's and the check's)
    for name, p in model.named_parameters():  # and the engine holds the pushed weights
        assert torch.equal(engine.model.state_dict()[name], p.detach())


def test_a_tensor_changed_on_its_way_into_the_engine_is_still_named(ckpt):
    model, engine = load_causal_lm(ckpt), HFEngine(ckpt, dtype=torch.float32)
    rollouts, exports = _rollouts(engine), []
    real = engine.load_weights

    def swapping(named, *, manifest=None):  # two rows of the embedding swapped on the way in
        def stream():
            for n, t in named:
                yield n, (t[[1, 0, *range(2, len(t))]] if n == "model.embed_tokens.weight" else t)

        return real(stream(), manifest=manifest)

    engine.load_weights = swapping
    with pytest.raises(WeightSyncError, match=r"does not hold the learner's \['model.embed_tokens.weight'\]"):
        rollouts._push(_counted_export(model, exports), 1, probe_now=False)
    assert len(exports) == 1
