"""Episodes: token in, token out. The one rollout path, single-turn being its one-turn case.

An episode is one growing token sequence `prompt + response`. The response interleaves

- model turns: the exact token ids the engine sampled, with their log-probs (never decoded and
  re-encoded, so the stored log-probs always belong to the tokens that are trained on), and
- observations: the environment's messages, rendered with the tokenizer's chat template and tokenised
  once, as the text the template adds between the conversation without and with them (the close of
  the model's turn, the new messages, the next generation prompt).

`RolloutBatch.response_mask` is True on model tokens only: observation and template tokens are context
the learner sees (its attention mask covers the whole response) but never trains on, and
`rollout_logprobs` is set on every model token, so rollout IS, rollout-KL and the mismatch metrics
need no change. The G episodes of a row start from one engine call with n=G; every later turn of all
live episodes is one engine call with n=1 per episode.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlkit.batch import RolloutBatch, generation_stats
from rlkit.config.schema import ConfigError
from rlkit.envs import SingleTurn, make_env
from rlkit.rollout.engines.base import rows_to_batch

log = logging.getLogger(__name__)

_SENTINEL = "RLKIT_MODEL_TURN_SENTINEL"


@dataclass
class Episode:
    prompt: list[int]
    messages: list[dict]
    """The conversation so far (first messages, then model turns and observations)."""
    env: object
    position: int
    """Global episode index (seeds of later turns under rollout.seed_per_prompt)."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    finish: str = "stop"
    done: bool = False
    failed: str | None = None
    """"error" or "timeout" when an environment step failed (the episode's reward is then 0)."""


@dataclass(frozen=True)
class EpisodeBatch:
    """A batch of finished episodes: the RolloutBatch the learner trains on, plus per-episode facts."""

    rollout: RolloutBatch
    env_rewards: Tensor
    """[N] float32, sum of the environment's per-step rewards."""
    failed: Tensor
    """[N] bool, an environment step raised or timed out (the episode scores 0)."""
    stats: dict[str, Tensor]
    """[N] float32 per episode: `turns` (model turns), `tool_calls`, `failed` (1 when a step failed)."""
    errors: int
    """Environment steps that raised or timed out."""
    timeouts: int
    """Of those, the ones that timed out."""


def observation_ids(
    tokenizer, history: list[dict], observation: list[dict], sampled_eos: str | None
) -> list[int]:
    """Token ids to append after a model turn: the template's close of that turn, the observation
    messages and the next generation prompt, tokenised once.

    `history` is the conversation before the model turn; the turn itself is rendered as a sentinel,
    so what the template adds does not depend on how it would re-render the model's text.
    `sampled_eos`: the text of the EOS token the turn ended with, if any (already in the sequence).
    """
    conv = [*history, {"role": "assistant", "content": _SENTINEL}]
    without = tokenizer.apply_chat_template(conv, tokenize=False)
    with_obs = tokenizer.apply_chat_template(
        [*conv, *observation], tokenize=False, add_generation_prompt=True
    )
    if not with_obs.startswith(without):
        raise ValueError(
            "the tokenizer's chat template is not prefix-stable (adding a message re-renders earlier ones), "
            "so observations cannot be appended to the sampled tokens; use a template that only appends"
        )
    delta = without[without.rindex(_SENTINEL) + len(_SENTINEL) :] + with_obs[len(without) :]
    if sampled_eos and delta.startswith(sampled_eos):
        delta = delta[len(sampled_eos) :]
    return tokenizer(delta, add_special_tokens=False).input_ids


def check_multiturn_template(tokenizer, cfg, messages: list[dict]) -> None:
    """At start-up, before any model turn: an episode of several turns needs the chat template (to render
    observations) and a template that only appends (`observation_ids`); probe it on a training prompt."""

    where = f"env.name={cfg.env.name!r} with env.max_turns={cfg.env.max_turns}"
    if cfg.data.template != "chat":
        raise ConfigError(f"{where} renders observations with the chat template: set data.template='chat'")
    probe = [{"role": "user", "content": "<result>1</result>"}]
    try:
        observation_ids(tokenizer, messages or [{"role": "user", "content": "1 + 1?"}], probe, None)
    except Exception as e:
        raise ConfigError(
            f"{where}: the chat template of model.path={cfg.model.path!r} cannot append an observation to a "
            f"sampled turn ({e}); use a model whose template only appends, or env.max_turns=1"
        ) from e


def _check_step(out) -> tuple[list[dict] | None, float, bool]:
    obs, reward, done = out
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"non-finite reward {reward}")
    if obs is not None and not isinstance(obs, list):
        raise TypeError(f"observation must be a list of messages or None, got {type(obs).__name__}")
    return obs, reward, bool(done)


def step_all(envs: list, texts: list[str], timeout_s: float) -> list[tuple[str, object]]:
    """env.step(text) for every pair, concurrently, each within `timeout_s` of the start.

    Returns ("ok", (obs, reward, done)), ("error", message) or ("timeout", None) per pair. A hung
    step's thread cannot be killed in Python: it is abandoned (a daemon thread) and its episode ends.
    """
    results: list = [None] * len(envs)

    def work(k):
        try:
            results[k] = ("ok", _check_step(envs[k].step(texts[k])))
        except BaseException as e:  # an environment must never take the run down
            results[k] = ("error", f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(len(envs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [r if r is not None else ("timeout", None) for r in results]


def _single_turn(rb: RolloutBatch, rooms: list[int]) -> EpisodeBatch | None:
    """The one-turn episodes of the default environment: the engine's batch as it is (tensors kept, no
    environment step, no thread); None when a response must be cut to its room (the general path does it)."""
    if bool((rb.response_lengths > torch.tensor(rooms)).any()):
        return None
    n = rb.num_samples
    zeros = torch.zeros(n, dtype=torch.float32)
    return EpisodeBatch(
        rollout=rb,
        env_rewards=zeros,
        failed=torch.zeros(n, dtype=torch.bool),
        stats={"turns": torch.ones(n), "tool_calls": zeros.clone(), "failed": zeros.clone()},
        errors=0,
        timeouts=0,
    )


def _start(prompts, messages, rows, n, env_name, env_kwargs, tokenizer, first_position) -> list[Episode]:
    """n episodes per prompt, each with its own environment, reset from the prompt's dataset row."""
    episodes: list[Episode] = []
    for i, (ids, msgs, row) in enumerate(zip(prompts, messages, rows)):
        envs = [make_env(env_name, env_kwargs) for _ in range(n)]
        # Every episode's env is reset (it may keep state from the row); the G episodes of a row share
        # one first prompt, so reset must be a function of the row.
        firsts = [env.reset(row, msgs) for env in envs]
        if firsts[0] != msgs:
            ids = tokenizer.apply_chat_template(firsts[0], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(ids, add_special_tokens=False).input_ids
        for j, env in enumerate(envs):
            episodes.append(Episode(list(ids), list(firsts[0]), env, (first_position + i) * n + j))
    return episodes


def _take_turn(live: list[Episode], rb: RolloutBatch, room, tokenizer) -> list[Episode]:
    """Append each live episode's sampled turn (cut to its room); returns the episodes whose environment
    steps next (a turn cut by the token budget ends its episode without a step)."""
    lengths = rb.response_lengths.tolist()
    stepping = []
    for k, e in enumerate(live):
        toks = rb.response_ids[k, : lengths[k]].tolist()
        lps = rb.rollout_logprobs[k, : lengths[k]].tolist()
        finish, limit = rb.finish_reasons[k], room(e)
        if len(toks) > limit:  # the shared call's cap is the largest room; this episode has less
            toks, lps, finish = toks[:limit], lps[:limit], "length"
        e.ids += toks
        e.logprobs += lps
        e.model += [True] * len(toks)
        text = (
            rb.response_texts[k]
            if len(toks) == lengths[k]
            else tokenizer.decode(toks, skip_special_tokens=True)
        )
        e.texts.append(text)
        e.turns += 1
        e.finish = finish
        if finish == "length":
            e.done = True
        else:
            stepping.append(e)
    return stepping


def _observe(e: Episode, out, *, max_turns: int, room, tokenizer, eos_ids: set[int]) -> None:
    """Apply one successful environment step: its reward, and its observation appended as context tokens."""
    obs, reward, done = out
    e.reward += reward
    history = list(e.messages)
    e.messages += [{"role": "assistant", "content": e.texts[-1]}, *(obs or [])]
    if done or e.turns >= max_turns:
        e.done = True
        return
    eos = tokenizer.decode([e.ids[-1]]) if e.ids and e.ids[-1] in eos_ids else None
    extra = observation_ids(tokenizer, history, obs or [], eos)
    if len(extra) >= room(e):  # no room for the observation and one more model token
        e.done, e.finish = True, "length"
        return
    e.ids += extra
    e.logprobs += [0.0] * len(extra)
    e.model += [False] * len(extra)


def _finish(episodes: list[Episode], n: int, pad_id: int, gen_seconds: float, errors: int, timeouts: int):
    """The finished episodes as an EpisodeBatch (observation tokens out of the response mask)."""
    batch = rows_to_batch(
        [e.prompt for e in episodes],
        [(e.ids, e.logprobs, e.finish) for e in episodes],
        [e.texts[-1] for e in episodes],
        n,
        pad_id,
    )
    model_mask = torch.zeros_like(batch.response_mask)
    for r, e in enumerate(episodes):
        model_mask[r, : len(e.model)] = torch.tensor(e.model, dtype=torch.bool)
    stats = generation_stats(batch.prompt_mask, batch.response_mask, model_mask, gen_seconds)
    return EpisodeBatch(
        rollout=dataclasses.replace(batch, response_mask=model_mask, stats=stats),
        env_rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        failed=torch.tensor([e.failed is not None for e in episodes], dtype=torch.bool),
        stats={
            "turns": torch.tensor([float(e.turns) for e in episodes]),
            "tool_calls": torch.tensor([float(getattr(e.env, "tool_calls", 0)) for e in episodes]),
            "failed": torch.tensor([float(e.failed is not None) for e in episodes]),
        },
        errors=errors,
        timeouts=timeouts,
    )


def run_episodes(
    generate: Callable,
    tokenizer,
    prompts: list[list[int]],
    messages: list[list[dict]],
    rows: list[dict],
    n: int,
    sampling,
    *,
    env_name: str,
    env_kwargs: dict,
    max_turns: int,
    max_total_tokens: int,
    timeout_s: float,
    eos_ids: set[int],
    pad_id: int,
    context: int | None = None,
    first_position: int = 0,
) -> EpisodeBatch:
    """Run n episodes per prompt to the end; episodes of prompt i are rows i*n ... i*n+n-1.

    `generate(prompts, n, sampling, turn, positions) -> RolloutBatch` samples one turn (the caller
    seeds it); `positions` are the global indices of the episodes (turns after the first).
    """
    episodes = _start(prompts, messages, rows, n, env_name, env_kwargs, tokenizer, first_position)
    stop = tuple(sampling.stop) + tuple(
        s for s in getattr(episodes[0].env, "stop", ()) if s not in sampling.stop
    )

    def room(e: Episode) -> int:
        left = max_total_tokens - len(e.ids)
        if context is not None:
            left = min(left, context - len(e.prompt) - len(e.ids))
        return left

    errors = timeouts = 0
    gen_seconds = 0.0
    live = episodes
    for turn in range(max_turns):
        s = dataclasses.replace(
            sampling, max_new_tokens=min(sampling.max_new_tokens, max(map(room, live))), stop=stop
        )
        if turn == 0:
            rb = generate([episodes[i * n].prompt for i in range(len(prompts))], n, s, 0, None)
            if type(episodes[0].env) is SingleTurn and (
                single := _single_turn(rb, [room(e) for e in episodes])
            ):
                return single
        else:
            rb = generate([e.prompt + e.ids for e in live], 1, s, turn, [e.position for e in live])
        gen_seconds += rb.stats.get("gen_seconds", 0.0)
        stepping = _take_turn(live, rb, room, tokenizer)
        results = step_all([e.env for e in stepping], [e.texts[-1] for e in stepping], timeout_s)
        for e, (status, out) in zip(stepping, results):
            if status == "ok":
                _observe(e, out, max_turns=max_turns, room=room, tokenizer=tokenizer, eos_ids=eos_ids)
                continue
            e.failed, e.done = status, True
            errors += 1
            timeouts += status == "timeout"
            log.warning("environment %s step %s on episode %d: %s", env_name, status, e.position, out)
        live = [e for e in episodes if not e.done]
        if not live:
            break
    return _finish(episodes, n, pad_id, gen_seconds, errors, timeouts)
