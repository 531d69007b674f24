"""LoRA (rlkit/lora.py): adapters only train, the reference is the base model, engines get merged weights.

Expected values come from independent models: a separately loaded base model, and a deep copy of the
trained peft model merged by peft's own `merge_and_unload`."""

from __future__ import annotations

import copy

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import make_batch
from transformers import AutoModelForCausalLM

from rlkit.learner import Learner
from rlkit.weights import push_weights

RANK, ALPHA = 4, 8.0


def _cfg(path, **kw):
    base = dict(model_path=path, dtype="float32", lr=5e-2, lora_rank=RANK, lora_alpha=ALPHA)
    return learner_cfg(**{**base, **kw})


def _update(learner, seed=0):
    batch = make_batch(all_fields=False, seed=seed)
    g = torch.Generator().manual_seed(seed)
    fields = {**batch.tensor_fields(), "advantages": torch.randn(batch.advantages.shape, generator=g)}
    if learner.derived.kl_loss_coef > 0:  # the KL loss term, against the reference (here: adapters off)
        fields["ref_logprobs"] = learner.forward(batch, policy=False, ref=True).ref_logprobs
    return learner.update(type(batch)(**fields))


def _plain_logprobs(model, batch):
    """Log-probs of the response tokens under `model`, by a plain full-logits forward (no learner code)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    p = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : -1], dim=-1)
    out = logp.gather(-1, batch.response_ids[..., None])[..., 0]
    return torch.where(batch.response_mask, out, 0.0)


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    learner = Learner(_cfg(tiny_model_dir, kl_coef=0.1))
    _update(learner, seed=0)
    _update(learner, seed=1)
    return learner


def test_only_adapters_train_and_hold_optimizer_state(tiny_model_dir, trained):
    model = trained.accelerator.unwrap_model(trained.model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # Frozen weights did not move (a separately loaded base model is the expectation).
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_params = dict(base.named_parameters())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            clean = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p.detach(), base_params[clean].detach()), name
    # Adapters moved away from their zero-initialised B.
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if ".lora_B." in n)
    # Optimizer state covers the adapters only, and is far smaller than full fine-tuning's.
    state = trained.optimizer.state_dict()["state"]
    lora_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state_numel = sum(t.numel() for s in state.values() for t in s.values() if t.dim() > 0)
    assert state_numel == 2 * lora_numel  # Adam's two moments
    full = Learner(learner_cfg(model_path=tiny_model_dir, dtype="float32", lr=5e-2))
    _update(full)
    full_numel = sum(
        t.numel() for s in full.optimizer.state_dict()["state"].values() for t in s.values() if t.dim() > 0
    )
    full_trainable = sum(p.numel() for p in full.model.parameters() if p.requires_grad)
    print(
        f"trainable {lora_numel} vs {full_trainable}; optimizer state {state_numel} vs {full_numel} numbers"
    )
    assert lora_numel < full_trainable / 3 and state_numel < full_numel / 3


def test_reference_is_the_base_model_with_adapters_off(tiny_model_dir, trained):
    assert trained.ref_model is None  # no second model loaded
    batch = make_batch(all_fields=False, seed=5)
    lp = trained.forward(batch, policy=True, ref=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    expected_ref = _plain_logprobs(base, batch)
    torch.testing.assert_close(lp.ref_logprobs, expected_ref, atol=1e-5, rtol=0)
    # ... while the policy (adapters on) differs from it after training.
    assert (lp.logprobs - expected_ref)[batch.response_mask].abs().max() > 1e-3


def test_pushed_weights_are_the_merged_model_and_the_engine_scores_like_it(tiny_model_dir, trained):
    class Recording:
        def load_weights(self, named, *, manifest):
            self.manifest = manifest
            self.received = {n: t.clone() for n, t in named}

    engine = Recording()
    push_weights(trained.export(), engine)
    model = trained.accelerator.unwrap_model(trained.model)
    merged = copy.deepcopy(model).merge_and_unload()  # peft's own merge, on a copy
    expected = dict(merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert engine.manifest == {n: tuple(p.shape) for n, p in base.named_parameters()}
    assert engine.received.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(engine.received[name], tensor.detach(), atol=1e-6, rtol=0)
    # The trained model itself was not merged: adapters still there, base weights still the base's.
    assert any(".lora_A." in n for n, _ in model.named_parameters())
    # A model holding the pushed weights scores like the learner's policy.
    base.load_state_dict(engine.received, strict=False)
    batch = make_batch(all_fields=False, seed=6)
    torch.testing.assert_close(
        _plain_logprobs(base, batch), trained.forward(batch).logprobs, atol=1e-5, rtol=0
    )


def test_gradient_checkpointing_gives_the_same_adapter_update(tiny_model_dir):
    plain = Learner(_cfg(tiny_model_dir))
    ckpt = Learner(_cfg(tiny_model_dir, gradient_checkpointing=True))
    _update(plain)
    _update(ckpt)
    a = {n: p for n, p in plain.accelerator.unwrap_model(plain.model).named_parameters() if p.requires_grad}
    b = {n: p for n, p in ckpt.accelerator.unwrap_model(ckpt.model).named_parameters() if p.requires_grad}
    assert a.keys() == b.keys() and any(p.abs().max() > 0 for n, p in a.items() if ".lora_B." in n)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-6, rtol=0)


def test_scoring_is_deterministic_with_lora_dropout(tiny_model_dir):
    """`forward` scores in eval mode: with model.lora.dropout=0.5 two scorings of a batch agree exactly (the
    rollout's mismatch metrics, IS weights and the distillation term read them), while the update still
    trains with dropout (two updates from the same weights and batch but other random states differ)."""
    learner = Learner(_cfg(tiny_model_dir, lora_dropout=0.5))
    _update(learner, seed=0)  # the adapters' B leaves 0, so the dropout on their input changes the output
    batch = make_batch(all_fields=False, seed=3)
    first, second = learner.forward(batch).logprobs, learner.forward(batch).logprobs
    assert torch.equal(first, second)
    model = learner.accelerator.unwrap_model(learner.model)
    assert model.training  # back in train mode for the update
    grads = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        learner.accumulate_gradients(_with_advantages(batch))
        grads.append([p.grad.clone() for n, p in model.named_parameters() if ".lora_B." in n])
        learner.zero_grad()
    assert any(not torch.equal(a, b) for a, b in zip(*grads))  # dropout is active in the update


def _with_advantages(batch):
    g = torch.Generator().manual_seed(0)
    fields = {**batch.tensor_fields(), "advantages": torch.randn(batch.advantages.shape, generator=g)}
    return type(batch)(**fields)
