"""Two-process CPU tests (gloo): DDP through accelerate, and FSDP2 weight export with torch's fully_shard."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import (
    FULL_LOSS,
    RANK_ROWS,
    RESUME,
    TIMING,
    assert_grads_close,
    assert_resume_exact,
    four_steps_then_two_plus_two,
    global_batch,
    init_worker_env,
    learner_grads,
    reference_grads,
    spawn_ranks,
    write_tiny_llama,
)

from rlkit.algos.losses import AGG_MODES
from rlkit.learner import Learner

pytestmark = pytest.mark.slow  # the learner in 2 processes: `make test-fast` leaves it out


def _ddp_worker(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    init_worker_env(rank, world_size, port)
    _, batch = global_batch()
    local = batch.select(RANK_ROWS[rank])
    results = {}
    for mode in AGG_MODES:
        learner = Learner(learner_cfg(model_path=model_dir, loss_agg_mode=mode, **FULL_LOSS))
        assert learner.world_size == 2
        learner.accumulate_gradients(local)
        counts = [len(mb.micros) for mb in learner.plan(local, 1)]
        results[mode] = {"grads": learner_grads(learner), "counts": counts}
    # One real update: metrics merged over micro-batches and ranks, and the weights after the step.
    learner = Learner(learner_cfg(model_path=model_dir, **FULL_LOSS))
    metrics = learner.update(local)
    results["update"] = {"metrics": metrics, "weights": dict(learner.named_weights())}
    cfg = learner_cfg(model_path=model_dir, **{**FULL_LOSS, **RESUME})
    results["resume"] = {}
    four_steps_then_two_plus_two(lambda: Learner(cfg), rank, f"{out_dir}/ckpt", results["resume"])
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    spawn_ranks(_ddp_worker, tiny_model_dir, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_real_microbatch_counts_differ_between_ranks():
    """Guards the setup: without padding micro-batches the two ranks would run different counts."""
    from rlkit.learner.batching import microbatches

    _, batch = global_batch()
    counts = [
        len(microbatches(batch.select(RANK_ROWS[r]), FULL_LOSS["max_tokens_per_microbatch"])) for r in (0, 1)
    ]
    assert counts[0] >= 3 and counts[1] == 1


@pytest.mark.parametrize("mode", AGG_MODES)
def test_two_process_gradient_equals_full_batch_gradient(ddp_results, tiny_model_dir, mode):
    generated, batch = global_batch()
    cfg = learner_cfg(model_path=tiny_model_dir, loss_agg_mode=mode, **FULL_LOSS)
    expected = reference_grads(tiny_model_dir, batch, cfg, generated.response_mask)
    for rank in (0, 1):
        assert_grads_close(ddp_results[rank][mode]["grads"], expected)


def test_every_rank_runs_the_same_number_ofmicrobatches(ddp_results):
    counts = [ddp_results[r]["token-mean"]["counts"] for r in (0, 1)]
    assert counts[0] == counts[1] and counts[0][0] >= 3


def test_padding_microbatches_do_not_dilute_metrics(ddp_results, tiny_model_dir):
    """The merged 2-rank metrics (rank 1 runs padding micro-batches) equal a 1-process full-batch update."""
    _, batch = global_batch()
    single = Learner(learner_cfg(model_path=tiny_model_dir, **FULL_LOSS))
    expected = single.update(batch)
    got = ddp_results[0]["update"]["metrics"]
    assert got.keys() == expected.keys()
    for k in expected:
        # Timing, and the tokens of the tensors run: rank 1 runs padding micro-batches of its own widths.
        if k in (*TIMING, "learner/run_tokens"):
            continue
        torch.testing.assert_close(got[k], expected[k], atol=1e-5, rtol=1e-5, msg=k)
    # Padding rows would pull the minimum ratio to 0 if they were merged.
    assert got["policy/ratio_min"] > 0.1
    for k, v in dict(single.named_weights()).items():
        torch.testing.assert_close(ddp_results[0]["update"]["weights"][k], v, atol=1e-6, rtol=1e-5, msg=k)
        torch.testing.assert_close(ddp_results[1]["update"]["weights"][k], v, atol=1e-6, rtol=1e-5, msg=k)


def test_four_steps_equal_two_plus_resume_plus_two_under_ddp(ddp_results):
    assert_resume_exact([r["resume"] for r in ddp_results])


def test_padding_microbatch_carries_every_field_with_mask_zero():
    from rlkit.learner.batching import padding_micro

    _, batch = global_batch()
    pad = padding_micro(batch)
    assert pad.padding
    fields = pad.batch.tensor_fields()
    assert fields.keys() == batch.tensor_fields().keys()
    # every field the batch sets (all but a vision-language batch's images and a routing-replay batch's routes,
    # whose padding tests/leaves/test_batch_images.py and test_batch_routes.py hold)
    unset = {"images", "routed_experts"}
    assert all(v is not None for k, v in dataclasses.asdict(pad.batch).items() if k not in unset)
    assert not pad.batch.response_mask.any()
    for k, v in fields.items():
        assert v.shape[1:] == batch.tensor_fields()[k].shape[1:] and torch.isfinite(v.float()).all(), k


# -- FSDP2 weight export ----------------------------------------------------------------------------


def _fsdp_worker(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from rlkit.weights import iter_full_parameters

    init_worker_env(rank, world_size, port)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Activation checkpointing renames layers (`_checkpoint_wrapped_module`), as accelerate does.
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    assert sharded, "fully_shard should turn parameters into DTensor shards"
    exported = {}
    for name, tensor in iter_full_parameters(model):
        assert not isinstance(tensor, DTensor)
        exported[name] = tensor.clone()
    torch.save({"exported": exported, "num_sharded": len(sharded)}, f"{out_dir}/fsdp{rank}.pt")
    dist.destroy_process_group()


def test_fsdp2_export_equals_unsharded_state_dict(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny_llama(tmp_path / "untied", seed=3, tie=False)
    spawn_ranks(_fsdp_worker, model_dir, str(tmp_path))
    expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"fsdp{rank}.pt", weights_only=False)
        assert got["num_sharded"] == len(expected)
        assert got["exported"].keys() == expected.keys()  # transformers names, wrappers stripped
        for k, v in expected.items():
            assert torch.equal(got["exported"][k], v), k
