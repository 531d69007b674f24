"""Async training with weights updated in flight (trainer.inflight_updates=recompute, vLLM's CPU build):
the rollout worker takes a push between two engine steps of a batch, so rows mix policy versions. Checked:
at least one mixed row and one in-flight swap, every token's version between the batch's oldest and the
step that trains it, the oldest within trainer.max_staleness, and the logged staleness metrics agree with
the batches the learner received; and SIGTERM + resume with a mixed batch among the saved ones: the resumed
run trains exactly the saved batches, bit for bit, with the loss and weights of the stopped run continued
without the stop.

The swap is made certain, not left to timing: an environment (Gated, GatedFrom) holds the episodes of a batch
at their start until the learner has put its push on the queue and begun the weight broadcast; their
generation (12 tokens, no stop string) takes that push between two engine steps. Runs with in-flight swaps are
not bit-reproducible (where a swap lands depends on timing), so the resume is compared with the same stopped
run continued in memory, never with a second independent run."""

import pytest
import torch
from run_helpers import checkpoint_weights, overrides, train
from test_async import _step_then_sigterm
from vllm_import import import_vllm

import_vllm()

from rlkit.batch import NO_VERSION  # noqa: E402

pytestmark = pytest.mark.slow  # trainer runs with vLLM: `make test-fast` leaves it out

INFLIGHT = (
    "trainer.mode=async", "trainer.max_staleness=1", "trainer.inflight_updates=recompute",
    "rollout.engine=vllm", "+rollout.engine_kwargs.kv_cache_gib=0.1", "env.max_turns=1",
    "env.max_total_tokens=32", "env.timeout_s=600", "trainer.lr=0.05", "trainer.eval_at_start=false",
    "data.eval_size=0",
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    # head_dim 32: the smallest vLLM's CPU attention runs
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny128"), hidden_size=128, num_layers=2, seed=0)


def test_inflight_recompute_run_has_mixed_rows_within_the_staleness_bound(tiny128, tmp_path):
    from rlkit.rollout.remote import client
    from rlkit.rollout.remote.client import AsyncRollouts

    flags = tmp_path / "flags"
    flags.mkdir()
    batches, real_produce, real_send, sends = [], AsyncRollouts.produce, client.send_weights, []
    real_probe_input, probes = client.probe_input, []

    def spy_probe_input(*args, **kwargs):
        probes.append(1)
        return real_probe_input(*args, **kwargs)

    def spy_produce(self, step, timers):
        sb = real_produce(self, step, timers)
        batches.append((step, sb.policy_version, sb.rollout.token_versions.clone(), sb.rollout.response_mask))
        (flags / "armed").touch()  # the next batch's episodes wait for the next push
        return sb

    def spy_send(*args, **kwargs):
        sends.append(1)
        if len(sends) > 1:  # the push of version 1 (its Push message is on the worker's queue)
            (flags / "pushed").touch()
        return real_send(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AsyncRollouts, "produce", spy_produce)
        mp.setattr(client, "send_weights", spy_send)
        mp.setattr(client, "probe_input", spy_probe_input)
        hist = train(
            tiny128, tmp_path / "run", *INFLIGHT, "trainer.steps=2", "env.name=rlkit_test_envs:Gated",
            f"+env.kwargs.flags={flags}",
        )  # fmt: skip
    assert len(hist) == len(batches) == 2
    assert len(probes) == len(sends) > 1  # the learner's side of the vLLM worker's probe, at every push
    mixed_rows = 0
    for (step, oldest, versions, mask), metrics in zip(batches, hist):
        model = versions != NO_VERSION
        assert torch.equal(model, mask.bool())  # every model token labelled, nothing else
        assert oldest == int(versions[model].min()) and step - oldest <= 1
        assert int(versions[model].max()) <= step
        for row, keep in zip(versions, model):
            row = row[keep]
            assert torch.all(row[1:] >= row[:-1])  # a row's versions only move forward
            mixed_rows += int(row.max() != row.min())
        lag = (step - versions[model]).double()
        assert metrics["staleness/token_max"] == float(lag.max()) <= 1
        assert metrics["staleness/token_mean"] == pytest.approx(float(lag.mean()))
        assert metrics["staleness/max"] == step - oldest
    assert mixed_rows >= 1
    assert sum(m["inflight/swaps"] for m in hist) >= 1
    assert max(m["inflight/mixed_rows"] for m in hist) > 0


BATCH = 8  # trainer.train_batch_size: the episodes of one batch
# What a resumed run must train bit for bit: the saved batch as the worker sent it.
BATCH_FIELDS = (
    "prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "token_versions",
)  # fmt: skip
# The metrics of a step that depend on nothing but the learner's state and the batch (no timings).
DETERMINISTIC = (
    "loss/total", "grad_norm", "mismatch/kl", "rollout_is/mean", "rollout/entropy", "reward/mean",
    "staleness/token_max", "staleness/token_mean", "staleness/max", "inflight/mixed_rows", "inflight/swaps",
)  # fmt: skip


def _fields(sb) -> dict:
    """Copies of a scored batch's tensors, and its policy version."""
    rb = sb.rollout
    return {**{k: getattr(rb, k).clone() for k in BATCH_FIELDS}, "rewards": sb.rewards.clone(),
            "policy_version": sb.policy_version}  # fmt: skip


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _rows(fields: dict) -> list[list[int]]:
    """The versions of each row's model tokens."""
    versions = fields["token_versions"]
    return [row[row != NO_VERSION].tolist() for row in versions]


def _prompts(fields: dict) -> list[list[int]]:
    """Each sample's prompt tokens, without padding."""
    return [ids[keep].tolist() for ids, keep in zip(fields["prompt_ids"], fields["prompt_mask"].bool())]


def _data_order(cfg, batches: int) -> list[list[list[int]]]:
    """Each sample's prompt tokens in the run's first `batches` batches, drawn from the data order as the
    rollout side draws them (rlkit/rollout/local.py: the training split, its prompts, PromptOrder with
    trainer.seed)."""
    from rlkit.data.loading import load_splits
    from rlkit.data.prompts import PromptOrder, build_prompts
    from rlkit.models import load_tokenizer

    t, G = cfg.trainer, cfg.rollout.group_size
    train_ds, _ = load_splits(cfg.data, seed=t.seed, env=cfg.env)
    prompts = build_prompts(train_ds, load_tokenizer(cfg.model.path), cfg.data, name="train")
    order = PromptOrder(len(prompts), seed=t.seed)
    return [
        [prompts.token_ids[i] for i in order.next(t.train_batch_size // G) for _ in range(G)]
        for _ in range(batches)
    ]


def test_sigterm_with_a_mixed_batch_pending_resumes_as_the_uninterrupted_run(tiny128, tmp_path):
    """4 steps, max_staleness=1, SIGTERM after the second step (batches numbered from 0: batch k is trained by
    the step that pushes version k + 1). GatedFrom holds the episodes of batch 2 (granted with the push of
    version 1) at their start until the push of version 2, which follows the training of batch 1, has begun,
    so batch 2 takes that push mid-batch; the checkpoint then saves batch 2 (mixed rows, versions 1 and 2) and
    batch 3 (version 2) as granted and untrained, with the data position after them.

    The resumed run generates nothing: it trains the saved batches first, in order, bit for bit (prompts,
    tokens, token versions, behaviour log-probs, rewards); after the stopped run's two batches they follow the
    data order, no prompt lost or trained twice. Every step's staleness metrics equal those computed by hand
    from the token versions of the batch it trained, every token within trainer.max_staleness.

    Equal to the uninterrupted run: the stopped run's own trainer, continued in memory on the batches it held
    (its learner never saved and loaded), gives the resumed steps' loss, gradient norm and other metrics
    exactly, and the weights of the resumed run's last checkpoint. That is what a resume promises with
    in-flight swaps. A second run is not bit-equal: which engine step a swap lands on depends on when the push
    arrives, so another run (even the same one without the stop) samples other tokens under other versions
    from batch 1 on."""
    from rlkit.checkpoints import checkpoint_state, latest_checkpoint
    from rlkit.rollout.remote import client
    from rlkit.rollout.remote.client import AsyncRollouts
    from rlkit.rollout.remote.messages import load_pending
    from rlkit.rundir import PENDING_FILE
    from rlkit.train import compose, load_config
    from rlkit.trainer import Trainer

    flags, run_dir = tmp_path / "flags", tmp_path / "run"
    flags.mkdir()
    run = (
        *INFLIGHT, "trainer.steps=4", f"trainer.train_batch_size={BATCH}",
        "env.name=rlkit_test_envs:GatedFrom", f"+env.kwargs.flags={flags}",
        f"+env.kwargs.first={2 * BATCH}",  # the episodes of batches 2 and 3 wait
    )  # fmt: skip
    cfg = load_config(compose(overrides(tiny128, run_dir, *run)))
    produced, sends, held = [], [], {}
    real_produce, real_send = AsyncRollouts.produce, client.send_weights
    sigterm_step = _step_then_sigterm(Trainer.train_step)

    def spy_produce(self, step, timers):
        sb = real_produce(self, step, timers)
        produced.append((step, _fields(sb)))
        return sb

    def spy_send(*args, **kwargs):
        sends.append(1)
        if len(sends) == 3:  # the push of version 2 (its Push message is on the worker's queue)
            (flags / "pushed").touch()
        return real_send(*args, **kwargs)

    def keep_trainer_step_then_sigterm(self):
        held["trainer"] = self
        return sigterm_step(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AsyncRollouts, "produce", spy_produce)
        mp.setattr(client, "send_weights", spy_send)
        mp.setattr(Trainer, "train_step", keep_trainer_step_then_sigterm)
        first = train(tiny128, run_dir, *run)
    ckpt, trainer = latest_checkpoint(run_dir), held["trainer"]
    assert len(first) == 2 and len(sends) == 3 and ckpt.name == "step_2" and trainer.global_step == 2

    # The checkpoint's pending batches: batch 2, begun by version 1 and swapped to version 2 mid-batch once,
    # and batch 3, generated by version 2 after that push; the data position and grants after them.
    saved = load_pending(ckpt / PENDING_FILE)
    assert [(p.index, p.batch.policy_version) for p in saved] == [(2, 1), (3, 2)]
    state = checkpoint_state(ckpt)
    assert state["batches_granted"] == 4 and state["data_position"] == saved[-1].position
    mixed = [row for row in _rows(_fields(saved[0].batch)) if row and row[0] != row[-1]]
    assert mixed and all(row == sorted(row) and set(row) == {1, 2} for row in mixed)
    assert saved[0].batch.stats["inflight/swaps"] == 1
    assert {v for row in _rows(_fields(saved[1].batch)) for v in row} == {2}
    # The file holds what the stopped learner held (token versions and log-probs included).
    assert len(trainer.rollouts.pending) == len(saved)
    for kept, read in zip(trainer.rollouts.pending, saved):
        assert (kept.index, kept.position, kept.batch.stats) == (read.index, read.position, read.batch.stats)
        _assert_same(_fields(kept.batch), _fields(read.batch))

    # The uninterrupted run: the stopped trainer continued in memory on the batches it held, with the
    # learner's threads of the run. Its workers are gone, so its pushes go nowhere (no batch is left to
    # generate).
    reference, threads = [], torch.get_num_threads()
    torch.set_num_threads(trainer.rollouts.threads)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(trainer.rollouts, "push", lambda export, version, evaluate=False: {})
            for step in (2, 3):
                trainer.global_step = step
                reference.append(trainer.train_step())
    finally:
        torch.set_num_threads(threads)
    assert not trainer.rollouts.pending and all(m["grad_norm"] > 0 for m in reference)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AsyncRollouts, "produce", spy_produce)
        second = train(tiny128, run_dir, *run)
    assert len(second) == 2 and [step for step, _ in produced] == [0, 1, 2, 3]
    assert len(list(flags.glob("reset_*"))) == 4 * BATCH  # the resumed run started no episode
    for (_, got), p in zip(produced[2:], saved):  # the saved batches, in order, bit for bit
        _assert_same(got, _fields(p.batch))
    assert [_prompts(f) for _, f in produced] == _data_order(cfg, 4)  # none lost, none twice

    for (step, f), metrics in zip(produced, first + second):
        model = f["token_versions"] != NO_VERSION
        assert torch.equal(model, f["response_mask"].bool())
        lag = (step - f["token_versions"][model]).double()
        assert metrics["staleness/token_max"] == float(lag.max()) <= cfg.trainer.max_staleness
        assert metrics["staleness/token_mean"] == pytest.approx(float(lag.mean()))
        assert metrics["staleness/max"] == step - f["policy_version"] == float(lag.max())
        rows = _rows(f)
        assert metrics["inflight/mixed_rows"] == pytest.approx(sum(len(set(r)) > 1 for r in rows) / len(rows))

    for got, want in zip(second, reference):
        for key in DETERMINISTIC:
            assert got[key] == want[key], (key, got[key], want[key])
    final = latest_checkpoint(run_dir)
    policy = trainer.learner.accelerator.unwrap_model(trainer.learner.model).state_dict()
    assert final.name == "step_4"
    for name, tensor in checkpoint_weights(final).items():
        assert torch.equal(tensor, policy[name]), name
