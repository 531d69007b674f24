"""The learner's FSDP2 path (accelerate's, as on CUDA) under 2 gloo processes on CPU, fp32 and bf16.

One 2-process launch per precision runs every check's distributed half and saves what it measured;
the tests compare that with single-process computations that share no code with the learner's
distributed path (a naive full-batch loss, plain transformers models, a 1-process learner).

What bf16 runs: only what its precision path can change. bf16 is FSDP2's
MixedPrecisionPolicy over fp32 master weights: forward and backward in bf16, gradients reduced in bf16,
the reference model loaded in bf16, the push exporting from a bf16-compute learner. So bf16 checks the
gradient (one aggregation mode, token-mean, the one every other check trains with), gradient
checkpointing's recomputation under the bf16 cast, the 4 steps against one fp32 process (Adam on the fp32
masters), the sharded reference and critic, and the weight push. It does not repeat what is the same code
on the same fp32 state in both precisions, which fp32 checks at tolerances bf16 could not reach: the
other three aggregation modes (the loss normalisation over ranks: checked exactly in fp32; bf16's 15%
would only repeat it loosely), the 2 + resume + 2 steps and the HF checkpoint (rlkit/learner/checkpoint.py
has no dtype branch; it saves and loads the fp32 masters and optimizer state, which MixedPrecisionPolicy
never casts), and the shard sizes (the fp32 parameters and optimizer state are sharded alike).

bf16 tolerances, from the dtype's precision and each quantity's scale. FSDP2's MixedPrecisionPolicy runs
forward and backward with bf16 parameters and activations and reduces gradients in bf16; the references
run in fp32. bf16 keeps 8 significant bits: eps = 2^-8, so one rounding errs by at most u = 2^-9 relative.
- One forward (reference log-probs, critic values): a 2-layer model rounds each value about 12 times
  (embedding, 2 x (norm, q/k/v, attention, o, norm, MLP), head) -> at most 12u ~ 2.3% of the value's own
  scale (log-probs: their deviation from the uniform -log V, ~0.1). FORWARD_REL = 16u = 2^-5.
  (Measured 0.35-0.63%.)
- The whole gradient: the same roundings, but a tiny random model's gradient is a sum of terms that
  cancel (near-uniform attention), which multiplies the relative error by the cancellation ratio
  (~5 here): BF16_GRAD_REL = 0.15 (measured 3-8%); the gradient of one rank's rows alone is 0.48-1.0 away.
- grad norms and losses of 4 steps: after step 1 the bf16 run follows its own trajectory (weights differ
  by the gradient error relayed through Adam, below), so they differ by up to the gradient's relative
  error: 10% (measured <= 3.4%).
- Weights after 4 AdamW steps: fp32 master weights, so the error is only in the update directions. An
  Adam step moves each weight by at most ~lr_t whatever its scale, and a gradient off by BF16_GRAD_REL
  turns its direction by at most that fraction: the RMS difference per tensor is at most
  BF16_GRAD_REL * sum_t lr_t (= 0.15 * 0.025 ~ 3.8e-3), absolute, for a matrix of scale 0.025 as for a
  norm weight of scale 1 (measured ~7e-4 for both; the old 10% relative let a norm weight be off by 0.1).
- lr: the schedule's arithmetic never touches bf16: exact.
- Entropy (~ log V = 4.85 here, computed in fp32 from bf16 logits): near uniform it depends on the
  logits only through their spread (sigma_z ~ 0.1), to second order: dH ~ sigma_z^2 * 16u ~ 3e-4, i.e.
  6e-5 relative. ENTROPY_REL = 2^-12 ~ 2.4e-4 (measured <= 1.7e-5).
- mismatch/kl after a push: the mean over tokens of (fp32 engine - bf16 learner) log-probs, each off by
  at most FORWARD_REL of the log-prob's ~0.1 deviation from uniform (~3e-3) and signed, so their mean
  smaller: PUSH_KL = 2^-9 ~ 2e-3 (measured 2e-4). Before the push (the learner moved one step of lr
  1e-2, the engine did not) it must exceed 10 * PUSH_KL (measured 0.04-0.08), an order of magnitude out.
"""

from __future__ import annotations

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import (
    FULL_LOSS,
    RANK_ROWS,
    RESUME,
    assert_resume_exact,
    four_steps_then_two_plus_two,
    full_batch_logprobs,
    global_batch,
    init_worker_env,
    load_fp32,
    local_rows,
    reference_grads,
    spawn_ranks,
    step_batches,
)
from reuse_helpers import LOSS as REUSE_LOSS
from reuse_helpers import assert_same, both_paths, reuse_batches, rollout_logprobs

from rlkit.algos.losses import AGG_MODES
from rlkit.learner import Learner

pytestmark = pytest.mark.slow  # FSDP2 in 2 processes: `make test-fast` leaves it out

DTYPES = ("float32", "bfloat16")
# bf16 runs only the checks its mixed-precision path can change (module docstring).
BF16_MODE = "token-mean"  # the gradient's one aggregation mode in bf16
U = 2**-9  # bf16 unit roundoff (eps 2^-8)
# Relative error in norm of one forward's outputs (see the module docstring).
REL = {"float32": 1e-5, "bfloat16": 16 * U}
# bf16: relative error in norm allowed for the whole gradient, and for the 4-step run's grad norms and losses.
BF16_GRAD_REL = 0.15
BF16_STEP_REL = 0.1
ENTROPY_REL = {"float32": 1e-4, "bfloat16": 2**-12}
# |mismatch/kl| right after a push; before it, the same check must read more than 10 times this.
PUSH_KL = {"float32": 1e-5, "bfloat16": U}


def full_grads(learner) -> dict[str, torch.Tensor]:
    """Gathered gradient of every policy parameter (a collective per DTensor: all ranks call it)."""
    model = learner.accelerator.unwrap_model(learner.model)
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def local_numel(tensors) -> tuple[int, int]:
    """(elements held by this rank, elements of the full tensors) over DTensors."""
    tensors = list(tensors)
    return sum(t.to_local().numel() for t in tensors), sum(t.numel() for t in tensors)


def _worker(rank, world, port, model_dir, tok_dir, out_dir, dtype):
    import warnings

    init_worker_env(rank, world, port)
    with warnings.catch_warnings(record=True) as caught:  # under the process's filters, as a run's console
        out = _checks(rank, model_dir, tok_dir, out_dir, dtype)
    out["warnings"] = [str(w.message) for w in caught]
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _checks(rank, model_dir, tok_dir, out_dir, dtype) -> dict:
    from torch.distributed.tensor import DTensor

    def cfg(**kw):
        return learner_cfg(model_path=model_dir, **{**FULL_LOSS, "strategy": "fsdp2", "dtype": dtype, **kw})

    out = {}
    _, batch = global_batch()
    mine = local_rows(batch, rank)
    # Gradient of the whole global batch, all four aggregation modes (bf16: one), and with gradient
    # checkpointing.
    for mode in AGG_MODES if dtype == "float32" else (BF16_MODE,):
        learner = Learner(cfg(loss_agg_mode=mode))
        assert learner.accelerator.is_fsdp2 and learner.world_size == 2
        assert all(isinstance(p, DTensor) for p in learner.model.parameters())
        learner.accumulate_gradients(mine)
        out[mode] = full_grads(learner)
    learner = Learner(cfg(gradient_checkpointing=True))
    learner.accumulate_gradients(mine)
    out["checkpointing"] = full_grads(learner)

    if dtype == "float32":
        straight = four_steps_then_two_plus_two(lambda: Learner(cfg(**RESUME)), rank, f"{out_dir}/ckpt", out)
        params = local_numel(straight.model.parameters())
        opt_state = local_numel(
            v for s in straight.optimizer.state.values() for v in s.values() if isinstance(v, DTensor)
        )
        out["shards"] = {"params": params, "optimizer": opt_state}
    else:  # the 4-step run alone: its resume, checkpoint and shards are fp32's (module docstring)
        straight = Learner(cfg(**RESUME))
        out["straight"] = [straight.update(local_rows(b, rank)) for b in step_batches()]
        out["straight_weights"] = dict(straight.named_weights())
    out["ref_logprobs"] = straight.forward(mine, ref=True, policy=False).ref_logprobs
    out["values_after"] = straight.forward(mine, values=True, policy=False).values

    if dtype == "float32":  # the update's reused forward equals the separate scoring pass (test_reuse.py)
        out["reuse"] = _reuse_paths(learner_cfg(model_path=model_dir, strategy="fsdp2", **REUSE_LOSS), rank)
    # A fresh critic (sharded) scores like an unsharded one.
    critic = Learner(cfg(value_model=True, kl_coef=0.0))
    out["values"] = critic.forward(mine, values=True, policy=False).values
    out["push"] = _push_into_hf_engine(tok_dir, dtype, rank)
    return out


def _reuse_paths(config, rank: int) -> dict:
    """Both scoring paths (reuse_helpers.both_paths) on this rank's rows, token and sequence IS levels."""
    from rlkit.config.schema import RolloutISConfig

    learner = Learner(config)
    sampled, train = (b.select(RANK_ROWS[rank]) for b in reuse_batches())
    rollout = rollout_logprobs(learner, sampled, seed=10 + rank)
    return {
        level: both_paths(
            learner, sampled, train, rollout, RolloutISConfig(enabled=True, level=level, upper=1.5)
        )
        for level in ("token", "sequence")
    }


def _push_into_hf_engine(tok_dir: str, dtype: str, rank: int) -> dict:
    """Update the sharded learner, push its weights into this rank's HF engine, re-score: mismatch ~ 0."""
    from rlkit.algos.correction import mismatch_metrics
    from rlkit.batch import TrainBatch
    from rlkit.models import load_tokenizer
    from rlkit.rollout.engines.base import Sampling
    from rlkit.rollout.engines.hf import HFEngine
    from rlkit.verify import probe_tokens
    from rlkit.weights import push_weights

    learner = Learner(learner_cfg(model_path=tok_dir, dtype=dtype, strategy="fsdp2", lr=1e-2))
    tokenizer = load_tokenizer(tok_dir)
    engine = HFEngine(tok_dir, tokenizer, dtype=torch.float32, device="cpu", seed=rank)
    prompts = [tokenizer.encode("What is 2 + 3?"), tokenizer.encode("Name a colour.")]
    sampling = Sampling(temperature=1.0, max_new_tokens=8, seed=rank)
    rb = engine.generate(prompts, 2, sampling)
    g = torch.Generator().manual_seed(rank)
    batch = TrainBatch(
        prompt_ids=rb.prompt_ids,
        prompt_mask=rb.prompt_mask,
        response_ids=rb.response_ids,
        response_mask=rb.response_mask,
        advantages=torch.randn(rb.response_ids.shape, generator=g),
    )
    learner.update(batch)

    def kl(rollout):
        scored = learner.forward(rollout).logprobs
        return mismatch_metrics(scored, rollout.rollout_logprobs, rollout.response_mask)["mismatch/kl"]

    before = kl(rb)  # the learner moved, the engine did not
    push_weights(learner.export(), engine)
    after = kl(engine.generate(prompts, 2, sampling))
    # What a vLLM push does next: the log-prob probe (a forward without gradients, after which FSDP2 leaves the
    # root's parameters gathered), then the export read by a consumer. The export may not hand out FSDP2's own
    # gathered buffers: a consumer's numpy view of one (safetensors' save, the sha256 digest rlkit had) made its
    # storage non-resizable, and the next backward's reshard failed ("Trying to resize storage that is not
    # resizable"); FSDP2 would also free it under a consumer that holds it.
    export = learner.export()
    export.probe(probe_tokens(tokenizer.vocab_size))
    owned = [t.detach().cpu().numpy().sum() for _, t in export.tensors()]
    learner.update(batch)
    return {"before": before, "after": after, "digests": len(owned)}


@pytest.fixture(scope="module")
def tok_model_dir(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tok"), hidden_size=32, num_layers=2)


@pytest.fixture(scope="module")
def launches(tiny_model_dir, tok_model_dir, tmp_path_factory):
    """The 2-process launch of a precision, run once, on first use: (dtype, [rank outputs], out dir)."""
    done = {}

    def launch(dtype):
        if dtype not in done:
            out = tmp_path_factory.mktemp(f"fsdp2_{dtype}")
            spawn_ranks(_worker, tiny_model_dir, tok_model_dir, str(out), dtype)
            ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
            done[dtype] = dtype, ranks, out
        return done[dtype]

    return launch


@pytest.fixture(params=DTYPES)
def fsdp2(request, launches):
    """The checks run in both precisions."""
    return launches(request.param)


@pytest.fixture
def fsdp2_fp32(launches):
    """The checks whose code and state are the same in both precisions: fp32 only (module docstring)."""
    return launches("float32")


def assert_rel_close(got: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    err = (got.double() - expected.double()).norm() / expected.double().norm().clamp(min=1e-12)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel}"


def assert_dicts_close(got: dict, expected: dict, rel: float) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        assert_rel_close(got[k], expected[k], rel, k)


def global_rel_error(got: dict, expected: dict) -> float:
    """Relative error in norm of the whole gradient (all tensors concatenated)."""
    g = torch.cat([got[k].double().flatten() for k in expected])
    e = torch.cat([expected[k].double().flatten() for k in expected])
    return float((g - e).norm() / e.norm())


@pytest.mark.parametrize("dtype, mode", [("float32", mode) for mode in AGG_MODES] + [("bfloat16", BF16_MODE)])
def test_gradient_equals_single_process_full_batch_gradient(launches, tiny_model_dir, dtype, mode):
    _, ranks, _ = launches(dtype)
    generated, batch = global_batch()
    cfg = learner_cfg(model_path=tiny_model_dir, loss_agg_mode=mode, **FULL_LOSS)
    expected = reference_grads(tiny_model_dir, batch, cfg, generated.response_mask)
    if dtype == "float32":
        for r in ranks:
            assert_dicts_close(r[mode], expected, REL[dtype])
        return
    # bf16: a tiny random model's gradients cancel a lot (near-uniform attention), so single tensors
    # carry up to ~20% bf16 noise; the whole gradient measured 3-8%. Allowed: 15% (module docstring). The
    # check can fail: the gradient of rank 0's rows alone (a lost rank) is 0.48-1.0 away, over 3 times that.
    for r in ranks:
        assert global_rel_error(r[mode], expected) < BF16_GRAD_REL, mode
    rows = RANK_ROWS[0]
    alone = reference_grads(tiny_model_dir, batch.select(rows), cfg, generated.select(rows).response_mask)
    assert global_rel_error(alone, expected) > 3 * BF16_GRAD_REL


def test_gradient_checkpointing_gives_the_same_gradient(fsdp2):
    dtype, ranks, _ = fsdp2
    # Recomputation repeats the same ops on the same inputs, in the same precision: equal up to summation
    # order, in bf16 as in fp32 (bf16 measured bit-equal).
    assert_dicts_close(ranks[0]["checkpointing"], ranks[0]["token-mean"], 1e-5)


@pytest.fixture(scope="module")
def single_process_run(tiny_model_dir):
    """The 4-step run in one process (no wrapper, fp32, full global batches): the reference."""
    learner = Learner(learner_cfg(model_path=tiny_model_dir, **{**FULL_LOSS, **RESUME}))
    assert not learner.accelerator.is_fsdp2
    metrics = [learner.update(b) for b in step_batches()]
    return metrics, dict(learner.named_weights())


def test_four_steps_match_one_process_metrics_grad_norm_and_weights(fsdp2, single_process_run):
    dtype, ranks, _ = fsdp2
    metrics, weights = single_process_run
    rel = BF16_STEP_REL if dtype == "bfloat16" else 1e-4
    for step, expected in enumerate(metrics):
        got = ranks[0]["straight"][step]
        for k in ("grad_norm", "value/grad_norm", "loss/policy", "loss/total"):
            assert_rel_close(got[k], expected[k], rel, f"step {step} {k}")
        assert_rel_close(got["entropy"], expected["entropy"], ENTROPY_REL[dtype], f"step {step} entropy")
        assert torch.equal(got["lr"], expected["lr"]), step  # the schedule never touches bf16
    if dtype == "float32":
        assert_dicts_close(ranks[0]["straight_weights"], weights, 1e-5)
    else:  # Adam's steps are ~lr whatever the weight's scale: an absolute RMS bound (module docstring)
        bound = BF16_GRAD_REL * sum(float(m["lr"]) for m in metrics)
        assert ranks[0]["straight_weights"].keys() == weights.keys()
        for k, w in weights.items():
            rms = (ranks[0]["straight_weights"][k].double() - w.double()).pow(2).mean().sqrt()
            assert rms <= bound, f"{k}: RMS difference {rms:.3g} > {bound:.3g}"
    assert_dicts_close(ranks[1]["straight_weights"], ranks[0]["straight_weights"], 0.0)


def test_reused_forward_equals_the_separate_pass(fsdp2_fp32):
    """Log-probs, entropy, IS weights, IS and mismatch metrics, loss and the gathered gradient of the update's
    reused forward equal the separate pass's on each rank (rank 0: several micro-batches, rank 1: one)."""
    _, ranks, _ = fsdp2_fp32
    for out in ranks:
        for result in out["reuse"].values():
            assert_same(result)


def test_four_steps_equal_two_plus_resume_plus_two(fsdp2_fp32):
    _, ranks, _ = fsdp2_fp32
    assert_resume_exact(ranks)


def test_hf_checkpoint_loads_in_plain_transformers_and_equals_gathered_weights(fsdp2_fp32):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    _, ranks, out = fsdp2_fp32
    model = AutoModelForCausalLM.from_pretrained(out / "ckpt" / "model", dtype=torch.float32)
    saved = ranks[0]["saved_weights"]
    state = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(state[k], v), k
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # still tied
    critic = AutoModelForTokenClassification.from_pretrained(out / "ckpt" / "value_model")
    assert critic.score.weight.shape == (1, 32)
    assert (out / "ckpt" / "state" / "pytorch_model_fsdp_0").is_dir()  # sharded (DCP) state, not a full copy


def test_each_rank_holds_half_of_the_parameters_and_optimizer_state(fsdp2_fp32):
    _, ranks, _ = fsdp2_fp32
    for key in ("params", "optimizer"):
        locals_ = [r["shards"][key][0] for r in ranks]
        total = ranks[0]["shards"][key][1]
        assert sum(locals_) == total, key  # the shards partition the tensors
        for n in locals_:
            assert abs(n - total / 2) <= 0.05 * total, (key, n, total)
    # Optimizer state: exp_avg and exp_avg_sq of every (policy) parameter, sharded like it.
    assert ranks[0]["shards"]["optimizer"][1] == 2 * ranks[0]["shards"]["params"][1]


def test_sharded_reference_and_critic_score_like_unsharded_models(fsdp2, tiny_model_dir):
    dtype, ranks, _ = fsdp2
    generated, batch = global_batch()
    reference = load_fp32(tiny_model_dir)  # the initial policy, unsharded, plain transformers
    critic = Learner(learner_cfg(model_path=tiny_model_dir, dtype="float32", value_model=True))
    for rank, r in enumerate(ranks):
        mine = local_rows(batch, rank)
        mask = mine.response_mask
        with torch.no_grad():
            gen = local_rows(generated, rank).response_mask
            expected, _ = full_batch_logprobs(reference, mine, 1.0, gen)
        # bf16: compare log-probs through their deviation from the uniform -log(V) (~ -4.85), the part
        # the weights decide, so the relative check is not trivially met by the constant.
        offset = -torch.log(torch.tensor(float(reference.config.vocab_size)))
        assert_rel_close(r["ref_logprobs"][mask] - offset, expected[mask] - offset, REL[dtype], "ref")
        values = critic.forward(mine, values=True, policy=False).values
        assert_rel_close(r["values"][mask], values[mask], REL[dtype], "values")
        assert not torch.allclose(r["values_after"][mask], values[mask], atol=1e-4)  # the critic trained


def test_weight_push_from_sharded_learner_gives_zero_mismatch(fsdp2):
    dtype, ranks, _ = fsdp2
    for r in ranks:
        assert abs(r["push"]["after"]) < PUSH_KL[dtype]
        # The check can fail: before the push they disagree by an order of magnitude more than it allows.
        assert abs(r["push"]["before"]) > 10 * PUSH_KL["bfloat16"]
        # An update after the probe and the digests trained (the worker would have died in its backward).
        assert r["push"]["digests"] > 0


def test_the_sharded_forward_and_update_print_no_fsdp2_view_warning(fsdp2):
    """FSDP2 warns that a wrapped module returned a view (the embedding's output among the hidden states the
    chunked head asks for): no in-place write follows in rlkit, so no rank's console shows it."""
    _, ranks, _ = fsdp2
    for r in ranks:
        assert not [w for w in r["warnings"] if "returned a view tensor" in w], r["warnings"]


def test_strategy_validation_names_key_value_and_choices(tmp_path):
    from rlkit.config.schema import ConfigError
    from rlkit.learner.strategy import resolve_strategy
    from rlkit.train import load_config

    with pytest.raises(ValueError, match=r"trainer.strategy='zero3' is not valid; choose one of \['auto'"):
        resolve_strategy("zero3", cuda=False, world_size=2)
    with pytest.raises(
        ConfigError, match=r"trainer.strategy='zero3' is not one of \['auto', 'fsdp2', 'ddp'\]"
    ):
        load_config({"model": {"path": "x"}, "trainer": {"strategy": "zero3"}})
    assert resolve_strategy("auto", cuda=True, world_size=8) == "fsdp2"
    assert resolve_strategy("auto", cuda=False, world_size=2) == "ddp"
    assert resolve_strategy("fsdp2", cuda=False, world_size=2) == "fsdp2"
    assert resolve_strategy("fsdp2", cuda=False, world_size=1) == "none"
