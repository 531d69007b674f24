"""A reward module that cannot be imported inside an async rollout worker (a process named rlkit-rollout-*):
the worker fails at start-up, in its LocalRollouts' reward scorer, while the learner imports it fine."""

import multiprocessing

if multiprocessing.current_process().name.startswith("rlkit-rollout"):
    raise RuntimeError("rlkit_test_worker_fails: this reward refuses to load in a rollout worker")


def reward(prompt, response, answer):
    return 0.0
