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


# -- the learner's forward: the batch's routed_experts reach the routers, micro-batched or packed ----------


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from model_families import build_family

    return build_family("qwen3-moe", tmp_path_factory.mktemp("qwen3moe"))


@pytest.mark.parametrize("packed", [False, True])
def test_learner_forward_replays_batch_routes(moe_dir, packed):
    import dataclasses

    from cfg_helpers import learner_cfg
    from learner_helpers import full_batch_logprobs, make_batch

    from rlkit.learner import Learner
    from rlkit.learner.routing import install

    cfg = learner_cfg(
        model_path=moe_dir, dtype="float32", lr=1e-3, max_grad_norm=None, seed=0, pack_sequences=packed,
        max_tokens_per_microbatch=24,
    )  # fmt: skip
    cfg.algo.routing_replay = True
    learner = Learner(cfg)
    model = learner.accelerator.unwrap_model(learner.model)
    hooks = install(model)  # the learner's own hooks
    batch = make_batch(n=4, prompt_width=5, response_width=6, seed=4, all_fields=False)
    plain = learner.forward(batch).logprobs
    with torch.no_grad(), hooks.record() as rec:
        full_batch_logprobs(model, batch, 1.0)
    own = rec.tensor(4, 11)
    replayed = learner.forward(dataclasses.replace(batch, routed_experts=own)).logprobs
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-5)

    g = torch.Generator().manual_seed(5)
    other = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(own[..., 0].numel())]).reshape(
        own.shape
    )
    other = other.to(torch.int16)
    got = learner.forward(dataclasses.replace(batch, routed_experts=other)).logprobs
    with torch.no_grad(), hooks.replay(other):  # a second method: one forward over the whole padded batch
        want, _ = full_batch_logprobs(model, batch, 1.0)
    mask = batch.response_mask
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-4)
    assert (got[mask] - plain[mask]).abs().max() > 1e-3


def test_check_config_refuses_what_cannot_replay(moe_dir, tmp_path, monkeypatch):
    import importlib.util

    from cfg_helpers import learner_cfg
    from model_families import build_family

    from rlkit.config.schema import ConfigError
    from rlkit.learner import routing

    def cfg(path=moe_dir, engine="vllm", **flat):
        c = learner_cfg(model_path=path, **flat)
        c.algo.routing_replay, c.rollout.engine = True, engine
        return c

    routing.check_config(learner_cfg(model_path=moe_dir))  # off: nothing checked
    with pytest.raises(ConfigError, match="algo.routing_replay=true needs rollout.engine=vllm"):
        routing.check_config(cfg(engine="hf"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="Model Runner V2, which needs Triton"):
        routing.check_config(cfg())
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a)
    )
    routing.check_config(cfg())  # an MoE with replayable routers on a vLLM with Triton: accepted
    c = cfg()
    c.model.lora.rank = 8
    with pytest.raises(ConfigError, match=r"model.lora.rank=8 \(LoRA\)"):
        routing.check_config(c)
    c = cfg()
    c.trainer.strategy = "fsdp2"
    with pytest.raises(ConfigError, match="trainer.strategy=fsdp2"):
        routing.check_config(c)
    c = cfg()
    c.env.name = "calculator"
    with pytest.raises(ConfigError, match="multi-turn"):
        routing.check_config(c)
    with pytest.raises(ConfigError, match="no mixture-of-experts router"):
        routing.check_config(cfg(build_family("llama3", tmp_path / "dense")))


def test_learner_gradients_replay_under_gradient_checkpointing(moe_dir):
    """The backward's recomputation of a checkpointed forward replays the same routes: the gradient of a batch
    with other routes is the same with and without gradient checkpointing, and differs from the gradient
    without routes."""
    import dataclasses

    from cfg_helpers import learner_cfg
    from learner_helpers import make_batch

    from rlkit.learner import Learner

    batch = make_batch(n=4, prompt_width=5, response_width=6, seed=6, all_fields=False)
    g = torch.Generator().manual_seed(7)
    other = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4 * 11 * 2)]).reshape(4, 11, 2, 2)
    replayed = dataclasses.replace(batch, routed_experts=other.to(torch.int16))

    def grads(gc: bool, b):
        cfg = learner_cfg(
            model_path=moe_dir, dtype="float32", lr=1e-3, max_grad_norm=None, seed=0, gradient_checkpointing=gc,
            max_tokens_per_microbatch=24,
        )  # fmt: skip
        cfg.algo.routing_replay = True
        learner = Learner(cfg)
        model = learner.accelerator.unwrap_model(learner.model)
        # transformers checkpoints a layer only in training mode, and the learner's policy stays in eval mode
        # (from_pretrained's): train mode here so that the backward really recomputes (no dropout in this model)
        model.train()
        learner.accumulate_gradients(b)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed, unrouted = grads(False, replayed), grads(True, replayed), grads(False, batch)
    router = "model.layers.0.mlp.gate.weight"
    assert plain[router].abs().sum() > 0
    for name, want in plain.items():
        torch.testing.assert_close(checkpointed[name], want, rtol=1e-4, atol=1e-6, msg=name)
    assert (unrouted[router] - plain[router]).abs().max() > 1e-6
