"""Asynchronous training (`trainer.mode=async`): the learner's side (client.py), the rollout worker
process (worker.py), the schedule as pure bookkeeping (schedule.py), the typed messages and their
tensors-only encoding (messages.py) and the weights' process group (wire.py)."""
