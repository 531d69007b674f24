"""Rollout Routing Replay on the learner (rlkit.learner.routing): replaying the model's own routes changes
nothing (log-probs and gradients, against a forward without hooks), and replaying other routes gives what a
naive per-token computation of the MoE layer says (router softmax at the replayed experts, renormalised as the
model does, times each expert's MLP)."""

from __future__ import annotations

import pytest
import torch
from model_families import family_config
from transformers import AutoModelForCausalLM

from rlkit.learner.routing import RouterHooks, moe_routers

ROWS, COLS = 2, 7


def _model(family: str, **overrides):
    config = family_config(family)
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _logprobs(model, tokens):
    logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [("qwen3-moe", {"norm_topk_prob": False}), ("qwen3-moe", {"norm_topk_prob": True}), ("mixtral", {})]


@pytest.mark.parametrize("family,overrides", CASES)
def test_own_routes_change_nothing(family, overrides):
    model = _model(family, **overrides)
    tokens = torch.randint(0, 512, (ROWS, COLS), generator=torch.Generator().manual_seed(1))
    plain = _logprobs(model, tokens)
    plain.sum().backward()
    plain_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    hooks = RouterHooks(model)
    with torch.no_grad(), hooks.record() as rec:
        model(input_ids=tokens)
    routes = rec.tensor(ROWS, COLS)
    assert routes.shape == (ROWS, COLS, len(moe_routers(model)), 2)
    with hooks.replay(routes):
        replayed = _logprobs(model, tokens)
        replayed.sum().backward()
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)
    grads = _grads(model)
    assert grads.keys() == plain_grads.keys()
    assert any("gate.weight" in n for n in grads)  # the routers get gradients under replay
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _naive_moe(block, h: torch.Tensor, routes: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """One MoE layer token by token: softmax of the router at the replayed experts, times each expert's MLP."""
    experts, out = block.experts, torch.zeros_like(h)
    for t in range(h.shape[0]):
        probs = torch.softmax(h[t] @ block.gate.weight.T, -1)
        w = torch.stack([probs[e] for e in routes[t].tolist()])
        if renormalise:
            w = w / w.sum()
        for j, e in enumerate(routes[t].tolist()):
            gate, up = (experts.gate_up_proj[e] @ h[t]).chunk(2)
            out[t] += w[j] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("family,overrides", CASES)
def test_other_routes_follow_naive_moe(family, overrides):
    model = _model(family, **overrides)
    renormalise = overrides.get("norm_topk_prob", True)
    tokens = torch.randint(0, 512, (ROWS, COLS), generator=torch.Generator().manual_seed(2))
    hooks = RouterHooks(model)
    with torch.no_grad(), hooks.record() as rec:
        model(input_ids=tokens)
        plain = _logprobs(model, tokens)
    own = rec.tensor(ROWS, COLS)
    g = torch.Generator().manual_seed(3)  # two distinct experts per token, drawn at random
    other = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(ROWS * COLS * own.shape[2])])
    other = other.reshape(own.shape).to(torch.int16)
    assert not torch.equal(other, own)

    block = model.model.layers[0].mlp
    seen = {}
    handle = block.register_forward_hook(lambda m, a, o: seen.update(h=a[0].detach(), out=o.detach()))
    with torch.no_grad(), hooks.replay(other):
        replayed = _logprobs(model, tokens)
    handle.remove()
    h = seen["h"].reshape(-1, seen["h"].shape[-1])
    expected = _naive_moe(block, h, other[:, :, 0].reshape(-1, 2).long(), renormalise)
    torch.testing.assert_close(seen["out"].reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)
    assert (replayed - plain).abs().max() > 1e-4  # other experts, other log-probs


def test_wrong_shape_and_dense_model_refused():
    model = _model("qwen3-moe")
    hooks = RouterHooks(model)
    with pytest.raises(ValueError, match="MoE layers"):
        with hooks.replay(torch.zeros(ROWS, COLS, 5, 2, dtype=torch.int16)):
            pass
    with pytest.raises(ValueError, match="laid out as the input ids"):
        with torch.no_grad(), hooks.replay(torch.zeros(ROWS, COLS + 1, 2, 2, dtype=torch.int16)):
            model(input_ids=torch.zeros(ROWS, COLS, dtype=torch.long))
    with pytest.raises(ValueError, match="algo.routing_replay"):
        RouterHooks(_model("llama3"))
