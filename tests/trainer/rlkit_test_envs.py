"""Environments for the multi-turn tests (imported by path, also by launched subprocesses)."""

import os
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


HUGE = "x " * 500_000  # 1 MB of text


class Misbehaving(Chatty):
    """Fails the way `how` names (the row's column `how`, if any, wins), at reset or at its first step:
    `raise`, `content_none`, `content_int`, `element_not_dict`, `not_a_list`, `reset_none`,
    `reset_raise`, `huge_first` (a 1 MB first message), `huge_observation`, `spin` (a step that loops
    on the CPU), `sleep` (a step that sleeps for an hour), `exit` (os._exit in the step), `ok` (Chatty)."""

    def __init__(self, how: str = "ok"):
        self.how = how

    def reset(self, row, messages):
        self.how = row.get("how", self.how)
        if self.how == "reset_none":
            return None
        if self.how == "reset_raise":
            raise RuntimeError("reset boom")
        if self.how == "huge_first":
            return [{"role": "user", "content": HUGE}]
        return messages

    def step(self, text):
        bad = {
            "content_none": [{"role": "user", "content": None}],
            "content_int": [{"role": "user", "content": 7}],
            "element_not_dict": ["Go on."],
            "not_a_list": "Go on.",
            "huge_observation": [{"role": "user", "content": HUGE}],
        }
        if self.how in bad:
            return bad[self.how], 0.25, False
        if self.how == "raise":
            raise RuntimeError("step boom")
        if self.how == "spin":
            while True:
                pass
        if self.how == "sleep":
            time.sleep(3600)
        if self.how == "exit":
            os._exit(3)
        return super().step(text)


def _wait_for(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Gated(Chatty):
    """An episode whose start, once the test has armed it (a file `armed` in `flags`), waits until the learner
    has put its next push on the rollout worker's queue and begun the weight broadcast (a file `pushed`): the
    episode's first turn is then generated while that push waits, and the worker takes it between two engine
    steps. No stop strings, so each turn runs to rollout.max_new_tokens (one turn per episode). Unarmed, the
    start waits up to 5 s for the arming (the first batch is generated before the learner can arm it)."""

    stop = ()

    def __init__(self, flags: str):
        self.flags = flags

    def reset(self, row, messages):
        if _wait_for(os.path.join(self.flags, "armed"), 5.0):
            _wait_for(os.path.join(self.flags, "pushed"), 300.0)
        return messages


def _number(flags: str) -> int:
    """The next number of the run's episode starts: the first `reset_<n>` this call creates in `flags`
    (O_EXCL: each number goes to exactly one caller, whichever worker process it runs in)."""
    n = 0
    while True:
        try:
            os.close(os.open(os.path.join(flags, f"reset_{n}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            n += 1


class GatedFrom(Chatty):
    """Gated by episode number, with no timing involved: the episodes of the run are numbered in the order
    their starts run (files in `flags`; a batch's resets all end before the next batch's begin, so with B
    episodes a batch, batch k holds numbers kB .. kB + B - 1). Episode `first` and later wait at their start
    until the learner has put its next push on the rollout worker's queue and begun the weight broadcast (a
    file `pushed`); earlier ones start at once. No stop strings, as Gated (one full turn per episode)."""

    stop = ()

    def __init__(self, flags: str, first: int):
        self.flags, self.first = flags, int(first)

    def reset(self, row, messages):
        if _number(self.flags) >= self.first:
            _wait_for(os.path.join(self.flags, "pushed"), 300.0)
        return messages
