"""The environment protocol (`Environment`), the single-turn default, the registry of environments and the
checks of what an environment returns."""

from __future__ import annotations

import functools

from rlkit.envs.images import PictureRule, check_parts, text_chars
from rlkit.lookup import Registry, lookup
from rlkit.rewards.functions import describe, reward_number

# env.name: the built-in environments (an environment module registers its classes on import).
ENVIRONMENTS = Registry("env.name")


class Environment:
    """The protocol, with defaults: subclass it, or write any class with these members."""

    stop: tuple[str, ...] = ()
    """Extra stop strings of a model turn (kept in the turn), besides EOS and rollout.stop."""
    tool_calls: int = 0
    """Tool calls served in this episode (logged as `env/tool_calls`)."""
    images: bool = False
    """Its observations may show images (content parts `{"type": "image", "image": ...}`, rlkit.envs.images): the
    run then loads the vision-language model whole, with its processor."""
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


ADAPTERS: dict = {}
"""env.name prefixes (`<prefix>:<target>`) -> a function of the target giving the environment class: the
environments of other libraries, adapted (rlkit.envs registers `verifiers` and `openenv`)."""


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


MAX_MESSAGES = 1_000
"""Most messages in one observation or first-message list; more is refused as an oversized result."""
MAX_MESSAGE_CHARS = 4_000_000
"""Most characters in one observation or first-message list (about a million tokens, beyond any context):
more is refused in the worker, before it crosses the pipe or meets the tokenizer."""


def check_messages(
    value, what: str, pictures: PictureRule | None = None, *, parts: bool = False
) -> list[dict]:
    """`value` as chat messages: a list of dicts whose `role` is a string and `content` a string, or with
    `parts` (an observation) a list of text and image parts (rlkit.envs.images.check_parts: each image decoded
    by `pictures`, the run's rule, into `Pixels`). Raises TypeError naming what is wrong, so a malformed
    observation or first message fails its episode, not the run. An oversized one (over MAX_MESSAGES messages or
    MAX_MESSAGE_CHARS characters) raises ValueError naming its size, never its content."""
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list of messages, got {describe(value)}")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"{what} has {len(value)} messages (at most {MAX_MESSAGES})")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict):
            raise TypeError(f"{what}[{k}] must be a dict with role and content, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise TypeError(f"{what}[{k}]['role'] must be a string, got {type(m.get('role')).__name__}")
        content = m.get("content")
        if parts and isinstance(content, list):
            m = {**m, "content": check_parts(content, f"{what}[{k}]['content']", pictures)}
        elif not isinstance(content, str):
            kinds = "a string or a list of text and image parts" if parts else "a string"
            raise TypeError(f"{what}[{k}]['content'] must be {kinds}, got {type(content).__name__}")
        out.append(dict(m))
    chars = sum(text_chars(m["content"]) + len(m["role"]) for m in out)
    if chars > MAX_MESSAGE_CHARS:
        raise ValueError(f"{what} has {chars} characters (at most {MAX_MESSAGE_CHARS})")
    return out


def check_step(out, pictures: PictureRule | None = None) -> tuple[list[dict] | None, float, bool]:
    """An environment step's result `(observation or None, reward, done)`, checked (raises on a bad one); the
    observation's images decoded by `pictures` (rlkit.envs.images). The reward follows the reward functions'
    rule, from the same function (`reward_number`: a finite real number with |reward| <= MAX_ABS_REWARD, bools
    as 0 / 1, no strings)."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(f"step must return (observation, reward, done), got {describe(out)}")
    obs, reward, done = out
    reward = reward_number(reward)
    return (
        (None if obs is None else check_messages(obs, "observation", pictures, parts=True)),
        reward,
        bool(done),
    )
