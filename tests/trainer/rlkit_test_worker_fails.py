"""A reward module that cannot be imported inside an async rollout worker (a process named rlkit-rollout-*):
the worker fails at start-up, in its LocalRollouts' reward scorer, while the learner imports it fine.

Its error message is long (a few pipe buffers), so the worker's traceback reaches the learner only if the
worker waits for its queue to be flushed before it exits."""

import multiprocessing

if multiprocessing.current_process().name.startswith("rlkit-rollout"):
    raise RuntimeError(
        "rlkit_test_worker_fails: this reward refuses to load in a rollout worker"
        + " (a long explanation)" * 20000
        + " END OF THE WORKER'S MESSAGE"
    )


def reward(prompt, response, answer):
    return 0.0
