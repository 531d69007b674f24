"""Environments: what a multi-turn episode talks to.

An environment is built per episode (`cls(**env.kwargs)`) and driven by rlkit.rollout.episodes:

    messages = env.reset(row, messages)      # the first messages (default: the dataset's prompt)
    loop:  model turn (sampled token ids, kept exactly) -> text
           observation, reward, done = env.step(text)
           observation: chat messages appended to the conversation (rendered with the chat template),
                        or None; reward: a float added to the episode's reward; done: end the episode.

The episode ends at `done`, after `env.max_turns` model turns, or when the response (model and
observation tokens) reaches `env.max_total_tokens` (finish reason `length`). A step that raises or
runs longer than `env.timeout_s` ends its episode with reward 0 and is counted (`env/errors`,
`env/timeouts`); so does a malformed result or a first message that leaves no room (rlkit/envs/workers.py
runs the environments in worker processes, where a hung step is killed). `stop` lists extra stop strings that end a model turn (the tool call's closing tag);
`tool_calls` counts the tool calls the environment served (logged as `env/tool_calls`, per episode).

Environments are named like reward functions: a built-in (`single_turn`, `calculator`) or an import
path `module:Class` / `module.Class`; environments of other libraries by a prefix: `verifiers:<taskset id>`
(rlkit/envs/verifiers_env.py) and `openenv:<url>` (rlkit/envs/openenv_env.py). An environment class with a
classmethod `rows(**env.kwargs)` can also be the dataset (`data.path=env`).
"""

from __future__ import annotations

import functools

from rlkit.config.schema import ConfigError
from rlkit.envs import openenv_env, verifiers_env
from rlkit.envs.base import ENVIRONMENTS, Environment, SingleTurn
from rlkit.envs.calculator import Calculator
from rlkit.lookup import lookup

ADAPTERS = {"verifiers": verifiers_env.environment_class, "openenv": openenv_env.environment_class}
"""env.name prefixes (`<prefix>:<target>`): environments of other libraries, adapted."""


@functools.cache
def resolve_env(spec: str) -> type:
    """An environment class from a registered name, an import path `module:Class` / `module.Class`, or an
    adapter prefix (`verifiers:<taskset id>`, `openenv:<url>`)."""
    prefix, _, target = spec.partition(":")
    if prefix in ADAPTERS:
        return ADAPTERS[prefix](target)
    cls = lookup(spec, ENVIRONMENTS, key="env.name", kind="Class")
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        what = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', type(cls).__name__)}"
        raise ValueError(
            f"env.name={spec!r} is {what}, not an environment class (a class with reset(row, messages) and "
            f"step(text), e.g. a subclass of rlkit.envs.Environment); built-in: {list(ENVIRONMENTS)}"
        )
    return cls


def make_env(spec: str, kwargs: dict | None = None):
    """A fresh environment for one episode."""
    return resolve_env(spec)(**(kwargs or {}))


def environment_rows(env) -> list[dict]:
    """The dataset of `data.path=env`: the rows of env.name's environment (its classmethod `rows`)."""
    cls = resolve_env(env.name)
    if not callable(getattr(cls, "rows", None)):
        raise ValueError(
            f"data.path=env: env.name={env.name!r} brings no dataset (no classmethod rows); "
            "environments that do: verifiers:<taskset id>"
        )
    return cls.rows(**dict(env.kwargs))


def check_env_config(env, rollout) -> None:
    """Start-up checks of the `env.*` keys (raises ValueError naming the key, value and valid range)."""
    if env.name.split(":")[0].split(".")[0] == "__main__":
        raise ValueError(
            f"env.name={env.name!r}: environments are built in worker processes, which import them by path; "
            "move the class to a module (module:Class)"
        )
    resolve_env(env.name)
    if env.max_turns < 1:
        raise ValueError(f"env.max_turns={env.max_turns!r} must be >= 1")
    if env.max_total_tokens is not None and env.max_total_tokens < 1:
        raise ValueError(f"env.max_total_tokens={env.max_total_tokens!r} must be >= 1 (or null)")
    if env.timeout_s <= 0:
        raise ValueError(f"env.timeout_s={env.timeout_s!r} must be > 0")
    try:
        make_env(env.name, env.kwargs)
    except Exception as e:
        raise ValueError(
            f"env.name={env.name!r} cannot be built with env.kwargs={dict(env.kwargs)} ({e})"
        ) from e


def check_config(cfg) -> None:
    """The `env.*` keys of an `RLConfig` (raises ConfigError before any model loads)."""
    try:
        check_env_config(cfg.env, cfg.rollout)
    except ValueError as e:
        raise ConfigError(str(e)) from e


__all__ = [
    "Calculator",
    "ENVIRONMENTS",
    "Environment",
    "SingleTurn",
    "check_config",
    "check_env_config",
    "environment_rows",
    "make_env",
    "resolve_env",
]
