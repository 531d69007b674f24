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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlkit.batch import NO_VERSION, Images, RolloutBatch, generation_stats
from rlkit.config.schema import ConfigError
from rlkit.data.prompts import max_chars, max_token_chars
from rlkit.envs import SingleTurn, resolve_env
from rlkit.envs.images import PictureRule
from rlkit.envs.workers import DEFAULT_LIMITS, EnvWorkers, Limits, LocalEnvs, Oversized
from rlkit.rollout.engines.base import rows_to_batch
from rlkit.rollout.observations import observation_tokens

log = logging.getLogger(__name__)


@dataclass
class Episode:
    prompt: list[int]
    messages: list[dict]
    """The conversation so far (first messages, then model turns and observations)."""
    env: int
    """The environment's id in its runner (EnvWorkers / LocalEnvs)."""
    position: int
    """Global episode index (seeds of later turns under rollout.seed_per_prompt)."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version of each token (NO_VERSION at observation tokens)."""
    model: list[bool] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    finish: str = "stop"
    done: bool = False
    failed: str | None = None
    """"error" or "timeout" when an environment call failed (the episode's reward is then 0)."""
    why: str = ""
    """The failure's reason (logged once per batch and reason)."""
    images: Images | None = None
    """The first prompt's images (rlkit.batch.Images), joined by the pictures its environment shows
    (rlkit/rollout/observations.py): they stay with the episode through its turns."""


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
    first_failure: str = ""
    """The reason of the first failed episode ("" when none failed)."""


def observation_ids(
    tokenizer, history: list[dict], observation: list[dict], sampled_eos: str | None
) -> list[int]:
    """Token ids to append after a model turn: the template's close of that turn, the observation
    messages and the next generation prompt, tokenised once (rlkit.rollout.observations.observation_text).
    `sampled_eos`: the text of the EOS token the turn ended with, if any (already in the sequence).
    """
    return observation_tokens(tokenizer, history, observation, sampled_eos)[0]


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


def _fail(e: Episode, status: str, why: str) -> None:
    """End episode `e` with reward 0 (counted in env/errors, and env/timeouts for "timeout")."""
    e.failed, e.done, e.reward, e.why = status, True, 0.0, why


def _log_failures(episodes: list[Episode], env_name: str) -> None:
    """One warning per distinct reason of the batch's failed episodes, with how many and which."""
    by_reason: dict[tuple[str, str], list[int]] = {}
    for e in episodes:
        if e.failed is not None:
            by_reason.setdefault((e.failed, e.why), []).append(e.position)
    for (status, why), positions in by_reason.items():
        shown = ", ".join(map(str, positions[:8])) + (", ..." if len(positions) > 8 else "")
        log.warning(
            "environment %s: %d episode(s) (%s) end with reward 0, %s: %s",
            env_name, len(positions), shown, status, why,
        )  # fmt: skip


def _first_prompt(tokenizer, first: list[dict], context: int | None) -> tuple[list[int] | None, str | None]:
    """(token ids of reset's first messages as the prompt, None), or (None, why they cannot be one): the chat
    template cannot render them, or they leave no room in the context. Messages longer in characters than the
    context could hold (`max_chars`, as observations in `_turns`) are refused without being tokenized (a 1 MB
    first message took ~0.5 s a row to tokenize)."""
    try:
        text = tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    except Exception as ex:
        return None, f"the chat template cannot render reset's first messages ({type(ex).__name__}: {ex})"
    if context is None:
        return tokenizer(text, add_special_tokens=False).input_ids, None
    if (limit := max_chars(tokenizer, context)) is not None and len(text) > limit:
        return None, (
            f"reset's first messages take {len(text)} characters, more than the model's context of {context} "
            "tokens could hold (refused before tokenizing)"
        )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) >= context:
        return None, f"reset's first messages take {len(ids)} tokens, the model's context {context}"
    return ids, None


def _start(runner, prompts, messages, rows, n, tokenizer, *, context, first_position, images=None):
    """n episodes per prompt, each with its own environment (built and reset by `runner` from the prompt's
    dataset row). Returns the episodes and the environment's stop strings. An episode whose environment
    cannot be built or reset, or whose first messages leave no room in the context, has failed already
    (it keeps the dataset's prompt and gets no model turn: `_first_prompt`)."""
    made = runner.call("make", {k: () for k in range(len(prompts) * n)})
    stop = next((v for status, v in made.values() if status == "ok"), ())
    resets = runner.call(
        "reset", {k: (rows[k // n], messages[k // n]) for k, (status, _) in made.items() if status == "ok"}
    )
    episodes: list[Episode] = []
    for i, (ids, msgs) in enumerate(zip(prompts, messages)):
        # The G episodes of a row share one first prompt (one engine call with n=G), so reset must be a
        # function of the row: the first successful reset of the row gives it.
        outs = [resets.get(i * n + j, made[i * n + j]) for j in range(n)]
        first = next((v for status, v in outs if status == "ok"), msgs)
        problem = None
        if first != msgs:
            new_ids, problem = _first_prompt(tokenizer, first, context)
            ids = ids if new_ids is None else new_ids
        for j, (status, out) in enumerate(outs):
            k = i * n + j
            e = Episode(list(ids), list(first), k, (first_position + i) * n + j)
            e.images = images[i] if images is not None else None
            if e.images is not None and first != msgs and not problem:
                problem = "an environment's first messages replace a prompt with images: not supported"
            if status != "ok" or problem:
                e.messages = list(msgs)
                _fail(e, status if status != "ok" else "error", out if status != "ok" else problem)
            episodes.append(e)
    return episodes, stop


def _take_turn(live: list[Episode], rb: RolloutBatch, room, tokenizer) -> list[Episode]:
    """Append each live episode's sampled turn (cut to its room); returns the episodes whose environment
    steps next (a turn cut by the token budget ends its episode without a step). Row k of `rb` is
    `live[k]`'s turn; an episode already done (failed at its start) ignores its row."""
    lengths = rb.response_lengths.tolist()
    stepping = []
    for k, e in enumerate(live):
        if e.done:
            continue
        toks = rb.response_ids[k, : lengths[k]].tolist()
        lps = rb.rollout_logprobs[k, : lengths[k]].tolist()
        vers = (
            rb.token_versions[k, : lengths[k]].tolist()
            if rb.token_versions is not None
            else [NO_VERSION] * lengths[k]
        )
        finish, limit = rb.finish_reasons[k], room(e)
        if len(toks) > limit:  # the shared call's cap is the largest room; this episode has less
            toks, lps, vers, finish = toks[:limit], lps[:limit], vers[:limit], "length"
        e.ids += toks
        e.logprobs += lps
        e.versions += vers
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


def _observe(e: Episode, out, *, max_turns: int, room, tokenizer, eos_ids, processor=None) -> None:
    """Apply one successful environment step: its reward, and its observation appended as context tokens.
    An observation the chat template cannot render, or longer than the episode's whole token budget (it
    could never fit, however short the model's turns), fails the episode; one that only overflows the room
    left ends it with finish reason `length` (the budget ran out: not the environment's fault). An
    observation the worker refused by its length in characters (`Oversized`, see `_turns`) fails it too,
    never tokenized. Pictures in the observation (rlkit.envs.images) are expanded by `processor` and join the
    episode's `Images`; their image tokens count in the budget as text does."""
    obs, reward, done = out
    e.reward += reward
    history = list(e.messages)
    oversized = obs if isinstance(obs, Oversized) else None
    e.messages += [{"role": "assistant", "content": e.texts[-1]}, *(obs if obs and not oversized else [])]
    if done or e.turns >= max_turns:
        e.done = True
        return
    if oversized is not None:
        budget = room(e) + len(e.ids)
        _fail(e, "error", f"an observation of {oversized.chars} characters is longer than the episode's budget "
                          f"of {budget} tokens could hold (refused before tokenizing)")  # fmt: skip
        return
    eos = tokenizer.decode([e.ids[-1]]) if e.ids and e.ids[-1] in eos_ids else None
    try:
        extra, images = observation_tokens(
            tokenizer, history, obs or [], eos, processor=processor, images=e.images
        )
    except Exception as ex:
        what = "the observation" if images_of(obs) == 0 else f"the observation's {images_of(obs)} picture(s)"
        _fail(e, "error", f"turn {e.turns}: the chat template or processor cannot render {what} "
                          f"({type(ex).__name__}: {ex})")  # fmt: skip
        return
    budget = room(e) + len(e.ids)  # env.max_total_tokens, or less when the context is shorter
    if len(extra) >= budget:
        _fail(
            e,
            "error",
            f"an observation of {len(extra)} tokens is longer than the episode's budget of {budget}",
        )
        return
    if len(extra) >= room(e):  # no room for the observation and one more model token
        e.done, e.finish = True, "length"
        return
    e.images = images
    e.ids += extra
    e.logprobs += [0.0] * len(extra)
    e.versions += [NO_VERSION] * len(extra)
    e.model += [False] * len(extra)


def images_of(messages) -> int:
    """The number of image parts of `messages` (0 for None)."""
    return sum(
        p["type"] == "image"
        for m in messages or []
        if not isinstance(m["content"], str)
        for p in m["content"]
    )


def _finish(episodes: list[Episode], n: int, pad_id: int, gen_seconds: float, tool_calls: list[int]):
    """The finished episodes as an EpisodeBatch (observation tokens out of the response mask)."""
    batch = rows_to_batch(
        [e.prompt for e in episodes],
        [(e.ids, e.logprobs, e.finish) for e in episodes],
        [e.texts[-1] if e.texts else "" for e in episodes],
        n,
        pad_id,
        [e.versions for e in episodes],
    )
    model_mask = torch.zeros_like(batch.response_mask)
    for r, e in enumerate(episodes):
        model_mask[r, : len(e.model)] = torch.tensor(e.model, dtype=torch.bool)
    stats = generation_stats(batch.prompt_mask, batch.response_mask, model_mask, gen_seconds)
    pics = _images([e.images for e in episodes])
    return EpisodeBatch(
        rollout=dataclasses.replace(batch, response_mask=model_mask, stats=stats, **pics),
        env_rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        failed=torch.tensor([e.failed is not None for e in episodes], dtype=torch.bool),
        stats={
            "turns": torch.tensor([float(e.turns) for e in episodes]),
            "tool_calls": torch.tensor([float(tool_calls[e.env]) for e in episodes]),
            "failed": torch.tensor([float(e.failed is not None) for e in episodes]),
        },
        errors=sum(e.failed is not None for e in episodes),
        timeouts=sum(e.failed == "timeout" for e in episodes),
        first_failure=next((e.why for e in episodes if e.failed is not None), ""),
    )


def _images(pics: list) -> dict:
    """{"images": tuple} when any episode has images, else {} (a text-only call stays as it was)."""
    return {"images": tuple(pics)} if any(x is not None for x in pics) else {}


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
    limits: Limits = DEFAULT_LIMITS,
    images: list | None = None,
    processor=None,
    pictures: PictureRule | None = None,
) -> EpisodeBatch:
    """Run n episodes per prompt to the end; episodes of prompt i are rows i*n ... i*n+n-1.

    `generate(prompts, n, sampling, turn, positions) -> RolloutBatch` samples one turn (the caller
    seeds it); `positions` are the global indices of the episodes (turns after the first); with `images`
    (one rlkit.batch.Images or None per prompt) it is also given `images=` for the rows it samples.
    `pictures` (with the model's `processor`): the environment's observations may show images, decoded by this
    rule in its workers and rendered by the processor (rlkit/rollout/observations.py); each episode's Images
    grows with them, and so do the rows' `images` given to `generate` in later turns. The
    environments live in worker processes for the batch (rlkit/envs/workers.py), closed on return;
    `single_turn` runs in this process (no process, no thread).
    """
    count = len(prompts) * n
    if resolve_env(env_name) is SingleTurn:
        runner = LocalEnvs(env_name, env_kwargs, count)
    else:
        runner = EnvWorkers(env_name, env_kwargs, count, timeout_s=timeout_s, limits=limits)
    try:
        episodes, env_stop = _start(
            runner, prompts, messages, rows, n, tokenizer,
            context=context, first_position=first_position, images=images,
        )  # fmt: skip
        stop = tuple(sampling.stop) + tuple(s for s in env_stop if s not in sampling.stop)
        limits = dict(
            max_turns=max_turns, max_total_tokens=max_total_tokens, context=context, eos_ids=eos_ids,
            processor=processor, pictures=pictures,
        )  # fmt: skip
        sampling = dataclasses.replace(sampling, stop=stop)
        single = type(runner) is LocalEnvs
        single_turn, gen_seconds = _turns(
            generate, runner, episodes, n, sampling, tokenizer, single=single, **limits
        )
        _log_failures(episodes, env_name)
        return single_turn or _finish(episodes, n, pad_id, gen_seconds, runner.tool_calls)
    finally:
        runner.close()


def _turns(generate, runner, episodes, n, sampling, tokenizer, *, single, max_turns,
           max_total_tokens, context, eos_ids, processor, pictures):  # fmt: skip
    """The model turns and environment steps of `episodes` until all are done. Returns (the engine's batch
    as it is, for single-turn episodes that need no cut, else None; the generation seconds)."""

    def room(e: Episode) -> int:
        left = max_total_tokens - len(e.ids)
        if context is not None:
            left = min(left, context - len(e.prompt) - len(e.ids))
        return left

    gen_seconds = 0.0
    measurable = max_token_chars(tokenizer) is not None
    live = [e for e in episodes if not e.done]
    for turn in range(max_turns):
        if not live:
            break
        s = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, max(map(room, live))))
        if turn == 0:
            rows = [
                i for i in range(len(episodes) // n) if any(not e.done for e in episodes[i * n : i * n + n])
            ]
            pics = [episodes[i * n].images for i in rows]
            rb = generate([episodes[i * n].prompt for i in rows], n, s, 0, None, **_images(pics))
            if (
                single
                and len(rows) * n == len(episodes)
                and (one := _single_turn(rb, [room(e) for e in episodes]))
            ):
                return one, 0.0
            live = [episodes[i * n + j] for i in rows for j in range(n)]
        else:
            pics = [e.images for e in live]
            rb = generate(
                [e.prompt + e.ids for e in live], 1, s, turn, [e.position for e in live], **_images(pics)
            )
        gen_seconds += rb.stats.get("gen_seconds", 0.0)
        stepping = _take_turn(live, rb, room, tokenizer)
        # Told with each step, the worker refuses an observation longer in characters than the episode's
        # token budget could ever hold (`max_chars`, as for data rows), so what the trainer tokenizes is
        # bounded by the budget, never by what the environment sent.
        bounds = {e.env: max_chars(tokenizer, room(e) + len(e.ids)) for e in stepping} if measurable else None
        results = runner.call("step", {e.env: (e.texts[-1],) for e in stepping}, bounds, pictures)
        for e in stepping:
            status, out = results[e.env]
            if status == "ok":
                _observe(e, out, max_turns=max_turns, room=room, tokenizer=tokenizer,
                         eos_ids=eos_ids, processor=processor)  # fmt: skip
            else:
                _fail(e, status, f"turn {e.turns}: {out}")
        live = [e for e in episodes if not e.done]
    return None, gen_seconds
