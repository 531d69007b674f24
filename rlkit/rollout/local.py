"""The rollout half of training in this process: prompts, engine, rewards, producer and eval.

`trainer.mode=sync` uses one `LocalRollouts` per training rank (the engine colocated with the learner);
`trainer.mode=async` runs one inside each rollout worker process (rlkit/rollout/remote/). It implements the
`Rollouts` protocol (rlkit/rollout/protocol.py) that the trainer and `rlkit.sync.WeightSync` call; the
producer (rlkit/rollout/producer.py) makes the batches, rlkit/rollout/evaluation.py the evaluations.
"""

from __future__ import annotations

import time

import torch

from rlkit.batch import ScoredBatch
from rlkit.data.loading import load_splits
from rlkit.data.prompts import PromptOrder, build_prompts
from rlkit.envs import takes_images
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
from rlkit.verify import (
    check_engine,
    check_probe,
    learner_probe,
    probe_bound,
    probe_gap,
    probe_input,
    probe_tokens,
    verify_push,
)
from rlkit.vision import load_processor
from rlkit.weights import Export, push_weights


class LocalRollouts:
    """Engine, prompts, reward scorer and producer of one rank (`rank` of `world` ranks that produce)."""

    def __init__(
        self,
        cfg,
        *,
        rank: int,
        world: int,
        device,
        tokenizer,
        reward_dtype=torch.float32,
        colocated: bool = True,
    ):

        t, r = cfg.trainer, cfg.rollout
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        train_ds, eval_ds = load_splits(cfg.data, seed=t.seed, env=cfg.env)
        # Images (data.image_key, or an environment's): the VL model's processor renders each prompt once, here,
        # and the pictures an environment shows (rlkit/rollout/observations.py).
        processor = load_processor(cfg.model.path) if takes_images(cfg) else None
        self.train_prompts = build_prompts(train_ds, tokenizer, cfg.data, name="train", processor=processor)
        self.eval_prompts = (
            build_prompts(eval_ds, tokenizer, cfg.data, name="eval", processor=processor)
            if len(eval_ds)
            else None
        )
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
            max_processes=cfg.reward.max_processes,
        )
        # None: the engine takes this rank's GPU (set by the accelerator) or the CPU.
        self.engine = make_engine(
            r.engine,
            cfg.model.path,
            dtype=cfg.model.dtype,
            device="cpu" if t.device == "cpu" else None,
            seed=t.seed,
            colocated=colocated,  # False in an async rollout worker: the GPU is the engine's alone
            tokenizer=tokenizer,
            # In-flight updates (vLLM only): no forward may still be queued when step() returns (CUDA).
            **({"async_scheduling": False} if t.inflight_updates != "off" else {}),
            **(
                {"routing_replay": True} if cfg.algo.routing_replay else {}
            ),  # vLLM returns each token's experts
            vision=processor is not None,
            **r.engine_kwargs,
        )
        reward_model = None
        if cfg.reward.model is not None:
            reward_model = RewardModel(
                cfg.reward.model, device=device, batch_size=cfg.reward.model_batch_size, dtype=reward_dtype
            )
        self.last_eval: list[PromptResult] = []  # the last evaluation's prompts (evaluate)
        self.digests: dict | None = None  # of the last verified push (rlkit.verify.verify_push)
        self.producer = Producer(
            cfg, self.engine, self.scorer, self.train_prompts, self.order, rank=rank, world=world,
            device=device, reward_model=reward_model, tokenizer=tokenizer, processor=processor,
        )  # fmt: skip

    @property
    def engine_name(self) -> str:
        return self.engine.name

    def start(self, export: Export, step: int, *, evaluate: bool = False) -> None:
        """A resumed run's engine was built from the initial weights: give it the checkpoint's. Either way the
        engine's weights are checked against the learner's before the first step (`rollout.verify_push`)."""
        if step > 0:
            self._push(export, step, probe_now=True)
        elif self.cfg.rollout.verify_push:
            self.digests = verify_push(export, self.engine)
            # The engine as loaded computes what the learner computes;
            # an engine in its own layout (vLLM) then gets the same weights pushed once: no tensor of it may
            # change and the probe must still agree (a push that mangles a layer stops the run here).
            self.probe(export, when="as loaded, before training", at_load=True)
            if self.engine.digest_sources() is not None:
                self._push(export, 0, probe_now=True)

    def produce(self, step: int, timers) -> ScoredBatch:
        return self.producer.produce(step, timers)

    def push(self, export: Export, version: int, *, evaluate: bool = False) -> dict[str, float]:
        """Push and verify (`_push`)."""
        return self._push(export, version, probe_now=evaluate)

    def _push(self, export: Export, version: int, *, probe_now: bool) -> dict[str, float]:
        """Push and verify: the digests, then the log-prob probe. The probe of a push that the next batch
        trains on is that batch itself: this engine's sampled log-probs against the learner's, which the step
        computes anyway (`mismatch/logprob_abs_diff`); the push returns the bound as `probe_bound` and
        rlkit.sync.WeightSync.check_batch compares (no extra forward on either side). `probe_now`: a push that
        is evaluated (the eval reads its weights before any batch) or `start`'s (whose statistics go nowhere)
        is probed on the fixed tokens here, as is every push when no batch can probe (rollout.return_logprobs
        off); the gap is returned as `probe_gap`."""
        # Cast here (a bf16 engine gets bf16: half the bytes, and vLLM warns for every tensor it must cast).
        # Verified: each tensor is digested as it streams (on its device), so the learner exports once a push.
        sent: dict[str, str] | None = {} if self.cfg.rollout.verify_push else None
        stats = push_weights(export, self.engine, dtype=self.engine.weight_dtype, digests=sent)
        self.engine.set_version(version)  # labels the tokens it samples from now on
        if sent is not None:
            start = time.perf_counter()
            self.digests = check_engine(sent, self.engine, self.digests)
            if self._probed(export):
                if probe_now or not self.cfg.rollout.return_logprobs:
                    stats["probe_gap"] = self.probe(export, when=f"after the push of version {version}")
                else:
                    stats["probe_bound"] = probe_bound(
                        export.probe_dtype, self.engine.weight_dtype, platform=engine_platform(self.engine)
                    )
            stats["verify_seconds"] = time.perf_counter() - start
        return stats

    def _probed(self, export: Export) -> bool:
        """Whether this engine's weights are probed: the learner exports a probe and the engine has prompt
        log-probs (the HF engine has none: it is checked tensor for tensor, its digests are exact)."""
        return export.probe is not None and hasattr(self.engine, "prompt_logprobs")

    def probe(self, export: Export, *, when: str, at_load: bool = False) -> float | None:
        """The log-prob probe of this engine against the learner's (`export.probe`, a collective on every learner
        rank): `check_engine_probe`; None (and no learner forward) where the engine is not probed."""
        if not self._probed(export):
            return None
        tokens, images = probe_input(export)  # a prompt with a picture per row for a vision-language policy
        return check_engine_probe(
            self.engine, learner_probe(export, tokens, images), export.probe_dtype,
            self.cfg.rollout.accept_engine_gap, when=when, at_load=at_load, tokens=tokens, images=images,
        )  # fmt: skip

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


def engine_platform(engine) -> str:
    """The platform an engine computes on ("cpu", "cuda", ...): the probe's bound depends on it."""
    return getattr(engine, "platform", "cpu")


def check_engine_probe(
    engine, learner_logprobs, learner_dtype, accepted: float | None, *, when: str, at_load: bool = False,
    tokens=None, images=None,
) -> float | None:  # fmt: skip
    """The log-prob probe, where the engine lives (this process, or an async rollout worker): the engine's
    log-probs of `tokens` (the learner's, `rlkit.verify.probe_tokens`) against the learner's, within the bound of
    the two dtypes on the engine's platform or the gap the run accepted (`rollout.accept_engine_gap`);
    `WeightSyncError` otherwise. Returns the gap, or None for an engine without prompt log-probs (the HF engine,
    checked tensor for tensor instead). `at_load`: the weights the engine loaded itself (a gap is then its
    forward's, not a push's). `images`: each row's pictures (rlkit.verify.vl_probe_prompt), for a
    vision-language policy."""
    if not hasattr(engine, "prompt_logprobs"):
        return None
    tokens = probe_tokens() if tokens is None else tokens
    held = engine.prompt_logprobs(tokens) if images is None else engine.prompt_logprobs(tokens, images)
    gap = probe_gap(held, learner_logprobs)
    bound = probe_bound(learner_dtype, engine.weight_dtype, platform=engine_platform(engine))
    check_probe(gap, bound, when=when, engine=engine.name, accepted=accepted, at_load=at_load)
    return gap
