# ruff: noqa: F811  (the `tiny` fixture is imported from run_helpers and requested by name)
"""Dynamic sampling (refill), overlong filter and soft overlong penalty, end to end on a tiny model.

Expected values come from the data alone: with the `parity` reward a group has spread exactly when its
problem's answer is odd, so which prompts a step must draw, and what share of groups it keeps, follow
from the prompt order and the answers, computed here without the producer's code."""

import logging

import pytest
import torch
from run_helpers import overrides, tiny, train  # noqa: F401  (tiny: the shared model fixture)

from rlkit.algos.advantages import overlong_penalty
from rlkit.checkpoints import latest_checkpoint
from rlkit.data.prompts import PromptOrder
from rlkit.rollout.producer import informative_groups, select_groups
from rlkit.train import compose, load_config
from rlkit.trainer import Trainer

pytestmark = pytest.mark.slow  # trainer runs: `make test-fast` leaves it out

REFILL = ["algo.dynamic_sampling=refill", "algo.filter_metric=reward", "reward.fn=rlkit_test_rewards:parity"]


def test_select_groups_takes_kept_groups_in_order_then_completes_with_dropped():
    keep = [torch.tensor([False, True, False]), torch.tensor([True, False, True])]
    assert select_groups(keep, 2) == [(0, 1), (1, 0)]
    assert select_groups(keep, 3) == [(0, 1), (1, 0), (1, 2)]
    # Only three kept: the earliest dropped groups complete the batch.
    assert select_groups(keep, 5) == [(0, 1), (1, 0), (1, 2), (0, 0), (0, 2)]


def test_informative_groups_by_hand():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert informative_groups(metric, 2).tolist() == [False, True, False]
    assert informative_groups(metric, 3).tolist() == [True, True]


def test_overlong_penalty_by_hand_and_naive_loop():
    lengths = torch.tensor([0, 6, 7, 8, 9, 10, 12])
    # max_len 10, buffer 4: zone (6, 10]; L=7 -> -1/4, 8 -> -2/4, 9 -> -3/4, 10 -> -1, above the cap stays -1.
    got = overlong_penalty(lengths, 10, 4, penalty=2.0)
    assert got.tolist() == [0.0, 0.0, -0.5, -1.0, -1.5, -2.0, -2.0]
    for L, v in zip(lengths.tolist(), got.tolist()):
        expected = 0.0 if L <= 6 else -2.0 * min(1.0, (L - 6) / 4)
        assert v == pytest.approx(expected)
    assert lengths.tolist() == [0, 6, 7, 8, 9, 10, 12]  # input untouched
    with pytest.raises(ValueError, match="buffer=0"):
        overlong_penalty(lengths, 10, 0)
    with pytest.raises(ValueError, match="buffer=11"):
        overlong_penalty(lengths, 10, 11)


def _expected_refill(answers, seed, prompts_per_batch, needed, max_batches):
    """(generation batches, kept fraction, prompts consumed) of one step, from the answers' parity."""
    order = PromptOrder(len(answers), seed=seed)
    kept = drawn = batches = 0
    while batches < max_batches and kept < needed:
        idx = order.next(prompts_per_batch)
        batches += 1
        drawn += len(idx)
        kept += sum(int(answers[i].split("####")[-1]) % 2 for i in idx)
    return batches, kept / drawn, order.position


@pytest.mark.parametrize("max_batches", [8, 1])
def test_refill_fills_the_batch_with_informative_groups_or_trains_on_what_there_is(
    tiny, tmp_path, max_batches, caplog
):
    cfg = load_config(
        compose(
            overrides(tiny, tmp_path / "r", *REFILL, "trainer.steps=1", f"algo.max_gen_batches={max_batches}")
        )
    )
    trainer = Trainer(cfg)
    try:
        answers = list(trainer.rollouts.train_prompts.answers)
        batches, kept_frac, position = _expected_refill(answers, cfg.trainer.seed, 2, 2, max_batches)
        with caplog.at_level(logging.INFO):  # the shortfall is said once, as information
            (m,) = trainer.train()
        assert trainer.rollouts.order.position == position  # every drawn prompt is consumed
    finally:
        trainer.close()
    assert m["dynamic/gen_batches"] == batches
    assert m["dynamic/kept_frac"] == pytest.approx(kept_frac)
    enough = kept_frac * batches * 2 >= 2
    if max_batches == 8:
        assert enough and m["frac_reward_zero_std"] == 0.0  # every trained group has signal
    else:
        assert batches == 1
        assert ("dynamic sampling:" in caplog.text) == (not enough)


def test_no_signal_anywhere_hits_the_bound_and_still_trains_said_once_and_summed_up(tiny, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        history = train(
            tiny, tmp_path / "c", "algo.dynamic_sampling=refill", "algo.max_gen_batches=2",
            "reward.fn=rlkit_test_rewards:constant", "trainer.steps=3",
        )  # fmt: skip
    for m in history:
        assert m["dynamic/gen_batches"] == 2 and m["dynamic/kept_frac"] == 0.0
        assert m["frac_reward_zero_std"] == 1.0 and m["grad_norm"] == 0.0
        assert m["dynamic/shortfall_groups"] == 2.0  # 8 samples / 4 per group, none with signal
    # the shortfall is said once, as information (not a warning: it is normal early in training), not
    # every step; the end of the run sums it up
    said = [r for r in caplog.records if "dynamic sampling:" in r.getMessage()]
    assert len(said) == 1 and "0 of 2 groups with signal" in said[0].getMessage()
    assert said[0].levelno == logging.INFO
    assert "dynamic sampling fell short on 3 of 3 steps: 6 groups without signal" in caplog.text


def test_refill_resumes_exactly(tiny, tmp_path):
    extra = [*REFILL, "algo.max_gen_batches=3"]
    straight = train(tiny, tmp_path / "a", "trainer.steps=4", *extra)
    first = train(tiny, tmp_path / "b", "trainer.steps=2", *extra)
    second = train(tiny, tmp_path / "b", "trainer.steps=4", "trainer.resume=auto", *extra)
    keys = ["reward/mean", "loss/total", "grad_norm", "dynamic/gen_batches", "dynamic/kept_frac"]
    for want, got in zip(straight, first + second, strict=True):
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    assert latest_checkpoint(tmp_path / "b").name == "step_4"


def test_overlong_filter_and_penalty(tiny, tmp_path):
    # 12 new tokens at most; the tiny random model rarely emits EOS, so most responses are cut.
    cfg = load_config(
        compose(
            overrides(
                tiny,
                tmp_path / "o",
                "trainer.steps=1",
                "algo.overlong_filter=true",
                "reward.overlong_buffer=4",
                "reward.overlong_penalty=0.5",
            )  # fmt: skip
        )
    )
    trainer = Trainer(cfg)
    seen = {}
    real_update = trainer.learner.update

    def spy(batch, **kw):
        seen["mask"] = batch.response_mask.clone()
        return real_update(batch, **kw)

    trainer.learner.update = spy
    real_produce = trainer.rollouts.producer.produce

    def spy_produce(step, timers):
        seen["scored"] = real_produce(step, timers)
        return seen["scored"]

    trainer.rollouts.producer.produce = spy_produce
    try:
        (m,) = trainer.train()
    finally:
        trainer.close()
    scored = seen["scored"]
    rb = scored.rollout
    lengths = rb.response_mask.sum(-1).tolist()
    # By hand: 0 up to 8 tokens, then -0.5 * (L - 8) / 4.
    want = [0.0 if L <= 8 else -0.5 * (L - 8) / 4 for L in lengths]
    assert scored.per_fn["overlong"].tolist() == pytest.approx(want)
    base = torch.tensor([len(t) % 7 / 7.0 for t in rb.response_texts])
    assert scored.rewards.tolist() == pytest.approx((base + torch.tensor(want)).tolist())
    assert m["reward/overlong"] == pytest.approx(sum(want) / len(want))
    cut = [f == "length" for f in rb.finish_reasons]
    assert any(cut)
    for row, is_cut in enumerate(cut):
        assert bool(seen["mask"][row].any()) == (not is_cut)


def test_refill_and_lora_under_fsdp2_two_processes_equal_one(tiny, tmp_path):
    """Two features' 2-process checks share one pair of launches (a pair costs over a minute):
    - refill: the global batch is filled in global prompt order and split evenly, so 2 ranks train on exactly
      the groups 1 rank trains on (per-prompt seeds make the samples independent of the rank count);
    - LoRA under FSDP2 (with a KL term against the adapter-off reference): the same metrics, and the same
      adapter and merged model in the final checkpoint."""
    from run_helpers import launch, read_jsonl
    from safetensors.torch import load_file

    from rlkit.config.schema import REPO_ROOT

    lora = (
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "trainer.lr=0.02",
        "rollout.weight_sync_kl_threshold=1e-3",
    )

    def args(run_dir, *extra):
        common = overrides(tiny, run_dir, "rollout.seed_per_prompt=true", *REFILL, "algo.max_gen_batches=3")
        return [
            *common,
            *lora,
            "algo.kl_coef=0.05",
            "trainer.strategy=fsdp2",
            "trainer.eval_at_start=false",
            *extra,
        ]

    launch(REPO_ROOT, *args(tmp_path / "one"))
    launch(REPO_ROOT, *args(tmp_path / "two", "trainer.num_processes=2"))
    m1, m2 = read_jsonl(tmp_path / "one/metrics.jsonl"), read_jsonl(tmp_path / "two/metrics.jsonl")
    assert len(m1) == len(m2) == 2
    keys = ["reward/mean", "reward/std", "frac_reward_zero_std", "loss/total", "grad_norm", "mismatch/kl"]
    keys += ["rollout/kl"]
    for a, b in zip(m1, m2):
        assert b["dynamic/gen_batches"] == a["dynamic/gen_batches"]
        assert b["dynamic/kept_frac"] == pytest.approx(a["dynamic/kept_frac"])
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert any(m["dynamic/gen_batches"] > 1 for m in m1)  # a refill really happened
    for part in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        w1, w2 = (load_file(tmp_path / run / "checkpoints/step_2" / part) for run in ("one", "two"))
        assert w1.keys() == w2.keys()
        for k in w1:
            # Adam divides each gradient by its own RMS: an element whose gradient is as small as the
            # summation-order noise of 1 vs 2 processes moves by up to lr = 0.02 per step in either run.
            # Measured (2026-11-24): one element of 256 differed by 1.3e-4 after 2 steps, the others by < 1e-4.
            torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=5e-4)
