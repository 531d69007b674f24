""" "Correct" is the task's word: accuracy, eval/pass@k and the refill filter ask the main reward function
(a reward of at least reward.correct_threshold, or the function's own @correct_when verdict), whatever the
task; and an advantage estimator registered from outside the package trains."""

import inspect
from pathlib import Path

import pytest
import torch
from rlkit_test_rewards import length_target, lenient
from run_helpers import overrides, tiny  # noqa: F401

from rlkit.algos import advantages as adv
from rlkit.rewards import RewardScorer
from rlkit.rollout import producer
from rlkit.train import compose, load_config
from rlkit.trainer import run

pytestmark = pytest.mark.slow  # trainer runs: `make test-fast` leaves it out


def _spy_scores(monkeypatch) -> list[tuple[list[str], bool]]:
    """Every (responses, eval?) the scorer sees; an evaluation's calls come from rlkit/rollout/evaluation.py."""
    calls = []
    real = RewardScorer.score

    def score(self, prompts, responses, answers, **kw):
        from_eval = any(Path(f.filename).match("rlkit/rollout/evaluation.py") for f in inspect.stack())
        calls.append((list(responses), from_eval))
        return real(self, prompts, responses, answers, **kw)

    monkeypatch.setattr(RewardScorer, "score", score)
    return calls


def test_accuracy_and_pass_at_1_follow_a_non_math_reward(tiny, tmp_path, monkeypatch):  # noqa: F811
    calls = _spy_scores(monkeypatch)
    cfg = load_config(
        compose(
            overrides(
                tiny, tmp_path / "run", "reward.fn=rlkit_test_rewards:length_target", "trainer.eval_every=1"
            )
        )
    )
    history = run(cfg)
    train = [r for r, is_eval in calls if not is_eval]
    evals = [r for r, is_eval in calls if is_eval]
    assert len(train) == len(history) == 2 and len(evals) == 3  # step 0, 1 and 2
    for metrics, responses in zip(history, train):
        by_hand = sum(length_target("", r, "") == 1.0 for r in responses) / len(responses)
        assert 0 < by_hand < 1  # the test tells right from wrong
        assert metrics["accuracy"] == by_hand
        assert "reward/math" not in metrics  # math-verify is not consulted
    for metrics, responses in zip(history, evals[1:]):
        by_hand = sum(length_target("", r, "") == 1.0 for r in responses) / len(responses)
        assert abs(metrics["eval/pass@1"] - by_hand) < 1e-9


def test_refill_filter_accuracy_follows_the_functions_verdict(tiny, tmp_path, monkeypatch):  # noqa: F811
    calls = _spy_scores(monkeypatch)
    seen = []
    real = producer.informative_groups

    def spy(metric, group_size):
        seen.append(metric.clone())
        return real(metric, group_size)

    monkeypatch.setattr(producer, "informative_groups", spy)
    extra = [
        "reward.fn=rlkit_test_rewards:lenient",
        "algo.dynamic_sampling=refill",
        "algo.filter_metric=accuracy",
    ]
    run(load_config(compose(overrides(tiny, tmp_path / "run", "trainer.steps=1", *extra))))
    train = [r for r, is_eval in calls if not is_eval]
    assert len(seen) == len(train) >= 1
    for metric, responses in zip(seen, train):
        verdict = torch.tensor([float(lenient("", r, "") >= 0.5) for r in responses])
        assert torch.equal(metric, verdict)
        values = torch.tensor([lenient("", r, "") for r in responses])
        assert not torch.equal(verdict, values)  # the verdict is not the reward itself


def test_an_estimator_registered_outside_the_package_trains(tiny, tmp_path, monkeypatch):  # noqa: F811
    """Adding an estimator is one decorated function: here sign(r - group mean), checked by hand."""

    @adv.ESTIMATORS.register("sign_baseline", group_based=True, token_level=False, needs_critic=False)
    def sign_baseline(inputs, params):
        r = inputs.rewards.reshape(-1, inputs.group_size)
        return torch.sign(r - r.mean(-1, keepdim=True)).reshape(-1)[:, None] * inputs.mask, None

    trained = []
    from rlkit.learner import Learner

    real_update = Learner.update

    def update(self, batch, **kw):
        trained.append(batch)
        return real_update(self, batch, **kw)

    monkeypatch.setattr(Learner, "update", update)
    produced = []
    from rlkit.rollout.local import LocalRollouts

    real_produce = LocalRollouts.produce

    def produce(self, step, timers):
        produced.append(real_produce(self, step, timers))
        return produced[-1]

    monkeypatch.setattr(LocalRollouts, "produce", produce)
    try:
        extra = ["algo.adv_estimator=sign_baseline", "trainer.steps=1"]
        history = run(load_config(compose(overrides(tiny, tmp_path / "run", *extra))))
    finally:
        del adv.ESTIMATORS["sign_baseline"]
    assert len(history) == 1 and history[0]["grad_norm"] > 0
    rewards, mask = produced[0].rewards, produced[0].rollout.response_mask.bool()
    for i in range(len(rewards)):  # the naive loop
        g = i // 4
        mean = sum(rewards[g * 4 : g * 4 + 4].tolist()) / 4
        expected = (rewards[i].item() > mean) - (rewards[i].item() < mean)
        got = trained[0].advantages[i][mask[i]]
        assert torch.all(got == expected), (i, got, expected)
