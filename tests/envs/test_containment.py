"""An environment or a reward function cannot take the trainer down with it (rlkit/sandbox/containment.py,
rlkit/envs/workers.py, rlkit/rewards/scorer.py): memory, the processes it starts, a fork loop, its
constructor, its output and what it returns all stay inside its worker and fail only its own episode.

Environments and reward functions are in rlkit_test_contained_envs.py (workers import them by path); each
records the pids of the processes it starts, which the tests look for in /proc."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_helpers import alive, recorded, wait_dead
from run_helpers import FIXTURES, tiny  # noqa: F401  (the tiny model)
from test_episodes import _run, encode, tiny_dir, tok  # noqa: F401  (its tokenizer, a scripted engine)
from timing_helpers import within

from rlkit.config.schema import ConfigError, RLConfig
from rlkit.envs import check_config
from rlkit.envs.base import check_step
from rlkit.envs.workers import DEFAULT_LIMITS, EnvWorkers, Limits
from rlkit.rewards import RewardScorer
from rlkit.rewards.functions import call_reward, reward_number
from rlkit.sandbox import containment
from rlkit.sandbox.containment import ProcessCap

pytestmark = pytest.mark.slow  # worker processes and a trainer run: `make test-fast` leaves it out

M = "rlkit_test_contained_envs"


def _cgroup_available() -> bool:
    cap = ProcessCap(64)
    try:
        return cap.path is not None
    finally:
        cap.close()


@pytest.fixture(params=["cgroup", "count"])
def cap_mode(request, monkeypatch):
    """Each process test runs with the pids cgroup (skipped where none is writable) and with the fallback
    that counts process groups in /proc."""
    if request.param == "cgroup" and not _cgroup_available():
        pytest.skip("no writable pids cgroup here")
    if request.param == "count":
        monkeypatch.setattr(containment, "_pids_cgroup_roots", lambda: [])
    return request.param


def _steps(name, kwargs, count, *, timeout_s=10.0, limits=DEFAULT_LIMITS):
    """Build `count` environments in workers and step each once; returns (results, worker pids)."""
    workers = EnvWorkers(f"{M}:{name}", kwargs, count, timeout_s=timeout_s, limits=limits)
    try:
        made = workers.call("make", {k: () for k in range(count)})
        assert all(status == "ok" for status, _ in made.values()), made
        return workers, workers.call("step", {k: ("a",) for k in range(count)})
    except BaseException:
        workers.close()
        raise


# -- memory ----------------------------------------------------------------------------------------------


FORK_SERVER_THEN_CAP = """
from rlkit.envs.workers import EnvWorkers, Limits
for spec in ("HeavyPreload", "HeavyPreload", "Hog"):  # the first starts this process's fork server
    workers = EnvWorkers("rlkit_test_contained_envs:" + spec, {}, 1, timeout_s=60, limits=Limits(memory_limit_mb=200))
    try:
        print(spec, workers.call("make", {0: ()})[0][0], workers.call("step", {0: ("a",)})[0][0], flush=True)
    finally:
        workers.close()
"""


def test_the_cap_counts_from_the_workers_start_whatever_the_fork_server_preloaded():
    """A fork server started for an environment with a heavy preload (300 MB of private memory) hands that
    memory to every worker the process forks later, and a cap of 200 MB used to fall below it: the worker's first
    thread failed ("did not start within 60s", seen when a run with env.memory_limit_mb=200 followed an
    ecosystem environment's run in one process). The cap counts from what the worker holds at its start; a hog
    still fails at it. A fresh process: the fork server is one per process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", FORK_SERVER_THEN_CAP], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["HeavyPreload ok ok", "HeavyPreload ok ok", "Hog ok error"], (
        proc.stdout
    )


def test_a_memory_hog_fails_its_own_episode_and_workers_are_the_oom_killers_first_choice(tok):  # noqa: F811
    # The worker is alive and preferred by the OOM killer while it runs.
    # (timeouts far above the ~0.1 s the hog needs: writing 300 MB can take seconds on a loaded machine)
    workers, results = _steps("Hog", {}, 1, timeout_s=60, limits=Limits(memory_limit_mb=300))
    try:
        (w,) = workers._workers
        assert Path(f"/proc/{w.proc.pid}/oom_score_adj").read_text().strip() == "1000"
        assert (
            results[0][0] == "error"
            and "out of memory" in results[0][1]
            and "env.memory_limit_mb" in results[0][1]
        )
    finally:
        workers.close()
    # Through the episode runner: the batch finishes, both episodes end with reward 0 and are counted.
    _, _, _, out = _run(
        tok,
        [encode(tok, "Hello")],
        env=f"{M}:Hog",
        n=2,
        env_kwargs={"lazy": True},
        limits=Limits(memory_limit_mb=300),
        timeout_s=60,
    )
    assert out.errors == 2 and out.failed.all() and out.timeouts == 0


def test_a_reward_function_that_hogs_memory_or_leaves_a_child_is_contained(tmp_path):
    record = tmp_path / "pids"
    scorer = RewardScorer(
        f"{M}:leaves_a_child", {f"{M}:hogging": 1.0}, num_workers=1, timeout_s=60, memory_limit_mb=300
    )
    try:
        scores = scorer.score(["p"], ["r"], ["a"], rows=[{"record": str(record)}])
    finally:
        scorer.close()
    assert scores.per_fn[f"{M}:leaves_a_child"] == [1.0] and scores.per_fn[f"{M}:hogging"] == [0.0]
    assert scores.errors == 1 and scores.timeouts == 0  # the hog: a MemoryError in its worker, not a crash
    (child,) = recorded(record)
    assert wait_dead([child]) == []  # killed at the end of the batch


def test_a_reward_function_returning_a_huge_list_gets_a_short_message_at_once():
    start = time.monotonic()
    ((value, error),) = call_reward(f"{M}:five_million", [("p", "r", "a", {})])
    assert value == 0.0 and error == "non-numeric reward: list of 5000000 elements: [0, 1, 2, 3, 4, 5, ...]"
    assert time.monotonic() - start < within(5, failure_s=11)  # 11 s and a 25 MB message before


def test_a_run_with_a_memory_hog_that_leaves_processes_finishes_and_counts_it(tiny, tmp_path):  # noqa: F811
    """End to end: every step of every episode leaves 2 sleepers and then leaks memory past a 200 MB cap.
    The run finishes, each episode is an error, and no sleeper is alive after the run."""
    from run_helpers import train

    record = tmp_path / "pids"
    metrics = train(
        tiny, tmp_path / "run", "trainer.steps=2", "env.name=rlkit_test_contained_envs:Hog",
        "+env.kwargs.lazy=true", f"+env.kwargs.record={record}", "env.memory_limit_mb=200",
        "env.max_turns=3", "env.max_total_tokens=64", "rollout.max_new_tokens=8", "trainer.eval_at_start=false",
    )  # fmt: skip
    assert [m["env/errors"] for m in metrics] == [8, 8] and all(m["env/timeouts"] == 0 for m in metrics)
    pids = recorded(record)
    assert len(pids) >= 2 * 8 * 2 and wait_dead(pids) == []  # 2 per step of each episode


# -- processes -------------------------------------------------------------------------------------------


def test_children_of_a_timed_out_step_die_with_it(tmp_path, cap_mode):
    record = tmp_path / "pids"
    workers, results = _steps("Spinners", {"record": str(record)}, 1, timeout_s=3.0)
    try:
        assert results[0][0] == "timeout"
        pids = recorded(record)
        assert len(pids) == 4
        assert wait_dead(pids) == []  # before the batch ends: with the timeout kill
    finally:
        workers.close()


def test_processes_an_environment_starts_die_at_the_end_of_the_batch(tmp_path, cap_mode):
    record = tmp_path / "pids"
    escape = cap_mode == "cgroup"  # a process that leaves the group (setsid) is caught by the cgroup only
    workers, results = _steps("Sleepers", {"record": str(record), "escape": escape}, 2)
    try:
        assert all(status == "ok" for status, _ in results.values())
        pids = recorded(record)
        assert len(pids) == 2 * (5 + escape) and all(map(alive, pids))  # the test sees them
    finally:
        workers.close()
    assert wait_dead(pids) == []


def test_a_fork_loop_is_capped_and_killed(tmp_path, cap_mode):
    record = tmp_path / "pids"
    cap = 40
    workers, results = _steps(
        "ForkLoop", {"record": str(record)}, 1, timeout_s=2.0, limits=Limits(max_processes=cap)
    )
    try:
        pids = recorded(record)
        assert results[0][0] in ("timeout", "error")
        if cap_mode == "cgroup":  # forks over the cap fail (the worker and its 2 output threads count too)
            assert len(pids) <= cap
        else:  # the fallback's count killed the group
            assert "env.max_processes=40" in results[0][1]
        assert subprocess.run(["true"]).returncode == 0  # the trainer can still start processes
    finally:
        workers.close()
    assert pids and wait_dead(pids) == []


MAIN = """
import sys, time
with open(sys.argv[1], "a") as f:
    f.write("main ran\\n")  # in the trainer, and (before the fix) again in every worker
if __name__ == "__main__":
    from rlkit.envs.workers import EnvWorkers
    for batch in range(2):
        start = time.monotonic()
        w = EnvWorkers("rlkit_test_contained_envs:KillsForkServer", {}, 4, timeout_s=20)
        made = w.call("make", {k: () for k in range(4)})
        steps = w.call("step", {k: ("a",) for k in range(4)})
        w.close()
        print("BATCH", batch, sorted(s for s, _ in made.values()), sorted(s for s, _ in steps.values()),
              round(time.monotonic() - start, 1), flush=True)
"""


def test_workers_never_rerun_the_trainers_main_and_a_killed_fork_server_is_replaced_at_once(tmp_path):
    script, marks = tmp_path / "trainer_main.py", tmp_path / "marks"
    script.write_text(MAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), *sys.path])}
    out = subprocess.run(
        [sys.executable, str(script), str(marks)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert marks.read_text().count("main ran") == 1  # 1 + 8 on main: each worker ran the script again
    batches = [line for line in out.stdout.splitlines() if line.startswith("BATCH")]
    assert len(batches) == 2
    for i, line in enumerate(batches):  # built; every step fails (the fork server died), well within 60 s
        assert line.startswith(f"BATCH {i} ['ok', 'ok', 'ok', 'ok'] ['error', 'error', 'error', 'error'] ")
        assert float(line.split()[-1]) < 20


# -- the constructor -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("ExitInit", "its worker died (exit code 7)"),
        ("HangInit", "make ran over env.timeout_s=1s"),
        ("RaiseInit", "RuntimeError: no such tool server"),
    ],
)
def test_a_constructor_that_exits_hangs_or_raises_is_a_start_up_error(name, expected):
    cfg = RLConfig()
    cfg.env.name, cfg.env.timeout_s = f"{M}:{name}", 1.0
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert f"env.name='{M}:{name}'" in str(e.value) and expected in str(e.value)
    assert time.monotonic() - start < 15


# -- what a step returns, and its output -----------------------------------------------------------------


def test_environment_rewards_follow_the_reward_functions_rule():
    assert check_step((None, True, True))[1] == 1.0 and check_step((None, 3, True))[1] == 3.0
    for bad, words in [("0.5", "non-numeric reward: str"), (1e30, "out of range"), (1e308, "out of range"),
                       (float("nan"), "non-finite"), (None, "non-numeric")]:  # fmt: skip
        with pytest.raises((TypeError, ValueError), match=words):
            check_step((None, bad, True))
        with pytest.raises((TypeError, ValueError), match=words):
            reward_number(bad)  # the reward functions' rule: the same answer


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("Rewarding", {"reward": "0.5"}, "non-numeric reward: str of 3 characters"),
        ("Rewarding", {"reward": 1e30}, "reward 1e+30 out of range"),
        ("Rewarding", {"reward": 5_000_000}, "non-numeric reward: list of 5000000 elements"),
        ("HugeObservation", {}, "observation has 10000004 characters"),
    ],
)
def test_a_bad_or_oversized_step_result_fails_its_episode_with_a_short_message(name, kwargs, expected):
    start = time.monotonic()
    workers, results = _steps(name, kwargs, 1)
    workers.close()
    status, why = results[0]
    assert status == "error" and expected in why and len(why) < 300
    assert time.monotonic() - start < 10


FLOOD = """
from rlkit.envs.workers import EnvWorkers
w = EnvWorkers("rlkit_test_contained_envs:Flood", {}, 2, timeout_s=60)
assert all(s == "ok" for s, _ in w.call("make", {0: (), 1: ()}).values())
print("RESULTS", sorted(w.call("step", {0: ("a",), 1: ("a",)}).values()), flush=True)
w.close()
"""


def test_environment_output_is_bounded_per_worker():
    from rlkit.envs.workers import MAX_OUTPUT_BYTES

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), *sys.path])}
    out = subprocess.run([sys.executable, "-c", FLOOD], capture_output=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert b"RESULTS [('ok', (None, 1.0, True)), ('ok', (None, 1.0, True))]" in out.stdout
    # Each worker wrote 12 MB (8 from the step, 4 from its child); 2 x the cap (plus the notes) came through.
    total = len(out.stdout) + len(out.stderr)
    assert total <= 2 * MAX_OUTPUT_BYTES + 1000
    assert total >= 2 * MAX_OUTPUT_BYTES
    notes = (out.stdout + out.stderr).count(b"the rest is dropped")
    assert notes == 2
