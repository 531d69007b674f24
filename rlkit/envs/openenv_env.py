"""`env.name=openenv:<url>`: an OpenEnv environment server (openenv-core 0.3) as an rlkit environment.

Each episode opens its own session with openenv-core's client (`GenericEnvClient`, the dictionary client:
no environment package to install; it talks to the server's `/ws` endpoint of the URL), in the episode's
worker process, on an asyncio loop of its own:

    reset(row)  -> client.reset(seed=row's task_index, **reset_kwargs): its observation, as a user message,
                   is the episode's first message (after `system_prompt`, if given)
    step(text)  -> client.step({action_key: text}): the observation as the next user message, the step's
                   reward (None counts as 0) and done

An observation is shown as its `observation_key` field, or, without one, as its only text field, else as
JSON (without `reward`, `done` and `metadata`). A server started from a Docker image (openenv's
`from_docker_image`) is not supported in this version: start the server (docker run, uvicorn) and give its URL.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import urllib.parse

from rlkit.envs.base import Environment

PREFIX = "openenv:"
INSTALL = 'pip install "rlkit[openenv]"'
SCHEMES = ("http://", "https://", "ws://", "wss://")
HIDDEN = ("reward", "done", "metadata")


def require():
    """openenv-core's dictionary client class, or an ImportError naming the extra to install."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as e:
        raise ImportError(f"env.name={PREFIX}...: openenv-core is not installed ({e}); {INSTALL}") from e
    return GenericEnvClient


def observation_text(observation, key: str | None) -> str:
    """What the model reads of an observation (see the module doc)."""
    if not isinstance(observation, dict):
        return str(observation)
    if key is not None:
        if key not in observation:
            raise KeyError(
                f"observation_key={key!r} is not a field of the observation: {sorted(observation)}"
            )
        return str(observation[key])
    shown = {k: v for k, v in observation.items() if k not in HIDDEN}
    texts = [v for v in shown.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(shown, sort_keys=True, default=str)


class OpenEnvEnv(Environment):
    """An rlkit environment over one OpenEnv server (`url`, set by `environment_class`)."""

    url: str = ""
    preload = ("openenv.core.generic_client",)

    def __init__(
        self, action_key: str = "message", observation_key: str | None = None, system_prompt: str | None = None,
        reset_kwargs: dict | None = None, num_tasks: int = 64, timeout_s: float = 30.0,
    ):  # fmt: skip
        """`action_key`: the action's field that carries the model's text; `observation_key`: the
        observation's field shown to the model (see the module doc); `system_prompt`: a system message
        before the first observation; `reset_kwargs`: more arguments of every reset; `num_tasks`: rows of
        `data.path=env` (reset seeds 0 .. num_tasks-1); `timeout_s`: the client's connect / message timeout."""
        require()
        self.action_key, self.observation_key = action_key, observation_key
        self.system_prompt, self.reset_kwargs = system_prompt, dict(reset_kwargs or {})
        self.timeout_s = timeout_s
        self._loop = None
        self._client = None

    @classmethod
    def rows(cls, num_tasks: int = 64, **_) -> list[dict]:
        """The dataset of `data.path=env`: one row per reset seed (`task_index`)."""
        return [
            {"question": f"{cls.url} seed {i}", "answer": str(i), "task_index": i} for i in range(num_tasks)
        ]

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def reset(self, row: dict, messages: list[dict]) -> list[dict]:
        client_cls = require()
        self._loop = asyncio.new_event_loop()
        self._client = client_cls(
            base_url=self.url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s
        )
        self._run(self._client.connect())
        kwargs = dict(self.reset_kwargs)
        if "task_index" in row:
            kwargs.setdefault("seed", row["task_index"])
        result = self._run(self._client.reset(**kwargs))
        first = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return first + [
            {"role": "user", "content": observation_text(result.observation, self.observation_key)}
        ]

    def step(self, text: str) -> tuple[list[dict] | None, float, bool]:
        result = self._run(self._client.step({self.action_key: text}))
        # As the server sent it: the step check applies rlkit's one rule (a string "0.5" is refused, not parsed).
        reward = 0.0 if result.reward is None else result.reward
        if result.done:
            self.close()
            return None, reward, True
        return (
            [{"role": "user", "content": observation_text(result.observation, self.observation_key)}],
            reward,
            False,
        )

    def close(self) -> None:
        if self._client is not None:
            try:
                self._run(self._client.close())
            finally:
                self._client = None
                self._loop.close()


def check_server(url: str, timeout_s: float) -> None:
    """At start-up: something accepts a connection at `url`'s host and port (no environment session is
    opened); raises ValueError naming the URL and why (a refused connection, an unknown host, a timeout)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
    except ValueError as e:
        raise ValueError(f"env.name={PREFIX}{url}: not a server URL ({e})") from None
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(
            f"env.name={PREFIX}{url}: no OpenEnv server answers at {url} ({type(e).__name__}: {e}); start the "
            "server (docker run, uvicorn) or fix the URL"
        ) from None


def environment_class(url: str) -> type:
    """The environment class of `env.name=openenv:<url>`."""
    if not url.startswith(SCHEMES):
        raise ValueError(
            f"env.name={PREFIX}{url}: not a server URL ({', '.join(SCHEMES)}); OpenEnv environments from a Docker "
            "image are not supported in this version: start the server (docker run -p 8000:8000 <image>, or "
            f"uvicorn) and set env.name={PREFIX}http://<host>:<port>"
        )
    if importlib.util.find_spec("openenv") is None:  # found without importing it
        raise ValueError(f"env.name={PREFIX}{url}: openenv-core is not installed; {INSTALL}")
    return type(f"OpenEnv[{url}]", (OpenEnvEnv,), {"url": url})
