"""Rollout production, the first half of a step: prompts -> scored groups.

    draw prompts -> engine.generate (whole groups per rank) -> rewards (worker processes)
    -> overlong shaping -> dynamic sampling (drop groups without signal, refill from new prompts)

The learning half (log-probs, advantages, correction, update, push) only ever sees a `ScoredBatch`.

Dynamic sampling (`algo.dynamic_sampling=refill`, DAPO, Yu et al. 2025, arXiv:2503.14476 sec. 3.2):
a group whose `algo.filter_metric` has no spread teaches GRPO nothing, so it is dropped and more
prompts are drawn and generated, up to `algo.max_gen_batches` generation batches per step, until the
global batch holds `trainer.train_batch_size` samples of informative groups. Kept groups are taken
in global prompt order (generation batch, then rank, then prompt), so the choice does not depend on
the number of ranks; with several ranks they are exchanged so every rank trains on an equal share.
If the bound is reached first, the batch is completed with dropped groups (they carry no policy
gradient: their advantages are 0 and `algo.mask_zero_std_groups` masks them) and a warning is logged.
Every drawn prompt advances the data order, so a checkpoint records each prompt consumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from torch import Tensor

from rlkit.algos.advantages import ESTIMATORS, overlong_penalty, zero_std_groups
from rlkit.batch import SUMMED_STATS, ScoredBatch
from rlkit.collectives import all_gather_cat, scatter_object
from rlkit.config.rules import choice
from rlkit.config.schema import AlgoConfig, ConfigError
from rlkit.data.loading import load_splits
from rlkit.data.prompts import prompt_messages
from rlkit.envs import picture_rule, shows_images
from rlkit.envs.workers import limits_of
from rlkit.models import load_tokenizer
from rlkit.rollout.engines.base import Sampling
from rlkit.rollout.episodes import check_multiturn_template, run_episodes
from rlkit.rollout.failures import FailureWatch
from rlkit.rollout.observations import check_picture_template
from rlkit.rollout.scored import concat_rollouts, take_groups
from rlkit.vision import load_processor

log = logging.getLogger(__name__)


def sampling_seed(seed: int, step: int, rank: int, salt: int = 0) -> int:
    """Generation seed as a pure function of (seed, step, rank): an exact resume needs no engine RNG state."""
    return (((seed * 1_000_003 + step) * 10_007 + rank) * 31 + salt) % (2**31 - 1)


def task_names(rows: list[dict]) -> list[str]:
    """The sorted values of the rows' `task` column ([] unless every row has one)."""
    if not rows or any("task" not in r for r in rows):
        return []
    return sorted({str(r["task"]) for r in rows})


def task_masks(rows: list[dict], names: list[str]) -> dict[str, Tensor]:
    """[N] float32 1/0 per task name: the samples (rows) of that task."""
    return {t: torch.tensor([float(str(r["task"]) == t) for r in rows]) for t in names}


def informative_groups(metric: Tensor, group_size: int) -> Tensor:
    """[N / G] bool: the groups whose `metric` is not the same for all their samples."""

    return ~zero_std_groups(metric, group_size).reshape(-1, group_size)[:, 0]


def select_groups(keep: list[Tensor], needed: int) -> list[tuple[int, int]]:
    """(generation batch, global group) of the `needed` groups a step trains on.

    `keep[b]` is the global [groups] bool of generation batch b. Kept groups come first, in order;
    if there are fewer than `needed`, the earliest dropped groups complete the batch.
    """
    order = [(b, g) for b, k in enumerate(keep) for g in range(k.numel())]
    flags = torch.cat(keep).tolist() if keep else []
    kept = [pos for pos, f in zip(order, flags) if f]
    dropped = [pos for pos, f in zip(order, flags) if not f]
    return (kept + dropped)[:needed]


class Producer:
    """Produces this rank's `ScoredBatch` of every step (sync mode: called by the trainer's step)."""

    def __init__(
        self, cfg, engine, scorer, prompts, order, *, rank: int, world: int, device=None, reward_model=None,
        tokenizer=None, processor=None,
    ):  # fmt: skip
        self.cfg = cfg
        self.processor = processor  # the VL model's, where an environment's observations may show images
        self.pictures = picture_rule(cfg)
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self._awake = False
        # Whether the engine's next sleep may drop its weights (vLLM sleep level 2): only where a push comes
        # before the next generation (`produce` without refill); everywhere else the weights are kept.
        self._push_comes_next = False
        self._told_shortfall = False  # dynamic sampling: the first shortfall is logged, later ones counted
        self.scorer = scorer
        self.prompts = prompts
        self.order = order
        self.rank, self.world = rank, world
        self.device = device if device is not None else torch.device("cpu")  # for collectives (NCCL: GPU)
        self.reward_model = reward_model
        self.group_size = cfg.rollout.group_size
        self.prompts_per_rank = cfg.trainer.train_batch_size // (self.group_size * world)
        # The tasks of a dataset with a `task` column (per-task metrics): the same list on every rank.
        self.task_names = task_names(prompts.rows)
        self.watch = FailureWatch(
            reward_steps=cfg.reward.max_failed_steps,
            env_steps=cfg.env.max_failed_steps,
            env_name=cfg.env.name,
        )

    # -- generation ------------------------------------------------------------------------------

    def sampling(self, *, eval: bool = False):

        r = self.cfg.rollout
        return Sampling(
            temperature=r.eval_temperature if eval else r.temperature,
            top_p=1.0 if eval else r.top_p,
            top_k=0 if eval else r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop=tuple(r.stop),
            ignore_eos=r.ignore_eos and not eval,
        )

    @contextlib.contextmanager
    def awake(self):
        """The engine awake for the whole block (all turns of a batch of episodes), asleep after it."""
        if self._awake:
            yield
            return
        self.engine.wake()
        self._awake = True
        try:
            yield
        finally:
            self._awake = False
            self.engine.sleep(keep_weights=not self._push_comes_next)

    def generate(
        self, prompts: list[list[int]], n: int, sampling, seed: int, *, first_prompt: int = 0, positions=None,
        images=None,
    ):  # fmt: skip
        """engine.generate, seeded so the samples are a pure function of (seed, step, rank).

        With rollout.seed_per_prompt each prompt gets its own call seeded by its position in the global
        batch (`first_prompt` + j, or `positions[j]` when given), so the samples do not depend on the
        number of ranks. `images` (aligned with `prompts`, or None) go to the engine with their prompts.
        """
        with self.awake():
            if not self.cfg.rollout.seed_per_prompt:
                if images is None:
                    return self.engine.generate(prompts, n, dataclasses.replace(sampling, seed=seed))
                return self.engine.generate(
                    prompts, n, dataclasses.replace(sampling, seed=seed), images=images
                )
            if positions is None:
                positions = [first_prompt + j for j in range(len(prompts))]
            parts = []
            for j, (p, pos) in enumerate(zip(prompts, positions)):
                s = dataclasses.replace(sampling, seed=sampling_seed(seed, 0, pos))
                if images is None:
                    parts.append(self.engine.generate([p], n, s))
                else:
                    parts.append(self.engine.generate([p], n, s, images=[images[j]]))
            return concat_rollouts(parts)

    def episodes(self, prompt_set, indices: list[int], n: int, sampling, seed: int, *, first_prompt: int = 0):
        """Run `n` episodes of env.name for each prompt `indices` of `prompt_set` (rlkit/rollout/episodes.py).

        Turn 0 is exactly the single-turn call (same prompts, n, seed); turn t > 0 of the live episodes is
        one call with n=1 each, seeded by (seed, t) and, under rollout.seed_per_prompt, by each episode's
        global index, so multi-turn samples too are independent of the number of ranks.
        """

        env = self.cfg.env

        def gen(prompts, k, s, turn, positions, images=None):
            if turn == 0:
                return self.generate(prompts, k, s, seed, first_prompt=first_prompt, images=images)
            return self.generate(
                prompts, k, s, sampling_seed(seed, turn, 0, salt=7), positions=positions, images=images
            )

        eos = getattr(self.engine, "eos_ids", None) or [self.tokenizer.eos_token_id]
        pad = getattr(self.engine, "pad_id", None)
        with self.awake():
            return run_episodes(
                gen, self.tokenizer, [prompt_set.token_ids[i] for i in indices],
                [prompt_set.messages[i] for i in indices], [prompt_set.rows[i] for i in indices], n, sampling,
                env_name=env.name, env_kwargs=dict(env.kwargs), max_turns=env.max_turns,
                max_total_tokens=env.max_total_tokens or self.cfg.rollout.max_new_tokens,
                timeout_s=env.timeout_s, eos_ids=set(eos), pad_id=pad if pad is not None else eos[0],
                context=getattr(self.engine, "context", None), first_position=first_prompt,
                limits=limits_of(env),
                images=[prompt_set.images[i] for i in indices] if prompt_set.images else None,
                processor=self.processor, pictures=self.pictures if self.processor is not None else None,
            )  # fmt: skip

    # -- one generation batch --------------------------------------------------------------------

    def _generate_and_score(self, step: int, gen_batch: int, timers) -> dict:
        """Draw the next global batch of prompts, generate this rank's share, score it."""
        cfg, G, ppr = self.cfg, self.group_size, self.prompts_per_rank
        with timers("generate"):
            indices = self.order.next(ppr * self.world)
            mine = indices[self.rank * ppr : (self.rank + 1) * ppr]
            # Refill batches get their own seeds; batch 0 keeps the seed of a step without refill.
            salt = 0 if gen_batch == 0 else 1000 + gen_batch
            eb = self.episodes(
                self.prompts,
                mine,
                G,
                self.sampling(),
                # Per-prompt seeds are derived from a rank-independent base (see generate).
                sampling_seed(cfg.trainer.seed, step, 0 if cfg.rollout.seed_per_prompt else self.rank, salt),
                first_prompt=self.rank * ppr,
            )
            rb = eb.rollout
        with timers("reward"):
            texts = [self.prompts.texts[i] for i in mine for _ in range(G)]
            answers = [self.prompts.answers[i] for i in mine for _ in range(G)]
            rows = [self.prompts.rows[i] for i in mine for _ in range(G)]
            scores = self.scorer.score(texts, list(rb.response_texts), answers, rows=rows)
            self.watch.see_rewards(scores, len(texts))
            self.watch.see_episodes(rb.num_samples, eb.errors, eb.first_failure)
            per_fn = {k: torch.tensor(v, dtype=torch.float32) for k, v in scores.per_fn.items()}
            rewards = torch.tensor(scores.total, dtype=torch.float32)
            rw = cfg.reward
            if self.reward_model is not None:
                score = self.reward_model.score(
                    [self.prompts.messages[i] for i in mine for _ in range(G)], list(rb.response_texts)
                )
                per_fn["model"] = score
                rewards = rewards + rw.model_weight * score
            if rw.overlong_buffer > 0:
                penalty = overlong_penalty(
                    rb.response_lengths, cfg.rollout.max_new_tokens, rw.overlong_buffer, rw.overlong_penalty
                )
                per_fn["overlong"] = penalty
                rewards = rewards + penalty
            # Per-step environment rewards add to the episode's reward (undiscounted sum); an episode whose
            # environment step raised or hung scores 0 in every term.
            per_fn["env"] = eb.env_rewards
            rewards = torch.where(eb.failed, 0.0, rewards + eb.env_rewards)
            per_fn = {k: torch.where(eb.failed, 0.0, v) for k, v in per_fn.items()}
            correct = torch.where(eb.failed, 0.0, torch.tensor(scores.correct, dtype=torch.float32))
        return {
            "rollout": rb,
            "rewards": rewards,
            "correct": correct,
            "per_fn": per_fn,
            "errors": scores.errors,
            "timeouts": scores.timeouts,
            "env_stats": eb.stats,
            "env_errors": eb.errors,
            "env_timeouts": eb.timeouts,
            "tasks": task_masks(rows, self.task_names),
        }

    # -- a step's scored batch -------------------------------------------------------------------

    def produce(self, step: int, timers) -> ScoredBatch:
        a = self.cfg.algo
        if a.dynamic_sampling == "off":
            # One generation, then the update and its push: the engine's sleep may drop the weights.
            self._push_comes_next = True
            try:
                piece = self._generate_and_score(step, 0, timers)
            finally:
                self._push_comes_next = False
            self.watch.end_step(step)  # loud failures (rlkit/rollout/failures.py)
            # The oldest version that sampled a token (the engine's, `step` in sync mode).
            return ScoredBatch(**piece, stats={}, policy_version=piece["rollout"].oldest_version(step))

        G, ppr = self.group_size, self.prompts_per_rank
        needed = ppr * self.world
        pieces, keep = [], []
        for b in range(a.max_gen_batches):
            piece = self._generate_and_score(step, b, timers)
            metric = piece["rewards"] if a.filter_metric == "reward" else piece["correct"]
            with timers("filter"):
                keep.append(self._gather(informative_groups(metric, G)))
                pieces.append(piece)
                if int(sum(int(k.sum()) for k in keep)) >= needed:
                    break
        self.watch.end_step(step)
        kept = int(sum(int(k.sum()) for k in keep))
        generated = sum(k.numel() for k in keep)
        if kept < needed and not self._told_shortfall and self.rank == 0:
            # Once, as information: a shortfall is normal early in training, not a problem; every step
            # counts it in dynamic/shortfall_groups and the trainer sums it up at the end of the run.
            self._told_shortfall = True
            log.info(
                "dynamic sampling: %d of %d groups with signal after algo.max_gen_batches=%d generation "
                "batches; training on them plus %d groups without signal (masked out of the loss). Later "
                "shortfalls are counted in dynamic/shortfall_groups, summed up at the end of the run",
                kept, needed, a.max_gen_batches, needed - kept,
            )  # fmt: skip
        with timers("filter"):
            scored = self._assemble(pieces, select_groups(keep, needed))
        stats = {
            "dynamic/gen_batches": float(len(keep)), "dynamic/kept_frac": kept / max(generated, 1),
            "dynamic/shortfall_groups": float(max(0, needed - kept)),
        }  # fmt: skip
        stats.update(self._kept_per_task(pieces, keep))
        return dataclasses.replace(scored, stats=stats, policy_version=scored.rollout.oldest_version(step))

    def _kept_per_task(self, pieces: list[dict], keep: list[Tensor]) -> dict[str, float]:
        """`dynamic/kept_frac/<task>`: the share of each task's generated groups that had signal."""
        if not self.task_names:
            return {}
        G, K = self.group_size, len(self.task_names)
        # [groups, K]: each group's task (its first sample's), over all ranks in global group order
        first = [torch.stack([p["tasks"][t][::G] for t in self.task_names], 1) for p in pieces]
        of_task = torch.cat([self._gather(f.flatten()).reshape(-1, K) for f in first])
        kept = torch.cat(keep).float()[:, None]
        generated, kept = of_task.sum(0).tolist(), (of_task * kept).sum(0).tolist()
        return {f"dynamic/kept_frac/{t}": k / g for t, k, g in zip(self.task_names, kept, generated) if g > 0}

    def _group(self, piece: dict, local: int) -> dict:
        """Group `local` of one generation batch of this rank: its samples and their scores."""
        rows = slice(local * self.group_size, (local + 1) * self.group_size)
        return {
            "rollout": take_groups(piece["rollout"], [local]),
            "rewards": piece["rewards"][rows],
            "correct": piece["correct"][rows],
            "per_fn": {k: v[rows] for k, v in piece["per_fn"].items()},
            "env_stats": {k: v[rows] for k, v in piece["env_stats"].items()},
            "tasks": {k: v[rows] for k, v in piece["tasks"].items()},
        }

    def _exchange(self, pieces: list[dict], chosen: list[tuple[int, int]]) -> list[dict]:
        """The groups this rank trains on, in order, each sent by the rank that generated it.

        Global group g of a generation batch was generated by rank g // prompts_per_rank; `chosen` is the
        global choice (the same on every rank), each rank training on its slice. Every rank sends each
        other rank just the groups that rank needs (one scatter per sending rank), nothing else.
        """
        ppr = self.prompts_per_rank
        outgoing: list[list[dict]] = [[] for _ in range(self.world)]
        for dest in range(self.world):
            for b, g in chosen[dest * ppr : (dest + 1) * ppr]:
                owner, local = divmod(g, ppr)
                if owner == self.rank:
                    outgoing[dest].append(self._group(pieces[b], local))
        incoming = {self.rank: outgoing[self.rank]}
        for src in range(self.world) if self.world > 1 else ():
            incoming[src] = scatter_object(outgoing if src == self.rank else None, self.world, src)
        mine = chosen[self.rank * ppr : (self.rank + 1) * ppr]
        taken = {src: iter(groups) for src, groups in incoming.items()}
        return [next(taken[g // ppr]) for _, g in mine]

    def _assemble(self, pieces: list[dict], chosen: list[tuple[int, int]]) -> ScoredBatch:
        """This rank's ScoredBatch of its share of the chosen (generation batch, global group) pairs; the
        counters and throughput are what this rank generated."""
        groups = self._exchange(pieces, chosen)
        stats = {k: sum(p["rollout"].stats.get(k, 0.0) for p in pieces) for k in SUMMED_STATS}
        rb = dataclasses.replace(concat_rollouts([x["rollout"] for x in groups]), stats=stats)
        return ScoredBatch(
            rollout=rb,
            rewards=torch.cat([x["rewards"] for x in groups]),
            correct=torch.cat([x["correct"] for x in groups]),
            per_fn={k: torch.cat([x["per_fn"][k] for x in groups]) for k in groups[0]["per_fn"]},
            errors=sum(p["errors"] for p in pieces),
            timeouts=sum(p["timeouts"] for p in pieces),
            stats={},
            policy_version=-1,
            env_stats={k: torch.cat([x["env_stats"][k] for x in groups]) for k in groups[0]["env_stats"]},
            env_errors=sum(p["env_errors"] for p in pieces),
            env_timeouts=sum(p["env_timeouts"] for p in pieces),
            tasks={k: torch.cat([x["tasks"][k] for x in groups]) for k in groups[0]["tasks"]},
        )

    def _gather(self, x: Tensor) -> Tensor:
        """Concatenate a per-rank [n] CPU tensor over ranks (same n on every rank), in rank order."""
        if self.world == 1:
            return x
        return all_gather_cat(x, self.world, self.device).cpu()


DYNAMIC_SAMPLING = ("off", "refill")  # algo.dynamic_sampling
FILTER_METRICS = ("reward", "accuracy")  # algo.filter_metric


def check_config(cfg) -> None:
    """`algo.dynamic_sampling` and `algo.filter_metric` (raises ConfigError)."""

    a = cfg.algo
    choice("algo.dynamic_sampling", a.dynamic_sampling, DYNAMIC_SAMPLING)
    choice("algo.filter_metric", a.filter_metric, FILTER_METRICS)
    if a.dynamic_sampling == "off" and a.filter_metric != AlgoConfig().filter_metric:
        log.warning(
            "algo.filter_metric=%r has no effect with algo.dynamic_sampling='off' (it picks the groups refill "
            "keeps): did you mean algo.dynamic_sampling=refill?", a.filter_metric,
        )  # fmt: skip
    grouped = ESTIMATORS.names(group_based=True)
    if a.dynamic_sampling == "refill" and a.adv_estimator not in grouped:
        raise ConfigError(
            f"algo.dynamic_sampling='refill' filters groups by their spread: algo.adv_estimator="
            f"{a.adv_estimator!r} is not one of {grouped}"
        )


def check_inputs(cfg) -> None:
    """The checks that need the tokenizer or the data (never a model), in the preflight: a multi-turn
    environment needs a chat template that only appends; `reward.route_by` must name a data column."""
    if cfg.env.max_turns > 1 and cfg.env.name != "single_turn":
        probe = prompt_messages("What is 1 + 1?", cfg.data)
        check_multiturn_template(load_tokenizer(cfg.model.path), cfg, probe)
        if shows_images(cfg.env):
            where = f"env.name={cfg.env.name!r} shows images (model.path={cfg.model.path!r})"
            try:
                check_picture_template(load_processor(cfg.model.path), probe, where)
            except ValueError as e:
                raise ConfigError(str(e)) from e
    route_by = cfg.reward.route_by
    if route_by is not None:
        train, _ = load_splits(cfg.data, seed=cfg.trainer.seed, env=cfg.env)
        if route_by not in train.column_names:
            raise ConfigError(
                f"reward.route_by={route_by!r} is not a column of the training data: {sorted(train.column_names)}"
            )
