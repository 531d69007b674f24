"""`env.name=verifiers:<taskset id>`: a verifiers (0.4, `verifiers.v1`) environment driven by rlkit's episodes.

verifiers resolves an environment from a taskset id the way `vf.load_environment` does (an installed
module exporting a `Taskset` subclass, and maybe an `Env` subclass, through `__all__`). Its own runs send
every model call over HTTP to an OpenAI-style server (a harness program behind an interception proxy);
rlkit instead plays the model's seat itself, in the environment's worker process:

- the environment's `run(task, agents)` coroutine runs on an asyncio loop in the worker; every model call
  it makes (`agents.<seat>.run(task)` for a plain taskset, `interaction.turn(...)` for a multi-turn
  environment such as verifiers' TextArena one) pauses it, and the messages it wants answered become the
  episode's first messages (`reset`) or an observation (`step`);
- `step(text)` answers the pending call with the model's turn, as decoded from the engine's sampled
  tokens (the tokens and their log-probs stay the engine's: rlkit.rollout.episodes never re-tokenises a
  model turn), then runs the coroutine on to its next model call or to its end;
- at the end the trace is scored by the task's own `@vf.reward` functions (`Task.score`, then the
  environment's `finalize`), and the episode's reward is the traces' weighted sum (`Trace.reward`),
  returned by the last step, where rlkit's step check (a finite float) applies.

Tools: a task's toolsets (`Task.toolsets`, `Taskset.toolsets`) are built in process, their `@vf.tool`
methods listed in the system message, and a model turn that writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` gets each call's result back as a message of
role `tool_role`. Not supported: harness programs and runtimes (sandboxes, Docker, Prime), MCP servers in
their own processes, judges that call a model, `@vf.stop` predicates over a request or response
(the ones over the trace are honoured), environments that play several seats at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import inspect
import json
import re

from rlkit.envs.base import Environment

PREFIX = "verifiers:"
INSTALL = 'pip install "rlkit[verifiers]"'
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PRELOAD = ("verifiers.v1", "verifiers.v1.tasksets", "verifiers.v1.envs.isolated_verifier")
"""What building a verifiers Env imports (17 s under load), imported once by the workers' fork server."""


def require():
    """verifiers.v1, or an ImportError naming the extra to install."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(
            f"env.name={PREFIX}...: the verifiers library is not installed ({e}); {INSTALL}"
        ) from e
    return vf


@functools.cache
def _environment(taskset_id: str, taskset_json: str):
    """The verifiers Env of the taskset, built once per process (as `vf.load_environment` builds it)."""
    vf = require()
    config = vf.resolve_env_config({"taskset": {"id": taskset_id, **json.loads(taskset_json)}})
    return vf.load_environment(config)


def _tasks(taskset_id: str, taskset_json: str, num_tasks: int | None) -> list:
    """The taskset's tasks, in its order (the first `num_tasks`; an infinite taskset needs the bound)."""
    taskset = _environment(taskset_id, taskset_json).taskset
    if num_tasks is not None:
        taskset = taskset.take(num_tasks)
    elif not taskset.bounded:
        raise ValueError(
            f"taskset {taskset_id!r} is infinite: bound it with env.kwargs.num_tasks=<number of tasks>"
        )
    return list(taskset)


def _task(env, wire: str):
    """A task rebuilt from its data (the row's `vf_task`, JSON), as verifiers rebuilds a task from a trace:
    `TaskClass(data, taskset config's task config)`; a worker never loads the whole taskset."""
    task_cls = type(env.taskset).task_type()
    return task_cls(task_cls.data_type().model_validate_json(wire), env.taskset.config.task)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(getattr(part, "text", "") for part in content or [] if getattr(part, "text", None))


def first_messages(data) -> list[dict]:
    """A task's opening messages as chat dicts: its system prompt, then its prompt (text or messages)."""
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        out += [{"role": m.role, "content": _text(m.content)} for m in data.prompt or []]
    return out


def tool_calls(text: str) -> list[tuple[str, dict]]:
    """The `(name, arguments)` of each `<tool_call>{json}</tool_call>` of a model turn; a call that is not
    an object with a string `name` is returned as `("", {"error": why})`."""
    calls = []
    for body in re.findall(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), text, flags=re.S):
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
        except Exception as e:
            calls.append(("", {"error": f"malformed tool call ({type(e).__name__}: {e})"}))
        else:
            calls.append((name, args))
    return calls


class _TurnLimit(Exception):
    """The seat's turn limit (`max_turns`) is reached: the run is stopped, then scored."""


class _Driver:
    """Runs a verifiers Env's `run(task, agents)` coroutine, pausing at each model call (see the module doc)."""

    def __init__(self, vf_env, task, *, max_turns: int | None, tool_role: str):
        vf = require()
        self.vf, self.env, self.task = vf, vf_env, task
        self.max_turns, self.tool_role = max_turns, tool_role
        self.loop = asyncio.new_event_loop()
        self.traces: list = []
        self.turns = 0
        self.tool_calls = 0
        self.asking: list[dict] | None = None  # the messages of the pending model call
        self._answer: asyncio.Future | None = None
        self._asked = asyncio.Event()
        self._main = self.loop.create_task(self._episode())

    # -- the rlkit side --------------------------------------------------------------------------

    def advance(self, answer: str | None = None) -> list[dict] | None:
        """Answer the pending model call (if any) and run on: the next call's messages, or None at the end."""
        if answer is not None:
            self._answer.set_result(answer)
        self.asking = None
        self._asked.clear()
        self.loop.run_until_complete(self._until_asked())
        if self._main.done():
            self._main.result()  # the run's exception, if any, fails the episode
            return None
        return self.asking

    async def _until_asked(self):
        waiter = asyncio.ensure_future(self._asked.wait())
        await asyncio.wait({self._main, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()

    def reward(self) -> float:
        return float(sum(t.reward for t in self.traces))

    def close(self) -> None:
        if not self._main.done():
            self._main.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(self._main)
        self.loop.close()

    # -- the verifiers side ----------------------------------------------------------------------

    async def _episode(self):
        vf = self.vf
        # The env's own agents, made by rlkit (one seat object per AgentConfig field of its config).
        agents = vf.Agents(self.env.config, lambda name, spec: _Seat(self, name, spec))
        await self.env.setup(agents)
        await self.env.run(self.task, agents)
        if not self.traces:
            raise ValueError(f"{type(self.env).__name__}.run() ran no agent")
        episode = vf.Episode(
            env=vf.EnvInfo(id=self.env.config.env_id),
            task=vf.TraceTask(type=type(self.task).__name__, data=self.task.data, key=self.task.key),
            traces=self.traces,
        )
        await self.env.finalize(self.task, episode)
        self.traces = list(episode.traces)

    async def model(self, messages: list[dict]) -> str:
        """One model call: pause until rlkit answers with the model's turn."""
        if self.max_turns is not None and self.turns >= self.max_turns:
            raise _TurnLimit
        self._answer = self.loop.create_future()
        self.asking = messages
        self._asked.set()
        text = await self._answer
        self.turns += 1
        return text


class _Seat:
    """One agent seat of the environment, played by the policy: `run(task)` and `interaction(task)`."""

    def __init__(self, driver: _Driver, name: str, spec):
        self.driver, self.name, self.spec = driver, name, spec

    def _trace(self, task):
        vf = self.driver.vf
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=self.spec, name=self.name),
        )
        self.driver.traces.append(trace)
        return trace

    def _add(self, trace, message: dict, *, sampled: bool = False) -> None:
        vf = self.driver.vf
        role = message["role"]
        if role == "assistant":
            msg = vf.AssistantMessage(content=message["content"])
        elif role == "system":
            msg = vf.SystemMessage(content=message["content"])
        elif role == "tool":
            msg = vf.ToolMessage(content=message["content"], tool_call_id=message.get("id", ""))
        else:
            msg = vf.UserMessage(content=message["content"])
        parent = len(trace.nodes) - 1 if trace.nodes else None
        trace.nodes.append(vf.MessageNode(parent=parent, message=msg, sampled=sampled))

    async def _turn(self, task, trace, messages: list[dict]) -> str | None:
        """Show `messages`, take the model's reply (None when a turn limit or a @vf.stop ended the run)."""
        for m in messages:
            self._add(trace, m)
        if self._stopped(task, trace):
            return None
        try:
            text = await self.driver.model(messages)
        except _TurnLimit:
            trace.stop("max_turns")
            return None
        self._add(trace, {"role": "assistant", "content": text}, sampled=True)
        return text

    def _stopped(self, task, trace) -> bool:
        """Whether a @vf.stop predicate of the task says the trace is over (predicates over the trace)."""
        from verifiers.v1.utils.decorators import invoke

        if not trace.num_turns:
            return False
        for fn in task.hooks("stop"):
            if invoke(fn, {"task": task.data, "trace": trace, type(trace): trace}):
                trace.stop(fn.__name__)
                return True
        return False

    async def _score(self, task, trace) -> None:
        trace.is_completed = trace.ok = True
        await task.score(trace)

    async def run(self, task):
        """The plain chat loop of a taskset: the prompt, then model turns, each answered by its tool calls'
        results, until a turn calls no tool (or a limit or @vf.stop ends it); then the task's scoring."""
        trace = self._trace(task)
        async with _tools(self.driver, task) as tools:
            messages = first_messages(task.data)
            if tools:
                messages = _with_tool_list(messages, tools)
            while (text := await self._turn(task, trace, messages)) is not None:
                calls = tool_calls(text) if tools else []
                if not calls:
                    break
                messages = [await self._call(tools, name, args) for name, args in calls]
        await self._score(task, trace)
        return trace

    async def _call(self, tools: dict, name: str, args: dict) -> dict:
        self.driver.tool_calls += 1
        if not name:
            result = args["error"]
        elif name not in tools:
            result = f"error: no tool {name!r} (tools: {sorted(tools)})"
        else:
            try:
                result = tools[name](**args)
                if inspect.isawaitable(result):
                    result = await result
            except Exception as e:  # the model's mistake, shown to it
                result = f"error: {type(e).__name__}: {e}"
        return {"role": self.driver.tool_role, "content": str(result)}

    @contextlib.asynccontextmanager
    async def interaction(self, task):
        """A turn-by-turn exchange (`await interaction.turn(message)`), scored when the block ends."""
        exchange = _Interaction(self, task, self._trace(task))
        try:
            yield exchange
        finally:
            await self._score(task, exchange.trace)


class _Interaction:
    """The env's side of a turn-by-turn exchange: `turn(message)` shows it and returns the model's reply."""

    def __init__(self, seat: _Seat, task, trace):
        self.seat, self.task, self.trace = seat, task, trace
        self._started = False
        self._over = False

    async def turn(self, message=None):
        vf = self.seat.driver.vf
        if self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        if not self._started:
            messages = first_messages(self.task.data) if self.task.data.prompt is not None else []
        else:
            messages = []
        self._started = True
        if isinstance(message, str):
            messages.append({"role": "user", "content": message})
        elif message is not None:
            messages += [
                m if isinstance(m, dict) else {"role": m.role, "content": _text(m.content)} for m in message
            ]
        text = await self.seat._turn(self.task, self.trace, messages)
        if text is None:
            self._over = True
            return vf.Segment(messages=[], terminated=True)
        return vf.Segment(messages=[vf.AssistantMessage(content=text)])


@contextlib.asynccontextmanager
async def _tools(driver: _Driver, task):
    """The task's and the taskset's toolsets built in process: {tool name: callable}."""
    from verifiers.v1.utils.decorators import discover_decorated

    sets = list(type(task).toolsets(task.config)) + list(
        driver.env.taskset.toolsets(driver.env.taskset.config)
    )
    tools = {}
    for toolset in sets:
        await toolset.setup()
        await toolset.setup_task(task)
        prefix = toolset.server_name
        for fn in discover_decorated(toolset, "tool"):
            name = getattr(fn, "tool_name", None) or fn.__name__
            tools[f"{prefix}_{name}" if prefix else name] = fn
    yield tools


def _with_tool_list(messages: list[dict], tools: dict) -> list[dict]:
    """The messages with the tools described in the system message (Hermes-style tool-call format)."""
    listed = []
    for name, fn in tools.items():
        params = {
            p.name: getattr(p.annotation, "__name__", str(p.annotation))
            for p in inspect.signature(fn).parameters.values()
        }
        listed.append(
            json.dumps({"name": name, "description": (fn.__doc__ or "").strip(), "parameters": params})
        )
    text = (
        "You may call these tools, one JSON object per call: "
        f'{TOOL_OPEN}{{"name": <tool name>, "arguments": {{...}}}}{TOOL_CLOSE}\n<tools>\n'
        + "\n".join(listed)
        + "\n</tools>"
    )
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class VerifiersEnv(Environment):
    """An rlkit environment over one verifiers taskset (`taskset_id`, set by `environment_class`)."""

    taskset_id: str = ""
    stop = (TOOL_CLOSE,)
    preload = PRELOAD

    def __init__(
        self, taskset: dict | None = None, num_tasks: int | None = None, max_turns: int | None = None,
        tool_role: str = "tool",
    ):  # fmt: skip
        """`taskset`: fields of the taskset's verifiers config (`TasksetConfig`, e.g. `system_prompt`);
        `num_tasks`: use the first this many tasks (required for an infinite taskset); `max_turns`: the
        seat's own turn limit, after which the run is stopped and scored (set it to env.max_turns: an
        episode that rlkit cuts first is never scored and gets reward 0); `tool_role`: the chat role of tool
        results (the chat template must know it)."""
        self.taskset_json = json.dumps(dict(taskset or {}), sort_keys=True)
        self.num_tasks, self.max_turns, self.tool_role = num_tasks, max_turns, tool_role
        _environment(self.taskset_id, self.taskset_json)  # fail at construction on a bad id or config
        self._driver: _Driver | None = None
        self.tool_calls = 0

    @classmethod
    def rows(cls, taskset: dict | None = None, num_tasks: int | None = None, **_) -> list[dict]:
        """The dataset rows of the taskset (data.path=env): `question` (the prompt's text), `answer` (the
        task's `answer` field, else its key: rlkit's reward functions are not needed) and `vf_task` (the
        task's data as JSON, from which the worker rebuilds the task)."""
        tasks = _tasks(cls.taskset_id, json.dumps(dict(taskset or {}), sort_keys=True), num_tasks)
        return [
            {
                "question": t.data.prompt_text or t.key,
                "answer": str(getattr(t.data, "answer", None) or t.key),
                "vf_task": t.data.model_dump_json(),
            }
            for t in tasks
        ]

    def reset(self, row: dict, messages: list[dict]) -> list[dict]:
        if "vf_task" not in row:
            raise KeyError("the row has no vf_task column: train a verifiers environment with data.path=env")
        env = _environment(self.taskset_id, self.taskset_json)
        task = _task(env, row["vf_task"])
        self._driver = _Driver(env, task, max_turns=self.max_turns, tool_role=self.tool_role)
        first = self._driver.advance()
        if first is None:
            raise ValueError("the environment's run ended before the model's first turn")
        return first

    def step(self, text: str) -> tuple[list[dict] | None, float, bool]:
        asking = self._driver.advance(text)
        self.tool_calls = self._driver.tool_calls
        if asking is None:
            reward = self._driver.reward()
            self._driver.close()
            return None, reward, True
        return asking, 0.0, False


def environment_class(taskset_id: str) -> type:
    """The environment class of `env.name=verifiers:<taskset_id>`."""
    if not taskset_id:
        raise ValueError(f"env.name={PREFIX}<taskset id>: the taskset id is missing")
    if importlib.util.find_spec("verifiers") is None:  # found without importing it (10-17 s)
        raise ValueError(f"env.name={PREFIX}{taskset_id}: the verifiers library is not installed; {INSTALL}")
    # The taskset's module, named as verifiers names an installed environment (`owner/name@version` -> name).
    module = taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    attrs = {"taskset_id": taskset_id, "preload": (*PRELOAD, module)}
    return type(f"Verifiers[{taskset_id}]", (VerifiersEnv,), attrs)
