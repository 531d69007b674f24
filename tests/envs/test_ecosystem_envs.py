# ruff: noqa: F811  (the `tiny` fixture is imported from run_helpers and requested by name)
"""Environments of other libraries trained end to end on the tiny model: a verifiers taskset (single-turn, its
rubric as the reward), a multi-turn verifiers environment (the engine's tokens and log-probs kept across
turns), a verifiers toolset, a real OpenEnv server on loopback; a missing library names its extra."""

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from run_helpers import FIXTURES, tiny, train  # noqa: F401

pytestmark = pytest.mark.slow  # trainer runs and environment servers: `make test-fast` leaves it out

COMMON = [
    "data.path=env",
    "data.eval_size=4",
    "reward.fn=none",
    "rollout.stop=[' ',e]",
    "trainer.eval_at_start=false",
]


@pytest.fixture
def fresh_fork_server():
    """A training run starts the environment workers' fork server with the adapter's library preloaded
    (`Environment.preload`); in this pytest process an earlier test may have started it with other
    modules, so it is stopped here (a stdlib-private call, in a test only) and the next batch starts it anew."""
    import multiprocessing.forkserver

    multiprocessing.forkserver._forkserver._stop()
    yield


@pytest.fixture
def captured(monkeypatch):
    """The producer's scored pieces and every engine call's sampled turns (ids, log-probs) of a run."""
    from rlkit.rollout.producer import Producer

    pieces, turns = [], []
    real_score, real_generate = Producer._generate_and_score, Producer.generate

    def score(self, step, gen_batch, timers):
        pieces.append(real_score(self, step, gen_batch, timers))
        return pieces[-1]

    def generate(self, prompts, n, sampling, seed, **kw):
        rb = real_generate(self, prompts, n, sampling, seed, **kw)
        for k, length in enumerate(rb.response_lengths.tolist()):
            turns.append((rb.response_ids[k, :length].tolist(), rb.rollout_logprobs[k, :length].tolist()))
        return rb

    monkeypatch.setattr(Producer, "_generate_and_score", score)
    monkeypatch.setattr(Producer, "generate", generate)
    return pieces, turns


def _model_runs(rollout, row: int) -> list[list[int]]:
    """The positions of each model turn of a response: the runs of its response mask."""
    runs, current = [], []
    mask = rollout.response_mask[row].tolist()
    for t, m in enumerate(mask):
        if m:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_verifiers_single_turn_taskset_trains_on_its_rubric(tiny, tmp_path, captured, fresh_fork_server):
    from rlkit_test_vf_single import length_score

    pieces, _ = captured
    hist = train(
        tiny, tmp_path / "run", "env.name=verifiers:rlkit_test_vf_single", "env.max_turns=1", *COMMON
    )  # fmt: skip
    assert len(hist) == 2 and all(m["env/errors"] == 0 for m in hist)
    for piece in pieces:
        rb = piece["rollout"]
        for i, text in enumerate(rb.response_texts):
            # The task's @vf.reward (weight 2) on the trace's last reply; a turn cut by the token cap is
            # never handed to the environment (reward 0), as in every rlkit environment.
            want = 0.0 if rb.finish_reasons[i] == "length" else 2.0 * length_score(text.strip())
            assert piece["rewards"][i].item() == pytest.approx(want)
            assert piece["per_fn"]["env"][i].item() == pytest.approx(want)
    assert any(r > 0 for p in pieces for r in p["rewards"].tolist())


def test_verifiers_multi_turn_env_keeps_the_engine_tokens_and_scores_the_trace(
    tiny, tmp_path, captured, fresh_fork_server
):
    import rlkit_test_vf_guess as guess

    pieces, turns = captured
    hist = train(
        tiny, tmp_path / "run", "env.name=verifiers:rlkit_test_vf_guess", f"env.max_turns={guess.TURNS}",
        "env.max_total_tokens=96", "rollout.max_new_tokens=8", *COMMON,
    )  # fmt: skip
    assert len(hist) == 2 and all(m["env/errors"] == 0 for m in hist)
    assert all(m["env/turns"] > 1.5 for m in hist)
    sampled = {tuple(ids): lps for ids, lps in turns}
    multi = scored = 0
    for piece in pieces:
        rb = piece["rollout"]
        for i in range(rb.num_samples):
            runs = _model_runs(rb, i)
            multi += len(runs) > 1
            assert len(runs) == int(piece["env_stats"]["turns"][i])
            for run in runs:  # each model turn is exactly a sampled turn of the engine, with its log-probs
                ids = tuple(rb.response_ids[i, run].tolist())
                assert ids in sampled
                assert rb.rollout_logprobs[i, run].tolist() == pytest.approx(sampled[ids])
            finished = len(runs) == guess.TURNS and rb.finish_reasons[i] != "length"
            scored += finished
            # The task's rubric on the last reply plus the reward the env's run records itself.
            want = guess.length_score(rb.response_texts[i].strip()) + guess.BONUS * guess.BONUS_WEIGHT
            assert piece["rewards"][i].item() == pytest.approx(want if finished else 0.0)
    assert multi > 0 and scored > 0


def test_verifiers_toolset_is_served_in_process():
    from rlkit.envs import make_env

    env = make_env("verifiers:rlkit_test_vf_tools", {"max_turns": 3})
    (row,) = [r for r in type(env).rows() if r["question"] == "What is 1 + 2?"]
    first = env.reset(row, [])
    assert first[0]["role"] == "system" and '"name": "add_tools_add"' in first[0]["content"]
    assert first[-1] == {"role": "user", "content": "What is 1 + 2?"}
    call = '<tool_call>{"name": "add_tools_add", "arguments": {"a": 40, "b": 2}}</tool_call>'
    assert env.step(call) == ([{"role": "tool", "content": "42"}], 0.0, False)
    obs, _, done = env.step('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    assert not done and "no tool 'nope'" in obs[0]["content"]
    assert env.tool_calls == 2
    assert env.step("3") == (None, 1.0, True)  # no call: the run ends, the task's reward scores "3"
    # max_turns=1: the tool call is the last turn; the run is stopped there and scored (the reply is not "3")
    limited = make_env("verifiers:rlkit_test_vf_tools", {"max_turns": 1})
    limited.reset(row, [])
    assert limited.step(call) == (None, 0.0, True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def openenv_server():
    """The test OpenEnv server (openenv-core's create_app) under uvicorn on a free loopback port."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "rlkit_test_openenv_server:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=FIXTURES, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not start"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_openenv_server_on_loopback_trains(tiny, tmp_path, captured, openenv_server, fresh_fork_server):
    from rlkit_test_openenv_server import STEPS, reward_of

    from rlkit.models import load_tokenizer

    pieces, _ = captured
    hist = train(
        tiny, tmp_path / "run", f"env.name=openenv:{openenv_server}", f"env.max_turns={STEPS}",
        "+env.kwargs.observation_key=prompt", "+env.kwargs.num_tasks=16", "env.max_total_tokens=64",
        "rollout.max_new_tokens=8", *COMMON,
    )  # fmt: skip
    assert len(hist) == 2 and all(m["env/errors"] == 0 for m in hist)
    tokenizer = load_tokenizer(tiny)
    for piece in pieces:
        rb = piece["rollout"]
        for i in range(rb.num_samples):
            runs = _model_runs(rb, i)
            if rb.finish_reasons[i] == "length":
                runs = runs[:-1]  # a turn cut by the token cap is never sent to the server
            texts = [
                tokenizer.decode(rb.response_ids[i, run].tolist(), skip_special_tokens=True) for run in runs
            ]
            # the server's reward of every step, summed
            assert piece["rewards"][i].item() == pytest.approx(sum(reward_of(t) for t in texts))
    assert any(r > 0 for p in pieces for r in p["rewards"].tolist())


@pytest.mark.parametrize(
    ("name", "hidden", "extra"),
    [
        ("verifiers:rlkit_test_vf_single", ["verifiers", "verifiers.v1"], "rlkit[verifiers]"),
        (
            "openenv:http://127.0.0.1:1",
            ["openenv", "openenv.core", "openenv.core.generic_client"],
            "rlkit[openenv]",
        ),
    ],
)
def test_a_missing_library_names_its_extra(monkeypatch, name, hidden, extra):
    from rlkit.config.schema import ConfigError
    from rlkit.envs import resolve_env, verifiers_env
    from rlkit.train import compose, load_config

    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)  # `import` raises ImportError
    resolve_env.cache_clear()
    verifiers_env._environment.cache_clear()
    with pytest.raises(ConfigError, match=extra.replace("[", r"\[").replace("]", r"\]")):
        load_config(compose(["+recipe=quickstart_1digit", f"env.name={name}"]))  # its preflight checks


def test_an_image_name_is_refused_with_how_to_serve_it():
    from rlkit.envs import resolve_env

    with pytest.raises(ValueError, match="Docker image are not supported"):
        resolve_env("openenv:my-env:latest")
