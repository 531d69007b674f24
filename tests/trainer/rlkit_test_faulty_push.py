"""A reward module whose import, in a rollout worker, makes that worker's weight pushes arrive nowhere: the
tensors are received (the broadcast stays in step) and dropped, as a transport or loading bug would drop
them. Used as `reward.fn=rlkit_test_faulty_push:reward` by tests/trainer/test_async.py."""

import rlkit.rollout.remote.worker as worker
import rlkit.weights


class _Nowhere:
    """An engine stand-in that takes every tensor of a push and keeps none."""

    def __init__(self, engine):
        self.name = engine.name

    def load_weights(self, named, *, manifest=None):
        return sum(1 for _ in named)


def _dropping_receive(pg, engine, manifest, dtype, device):
    rlkit.weights.receive_weights(pg, _Nowhere(engine), manifest, dtype, device)


worker.receive_weights = _dropping_receive


def reward(prompt, response, answer):
    return len(response) % 7 / 7.0
