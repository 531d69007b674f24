"""Loud failures (rlkit/rollout/failures.py): a reward function that fails on every sample is said on the
console with its first error, once, and stops the run after reward.max_failed_steps steps; an environment
whose every episode fails stops it after env.max_failed_steps steps."""

import logging

import pytest
from run_helpers import tiny, train  # noqa: F401

pytestmark = pytest.mark.slow  # trainer runs: `make test-fast` leaves it out


def test_a_reward_function_failing_on_every_sample_warns_once_and_stops_the_run(tiny, tmp_path, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING)
    with pytest.raises(RuntimeError) as e:  # FailingRunError, at the default reward.max_failed_steps=3
        train(tiny, tmp_path / "run", "trainer.steps=3", "trainer.eval_at_start=false", "data.eval_size=0",
              "reward.fn=rlkit_test_rewards:always_raising")  # fmt: skip
    assert type(e.value).__name__ == "FailingRunError"
    assert str(e.value).startswith(
        "step 3: reward function 'rlkit_test_rewards:always_raising' failed on every "
    )
    assert '(reward.max_failed_steps=3): first error: KeyError: "no metadata for answer' in str(e.value)
    warnings = [r.getMessage() for r in caplog.records if "failed on 8 of 8 samples" in r.getMessage()]
    assert len(warnings) == 1 and "step 1" in warnings[0] and "KeyError" in warnings[0]  # once, not per step


def test_an_environment_whose_every_episode_fails_stops_the_run(tiny, tmp_path):  # noqa: F811
    with pytest.raises(RuntimeError) as e:  # FailingRunError, at the default env.max_failed_steps=3
        train(tiny, tmp_path / "run", "trainer.steps=3", "trainer.eval_at_start=false", "data.eval_size=0",
              "env.name=rlkit_test_envs:Misbehaving", "+env.kwargs.how=reset_raise", "data.template=chat",
              "env.max_turns=2")  # fmt: skip
    assert str(e.value).startswith(
        "step 3: every episode of env.name='rlkit_test_envs:Misbehaving' failed in 3"
    )
    assert "first reason: reset raised RuntimeError: reset boom" in str(e.value)
