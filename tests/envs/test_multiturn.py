# ruff: noqa: F811  (the `tiny` fixture is imported from run_helpers and requested by name)
"""Multi-turn episodes end to end on the tiny model: observation tokens never trained, exact resume,
environment errors and timeouts counted, 2 processes (launched from another folder) == 1 process."""

import pytest
from run_helpers import REPO_ROOT, launch, overrides, read_jsonl, tiny, train  # noqa: F401

from rlkit.checkpoints import latest_checkpoint

pytestmark = pytest.mark.slow  # trainer runs: `make test-fast` leaves it out

MULTI = [
    "env.name=rlkit_test_envs:Chatty",
    "env.max_turns=3",
    "env.max_total_tokens=64",
    "rollout.max_new_tokens=8",
]
OBS = "<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"


def _observation_positions(tokenizer, ids: list[int]) -> set[int]:
    """Positions of the observation's tokens in a response, found by matching the observation's own
    tokenisation (independent of the producer's bookkeeping)."""
    pattern = tokenizer(OBS, add_special_tokens=False).input_ids
    out = set()
    for t in range(len(ids) - len(pattern) + 1):
        if ids[t : t + len(pattern)] == pattern:
            out.update(range(t, t + len(pattern)))
    return out


def test_multi_turn_exact_resume_and_observation_tokens_never_trained(tiny, tmp_path, monkeypatch):
    from rlkit.learner import Learner
    from rlkit.models import load_tokenizer

    seen = []
    real_update = Learner.update

    def capture(self, batch, **kw):
        seen.append(batch)
        return real_update(self, batch, **kw)

    monkeypatch.setattr(Learner, "update", capture)
    fast = [*MULTI, "trainer.eval_at_start=false"]
    straight = train(tiny, tmp_path / "a", "trainer.steps=4", *fast)
    monkeypatch.setattr(Learner, "update", real_update)
    assert all(m["env/turns"] > 1.5 for m in straight)  # really multi-turn
    assert all(m["env/errors"] == 0 and m["env/tool_calls"] == 0 for m in straight)

    tokenizer = load_tokenizer(tiny)
    holes = 0
    for batch in seen:
        for row in range(batch.response_ids.shape[0]):
            ids = batch.response_ids[row].tolist()
            obs = _observation_positions(tokenizer, ids)
            holes += bool(obs)
            assert not any(batch.response_mask[row, t] for t in obs)
    assert holes > 0

    first = train(tiny, tmp_path / "b", "trainer.steps=2", *fast)
    second = train(tiny, tmp_path / "b", "trainer.steps=4", "trainer.resume=auto", *fast)
    keys = ["reward/mean", "loss/total", "grad_norm", "mismatch/kl", "response_length/mean", "env/turns"]
    for want, got in zip(straight, first + second):
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k


def test_environment_errors_and_timeouts_are_counted_and_score_zero(tiny, tmp_path, monkeypatch):
    from rlkit.rollout.producer import Producer

    produced = []
    real = Producer._generate_and_score

    def capture(self, step, gen_batch, timers):
        piece = real(self, step, gen_batch, timers)
        produced.append(piece)
        return piece

    monkeypatch.setattr(Producer, "_generate_and_score", capture)
    (m,) = train(
        tiny,
        tmp_path / "x",
        "trainer.steps=1",
        *MULTI,
        "env.name=rlkit_test_envs:Flaky",
        "env.timeout_s=0.5",
        "trainer.eval_at_start=false",
        # 32 episodes, each about a third likely to fail, hang or end normally: all three happen but for
        # odds of ~(2/3)^32 = 2e-6 each
        "trainer.train_batch_size=32",
    )
    assert m["env/errors"] > 0 and m["env/timeouts"] > 0 and m["env/errors"] >= m["env/timeouts"]
    assert m["reward/errors"] == 0  # environment failures are not reward failures
    (piece,) = produced
    failed = piece["env_stats"]["failed"].bool()
    assert int(failed.sum()) == m["env/errors"]
    assert (piece["rewards"][failed] == 0).all()
    assert all((v[failed] == 0).all() for v in piece["per_fn"].values())
    assert (piece["per_fn"]["env"][~failed] > 0).any()  # the others kept their per-step rewards


@pytest.mark.parametrize("how", ["content_none", "huge_first", "spin"])
def test_a_misbehaving_environment_never_ends_the_run(tiny, tmp_path, how):
    """A malformed observation (it raised from the chat template), a 1 MB first message (it made
    max_new_tokens negative) and a step that spins on the CPU: the run finishes, every episode scores 0
    and is counted in env/errors, the step time does not grow, and no worker process is left. (Stopping
    a run whose every episode fails is off here: env.max_failed_steps=0; tests/trainer/test_loud_failures.py.)"""
    import multiprocessing

    metrics = train(
        tiny, tmp_path / "x", "trainer.steps=3", *MULTI, "env.name=rlkit_test_envs:Misbehaving",
        f"+env.kwargs.how={how}", "env.timeout_s=0.5", "trainer.eval_at_start=false", "env.max_failed_steps=0",
    )  # fmt: skip
    assert len(metrics) == 3
    for m in metrics:
        assert m["env/errors"] == 8 and m["reward/mean"] == 0 and m["reward/env"] == 0
        assert m["env/timeouts"] == (8 if how == "spin" else 0)
    seconds = [m["timing/step_s"] for m in metrics]
    assert seconds[-1] < 2 * seconds[1] + 1, seconds
    assert multiprocessing.active_children() == []


def test_launch_line_from_repo_root_and_two_processes_from_another_folder_give_the_same_multi_turn_metrics(
    tiny, tmp_path
):
    """`python -m rlkit.train +recipe=quickstart_1digit ...` from the repo root (1 process) and from another folder
    (2 gloo processes) give the same metrics on the same global batch, with multi-turn episodes (observation
    tokens masked, the environment's rewards) and REINFORCE++, whose advantages are whitened over the global
    batch's tokens (not over each rank's rows), so the trainer's cross-rank sum is checked too; GRPO's per-group
    advantages need no collective (its 2-process runs are compared in test_dynamic, test_distill, test_async and
    test_multinode). One pair of launches for both (a pair costs over a minute)."""
    common = overrides(tiny, "X", "rollout.seed_per_prompt=true", "algo.adv_estimator=reinforce_pp", *MULTI)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    runs = {}
    for name, cwd, extra in (("one", REPO_ROOT, []), ("two", elsewhere, ["trainer.num_processes=2"])):
        args = [
            o if not o.startswith("trainer.run_dir") else f"trainer.run_dir={tmp_path / name}" for o in common
        ]
        launch(cwd, *args, *extra)
        runs[name] = read_jsonl(tmp_path / name / "metrics.jsonl")
    assert len(runs["one"]) == len(runs["two"]) == 3  # the step-0 baseline eval, then 2 steps
    assert runs["two"][0]["eval/pass@1"] == pytest.approx(runs["one"][0]["eval/pass@1"])
    keys = ["reward/mean", "reward/std", "accuracy", "response_length/mean", "loss/total", "grad_norm"]
    keys += ["mismatch/kl", "rollout/entropy", "env/turns", "reward/env"]
    for a, b in zip(runs["one"][1:], runs["two"][1:]):
        assert a["env/turns"] > 1.5
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert latest_checkpoint(tmp_path / "two").name == "step_2"
