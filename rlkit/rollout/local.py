"""The rollout half of training in this process: prompts, engine, rewards, producer and eval.

`trainer.mode=sync` uses one `LocalRollouts` per training rank (the engine colocated with the learner);
`trainer.mode=async` runs one inside each rollout worker process (rlkit/rollout/remote/). Both
trainers talk to it through the same calls:

    start(export, step, evaluate)    the run begins (or resumes) at `step`
    produce(step, timers)            -> ScoredBatch (rlkit/rollout/producer.py)
    push(export, version, evaluate)  the learner's new weights (an rlkit.weights.Export) reach the engine
    evaluate(version)                -> {"eval/pass@1": ...} of the engine's weights `version`
    checkpoint(directory) / load_checkpoint(directory, state)
"""

from __future__ import annotations

import time

import torch

from rlkit.batch import ScoredBatch
from rlkit.data.loading import load_splits
from rlkit.data.prompts import PromptOrder, build_prompts
from rlkit.rewards import RewardScorer
from rlkit.rewards.model import RewardModel
from rlkit.rollout.engines import make_engine
from rlkit.rollout.evaluation import (
    EvalSettings,
    PromptResult,
    default_ks,
    evaluate_prompts,
    summarize,
    training_metrics,
)
from rlkit.rollout.producer import Producer
from rlkit.rundir import PENDING_FILE
from rlkit.weights import (
    Export,
    check_probe,
    probe_bound,
    probe_gap,
    probe_tokens,
    push_weights,
    verify_push,
)


class LocalRollouts:
    """Engine, prompts, reward scorer and producer of one rank (`rank` of `world` ranks that produce)."""

    def __init__(self, cfg, *, rank: int, world: int, device, tokenizer, reward_dtype=torch.float32):

        t, r = cfg.trainer, cfg.rollout
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        train_ds, eval_ds = load_splits(cfg.data, seed=t.seed, env=cfg.env)
        self.train_prompts = build_prompts(train_ds, tokenizer, cfg.data, name="train")
        self.eval_prompts = build_prompts(eval_ds, tokenizer, cfg.data, name="eval") if len(eval_ds) else None
        self.order = PromptOrder(len(self.train_prompts), seed=t.seed)
        self.scorer = RewardScorer(
            cfg.reward.fn,
            cfg.reward.extra,
            timeout_s=cfg.reward.timeout_s,
            num_workers=cfg.reward.num_workers,
            correct_threshold=cfg.reward.correct_threshold,
            route_by=cfg.reward.route_by,
            routes=cfg.reward.routes,
            batch_timeout_s=cfg.reward.batch_timeout_s,
            memory_limit_mb=cfg.reward.memory_limit_mb,
        )
        # None: the engine takes this rank's GPU (set by the accelerator) or the CPU.
        self.engine = make_engine(
            r.engine,
            cfg.model.path,
            dtype=cfg.model.dtype,
            device="cpu" if t.device == "cpu" else None,
            seed=t.seed,
            # In-flight updates (vLLM only): no forward may still be queued when step() returns (CUDA).
            **({"async_scheduling": False} if t.inflight_updates != "off" else {}),
            **r.engine_kwargs,
        )
        reward_model = None
        if cfg.reward.model is not None:
            reward_model = RewardModel(
                cfg.reward.model, device=device, batch_size=cfg.reward.model_batch_size, dtype=reward_dtype
            )
        self.last_eval: list[PromptResult] = []  # the last evaluation's prompts (evaluate)
        self.digests: dict | None = None  # of the last verified push (rlkit.weights.verify_push)
        self.producer = Producer(
            cfg, self.engine, self.scorer, self.train_prompts, self.order, rank=rank, world=world,
            device=device, reward_model=reward_model, tokenizer=tokenizer,
        )  # fmt: skip

    @property
    def engine_name(self) -> str:
        return self.engine.name

    def start(self, export: Export, step: int, *, evaluate: bool = False) -> None:
        """A resumed run's engine was built from the initial weights: give it the checkpoint's. Either way the
        engine's weights are checked against the learner's before the first step (`rollout.verify_push`)."""
        if step > 0:
            self.push(export, step)
        elif self.cfg.rollout.verify_push:
            self.digests = verify_push(export, self.engine)
            # [issue 43 wiring: WeightSync ports this] The engine as loaded computes what the learner computes;
            # an engine in its own layout (vLLM) then gets the same weights pushed once: no tensor of it may
            # change and the probe must still agree (a push that mangles a layer stops the run here).
            self.probe(export, when="as loaded, before training", at_load=True)
            if self.engine.digest_sources() is not None:
                self.push(export, 0)

    def produce(self, step: int, timers) -> ScoredBatch:
        return self.producer.produce(step, timers)

    def push(self, export: Export, version: int, *, evaluate: bool = False) -> dict[str, float]:
        # Cast here (a bf16 engine gets bf16: half the bytes, and vLLM warns for every tensor it must cast).
        stats = push_weights(export, self.engine, dtype=self.engine.weight_dtype)
        self.engine.set_version(version)  # labels the tokens it samples from now on
        if self.cfg.rollout.verify_push:
            start = time.perf_counter()
            self.digests = verify_push(export, self.engine, self.digests)
            gap = self.probe(export, when=f"after the push of version {version}")  # [issue 43 wiring]
            stats = {**stats, "verify_seconds": time.perf_counter() - start}
            if gap is not None:
                stats["probe_gap"] = gap
        return stats

    def probe(self, export: Export, *, when: str, at_load: bool = False) -> float | None:
        """[issue 43 wiring: WeightSync ports this] The log-prob probe: the engine's log-probs of fixed tokens
        against the learner's (`export.probe`, a collective on every learner rank), within the bound of the
        compute dtype or `rollout.accept_engine_gap`; a `WeightSyncError` otherwise. None where the engine has
        no prompt log-probs (the HF engine, which is checked tensor for tensor)."""
        if export.probe is None or not hasattr(self.engine, "prompt_logprobs"):
            return None
        tokens = probe_tokens()
        gap = probe_gap(self.engine.prompt_logprobs(tokens), export.probe(tokens))
        bound = probe_bound(export.probe_dtype, self.engine.weight_dtype)
        accepted = self.cfg.rollout.accept_engine_gap
        check_probe(gap, bound, when=when, engine=self.engine.name, accepted=accepted, at_load=at_load)
        return gap

    def evaluate(self, version: int) -> dict[str, float]:
        """The `eval/*` metrics of the engine's weights `version` on the held-out split (never masked):
        pass@k (unbiased) and maj@k for eval.ks, mean reward, standard errors, per-task pass@1. The
        prompts' results stay in `last_eval` (rank 0 logs `trainer.log_samples` of them)."""
        if self.eval_prompts is None:
            return {}
        settings = EvalSettings(
            n=self.cfg.rollout.eval_group_size,
            temperature=self.cfg.rollout.eval_temperature,
            seed=self.cfg.trainer.seed,
        )
        self.last_eval = self.evaluate_prompts(settings)
        ks = default_ks(self.cfg.eval.ks, settings.n)
        return training_metrics(summarize(self.last_eval, ks), ks)

    def evaluate_prompts(self, settings: EvalSettings) -> list[PromptResult]:
        """Every eval prompt's samples under `settings` (rlkit/rollout/evaluation.py; rlkit.eval calls this)."""
        return evaluate_prompts(
            self.producer, self.eval_prompts, settings, rank=self.rank, world=self.world,
            task_key=self.cfg.eval.task_key,
        )  # fmt: skip

    def checkpoint(self, directory) -> dict:
        """What trainer_state.json records for the rollout side (every prompt consumed so far)."""
        return {"data_position": self.order.position}

    def load_checkpoint(self, directory, state: dict) -> None:
        from pathlib import Path

        self.order.position = state["data_position"]
        if self.rank == 0 and (Path(directory) / PENDING_FILE).exists():
            import logging

            logging.getLogger(__name__).warning(
                "%s holds batches generated in trainer.mode=async and not trained yet; resumed with "
                "trainer.mode=sync they are skipped (their prompts count as consumed)", directory,
            )  # fmt: skip

    def close(self) -> None:
        self.scorer.close()
        try:
            self.engine.close()
        except Exception as e:  # closing is best effort (the process is ending), but never silent
            import logging

            logging.getLogger(__name__).warning(
                "closing the %s engine failed: %s: %s", self.engine.name, type(e).__name__, e
            )
