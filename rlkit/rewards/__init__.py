"""Rewards: the function contract and built-ins (functions.py), their safe execution in worker processes
(scorer.py, through the process sandbox of rlkit/sandbox/), and neural reward models (model.py, imported on demand: it loads torch).

    from rlkit.rewards import answer_with, batched, correct_when   # decorators for your own reward functions
"""

from rlkit.rewards.functions import (
    REGISTRY,
    answer_with,
    batched,
    check_config,
    correct_when,
    extract_answer,
    extract_gsm8k_answer,
    final_answer,
    format_reward,
    is_batched,
    is_correct,
    math_reward,
    resolve,
)
from rlkit.rewards.scorer import RewardScorer, Scores

__all__ = [
    "REGISTRY", "RewardScorer", "Scores", "answer_with", "batched", "check_config", "correct_when", "extract_answer", "extract_gsm8k_answer", "final_answer", "format_reward",
    "is_batched", "is_correct", "math_reward", "resolve",
]  # fmt: skip
