"""rlkit: single-machine GRPO/PPO post-training for language models."""

__version__ = "0.1.0"
