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
`env/timeouts`); so does a malformed result (a reward follows the reward functions' rule:
rlkit.rewards.functions.reward_number), an oversized one, a memory hog over `env.memory_limit_mb`, or a
first message that leaves no room (rlkit/envs/workers.py runs the environments in contained worker
processes, where a hung step is killed with everything it started). `stop` lists extra stop strings that end a model turn (the tool call's closing tag);
`tool_calls` counts the tool calls the environment served (logged as `env/tool_calls`, per episode).

Environments are named like reward functions: a built-in (`single_turn`, `calculator`) or an import
path `module:Class` / `module.Class`; environments of other libraries by a prefix: `verifiers:<taskset id>`
(rlkit/envs/verifiers_env.py) and `openenv:<url>` (rlkit/envs/openenv_env.py). An environment class with a
classmethod `rows(**env.kwargs)` can also be the dataset (`data.path=env`).
"""

from __future__ import annotations

from rlkit.config.schema import ConfigError
from rlkit.envs import openenv_env, verifiers_env
from rlkit.envs.base import ADAPTERS, ENVIRONMENTS, Environment, SingleTurn, make_env, resolve_env
from rlkit.envs.calculator import Calculator
from rlkit.envs.images import PictureRule
from rlkit.envs.look import Look
from rlkit.envs.workers import build_once, limits_of, rows_in_worker

ADAPTERS.update(verifiers=verifiers_env.environment_class, openenv=openenv_env.environment_class)


def environment_rows(env) -> list[dict]:
    """The dataset of `data.path=env`: the rows of env.name's environment (its classmethod `rows`), read in
    an environment worker under `env.startup_timeout_s` (rows that raise, exit or hang are a ValueError
    naming env.name, never an exit or a hang of the trainer)."""
    cls = resolve_env(env.name)
    if not callable(getattr(cls, "rows", None)):
        raise ValueError(
            f"data.path=env: env.name={env.name!r} brings no dataset (no classmethod rows); "
            "environments that do: verifiers:<taskset id>, openenv:<url>"
        )
    return rows_in_worker(env.name, dict(env.kwargs), timeout_s=env.startup_timeout_s, limits=limits_of(env))


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
    # Built once as an episode builds it, in a worker under env.timeout_s: an __init__ that raises, exits or
    # hangs is a start-up error here, not an exit code or a hang of the trainer.
    if issubclass(resolve_env(env.name), openenv_env.OpenEnvEnv):  # an episode's reset would be refused
        openenv_env.check_server(resolve_env(env.name).url, timeout_s=env.timeout_s)
    if resolve_env(env.name) is SingleTurn:
        try:
            make_env(env.name, env.kwargs)
        except Exception as e:
            raise ValueError(
                f"env.name={env.name!r} cannot be built with env.kwargs={dict(env.kwargs)} ({e})"
            ) from e
    else:
        build_once(env.name, dict(env.kwargs), timeout_s=env.timeout_s, limits=limits_of(env))


def shows_images(env) -> bool:
    """Whether env.name's observations may show images (its class's `images`, rlkit.envs.images)."""
    return (
        env.name != "single_turn"
        and env.max_turns > 1
        and bool(getattr(resolve_env(env.name), "images", False))
    )


def takes_images(cfg) -> bool:
    """Whether a run's prompts may hold images, from its data (`data.image_key`) or its environment
    (`shows_images`): the vision-language model is then loaded whole, with its processor."""
    return cfg.data.image_key is not None or shows_images(cfg.env)


def picture_rule(cfg) -> PictureRule | None:
    """How an environment's images are decoded in a run (`data.max_image_pixels`, `data.resize_images`), or None
    when its environment shows none."""
    if not shows_images(cfg.env):
        return None
    return PictureRule(max_pixels=cfg.data.max_image_pixels, resize=cfg.data.resize_images)


def check_env_images(cfg) -> None:
    """An environment that shows images needs a vision-language model.path with its processor and an engine that
    takes them (raises ValueError naming the keys)."""
    if not shows_images(cfg.env):
        return
    from rlkit.vision import images_problem  # defers torch

    where = f"env.name={cfg.env.name!r} shows images in its observations"
    problem = images_problem(cfg.model.path)
    if problem is not None:
        raise ValueError(f"{where}, but model.path={cfg.model.path!r} {problem}")
    if cfg.trainer.strategy == "fsdp2":
        raise ValueError(
            f"{where}: with trainer.strategy=fsdp2 a row whose episode showed no picture would skip the sharded "
            "vision tower on some ranks; use trainer.strategy=ddp or none"
        )


def check_config(cfg) -> None:
    """The `env.*` keys of an `RLConfig` (raises ConfigError before any model loads)."""
    try:
        check_env_config(cfg.env, cfg.rollout)
        check_env_images(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from e


__all__ = [
    "Calculator",
    "ENVIRONMENTS",
    "Environment",
    "Look",
    "SingleTurn",
    "check_config",
    "check_env_config",
    "environment_rows",
    "make_env",
    "picture_rule",
    "resolve_env",
    "shows_images",
    "takes_images",
]
