"""The learner on a mixture-of-experts model: FSDP2 in 2 gloo processes on a tiny Qwen3-MoE (4 experts,
top-2, the experts fused into one tensor per layer and sharded like every parameter) gives the single-process
full-batch gradient, and the push's export gathers each expert tensor whole from its shards.

The checkpoint asks for router logits (`output_router_logits=True`): the learner turns them off, so its loss
carries no router auxiliary (load-balancing) term, as documented; the reference is the configured loss
computed from a plain transformers forward's logits (tests/learner/learner_helpers.py), with no such term."""

from __future__ import annotations

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import FULL_LOSS, global_batch, init_worker_env, local_rows, reference_grads, spawn_ranks
from model_families import family_config

from rlkit.learner import Learner

pytestmark = pytest.mark.slow  # FSDP2 in 2 processes: `make test-fast` leaves it out


def _worker(rank, world, port, model_dir, out_dir):
    from torch.distributed.tensor import DTensor

    init_worker_env(rank, world, port)
    learner = Learner(learner_cfg(model_path=model_dir, strategy="fsdp2", **FULL_LOSS))
    model = learner.accelerator.unwrap_model(learner.model)
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    out = {
        "router_logits": model.config.output_router_logits,
        "expert_shards": {
            n: (p.to_local().shape, p.shape) for n, p in experts.items() if isinstance(p, DTensor)
        },
    }
    out["weights"] = dict(learner.named_weights())  # what a push streams: gathered from the shards
    _, batch = global_batch()
    learner.accumulate_gradients(local_rows(batch, rank))
    out["grads"] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    config = family_config("qwen3-moe")
    config.output_router_logits = True
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_moe")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ranks(moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_moe")
    spawn_ranks(_worker, moe_dir, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_fsdp2_moe_gradient_equals_the_single_process_gradient(ranks, moe_dir):
    generated, batch = global_batch()
    cfg = learner_cfg(model_path=moe_dir, **FULL_LOSS)
    expected = reference_grads(moe_dir, batch, cfg, generated.response_mask)
    assert any(".experts." in n for n in expected)
    for r in ranks:
        assert r["grads"].keys() == expected.keys()
        for name, g in expected.items():
            err = (r["grads"][name].double() - g.double()).norm() / g.double().norm().clamp(min=1e-12)
            assert err <= 1e-5, f"{name}: relative error {err:.3g}"
    # The experts received gradient (top-2 of 4 over 40-odd tokens reaches every expert).
    assert all(expected[n].abs().sum() > 0 for n in expected if ".experts." in n)


def test_experts_are_sharded_and_the_push_gathers_them_whole(ranks, moe_dir):
    from transformers import AutoModelForCausalLM

    plain = dict(AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).named_parameters())
    for r in ranks:
        assert not r["router_logits"]  # turned off: no auxiliary loss, no router logits computed
        shards = r["expert_shards"]
        assert shards and all(local[0] * 2 == full[0] for local, full in shards.values())
        for name, tensor in r["weights"].items():
            assert torch.equal(tensor, plain[name]), name
