"""The environment protocol (`Environment`), the single-turn default and the registry of environments."""

from __future__ import annotations

import math

from rlkit.lookup import Registry

# env.name: the built-in environments (an environment module registers its classes on import).
ENVIRONMENTS = Registry("env.name")


class Environment:
    """The protocol, with defaults: subclass it, or write any class with these members."""

    stop: tuple[str, ...] = ()
    """Extra stop strings of a model turn (kept in the turn), besides EOS and rollout.stop."""
    tool_calls: int = 0
    """Tool calls served in this episode (logged as `env/tool_calls`)."""
    preload: tuple[str, ...] = ()
    """Modules (a heavy library) imported once by the fork server the environment workers fork from, so a
    batch's workers start with them imported; a module that does not import is skipped there."""

    def reset(self, row: dict, messages: list[dict]) -> list[dict]:
        """The episode's first messages, from its dataset row; `messages` is the dataset's prompt
        (system + user, as data.* renders it). Returning `messages` unchanged keeps the dataset's
        exact prompt tokens (including data.template=plain)."""
        return messages

    def step(self, text: str) -> tuple[list[dict] | None, float, bool]:
        """React to one model turn (its decoded text): (observation messages or None, reward, done)."""
        raise NotImplementedError


@ENVIRONMENTS.register("single_turn")
class SingleTurn(Environment):
    """The dataset's single-turn task: one model turn, then the reward functions judge it."""

    def step(self, text: str) -> tuple[list[dict] | None, float, bool]:
        return None, 0.0, True


def check_messages(value, what: str) -> list[dict]:
    """`value` as chat messages: a list of dicts whose `role` and `content` are strings (raises TypeError
    naming what is wrong, so a malformed observation or first message fails its episode, not the run)."""
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list of messages, got {type(value).__name__}")
    for k, m in enumerate(value):
        if not isinstance(m, dict):
            raise TypeError(f"{what}[{k}] must be a dict with role and content, got {type(m).__name__}")
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                raise TypeError(f"{what}[{k}][{field!r}] must be a string, got {type(m.get(field)).__name__}")
    return [dict(m) for m in value]


def check_step(out) -> tuple[list[dict] | None, float, bool]:
    """An environment step's result `(observation or None, reward, done)`, checked (raises on a bad one)."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(f"step must return (observation, reward, done), got {type(out).__name__}")
    obs, reward, done = out
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"non-finite reward {reward}")
    return (None if obs is None else check_messages(obs, "observation")), reward, bool(done)
