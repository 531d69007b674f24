"""The RL math: pure tensor functions (no I/O, no distributed calls, no config objects).

    from rlkit.algos import advantages, kl, losses, correction, distill, evaluation

See docs/concepts/math.md for a guide to the estimators and when to pick each.
"""

from rlkit.algos import advantages, correction, distill, evaluation, kl, losses

__all__ = ["advantages", "kl", "losses", "correction", "distill", "evaluation"]
