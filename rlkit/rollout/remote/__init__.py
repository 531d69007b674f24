"""Asynchronous training (`trainer.mode=async`): the learner's side (client.py), the rollout worker
process (worker.py) and what crosses between them (wire.py)."""
