import time

import pytest
from timing_helpers import within

from rlkit.rewards import RewardScorer, extract_gsm8k_answer, format_reward, math_reward, resolve


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("Natalia sold 48/2 = 24 clips.\n#### 1,072") == "1072"
    assert extract_gsm8k_answer("7") == "7"


@pytest.mark.parametrize(
    "response, expected",
    [
        ("3 + 4 = 7\n#### 7", 1.0),
        ("The answer is 7.", 1.0),
        ("#### 7.0", 1.0),
        ("\\boxed{7}", 1.0),
        ("#### 8", 0.0),
        ("I don't know", 0.0),
        ("3 + 4 = 7 so #### 6", 0.0),  # the stated final answer counts, not an earlier number
        # Restating the question is not an answer, although math-verify evaluates 3 + 4 to 7 (a policy
        # trained on the quickstart learned to echo "a + b" for "What is a + b?").
        ("3 + 4", 0.0),
        ("To add 3 + 4, we can use the sum of the", 0.0),
        ("#### 3 + 4", 0.0),
        ("#### 14/2", 1.0),  # a fraction is a number
        ("$7$ apples", 1.0),
        ("x = 7", 1.0),
    ],
)
def test_math_reward(response, expected):
    assert math_reward("q", response, "3 + 4 = 7\n#### 7") == expected


def test_format_reward():
    assert format_reward("q", "so #### 12", "") == 1.0
    assert format_reward("q", "\\boxed{x+1}", "") == 1.0
    assert format_reward("q", "twelve", "") == 0.0


def test_resolve_names_and_paths():
    assert resolve("math") is math_reward
    assert resolve("rlkit.rewards:format_reward") is format_reward
    assert resolve("rlkit.rewards.format_reward") is format_reward
    assert resolve("none")("q", "any response", "7") == 0.0  # no task reward (pure distillation)
    with pytest.raises(
        ValueError,
        match=r"reward.fn='nope' is not one of \['math', 'format', 'none', 'reasoning_gym', 'reasoning_gym_lenient', 'answer_tags', 'exact'\]",
    ):
        resolve("nope")
    with pytest.raises(ValueError, match="cannot import"):
        RewardScorer("rlkit.rewards:missing")


def test_weighted_sum():
    scorer = RewardScorer("math", {"format": 0.5}, num_workers=1)
    try:
        s = scorer.score(["q"] * 3, ["#### 7", "7", "#### 5"], ["#### 7"] * 3)
    finally:
        scorer.close()
    # math: 1, 1, 0; format: 1, 0, 1 -> 1 + 0.5, 1 + 0, 0 + 0.5
    assert s.total == [1.5, 1.0, 0.5]
    assert s.per_fn["format"] == [1.0, 0.0, 1.0]
    assert s.errors == 0


def test_raising_reward_scores_zero_and_is_counted():
    scorer = RewardScorer("rlkit_test_rewards:raising", num_workers=2)
    try:
        s = scorer.score(["q"] * 4, ["ab"] * 4, ["#### 1", "#### 3", "#### 2", "#### 3"])
    finally:
        scorer.close()
    assert s.total == [1.0, 0.0, 1.0, 0.0]
    assert s.errors == 2 and s.timeouts == 0


def test_hanging_reward_times_out_scores_zero_and_is_counted():
    scorer = RewardScorer("rlkit_test_rewards:hanging", timeout_s=1.0, num_workers=2)
    try:
        t0 = time.monotonic()
        s = scorer.score(["q"] * 4, ["ab"] * 4, ["#### 3", "#### 1", "#### 2", "#### 3"])
        elapsed = time.monotonic() - t0
        # the scorer still works after killing its hung workers
        s2 = scorer.score(["q"], ["ab"], ["#### 1"])
    finally:
        scorer.close()
    assert s.total == [0.0, 0.5, 0.5, 0.0]
    assert s.errors == 2 and s.timeouts == 2
    assert elapsed < within(60, failure_s=3600)  # the hanging reward sleeps an hour
    assert s2.total == [0.5] and s2.errors == 0
