"""Environments for the multi-turn tests (imported by path, also by launched subprocesses)."""

import time

from rlkit.envs import Environment


class Chatty(Environment):
    """Answers every model turn with the same user message and a per-step reward of 0.25; never done,
    so `env.max_turns` ends the episode. Its stop strings end a random model's turns within a few tokens."""

    stop = (" ", "e")

    def step(self, text):
        return [{"role": "user", "content": "Go on."}], 0.25, False


class Flaky(Chatty):
    """Raises on some turns and hangs on others, decided by the length of the turn's text."""

    def step(self, text):
        if len(text) % 3 == 0:
            raise RuntimeError("environment boom")
        if len(text) % 3 == 1:
            time.sleep(3)
        return super().step(text)


class Reframed(Chatty):
    """Replaces the dataset prompt by its own first message (rendered with the chat template)."""

    def reset(self, row, messages):
        return [{"role": "user", "content": f"Repeat: {row['question']}"}]
