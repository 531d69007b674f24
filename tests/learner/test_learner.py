"""Single-process learner tests: log-probs, micro-batching, exact gradients, masking, no aliasing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import (
    assert_grads_close,
    full_batch_logprobs,
    learner_grads,
    load_fp32,
    make_batch,
    reference_grads,
    reference_loss,
)

from rlkit.algos import advantages, kl
from rlkit.algos.losses import AGG_MODES
from rlkit.learner import Learner
from rlkit.learner.batching import pack_microbatches, position_ids_from_mask
from rlkit.weights import clean_param_name

pytestmark = (
    pytest.mark.slow
)  # the learner in 2 processes, and updates for seconds: `make test-fast` leaves it out


def config(path, **kw):
    base = dict(model_path=path, dtype="float32", lr=1e-3, max_grad_norm=None, seed=0)
    return learner_cfg(**{**base, **kw})


# -- pure helpers ---------------------------------------------------------------------------------


def test_position_ids_match_generate_for_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    assert torch.equal(position_ids_from_mask(mask), expected)


@pytest.mark.parametrize("budget", [10, 25, 60, 1000])
def test_pack_microbatches_respects_budget_and_covers_every_row(budget):
    g = torch.Generator().manual_seed(1)
    plens = torch.randint(1, 12, (23,), generator=g).tolist()
    rlens = torch.randint(0, 20, (23,), generator=g).tolist()
    bins = pack_microbatches(plens, rlens, budget)
    assert sorted(i for b in bins for i in b) == list(range(23))
    for b in bins:
        padded = len(b) * (max(plens[i] for i in b) + max(rlens[i] for i in b))
        # Only a single over-long row may exceed the budget.
        assert padded <= budget or len(b) == 1
    if budget >= sum(plens) + sum(rlens) and budget >= 23 * (max(plens) + max(rlens)):
        assert len(bins) == 1


def test_clean_param_name_strips_wrappers_only():
    assert clean_param_name("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.weight") == (
        "model.layers.0.mlp.weight"
    )
    assert clean_param_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"
    # "module" inside a real name is left alone.
    assert clean_param_name("model.some_module.weight") == "model.some_module.weight"


# -- log-probs ------------------------------------------------------------------------------------


def test_forward_logprobs_equal_naive_per_sample_loop(tiny_model_dir):
    temperature = 0.7
    learner = Learner(config(tiny_model_dir, temperature=temperature, max_tokens_per_microbatch=30))
    batch = make_batch(n=7, seed=3, all_fields=False)
    out = learner.forward(batch)

    model = load_fp32(tiny_model_dir)
    with torch.no_grad():
        for i in range(batch.num_samples):
            prompt = batch.prompt_ids[i][batch.prompt_mask[i]]
            resp = batch.response_ids[i][batch.response_mask[i]]
            ids = torch.cat([prompt, resp])[None]
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            logsm = torch.log_softmax(logits / temperature, -1)
            expected = logsm.gather(-1, resp[:, None])[:, 0]
            entropy = -(logsm.exp() * logsm).sum(-1)
            r = len(resp)
            torch.testing.assert_close(out.logprobs[i, :r], expected, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.entropy[i, :r], entropy, atol=1e-5, rtol=0)
            assert torch.all(out.logprobs[i, r:] == 0)


def test_forward_ref_without_reference_model_raises(tiny_model_dir):
    learner = Learner(config(tiny_model_dir))
    with pytest.raises(ValueError, match="kl_coef"):
        learner.forward(make_batch(), ref=True)


@pytest.mark.parametrize("why", [{"kl_coef": 0.1}, {"kl_coef": 0.1, "kl_in_reward": True}])
def test_reference_model_scores_the_initial_policy(tiny_model_dir, why):
    learner = Learner(config(tiny_model_dir, lr=1e-2, **why))
    batch = make_batch(seed=4)
    before = learner.forward(batch, ref=True)
    torch.testing.assert_close(before.logprobs, before.ref_logprobs, atol=1e-6, rtol=0)
    learner.update(batch)
    after = learner.forward(batch, ref=True)
    assert torch.equal(after.ref_logprobs, before.ref_logprobs)  # frozen
    assert not torch.allclose(after.logprobs, before.logprobs)


# -- gradients ------------------------------------------------------------------------------------

FULL_LOSS = dict(
    clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_estimator="k3", rollout_kl_coef=0.05, entropy_coef=0.01
)


@pytest.mark.parametrize(
    "mode,policy_loss",
    [(m, "ppo_clip") for m in AGG_MODES] + [("seq-mean-token-mean", "gspo"), ("token-mean", "cispo")],
)
def test_microbatched_gradient_equals_full_batch_gradient(tiny_model_dir, mode, policy_loss):
    cfg = config(
        tiny_model_dir, loss_agg_mode=mode, policy_loss=policy_loss, max_tokens_per_microbatch=20, **FULL_LOSS
    )
    batch = make_batch(n=8, seed=11)
    # Make one row fully masked (as zero-std masking does) and one with a hole in its loss mask; the
    # model still sees every generated token.
    generated = batch.response_mask
    mask = generated.clone()
    mask[2] = False
    mask[5, 0] = False
    batch = dataclasses.replace(batch, response_mask=mask)

    learner = Learner(cfg)
    learner.accumulate_gradients(batch)
    assert len(learner.plan(batch, 1)[0].micros) >= 3  # the budget really splits the batch
    assert_grads_close(learner_grads(learner), reference_grads(tiny_model_dir, batch, cfg, generated))


def test_norm_len_is_a_global_constant(tiny_model_dir):
    cfg = config(
        tiny_model_dir, loss_agg_mode="seq-mean-token-sum-norm", norm_len=16, max_tokens_per_microbatch=30
    )
    batch = make_batch(n=6, seed=12, all_fields=False)
    learner = Learner(cfg)
    learner.accumulate_gradients(batch)
    assert_grads_close(learner_grads(learner), reference_grads(tiny_model_dir, batch, cfg))


def test_missing_fields_raise_naming_field_and_key(tiny_model_dir):
    batch = make_batch(all_fields=False)
    with pytest.raises(ValueError, match=r"ref_logprobs.*kl_coef"):
        Learner(config(tiny_model_dir, kl_coef=0.1)).update(batch)
    with pytest.raises(ValueError, match=r"rollout_logprobs.*rollout_kl_coef"):
        Learner(config(tiny_model_dir, rollout_kl_coef=0.1)).update(batch)


# -- zero-std masking -----------------------------------------------------------------------------


def test_zero_std_group_contributes_exactly_zero_gradient_kl_included(tiny_model_dir):
    cfg = config(
        tiny_model_dir, kl_coef=0.5, kl_estimator="k3", rollout_kl_coef=0.1, max_tokens_per_microbatch=40
    )
    base = make_batch(n=6, seed=21)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0])  # group 1 (rows 2, 3) has zero std
    adv = advantages.grpo(rewards, 2)[:, None].expand_as(base.advantages).clone()
    zero_std = advantages.zero_std_groups(rewards, 2)
    assert zero_std.tolist() == [False, False, True, True, False, False]

    def perturbed(batch):
        """The zero-std group's reference / rollout log-probs moved far away: only KL terms see it."""
        ref = batch.ref_logprobs.clone()
        ref[zero_std] -= 3.0
        roll = batch.rollout_logprobs.clone()
        roll[zero_std] += 2.0
        return dataclasses.replace(batch, ref_logprobs=ref, rollout_logprobs=roll)

    def grads(batch):
        learner = Learner(cfg)
        learner.accumulate_gradients(batch)
        return learner_grads(learner)

    unmasked = dataclasses.replace(base, advantages=adv)
    masked = dataclasses.replace(unmasked, response_mask=unmasked.response_mask & ~zero_std[:, None])

    # Masking off: the group's advantage is 0, yet the KL terms still pull on it.
    g_off, g_off_perturbed = grads(unmasked), grads(perturbed(unmasked))
    diff = sum((g_off[k] - g_off_perturbed[k]).abs().sum() for k in g_off)
    assert diff > 1e-3
    # Masking on: whatever the masked rows hold, the gradient is bit-for-bit the same.
    g_on, g_on_perturbed = grads(masked), grads(perturbed(masked))
    for k in g_on:
        assert torch.equal(g_on[k], g_on_perturbed[k]), k


def test_rows_without_loss_tokens_are_not_forwarded_and_change_nothing(tiny_model_dir):
    """Zero-std rows cost no forward/backward: with one row per micro-batch only live rows are run,
    and the gradient still equals the full-batch reference (where the masked rows add exactly 0)."""
    cfg = config(tiny_model_dir, kl_coef=0.5, rollout_kl_coef=0.1, max_tokens_per_microbatch=1)
    batch = make_batch(n=6, seed=23)
    generated = batch.response_mask
    live = torch.tensor([True, False, False, True, False, True])
    masked = dataclasses.replace(batch, response_mask=generated & live[:, None])

    learner = Learner(cfg)
    learner.accumulate_gradients(masked)
    assert (
        len(learner.plan(masked, 1)[0].micros) == 3
    )  # one micro-batch per live row, none for the 3 masked rows
    assert_grads_close(learner_grads(learner), reference_grads(tiny_model_dir, masked, cfg, generated))

    # A batch with no live row at all still runs (one padding micro-batch) and yields a zero gradient.
    empty = dataclasses.replace(batch, response_mask=torch.zeros_like(generated))
    learner = Learner(cfg)
    learner.accumulate_gradients(empty)
    assert len(learner.plan(empty, 1)[0].micros) == 1
    assert all(g is None or torch.count_nonzero(g) == 0 for g in learner_grads(learner).values())
    # Its update reports a zero loss, and undefined (NaN, not 0) per-token statistics.
    metrics = Learner(cfg).update(empty)
    assert metrics["loss/total"] == 0 and metrics["loss/policy"] == 0
    assert torch.isnan(metrics["entropy"]) and torch.isnan(metrics["kl_ref"])
    assert torch.isfinite(metrics["lr"])


# -- aliasing -------------------------------------------------------------------------------------


def test_logged_tensors_are_not_modified_by_advantages_or_update(tiny_model_dir):
    learner = Learner(config(tiny_model_dir, kl_coef=0.1, lr=1e-2, ppo_epochs=2, mini_batches=2))
    rb = make_batch(n=6, seed=31, all_fields=False)
    scored = learner.forward(rb, ref=True)
    kl_logged = kl.kl_estimate(scored.logprobs, scored.ref_logprobs, "k3")
    snapshots = {"kl": kl_logged.clone(), "logp": scored.logprobs.clone(), "ref": scored.ref_logprobs.clone()}

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    token_rewards = advantages.kl_shaped_rewards(rewards, kl_logged, rb.response_mask, kl_coef=0.1)
    adv = advantages.reinforce_pp(token_rewards, rb.response_mask)
    batch = dataclasses.replace(
        rb, advantages=adv, old_logprobs=scored.logprobs, ref_logprobs=scored.ref_logprobs
    )
    fields = {k: v.clone() for k, v in batch.tensor_fields().items()}
    learner.update(batch)

    assert torch.equal(kl_logged, snapshots["kl"])
    assert torch.equal(scored.logprobs, snapshots["logp"])
    assert torch.equal(scored.ref_logprobs, snapshots["ref"])
    for k, v in batch.tensor_fields().items():
        assert torch.equal(v, fields[k]), k


# -- training sanity ------------------------------------------------------------------------------


def test_updates_raise_likelihood_of_positively_rewarded_responses(tiny_model_dir):
    learner = Learner(config(tiny_model_dir, lr=3e-3, warmup_steps=1, lr_schedule="cosine", total_steps=8))
    batch = dataclasses.replace(make_batch(n=6, seed=41, all_fields=False), old_logprobs=None)
    batch = dataclasses.replace(batch, advantages=torch.ones_like(batch.advantages))
    mask = batch.response_mask

    def nll():
        logp = learner.forward(batch).logprobs
        return -(logp * mask).sum() / mask.sum()

    losses, lrs = [nll()], []
    for _ in range(8):
        metrics = learner.update(batch)
        lrs.append(float(metrics["lr"]))
        losses.append(nll())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1
    # Warm-up then cosine: lr rises, then decays.
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[1]
    # On-policy ppo_clip: ratio 1, loss = -mean advantage = -1.
    torch.testing.assert_close(metrics["loss/policy"], torch.tensor(-1.0))


def test_off_policy_update_recomputes_old_logprobs(tiny_model_dir):
    cfg = config(tiny_model_dir, lr=1e-2, ppo_epochs=2, mini_batches=2, max_tokens_per_microbatch=40)
    batch = dataclasses.replace(make_batch(n=6, seed=51, all_fields=False), old_logprobs=None)
    metrics = Learner(cfg).update(batch)
    # 4 optimizer steps: the first mini-batch of epoch 1 starts at ratio 1 exactly; later ones move.
    assert metrics["policy/ratio_max"] > 1.0 + 1e-4 or metrics["policy/ratio_min"] < 1.0 - 1e-4
    assert metrics["policy/approx_kl_k3"] > 0


def test_value_model_trains_toward_returns(tiny_model_dir):
    cfg = config(tiny_model_dir, value_model=True, vf_coef=1.0, value_clip=None, lr=1e-2)
    learner = Learner(cfg)
    batch = make_batch(n=6, seed=61)
    batch = dataclasses.replace(batch, returns=torch.full_like(batch.returns, 2.0))
    mask = batch.response_mask

    def value_error():
        v = learner.forward(batch, policy=False, values=True).values
        return ((v - 2.0) ** 2 * mask).sum() / mask.sum()

    before = value_error()
    for _ in range(5):
        metrics = learner.update(batch)
    assert value_error() < 0.5 * before
    assert "loss/value" in metrics and "value/grad_norm" in metrics


def test_named_weights_and_checkpoint_roundtrip(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    learner = Learner(config(tiny_model_dir, lr=1e-2))
    batch = make_batch(seed=71, all_fields=False)
    learner.update(batch)
    weights = dict(learner.named_weights())
    state = learner.accelerator.unwrap_model(learner.model).state_dict()
    # Tied lm_head is exported once, under the embedding's name.
    assert set(weights) == set(state) - {"lm_head.weight"}
    for k, v in weights.items():
        assert torch.equal(v, state[k])

    learner.save_checkpoint(tmp_path / "ckpt")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model", dtype=torch.float32)
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, state[k]), k

    # Resume: a fresh learner loaded from the checkpoint takes the same next step as the original.
    resumed = Learner(config(tiny_model_dir, lr=1e-2))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.global_step == learner.global_step == 1
    learner.update(batch)
    resumed.update(batch)
    for (k, a), (_, b) in zip(learner.named_weights(), resumed.named_weights()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=k)


def test_full_batch_reference_is_independent_of_padding_width(tiny_model_dir):
    """Guards the test oracle itself: extra padding columns do not change its log-probs."""
    model = load_fp32(tiny_model_dir)
    batch = make_batch(n=4, seed=81, all_fields=False)
    wide = dataclasses.replace(
        batch,
        prompt_ids=torch.cat([torch.zeros(4, 3, dtype=torch.long), batch.prompt_ids], 1),
        prompt_mask=torch.cat([torch.zeros(4, 3, dtype=torch.bool), batch.prompt_mask], 1),
    )
    with torch.no_grad():
        a, _ = full_batch_logprobs(model, batch, 1.0)
        b, _ = full_batch_logprobs(model, wide, 1.0)
    m = batch.response_mask
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)


def test_learner_counts_the_tokens_it_runs_and_skips_empty_rows(tiny_model_dir):
    learner = Learner(config(tiny_model_dir))
    batch = make_batch(n=6, seed=7)
    mask = batch.response_mask.clone()
    mask[1] = False  # a zero-std row: skipped by the learner
    mask[4] = False
    batch = dataclasses.replace(batch, response_mask=mask)
    kept = mask.any(-1)
    real = int(batch.prompt_mask[kept].sum() + mask[kept].sum())
    metrics = learner.update(batch)
    assert metrics["learner/tokens"].item() == real
    shape = learner.shape
    lengths = (batch.prompt_mask.sum(-1) + mask.sum(-1))[kept].tolist()
    by_hand = sum(
        t * (6 * shape.matmul_params + 12 * shape.layers * shape.attention_width * t) for t in lengths
    )
    assert abs(metrics["learner/flops"].item() - by_hand) <= 1e-9 * by_hand
    # Padded micro-batches run at least the real tokens; their count is the tensors' widths, not the masks.
    assert metrics["learner/run_tokens"].item() >= real


def test_ppo_update_with_critic_equals_a_naive_optimizer_loop(tiny_model_dir):
    """PPO with a critic, 2 epochs of 2 mini-batches: the learner's update equals a plain torch loop written
    here on fresh copies of the checkpoint: for each epoch, for each mini-batch (rows 0-3, then 4-7), the
    mini-batch's whole loss (policy x IS + KL - entropy + vf_coef * clipped value loss, token means over the
    mini-batch), one backward, each model's gradient clipped to max_grad_norm, both AdamW optimizers
    stepped. Micro-batches of 20 tokens split each mini-batch, so the accumulation is under test too."""
    from transformers import AutoModelForTokenClassification

    from rlkit.algos import losses

    cfg = config(
        tiny_model_dir, value_model=True, vf_coef=0.5, value_clip=0.2, ppo_epochs=2, mini_batches=2, lr=1e-2,
        weight_decay=0.01, max_grad_norm=0.5, lr_schedule="constant", warmup_steps=0, kl_coef=0.1,
        kl_estimator="k3", entropy_coef=0.01, clip_high=0.28, max_tokens_per_microbatch=20,
    )  # fmt: skip
    t = cfg.trainer
    batch = make_batch(n=8, seed=71)
    p, w = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    attn = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)

    def values_of(critic, rows):  # the value at the position whose hidden state predicts each response token
        out = critic(input_ids=ids[rows], attention_mask=attn[rows], position_ids=pos[rows]).logits
        return out[:, p - 1 : p + w - 1, 0].float()

    learner = Learner(cfg)
    critic0 = {k: v.detach().clone() for k, v in learner.accelerator.unwrap_model(learner.value_model).state_dict().items()}  # fmt: skip
    policy = load_fp32(tiny_model_dir)
    # The critic as the learner builds it: the checkpoint's backbone plus a Linear(hidden, 1) head, whose
    # random initial weights are taken from the learner (they depend on what drew random numbers before).
    critic = AutoModelForTokenClassification.from_pretrained(
        tiny_model_dir, num_labels=1, dtype=torch.float32
    )
    critic.config.use_cache = False
    for k, v in critic.state_dict().items():
        if not k.startswith("score."):
            torch.testing.assert_close(critic0[k], v, rtol=0, atol=0)  # the backbone is the checkpoint's
    critic.load_state_dict(critic0)
    # Rollout-time old log-probs and values: the initial models' (ratio 1 and no value clip on the first step).
    all_rows = list(range(8))
    with torch.no_grad():
        old_logp, _ = full_batch_logprobs(policy, batch, cfg.rollout.temperature)
        old_values = values_of(critic, all_rows)
    batch = dataclasses.replace(batch, old_logprobs=old_logp, values=old_values)

    policy_opt = torch.optim.AdamW(
        policy.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay
    )
    critic_opt = torch.optim.AdamW(
        critic.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay
    )
    norms, value_parts = [], []
    for _epoch in range(2):
        for rows in ([0, 1, 2, 3], [4, 5, 6, 7]):
            mb = batch.select(rows)
            vl, _ = losses.value_loss(
                values_of(critic, rows), mb.values, mb.returns, mb.response_mask, clip=0.2
            )
            value_loss = losses.aggregate(vl, mb.response_mask, "token-mean")
            loss = reference_loss(policy, mb, cfg) + 0.5 * value_loss
            value_parts.append((mb.response_mask.sum().item(), 0.5 * value_loss.item()))
            loss.backward()
            norms.append(
                [torch.nn.utils.clip_grad_norm_(m.parameters(), t.max_grad_norm) for m in (policy, critic)]
            )
            policy_opt.step()
            critic_opt.step()
            policy_opt.zero_grad()
            critic_opt.zero_grad()
    assert any(n > t.max_grad_norm for n, _ in norms) and any(n > t.max_grad_norm for _, n in norms)

    metrics = learner.update(batch)
    assert learner.global_step == 4
    assert len(learner.plan(batch, 2)[0].micros) >= 2  # each mini-batch really is several micro-batches
    # loss/value: the four steps' vf_coef * value loss merged by token counts (vf_coef is invisible in the
    # critic's weights: its own AdamW normalises a constant gradient scale away).
    want = sum(n * v for n, v in value_parts) / sum(n for n, _ in value_parts)
    assert metrics["loss/value"].item() == pytest.approx(want, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(torch.tensor([n for n, _ in norms]).mean().item(), rel=1e-5)
    # Adam moves a weight by about lr (1e-2) per step whatever its gradient's scale, and turns the float32
    # rounding of another summation order (micro-batches vs whole mini-batch, ~1e-7 relative) into up to
    # ~1e-6 where a gradient is near 0 (measured 3e-6): 1e-5, a thousandth of one step, is the bound; a
    # wrong loss term, order or clip moves weights by a good part of a step.
    moved = 0.0
    got = dict(learner.named_weights())
    for name, want in policy.named_parameters():
        torch.testing.assert_close(
            got[name], want.detach(), rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    got = learner.accelerator.unwrap_model(learner.value_model).state_dict()
    for name, want in critic.named_parameters():
        torch.testing.assert_close(
            got[name], want.detach(), rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
        moved = max(moved, (want.detach() - critic0[name]).abs().max().item())
    assert moved > 1e-3  # the critic really trained (4 steps of lr 1e-2)


def _update_delta(learner, batch):
    before = {
        n: p.detach().clone() for n, p in learner.accelerator.unwrap_model(learner.model).named_parameters()
    }
    learner.update(batch)
    after = dict(learner.accelerator.unwrap_model(learner.model).named_parameters())
    return torch.cat([(after[n].detach() - before[n]).flatten() for n in before]), after


def _precision_worker(rank, model_dir, compute, out_dir):
    """One process per compute dtype: accelerate's mixed-precision state is per process."""
    import rlkit.learner.logprobs as logprobs

    head_dtypes, chunked = set(), logprobs.chunked_logprobs

    def spy(*args, **kw):  # the dtype the learner asks the chunked LM head to multiply in
        head_dtypes.add(kw.get("matmul_dtype"))
        return chunked(*args, **kw)

    logprobs.chunked_logprobs = spy
    logprobs.BF16_HEAD_MIN_POSITIONS = 0  # the tiny batches here are below it: multiply in bf16 anyway
    batch = make_batch(n=6, seed=11)
    learner = Learner(config(model_dir, lr=1e-3, compute_dtype=compute))
    out = {"compute_dtype": learner.compute_dtype, "logprobs": learner.forward(batch).logprobs}
    out["delta"], params = _update_delta(learner, batch)
    out["param_dtypes"] = {p.dtype for p in params.values()}
    states = [learner.optimizer.state[p] for g in learner.optimizer.param_groups for p in g["params"]]
    out["state_dtypes"] = {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")}
    # Exact resume: two updates straight, or one, a checkpoint, a new learner, and the second.
    batches = [make_batch(n=6, seed=20 + k) for k in range(2)]
    straight = Learner(config(model_dir, lr=1e-2, compute_dtype=compute))
    for b in batches:
        straight.update(b)
    first = Learner(config(model_dir, lr=1e-2, compute_dtype=compute))
    first.update(batches[0])
    first.save_checkpoint(f"{out_dir}/ckpt-{compute}")
    resumed = Learner(config(model_dir, lr=1e-2, compute_dtype=compute))
    resumed.load_checkpoint(f"{out_dir}/ckpt-{compute}")
    resumed.update(batches[1])
    out["head_dtypes"] = head_dtypes
    out["resume_equal"] = all(
        torch.equal(a, b) for (_, a), (_, b) in zip(straight.named_weights(), resumed.named_weights())
    )
    torch.save(out, f"{out_dir}/{compute}.pt")


@pytest.fixture(scope="module")
def precision_runs(tiny_model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("precision")
    for compute in ("float32", "bfloat16"):
        torch.multiprocessing.spawn(_precision_worker, args=(tiny_model_dir, compute, str(out_dir)), nprocs=1)
    return {c: torch.load(out_dir / f"{c}.pt") for c in ("float32", "bfloat16")}


def test_bf16_compute_tracks_fp32_and_keeps_fp32_master_state(precision_runs):
    """model.compute_dtype=bfloat16 on CPU: bf16 matmuls (autocast), fp32 weights and Adam state."""
    fp32, bf16 = precision_runs["float32"], precision_runs["bfloat16"]
    assert fp32["compute_dtype"] == torch.float32 and bf16["compute_dtype"] == torch.bfloat16
    # The forward really runs in bf16: its log-probs differ from fp32's by bf16 rounding (2^-9 relative on
    # logits of a few units), not by nothing and not by more.
    gap = (fp32["logprobs"] - bf16["logprobs"]).abs().max()
    assert 1e-5 < gap < 0.1, gap
    cosine = torch.nn.functional.cosine_similarity(fp32["delta"], bf16["delta"], dim=0)
    assert cosine > 0.99, cosine
    assert bf16["param_dtypes"] == {torch.float32}  # fp32 master weights
    assert bf16["state_dtypes"] == {torch.float32}  # and optimizer state
    # The chunked LM head multiplies in bf16 too (it runs outside the model's autocast).
    assert bf16["head_dtypes"] == {torch.bfloat16} and fp32["head_dtypes"] == {None}


def test_bf16_compute_resumes_exactly(precision_runs):
    assert precision_runs["bfloat16"]["resume_equal"] and precision_runs["float32"]["resume_equal"]
