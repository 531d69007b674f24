"""Loud failures: a reward function or an environment that fails on a large share of a step's samples is
said on the console, and one that fails on every sample for several steps in a row stops the run.

A raising reward function or a failing episode scores 0 and is counted (`reward/errors`, `env/errors`), so
one bad sample never ends a run. But a function that fails on everything (a wrong `reward.fn` for the data,
a missing dependency in the workers) would train on rewards of 0 at rc 0, seen only in a metric:

- a reward function failing on more than `WARN_SHARE` of a step's samples logs a warning with its first
  error, once per function and cause (the error's kind: its text before the first colon), not every step;
- a reward function that fails on every sample of `reward.max_failed_steps` steps in a row, or an
  environment whose every episode fails for `env.max_failed_steps` steps in a row, stops the run with
  `FailingRunError` naming it and the first error (0 = never stop). Environment failures are already logged
  per batch and reason (rlkit/rollout/episodes.py).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

WARN_SHARE = 0.5
"""A reward function failing on more than this share of a step's samples is warned about on the console."""


class FailingRunError(RuntimeError):
    """Every reward call of a function, or every episode of the environment, failed for several steps."""


def _cause(error: str) -> str:
    return error.split(":", 1)[0][:100]


class FailureWatch:
    """Per step (`see_rewards` / `see_episodes` for each generation batch, then `end_step`)."""

    def __init__(self, *, reward_steps: int, env_steps: int, env_name: str):
        self.reward_steps, self.env_steps, self.env_name = reward_steps, env_steps, env_name
        self._warned: set[tuple[str, str]] = set()
        self._streaks: dict[str, int] = {}
        self._env_streak = 0
        self._reset()

    def _reset(self) -> None:
        self._samples = self._episodes = self._episode_errors = 0
        self._failed: dict[str, int] = {}
        self._first: dict[str, str] = {}
        self._env_first = ""

    def see_rewards(self, scores, samples: int) -> None:
        """One generation batch's `Scores` (rlkit.rewards.scorer) of `samples` samples."""
        self._samples += samples
        for slot, count in scores.failed.items():
            self._failed[slot] = self._failed.get(slot, 0) + count
            self._first.setdefault(slot, scores.first_error[slot])

    def see_episodes(self, episodes: int, errors: int, first_failure: str) -> None:
        self._episodes += episodes
        self._episode_errors += errors
        self._env_first = self._env_first or first_failure

    def end_step(self, step: int) -> None:
        """Warn about the failures of step `step` (0-based, as the producer counts: named as the metrics
        number it, step + 1), count the steps in a row that failed everywhere, and raise FailingRunError once
        a count reaches its limit."""
        try:
            self._rewards(step + 1)
            self._environment(step + 1)
        finally:
            self._reset()

    def _rewards(self, step: int) -> None:
        for slot, count in self._failed.items():
            key = (slot, _cause(self._first[slot]))
            if count > WARN_SHARE * self._samples and key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "reward function %r failed on %d of %d samples of step %d (they score 0; counted in "
                    "reward/errors): first error: %s. (Said once per function and cause.)",
                    slot, count, self._samples, step, self._first[slot],
                )  # fmt: skip
        for slot in set(self._streaks) | set(self._failed):
            every = self._samples > 0 and self._failed.get(slot, 0) >= self._samples
            self._streaks[slot] = self._streaks.get(slot, 0) + 1 if every else 0
            if every and self.reward_steps and self._streaks[slot] >= self.reward_steps:
                raise FailingRunError(
                    f"step {step}: reward function {slot!r} failed on every sample of {self._streaks[slot]} steps "
                    f"in a row (reward.max_failed_steps={self.reward_steps}): first error: {self._first[slot]}"
                )

    def _environment(self, step: int) -> None:
        every = self._episodes > 0 and self._episode_errors >= self._episodes
        self._env_streak = self._env_streak + 1 if every else 0
        if every and self.env_steps and self._env_streak >= self.env_steps:
            raise FailingRunError(
                f"step {step}: every episode of env.name={self.env_name!r} failed in {self._env_streak} steps in a "
                f"row (env.max_failed_steps={self.env_steps}): first reason: {self._env_first}"
            )
