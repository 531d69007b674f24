"""Every door of an environment is contained: its dataset (`rows`, data.path=env) is read in a worker at
start-up, an OpenEnv server is tried at start-up, and an OpenEnv reward follows rlkit's one number rule."""

import asyncio
import importlib.util
import os
import socket
import time
from types import SimpleNamespace

import pytest
from timing_helpers import within

from rlkit.config.schema import RLConfig
from rlkit.data.loading import DataError, check_data, load_splits
from rlkit.envs import check_config, resolve_env
from rlkit.envs.base import check_step

M = "rlkit_test_doors"


def _env_data(name: str, **env) -> RLConfig:
    cfg = RLConfig()
    cfg.data.path, cfg.data.eval_size = "env", 1
    cfg.env.name = f"{M}:{name}"
    for key, value in env.items():
        setattr(cfg.env, key, value)
    return cfg


@pytest.mark.parametrize(
    "name, expected",
    [
        ("ExitingRows", "its worker died (exit code 9)"),
        ("HangingRows", "rows ran over env.startup_timeout_s=1s"),
    ],
)
def test_an_environment_dataset_that_exits_or_hangs_is_a_start_up_error(name, expected):
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        check_data(_env_data(name, startup_timeout_s=1.0))  # the preflight's data check
    assert f"env.name='{M}:{name}'" in str(e.value) and expected in str(e.value)
    # 1 s of timeout and a worker's start; the bug: env.startup_timeout_s's default, 300 s
    assert time.monotonic() - start < within(30, failure_s=300)


def test_an_environment_dataset_is_read_in_a_worker():
    cfg = _env_data("GoodRows")
    train, eval_ds = load_splits(cfg.data, seed=0, env=cfg.env)
    assert len(train) + len(eval_ds) == 4
    assert {row["pid"] for row in train} != {os.getpid()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


needs_openenv = pytest.mark.skipif(
    importlib.util.find_spec("openenv") is None, reason="openenv-core not installed"
)


@needs_openenv
def test_an_openenv_url_with_nothing_listening_is_a_start_up_error():
    url = f"http://127.0.0.1:{_free_port()}"
    cfg = RLConfig()
    cfg.env.name = f"openenv:{url}"
    with pytest.raises(ValueError) as e:
        check_config(cfg)
    assert f"env.name=openenv:{url}" in str(e.value) and "ConnectionRefusedError" in str(e.value)


@needs_openenv
def test_an_openenv_reward_follows_the_one_number_rule():
    """A server that sends the reward "0.5" (a string) fails that step, as a reward function's would. (The
    adapter is made without its constructor, which imports openenv-core's client: a stand-in client answers.)"""
    cls = resolve_env("openenv:http://127.0.0.1:1")
    env = object.__new__(cls)
    env.action_key, env.observation_key = "message", None

    async def step(action):
        return SimpleNamespace(reward="0.5", done=True, observation={"prompt": "again"})

    env._loop, env._client = (
        asyncio.new_event_loop(),
        SimpleNamespace(step=step, close=lambda: asyncio.sleep(0)),
    )
    with pytest.raises(TypeError, match="non-numeric reward: str"):
        check_step(env.step("hello"))
