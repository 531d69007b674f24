"""The environment protocol (`Environment`), the single-turn default and the registry of environments."""

from __future__ import annotations

from rlkit.lookup import Registry

# env.name: the built-in environments (an environment module registers its classes on import).
ENVIRONMENTS = Registry("env.name")


class Environment:
    """The protocol, with defaults: subclass it, or write any class with these members."""

    stop: tuple[str, ...] = ()
    """Extra stop strings of a model turn (kept in the turn), besides EOS and rollout.stop."""
    tool_calls: int = 0
    """Tool calls served in this episode (logged as `env/tool_calls`)."""

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
