"""model.gradient_checkpointing does what it says: the learner's update recomputes each decoder layer in the
backward (transformers checkpoints a layer only in training mode, and from_pretrained leaves a model in eval mode),
with the same gradient; and the policy trains without its own dropout."""

import torch
from cfg_helpers import learner_cfg
from learner_helpers import make_batch, write_tiny_llama
from transformers.models.llama import modeling_llama

from rlkit.learner import Learner


def _update_counting_layer_calls(path, monkeypatch, **kw):
    learner = Learner(learner_cfg(model_path=path, dtype="float32", **kw))
    calls = []
    forward = modeling_llama.LlamaDecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", counted)
    batch = make_batch(all_fields=False)
    g = torch.Generator().manual_seed(0)
    batch = type(batch)(
        **{**batch.tensor_fields(), "advantages": torch.randn(batch.advantages.shape, generator=g)}
    )
    learner.accumulate_gradients(batch)
    model = learner.accelerator.unwrap_model(learner.model)
    monkeypatch.undo()
    return len(calls), {n: p.grad.clone() for n, p in model.named_parameters()}, model


def test_checkpointing_recomputes_the_layers_with_the_same_gradient(tmp_path, monkeypatch):
    path = write_tiny_llama(tmp_path / "m")
    plain_calls, plain_grads, _ = _update_counting_layer_calls(path, monkeypatch)
    ckpt_calls, ckpt_grads, model = _update_counting_layer_calls(
        path, monkeypatch, gradient_checkpointing=True
    )
    assert plain_calls > 0 and ckpt_calls == 2 * plain_calls  # every layer run again in the backward
    for n in plain_grads:
        torch.testing.assert_close(ckpt_grads[n], plain_grads[n], atol=1e-6, rtol=0)
    assert model.training and all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
