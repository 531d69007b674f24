"""A tiny OpenEnv environment server for the OpenEnv tests, written with openenv-core's server API and served
with uvicorn (`python -m uvicorn rlkit_test_openenv_server:app --port N`).

Each session: reset(seed) shows "Reply to seed <seed>."; every step rewards the reply's length modulo 3
(`reward_of`) and answers "Again."; the episode is done after `STEPS` steps.
"""

from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

STEPS = 2


def reward_of(message: str) -> float:
    return float(len(message) % 3)


class ReplyAction(Action):
    message: str


class ReplyObservation(Observation):
    prompt: str


class ReplyEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return ReplyObservation(prompt=f"Reply to seed {seed}.", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        done = self._state.step_count >= STEPS
        return ReplyObservation(prompt="Again.", done=done, reward=reward_of(action.message))

    @property
    def state(self):
        return self._state


app = create_app(ReplyEnvironment, ReplyAction, ReplyObservation, env_name="reply", max_concurrent_envs=64)
