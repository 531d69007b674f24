"""The rollout half of training: engines/ (HF, vLLM), episodes (environment turns), the producer (generate ->
rewards -> dynamic sampling; also evaluation), local (in this process) and remote/ (async rollout workers).

It never imports rlkit.learner: the learner's weights arrive as an `rlkit.weights.Export`.
"""
