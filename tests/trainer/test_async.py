# ruff: noqa: F811  (the `tiny` fixture is imported from run_helpers and requested by name)
"""Asynchronous training (trainer.mode=async, rlkit/rollout/remote/) on CPU with a tiny random model.

The rollout worker is a real separate process; weights reach it by a gloo broadcast. Tests: staleness 0
equals sync, staleness 1 trains batches exactly one version old, the learner's gradient on a stale batch
equals a hand-built decoupled-PPO reference, exact resume after SIGTERM, a checkpoint resumed with a
smaller staleness drops and counts the over-age batches, a dead worker is a loud error (by number and
exit code, also when the weight broadcast meets it first; with its traceback when it failed), a crafted
pending-batches file is refused on resume without running it. (2 learner processes and 2 rollout workers
equal 1 and 1: tests/trainer/test_distill.py, with distillation.)
"""

import copy
import os
import shutil
import signal

import pytest
import torch
from run_helpers import overrides, read_jsonl, tiny, train  # noqa: F401  (tiny is a fixture)

from rlkit.checkpoints import latest_checkpoint

pytestmark = pytest.mark.slow  # trainer runs: `make test-fast` leaves it out

ASYNC = ("trainer.mode=async", "trainer.lr=0.05")
COMPARED = [
    "reward/mean",
    "grad_norm",
    "loss/total",
    "mismatch/kl",
    "rollout/entropy",
    "response_length/mean",
]


def _close(a, b, keys):
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])


def test_staleness_zero_equals_sync_and_every_push_reaches_the_worker(tiny, tmp_path, monkeypatch):
    """max_staleness=0 is the sync schedule: same seeds, same metrics (sync with the IS correction that
    async turns on by default). lr 0.05 moves the policy a lot, so mismatch ~0 at every step (batch
    version == learner version) proves each push reached the worker's engine; the run's own weight-sync
    check also ran at step 1. The HF engine has no log-prob probe (its pushes are checked tensor for
    tensor), so the learner computes none, at start-up (sync) or for the worker's pushes (async);
    tests/trainer/test_async_inflight.py: it does for vLLM."""
    from rlkit.rollout import local
    from rlkit.rollout.remote import client

    probes = []
    for module in (local, client):
        monkeypatch.setattr(module, "probe_input", lambda *a, **k: probes.append(1))
    common = ("trainer.lr=0.05", "trainer.steps=3", "rollout.weight_sync_kl_threshold=1e-4")
    sync = train(tiny, tmp_path / "sync", *common, "algo.rollout_is.enabled=true")
    asyn = train(tiny, tmp_path / "async", *common, "trainer.mode=async", "trainer.max_staleness=0")
    assert len(sync) == len(asyn) == 3 and probes == []
    for s, a in zip(sync, asyn):
        _close(s, a, COMPARED + ["rollout_is/mean"])
        assert a["staleness/max"] == 0 and a["staleness/dropped"] == 0
        assert abs(a["mismatch/kl"]) < 1e-4 and a["mismatch/logprob_abs_diff"] < 1e-4
    assert asyn[-1]["eval/pass@1"] == pytest.approx(sync[-1]["eval/pass@1"])
    # The baseline eval (step 0) ran on the worker too.
    base = [read_jsonl(tmp_path / d / "metrics.jsonl")[0] for d in ("sync", "async")]
    assert base[0]["step"] == base[1]["step"] == 0
    assert base[1]["eval/pass@1"] == pytest.approx(base[0]["eval/pass@1"])


# The separate scoring pass: the decoupled-PPO check below reads the TrainBatch's IS weights (the reused forward
# computes them inside the update; tests/learner/test_reuse.py holds the two paths equal).
STALENESS_ONE = ("trainer.max_staleness=1", "trainer.steps=4", "trainer.reuse_update_forward=false", *ASYNC)


def _step_then_sigterm(real_step):
    def step_then_sigterm(self):
        metrics = real_step(self)
        if self.global_step == 1:  # the step being finished is the second
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    return step_then_sigterm


@pytest.fixture(scope="module")
def staleness_one_runs(tiny, tmp_path_factory):
    """The 4-step max_staleness=1 run, each leg once for the three tests that need it: straight (with the
    spies of the decoupled-PPO check and of the prompts), and stopped by SIGTERM after step 2 (prompts
    spied). The resume tests copy the stopped run's directory and each continue their own copy.

    At step 2 of the straight run the update spy records, for the test to check, the batch's version, the
    hand-built decoupled-PPO reference (IS weights and gradient) and the learner's own IS weights and
    gradient on that batch."""
    from rlkit.learner import Learner
    from rlkit.rollout.remote.client import AsyncRollouts
    from rlkit.trainer import Trainer

    root = tmp_path_factory.mktemp("staleness_one")
    behaviour, checked, prompts = {}, [], {}
    real_produce, real_update, real_step = AsyncRollouts.produce, Learner.update, Trainer.train_step

    def spy_produce(self, step, timers):
        sb = real_produce(self, step, timers)
        behaviour["current"] = (step, sb.rollout.rollout_logprobs.clone(), sb.policy_version)
        prompts.setdefault(self.cfg.trainer.run_dir, []).append(sb.rollout.prompt_ids.tolist())
        return sb

    def spy_update(self, batch):
        step, beh, version = behaviour["current"]
        if step == 2:
            model = copy.deepcopy(self.accelerator.unwrap_model(self.model)).float()
            ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
            # Causal attention: padding after a response never reaches its scored tokens.
            attn = torch.cat([batch.prompt_mask, torch.ones_like(batch.response_mask)], 1).long()
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
            p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
            logsm = torch.log_softmax(logits[:, p - 1 : p + t - 1].float(), -1)  # temperature 1
            logp = logsm.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
            proximal = logp.detach()
            mask = batch.response_mask
            w = torch.where(mask, torch.exp(proximal - beh).clamp(max=2.0), 0.0)
            loss = (
                torch.where(mask, -batch.advantages * w * torch.exp(logp - proximal), 0.0)
            ).sum() / mask.sum()
            loss.backward()
            expected = {n: q.grad for n, q in model.named_parameters()}
            self.zero_grad()
            self.accumulate_gradients(batch)
            got = {
                n: q.grad.detach().clone()
                for n, q in self.accelerator.unwrap_model(self.model).named_parameters()
            }
            self.zero_grad()
            found = dict(
                version=version,
                mask=mask.clone(),
                w=w,
                is_weights=batch.is_weights.clone(),
                expected=expected,
                got=got,
            )
            checked.append((step, found))
        return real_update(self, batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AsyncRollouts, "produce", spy_produce)
        mp.setattr(Learner, "update", spy_update)
        straight = train(tiny, root / "straight", *STALENESS_ONE)
        mp.setattr(Learner, "update", real_update)
        mp.setattr(Trainer, "train_step", _step_then_sigterm(real_step))
        first = train(tiny, root / "stopped", *STALENESS_ONE)
    return dict(
        straight=straight,
        checked=checked,
        first=first,
        stopped=root / "stopped",
        straight_prompts=prompts[str(root / "straight")],
        first_prompts=prompts[str(root / "stopped")],
    )


def _continue(stopped, run_dir):
    """A copy of the stopped run in `run_dir` (its own directory: each test resumes its own copy)."""
    shutil.copytree(stopped, run_dir)
    return run_dir


def test_staleness_one_trains_one_version_old_batches_with_the_decoupled_ppo_loss(staleness_one_runs):
    """Batch s is generated by version s - 1 (step 0: version 0). On a stale batch the learner's gradient
    equals a hand-built decoupled-PPO reference: ratio against the proximal policy (the learner's weights
    before the update), times IS weights exp(proximal - behaviour) truncated at 2, behaviour = the worker
    engine's log-probs."""
    hist, checked = staleness_one_runs["straight"], staleness_one_runs["checked"]
    assert [step for step, _ in checked] == [2]
    c = checked[0][1]
    assert c["version"] == 1
    mask, w = c["mask"], c["w"]
    assert (w - 1).abs()[mask].max() > 1e-3  # the batch really is off-policy
    torch.testing.assert_close(c["is_weights"][mask], w[mask], atol=1e-5, rtol=1e-5)
    for n in c["expected"]:
        torch.testing.assert_close(c["got"][n], c["expected"][n], atol=1e-5, rtol=1e-4, msg=n)
    assert [m["staleness/max"] for m in hist] == [0, 1, 1, 1]
    assert all(m["staleness/dropped"] == 0 for m in hist)
    # Stale batches: the mismatch is now the policy's own change (lr 0.05), logged by staleness.
    assert abs(hist[0]["mismatch/kl"]) < 1e-4 and all(abs(m["mismatch/kl"]) > 1e-4 for m in hist[1:])
    assert hist[2]["mismatch/kl/staleness_1"] == hist[2]["mismatch/kl"]
    assert hist[0]["rollout_is/mean/staleness_0"] == hist[0]["rollout_is/mean"]


def test_sigterm_drains_and_the_resumed_run_continues_exactly(
    tiny, tmp_path, monkeypatch, staleness_one_runs
):
    """SIGTERM after step 2: the checkpoint saves the batches granted and not trained (steps 2 and 3,
    generated by versions 1 and 2) with the data position after them; the resumed run's steps 3-4 equal
    the uninterrupted run's, prompt for prompt."""
    from rlkit.rollout.remote.client import AsyncRollouts
    from rlkit.rollout.remote.messages import load_pending
    from rlkit.rundir import PENDING_FILE

    runs = staleness_one_runs
    first, straight = runs["first"], runs["straight"]
    assert len(first) == 2 and latest_checkpoint(runs["stopped"]).name == "step_2"
    saved = load_pending(latest_checkpoint(runs["stopped"]) / PENDING_FILE)
    assert [(p.index, p.batch.policy_version) for p in saved] == [(2, 1), (3, 2)]

    prompts, real_produce = [], AsyncRollouts.produce

    def spy_produce(self, step, timers):
        sb = real_produce(self, step, timers)
        prompts.append(sb.rollout.prompt_ids.tolist())
        return sb

    monkeypatch.setattr(AsyncRollouts, "produce", spy_produce)
    second = train(tiny, _continue(runs["stopped"], tmp_path / "b"), *STALENESS_ONE)
    assert len(second) == 2
    for want, got in zip(straight, first + second):
        _close(want, got, COMPARED + ["staleness/max"])
    assert runs["first_prompts"] + prompts == runs["straight_prompts"]  # none lost, none twice


def test_resume_with_a_smaller_staleness_drops_and_counts_over_age_batches(
    tiny, tmp_path, staleness_one_runs
):
    # The saved batch of step 2 was generated by version 1: too old for max_staleness=0.
    run_dir = _continue(staleness_one_runs["stopped"], tmp_path / "d")
    hist = train(tiny, run_dir, "trainer.max_staleness=0", "trainer.steps=4", *ASYNC)
    assert len(hist) == 2
    assert hist[0]["staleness/dropped"] == 1
    assert hist[1]["staleness/dropped"] == 0  # exactly the over-age batch: no replacement by old weights
    assert all(m["staleness/max"] == 0 for m in hist)


def test_a_dead_rollout_worker_is_a_loud_error(tiny, tmp_path, monkeypatch):
    from rlkit.learner import Learner
    from rlkit.rollout.remote.client import AsyncRollouts

    real_start, real_update = AsyncRollouts.start, Learner.update
    started = []

    def spy_start(self, *args, **kw):
        started.append(self)
        return real_start(self, *args, **kw)

    def update_then_kill(self, batch, **kw):
        out = real_update(self, batch, **kw)
        for proc in started[0].procs:  # SIGKILL: the worker cannot report anything
            proc.kill()
            proc.join()
        return out

    monkeypatch.setattr(AsyncRollouts, "start", spy_start)
    monkeypatch.setattr(Learner, "update", update_then_kill)
    with pytest.raises(RuntimeError, match="rollout worker 0 exited with code -9"):
        train(tiny, tmp_path / "k", "trainer.steps=3", *ASYNC)


@pytest.mark.parametrize(
    "extra",
    [
        # LoRA and multi-turn share one run: their checks (mismatch ~0, and the turn count) need no run
        # of their own, as in tests/rollout/test_vllm_train.py.
        [
            "model.lora.rank=4",
            "model.lora.alpha=8",
            "env.name=rlkit_test_envs:Chatty",
            "env.max_turns=3",
            "env.max_total_tokens=64",
            "rollout.max_new_tokens=8",
        ],
        ["algo.dynamic_sampling=refill", "algo.max_gen_batches=3", "algo.mask_zero_std_groups=true"],
    ],
    ids=["lora_multi_turn", "refill"],
)
def test_lora_refill_and_multi_turn_run_in_the_rollout_worker(tiny, tmp_path, extra):
    """The worker runs the same producer, so refill and environment turns happen there; with LoRA it gets
    merged weights (here with multi-turn episodes: more than one model turn scored per episode). Staleness
    0 with the tight weight-sync check: every push reached the worker."""
    hist = train(
        tiny, tmp_path / "x", "trainer.mode=async", "trainer.max_staleness=0", "trainer.steps=2",
        "rollout.weight_sync_kl_threshold=1e-4", *extra,
    )  # fmt: skip
    assert len(hist) == 2 and all(abs(m["mismatch/kl"]) < 1e-4 for m in hist)
    if "algo.dynamic_sampling=refill" in extra:
        assert all(1 <= m["dynamic/gen_batches"] <= 3 for m in hist)
    if "env.max_turns=3" in extra:
        assert all(m["env/turns"] > 1 for m in hist)


def test_a_kill_during_the_weight_broadcast_names_the_worker_not_the_transport(tiny, tmp_path, monkeypatch):
    """The worker dies while the learner broadcasts weights to it (after the push's own check of the
    workers): the broadcast's transport error is reported as the worker's exit, by number and code."""
    from rlkit.rollout.remote import client

    real_send, calls, started = client.send_weights, [], []
    real_start = client.AsyncRollouts.start

    def spy_start(self, *args, **kw):
        started.append(self)
        return real_start(self, *args, **kw)

    def kill_then_send(*args, **kw):
        calls.append(1)
        if len(calls) == 2:  # the push after step 0; SIGKILL, not joined: the broadcast meets it first
            for proc in started[0].procs:
                proc.kill()
        return real_send(*args, **kw)

    monkeypatch.setattr(client.AsyncRollouts, "start", spy_start)
    monkeypatch.setattr(client, "send_weights", kill_then_send)
    with pytest.raises(RuntimeError, match="rollout worker 0 exited with code -9") as info:
        train(tiny, tmp_path / "k", "trainer.steps=3", *ASYNC)
    assert len(calls) == 2
    # Raised from the broadcast's own error (gloo's "Connection reset by peer"), not from a later check.
    assert isinstance(info.value.__context__, RuntimeError) and "rollout worker" not in str(
        info.value.__context__
    )


@pytest.mark.parametrize("learner", ["reading", "busy"])
def test_a_worker_failing_at_start_up_reports_its_traceback(tiny, tmp_path, monkeypatch, learner):
    """The worker's traceback reaches the learner's error every time (it used to be lost when the worker
    exited before its queue was flushed: "exited ... without reporting an error"). `busy`: the learner
    reads nothing until the worker has exited, as when it is deep in a long step; the traceback (cut to
    fit a pipe: the module's message is ~400 kB) is there all the same."""
    from rlkit.rollout.remote import client
    from rlkit.train import compose, load_config

    if learner == "busy":
        real_receive = client.AsyncRollouts._receive

        def receive_after_the_exit(self):
            for proc in self.procs:
                proc.join(timeout=120)
            return real_receive(self)

        monkeypatch.setattr(client.AsyncRollouts, "_receive", receive_after_the_exit)
    cfg = load_config(
        compose(
            overrides(tiny, tmp_path / "f", "trainer.mode=async", "reward.fn=rlkit_test_worker_fails:reward")
        )
    )
    for _ in range(3 if learner == "reading" else 1):
        rollouts = client.AsyncRollouts(cfg, rank=0, world=1, device=torch.device("cpu"))
        try:
            with pytest.raises(RuntimeError, match="rollout worker 0 failed") as info:
                rollouts.start(None, 0)  # the export is never reached: the worker fails while loading
        finally:
            rollouts.close()
        text = str(info.value)
        assert text.count("Traceback (most recent call last)") == 1 and "characters cut" in text
        assert "rlkit_test_worker_fails" in text and text.rstrip().endswith("END OF THE WORKER'S MESSAGE")


def test_a_crafted_pending_file_is_refused_on_resume_and_never_run(tiny, tmp_path):
    """A pickle whose loading would write a marker file, saved under the pending file's name in an async
    checkpoint: the resume is refused with an error naming the file, and the marker is never written."""
    from rlkit.checkpoints import write_checksums
    from rlkit.rollout.remote.messages import MessageError
    from rlkit.rundir import PENDING_FILE

    run = ("trainer.steps=1", *ASYNC)
    train(tiny, tmp_path / "c", *run)
    ckpt = latest_checkpoint(tmp_path / "c")
    marker = tmp_path / "marker"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"pending": Evil()}, ckpt / PENDING_FILE)
    write_checksums(ckpt)  # checksums catch damage, not tampering: whoever plants a file can rewrite them
    with pytest.raises(MessageError, match=PENDING_FILE) as info:
        train(tiny, tmp_path / "c", "trainer.steps=2", *ASYNC)
    assert "never unpickled" in str(info.value)
    assert not marker.exists()


def test_a_push_that_never_reaches_the_worker_engine_is_caught(tiny, tmp_path):
    """rollout.verify_push in async mode: the learner sends the sha256 of every tensor it broadcast, and the
    worker checks its engine against them after every push. A worker whose pushes are dropped (the reward
    module's import patches its receive path) fails at the first push that changed the weights, naming the
    tensors; the learner reports that worker's error."""
    with pytest.raises(
        RuntimeError, match=r"rollout worker 0 failed:(.|\n)*WeightSyncError(.|\n)*does not hold"
    ):
        train(tiny, tmp_path / "a", *ASYNC, "reward.fn=rlkit_test_faulty_push:reward", "trainer.steps=3")
