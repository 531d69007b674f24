"""The training loop: one step = numbered phases, each inside a timer (`timing/<phase>_s`).

    1 generate     engine.wake -> engine.generate (whole groups per rank) -> engine.sleep
    2 reward       reward functions in worker processes (errors / timeouts count, never crash)
                   (1-2 are the rollout half: `self.rollouts.produce`, in this process with
                   trainer.mode=sync, in rollout worker processes with trainer.mode=async)
    3 logprobs     learner.forward: current policy (mismatch metrics, IS, off-policy ratio),
                   reference (KL), values (PPO)
    4 advantages   rlkit.algos.advantages (+ zero-std group masking, + KL-shaped rewards for PPO)
    5 correction   rlkit.algos.correction.rollout_is + mismatch metrics
    6 update       learner.update(TrainBatch)
    7 weight push  self.rollouts.push (+ the weight-sync check at the first steps)
    8 eval         every trainer.eval_every steps and at the end (never masked)
    9 checkpoint   every trainer.save_every steps, at the end, and on SIGTERM / SIGINT

Every rank runs the same code on its own prompts; per-sample statistics are gathered across ranks and
token statistics merged by token counts, so the logged numbers describe the global batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import resource
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit.config import RLConfig, to_dict

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"


class WeightSyncError(RuntimeError):
    """The rollout engine's weights differ from the learner's (the weight push did not happen)."""


class Timers:
    """`with timers("generate"): ...` accumulates wall seconds under `timing/generate_s`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # GPU work is asynchronous: time it to completion
            self.seconds[f"timing/{name}_s"] = (
                self.seconds.get(f"timing/{name}_s", 0.0) + time.perf_counter() - start
            )


def learner_config(cfg: RLConfig):
    """Map the run config onto the learner's own config (defaults live in RLConfig only)."""
    from rlkit.learner import LearnerConfig

    a, t = cfg.algo, cfg.trainer
    return LearnerConfig(
        model_path=cfg.model.path,
        dtype=cfg.model.dtype,
        strategy=t.strategy,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        lora_rank=cfg.model.lora.rank,
        lora_alpha=cfg.model.lora.alpha,
        lora_dropout=cfg.model.lora.dropout,
        lora_target_modules=tuple(cfg.model.lora.target_modules),
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=tuple(t.betas),
        warmup_steps=t.warmup_steps,
        total_steps=t.steps * a.ppo_epochs * a.mini_batches,
        lr_schedule=t.lr_schedule,
        max_grad_norm=t.max_grad_norm,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        pack_sequences=t.pack_sequences,
        logprob_chunk_tokens=t.logprob_chunk_tokens,
        temperature=cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
        policy_loss=a.policy_loss,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
        loss_agg_mode=a.loss_agg_mode,
        norm_len=a.norm_len if a.norm_len is not None else cfg.rollout.max_new_tokens,
        # With KL in the reward the KL is not a loss term, but the reference is still needed.
        kl_coef=0.0 if a.kl_in_reward else a.kl_coef,
        load_reference=a.kl_in_reward and a.kl_coef > 0,
        kl_estimator=a.kl_estimator,
        rollout_kl_coef=a.rollout_kl_coef,
        rollout_kl_estimator=a.rollout_kl_estimator,
        entropy_coef=a.entropy_coef,
        value_model=a.value_model,
        vf_coef=a.vf_coef,
        value_clip=a.value_clip,
        ppo_epochs=a.ppo_epochs,
        mini_batches=a.mini_batches,
        seed=t.seed,
        collective_timeout_s=t.collective_timeout_s,
    )


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `run_dir/checkpoints` (temp dirs are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := CHECKPOINT_RE.match(p.name)) and (p / TRAINER_STATE).exists()
    ]
    return max(done)[1] if done else None


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1)


class Trainer:
    """Builds everything from the config and runs `train()`. One instance per rank."""

    def __init__(self, cfg: RLConfig):
        from rlkit.learner import Learner, make_accelerator
        from rlkit.models import load_tokenizer

        self.cfg = cfg
        t = cfg.trainer
        self.lcfg = learner_config(cfg)
        # The accelerator initialises torch.distributed when launched with several processes.
        self.accelerator = make_accelerator(self.lcfg)
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.is_main = self.rank == 0
        from rlkit.collectives import CollectiveWatch

        self._watch = CollectiveWatch(self.world, t.collective_timeout_s)  # names a stopped rank
        self.run_dir = Path(self._broadcast(str(Path(t.run_dir).resolve())))
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._run_lock = self._guard_run_dir()

        self.tokenizer = load_tokenizer(cfg.model.path)
        self.group_size = cfg.rollout.group_size
        self.learner = Learner(self.lcfg, self.accelerator)
        self.device = self.learner.device
        # The rollout half: colocated with this rank (sync), or in rollout worker processes (async).
        if t.mode == "sync":
            from rlkit.rollout.local import LocalRollouts

            self.rollouts = LocalRollouts(
                cfg, rank=self.rank, world=self.world, device=self.device, tokenizer=self.tokenizer,
                reward_dtype=self.learner.compute_dtype,
            )  # fmt: skip
        else:
            from rlkit.rollout.remote import AsyncRollouts

            self.rollouts = AsyncRollouts(cfg, rank=self.rank, world=self.world, device=self.device)

        self.step = 0
        self.wandb_id = None
        self._stop_signal: int | None = None
        resume_from = self._resume_path()
        if resume_from is not None:
            self._load_checkpoint(resume_from)

        self.logger = None
        if self.is_main:
            from rlkit.logging import MetricsLogger

            lc = cfg.logger
            self.logger = MetricsLogger(
                lc.backend, self.run_dir, to_dict(cfg), project=lc.project, entity=lc.entity, name=lc.name,
                tags=lc.tags, resume_id=self.wandb_id,
            )  # fmt: skip
            self.wandb_id = self.logger.run_id
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))

    def _guard_run_dir(self):
        """Lock run_dir for this run and check what it holds, on rank 0 before any model loads (see
        rlkit.rundir); every rank raises rank 0's error. Returns the lock (rank 0) or None."""
        from rlkit.rundir import (
            RunDirLock,
            check_fresh_run,
            check_world_size,
            checkpoint_state,
            truncate_metrics,
        )

        lock = error = None
        if self.is_main:
            try:
                lock = RunDirLock(self.run_dir)
                check_fresh_run(self.run_dir, self.cfg.trainer.resume)
                resume_from = self._resume_path()
                if resume_from is not None:
                    check_world_size(resume_from, self.world)
                truncate_metrics(self.run_dir, checkpoint_state(resume_from)["step"] if resume_from else 0)
            except Exception as e:
                if lock is not None:
                    lock.release()
                error = e
        error = self._broadcast(error)
        if error is not None:
            raise error
        return lock

    # -- distributed helpers -------------------------------------------------------------------

    def _broadcast(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate a per-rank [n, ...] tensor over ranks (same n on every rank)."""
        if self.world == 1:
            return x
        x = x.to(self.device).contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(out, x)
        return torch.cat(out)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        x = x.to(self.device).clone()
        dist.all_reduce(x)
        return x

    # -- the step ------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One step on this rank's share of the global batch; returns the global metrics (all ranks)."""
        timers = Timers()
        step_start = time.perf_counter()
        # 1-2. generate and reward (+ environment turns, overlong shaping, dynamic sampling): in this
        # process (rlkit/rollout/local.py) or from the rollout workers (rlkit/rollout/remote.py).
        produced = self.rollouts.produce(self.step, timers)
        return self.learn(produced, timers, step_start)

    def learn(self, produced, timers: Timers, step_start: float) -> dict[str, float]:
        """Phases 3-7 on a `ScoredBatch` generated by the policy of step `produced.policy_version`."""
        from rlkit.algos import advantages as adv
        from rlkit.algos import correction, kl
        from rlkit.batch import Sequences, TrainBatch
        from rlkit.metrics import MetricMerger

        cfg, a = self.cfg, self.cfg.algo
        G = self.group_size
        rb = produced.rollout
        mask = rb.response_mask.to(self.device).bool()
        rollout_logp = rb.rollout_logprobs.to(self.device).float()
        rewards = produced.rewards.to(self.device)
        correct = produced.per_fn["math"].to(self.device)

        # 3. log-probs. The whole batch needs the current policy's log-probs when the update uses them
        # (IS weights, the off-policy ratio's denominator, the KL to the reference, the critic's
        # baseline); otherwise the update's own forward pass serves, and only `rollout.mismatch_samples`
        # samples are scored here for the mismatch metrics that prove the weight push happened.
        need_ref = a.kl_coef > 0
        whole = a.rollout_is.enabled or self.lcfg.off_policy or need_ref or a.value_model
        scored = rb.num_samples
        if not whole and cfg.rollout.mismatch_samples > 0:
            scored = min(cfg.rollout.mismatch_samples, rb.num_samples)
        with timers("logprobs"):
            seqs = Sequences.of(rb).select(slice(0, scored))  # all rows when scored == N (a view)
            lp = self.learner.forward(seqs, policy=True, ref=need_ref, values=a.value_model)
        logp = lp.logprobs.to(self.device)
        probe = mask[:scored]  # the tokens whose current-policy log-probs were computed
        token_metrics = MetricMerger()
        kl_tok = None
        if need_ref:
            # The KL to the reference as the rollout saw it, measured before any advantage code runs.
            kl_tok = kl.kl_estimate(logp, lp.ref_logprobs.to(self.device), a.kl_estimator)
            token_metrics.add({"rollout/kl": _masked_mean(kl_tok, mask)}, mask.sum())
        token_metrics.add({"rollout/entropy": _masked_mean(lp.entropy.to(self.device), probe)}, probe.sum())

        # 4. advantages
        with timers("advantages"):
            zero_std = adv.zero_std_groups(rewards, G)
            returns = None
            if a.adv_estimator in ("grpo", "rloo"):
                seq_adv = (
                    adv.grpo(rewards, G, norm_by_std=a.norm_by_std)
                    if a.adv_estimator == "grpo"
                    else adv.rloo(rewards, G)
                )
                advantages = seq_adv[:, None] * mask
            else:
                kl_for_reward = kl_tok if a.kl_in_reward else torch.zeros_like(rollout_logp)
                token_rewards = adv.kl_shaped_rewards(
                    rewards, kl_for_reward, mask, kl_coef=a.kl_coef if a.kl_in_reward else 0.0
                )
                if a.adv_estimator == "gae":
                    advantages, returns = adv.gae(
                        token_rewards, lp.values.to(self.device), mask, gamma=a.gamma, lam=a.lam
                    )
                else:
                    # REINFORCE++ whitens over the global batch: with several ranks, every rank
                    # whitens its rows with the statistics summed over all ranks.
                    discounted = adv.discounted_returns(token_rewards, mask, gamma=a.gamma)
                    stats = self._sum(adv.masked_moments(discounted, mask)) if self.world > 1 else None
                    advantages = adv.whiten(discounted, mask, moments=stats)
            loss_mask = mask & ~zero_std[:, None] if a.mask_zero_std_groups else mask
            if a.overlong_filter:
                # Responses cut by the length cap leave the loss (their reward judges an unfinished answer).
                cut = torch.tensor([f == "length" for f in rb.finish_reasons], device=self.device)
                loss_mask = loss_mask & ~cut[:, None]

        # 5. rollout correction (engine vs learner mismatch)
        with timers("correction"):
            probe_rollout = rollout_logp[:scored]
            token_metrics.add(correction.mismatch_metrics(logp, probe_rollout, probe), probe.sum())
            rkl = correction.rollout_kl(logp, probe_rollout, kind=a.rollout_kl_estimator)
            token_metrics.add({"rollout_kl": _masked_mean(rkl, probe)}, probe.sum())
            is_weights = None
            if a.rollout_is.enabled:
                # Weights and statistics over every sampled token (the rollout's drift, whether or not its
                # group trains); everything before narrowed the loss mask by whole rows, so the trained
                # rows' weights are the same, and the rejection only narrows the loss mask further.
                c = a.rollout_is
                is_weights, kept, is_metrics = correction.rollout_is(
                    logp, rollout_logp, mask, level=c.level, mode=c.mode, upper=c.upper, lower=c.lower,
                    veto_lower=c.veto_lower, veto_upper=c.veto_upper,
                )  # fmt: skip
                loss_mask = loss_mask & kept
                token_metrics.add(is_metrics, mask.sum())

        # 6. update
        with timers("update"):
            batch = TrainBatch(
                prompt_ids=rb.prompt_ids.to(self.device),
                prompt_mask=rb.prompt_mask.to(self.device),
                response_ids=rb.response_ids.to(self.device),
                response_mask=loss_mask,
                advantages=advantages,
                old_logprobs=logp if self.lcfg.off_policy else None,
                ref_logprobs=lp.ref_logprobs.to(self.device) if self.lcfg.kl_coef > 0 else None,
                rollout_logprobs=rollout_logp if a.rollout_kl_coef > 0 else None,
                is_weights=is_weights,
                values=lp.values.to(self.device) if a.value_model else None,
                returns=returns,
            )
            update_metrics = self.learner.update(batch)

        # 7. weight push (the rollout side evaluates the new weights when an eval is due)
        with timers("weight_push"):
            version = self.step + 1
            push_stats = self.rollouts.push(self.learner, version, evaluate=self._eval_due(version))

        # Global per-sample statistics (ranks hold equal numbers of samples).
        lengths = self._gather(mask.sum(-1).float())
        clipped = torch.tensor(
            [f == "length" for f in rb.finish_reasons], dtype=torch.float32, device=self.device
        )
        all_rewards, all_correct = self._gather(rewards), self._gather(correct)
        tokens = self._sum(
            torch.tensor([float(rb.stats.get("gen_tokens", float(mask.sum())))], device=self.device)
        )
        stats = {
            "reward/mean": all_rewards.mean(),
            "reward/std": all_rewards.std(unbiased=False) if all_rewards.numel() > 1 else torch.zeros(()),
            "reward/max": all_rewards.max(),
            "reward/min": all_rewards.min(),
            "accuracy": all_correct.mean(),
            "frac_reward_zero_std": self._gather(zero_std.float()).mean(),
            "response_length/mean": lengths.mean(),
            "response_length/max": lengths.max(),
            "response_length/clip_ratio": self._gather(clipped).mean(),
            "reward/errors": self._sum(torch.tensor([float(produced.errors)], device=self.device))[0],
            "reward/timeouts": self._sum(torch.tensor([float(produced.timeouts)], device=self.device))[0],
        }
        for name, values in produced.per_fn.items():
            short = name.split(":")[-1].split(".")[-1]  # module:fn -> fn
            stats[f"reward/{short}"] = self._gather(values.to(self.device)).mean()
        for name, values in produced.env_stats.items():  # env/turns, env/tool_calls: means per episode
            stats[f"env/{name}"] = self._gather(values.to(self.device)).mean()
        stats["env/errors"] = self._sum(torch.tensor([float(produced.env_errors)], device=self.device))[0]
        stats["env/timeouts"] = self._sum(torch.tensor([float(produced.env_timeouts)], device=self.device))[0]
        # Policy versions between the weights that generated the batch and the ones it trains (async).
        stats["staleness/mean"] = stats["staleness/max"] = float(self.step - produced.policy_version)
        stats["staleness/dropped"] = 0.0
        stats.update(produced.stats)
        stats.update(token_metrics.compute())
        stats.update(update_metrics)
        # The one host sync of the step.
        names = list(stats)
        values = torch.stack(
            [torch.as_tensor(stats[k], dtype=torch.float32).reshape(()).cpu() for k in names]
        ).tolist()
        metrics = dict(zip(names, values))
        metrics.update(timers.seconds)
        elapsed = time.perf_counter() - step_start
        metrics["timing/step_s"] = elapsed
        metrics["perf/tokens_per_s"] = float(tokens[0]) / max(elapsed, 1e-9)
        metrics["perf/gen_tokens_per_s"] = float(tokens[0]) / max(timers.seconds["timing/generate_s"], 1e-9)
        metrics["perf/weight_push_gb"] = float(push_stats.get("bytes", 0)) / 1e9
        metrics["perf/peak_memory_gb"] = _peak_memory_gb()
        if cfg.trainer.mode == "async":  # the drift statistics of this batch's staleness
            lag = int(metrics["staleness/max"])
            for key in ("mismatch/kl", "rollout_is/mean", "rollout_is/eff_sample_size"):
                if key in metrics:
                    metrics[f"{key}/staleness_{lag}"] = metrics[key]
        return metrics

    def _check_weight_sync(self, metrics: dict[str, float], *, after_push: bool) -> None:
        value = metrics.get("mismatch/kl")
        threshold = self.cfg.rollout.weight_sync_kl_threshold
        if value is not None and abs(value) > threshold:
            when = "right after the first weight push" if after_push else "before training (step 0)"
            raise WeightSyncError(
                f"mismatch/kl={value:.4g} {when} exceeds rollout.weight_sync_kl_threshold={threshold}: the rollout "
                f"engine's weights differ from the learner's (engine={self.rollouts.engine_name}). The weight push is not "
                "reaching the engine, or the two load different models/dtypes."
            )

    # -- eval ----------------------------------------------------------------------------------

    def _eval_due(self, step: int) -> bool:
        t = self.cfg.trainer
        return bool(t.eval_every and step % t.eval_every == 0) or step == t.steps

    def evaluate(self) -> dict[str, float]:
        """pass@1 (and pass@k) of the current weights on the held-out split (rlkit/rollout/local.py)."""
        return self.rollouts.evaluate(self.step)

    # -- checkpoints ---------------------------------------------------------------------------

    def _resume_path(self) -> Path | None:
        resume = self.cfg.trainer.resume
        if resume == "none":
            return None
        if resume == "auto":
            return latest_checkpoint(self.run_dir)
        path = Path(resume)
        if not (path / TRAINER_STATE).exists():
            raise FileNotFoundError(
                f"trainer.resume={resume!r} is not a complete checkpoint (no {TRAINER_STATE})"
            )
        return path

    def save_checkpoint(self) -> Path:
        """Write `checkpoints/step_<k>` through a temporary directory renamed into place when complete."""
        root = self.run_dir / "checkpoints"
        final = root / f"step_{self.step}"
        tmp = root / f".tmp-step_{self.step}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left over by an interrupted save
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.learner.save_checkpoint(tmp)
        rollout_state = self.rollouts.checkpoint(tmp)  # the data position (async: and the pending batches)
        if self.is_main:
            self.tokenizer.save_pretrained(tmp / "model")
            state = {
                "step": self.step,
                **rollout_state,
                "wandb_id": self.wandb_id,
                "world_size": self.world,
            }
            (tmp / TRAINER_STATE).write_text(json.dumps(state))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune(root)
        self.accelerator.wait_for_everyone()
        log.info("checkpoint written: %s", final)
        return final

    def _prune(self, root: Path) -> None:
        keep = self.cfg.trainer.keep_last
        if keep <= 0:
            return
        done = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_RE.match(p.name)))
        for _, path in done[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def _load_checkpoint(self, path: Path) -> None:
        state = json.loads((path / TRAINER_STATE).read_text())
        self.learner.load_checkpoint(path)
        self.step = state["step"]
        self.rollouts.load_checkpoint(path, state)
        self.wandb_id = state.get("wandb_id")
        if self.is_main:
            print(f"Resumed from {path} at step {self.step}", flush=True)

    # -- the loop ------------------------------------------------------------------------------

    def _on_signal(self, signum, frame):
        self._stop_signal = signum
        log.warning("received signal %d: finishing this step, writing a checkpoint and exiting", signum)

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self._stop_signal is not None else 0.0], device=self.device)
        return bool(self._sum(flag)[0] > 0)

    def train(self) -> list[dict[str, float]]:
        """Run from the current step to trainer.steps; returns the logged metrics of each step (the
        step-0 baseline eval of `trainer.eval_at_start` is logged as step 0, not returned)."""
        t = self.cfg.trainer
        history = []
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread
                previous[sig] = signal.signal(sig, self._on_signal)
        bar = None
        if self.is_main and t.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=t.steps, initial=self.step, desc="train", dynamic_ncols=True)
        first_step = self.step
        checkpoint_timing = {}
        try:
            baseline = t.eval_at_start and self.step == 0
            # The engine gets the learner's weights (a resumed run's; async: the workers start).
            self.rollouts.start(self.learner, self.step, evaluate=baseline)
            if baseline:
                timers = Timers()
                with timers("eval"):
                    baseline = self.evaluate()
                baseline.update(timers.seconds)
                if self.logger is not None and "eval/pass@1" in baseline:
                    self.logger.log(baseline, step=0)
            while self.step < t.steps:
                metrics = self.train_step()
                # A stale batch (async) was generated by older weights: its mismatch is policy change.
                if metrics["staleness/max"] == 0 and self.step in (first_step, first_step + 1):
                    self._check_weight_sync(metrics, after_push=self.step > 0)
                self.step += 1
                timers = Timers()
                if self._eval_due(self.step):
                    with timers("eval"):
                        metrics.update(self.evaluate())
                stop = self._should_stop()
                metrics.update(timers.seconds)
                metrics.update(checkpoint_timing)  # the checkpoint written after the previous step
                checkpoint_timing = {}
                history.append(metrics)
                # The step's line goes out before its checkpoint: a crash between the two leaves a line
                # that the resumed run cuts off and redoes (rlkit.rundir.truncate_metrics), never a gap.
                if self.logger is not None:
                    self.logger.log(metrics, step=self.step)
                if bar is not None:
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['accuracy']:.3f}")
                    bar.update(1)
                if (t.save_every and self.step % t.save_every == 0) or self.step == t.steps or stop:
                    checkpoint_timers = Timers()
                    with checkpoint_timers("checkpoint"):
                        self.save_checkpoint()
                    checkpoint_timing = checkpoint_timers.seconds
                if stop:
                    log.warning(
                        "stopped by signal %s at step %d (checkpoint written)", self._stop_signal, self.step
                    )
                    break
        finally:
            if bar is not None:
                bar.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.is_main:
            self._plot()
        return history

    def _plot(self) -> None:
        """Curves for a user without W&B: `<run_dir>/curves.png` (redraw: scripts/plot_run.py RUN_DIR)."""
        from rlkit.plots import plot_run

        try:
            out = plot_run(self.run_dir)
        except Exception as e:  # a plotting problem must not fail a finished run
            log.warning("could not draw the run's curves: %s: %s", type(e).__name__, e)
            return
        if out is not None:
            log.info("curves: %s", out)

    def close(self) -> None:
        self.rollouts.close()
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None


def _peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run(cfg: RLConfig) -> list[dict[str, float]]:
    """Build a Trainer for this rank, train, clean up. Returns the per-step metrics."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    except Exception as e:
        explained = trainer._watch.explain(e)  # a collective timed out: which rank stopped?
        if explained is not None:
            raise explained from e
        raise
    finally:
        trainer.close()
