"""`python -m rlkit.sft +recipe=NAME [key=value ...]`: supervised fine-tuning on rlkit's own parts.

The same Hydra config and groups as `python -m rlkit.train` (model, data, trainer, logger) plus `sft.*`; the same
learner (FSDP2 / DDP through accelerate, micro-batches and packing, chunked log-probs, LoRA, the optimizer and
its warm-up + cosine schedule), run directory, checkpoints (atomic, checksummed, exact resume) and logger. What
differs is the step: no rollout, the rows' own tokens are the targets.

    1 rows      trainer.train_batch_size rows of the training split (rlkit/data/sft.py: chat template, a loss
                mask on the assistant's tokens; with data.image_key the processor's expanded ids and each row's
                images, for the learner's vision-language forward), in a seeded order that a checkpoint's
                `data_position` resumes
    2 update    learner.update with algo.policy_loss=nll, token-mean over the whole global batch
                (rlkit/algos/losses.py: the gradient is the full batch's whatever the micro-batches and ranks)
    3 eval      the held-out split's token-mean NLL (`eval/loss`) every trainer.eval_every steps and at the end;
                with sft.generation_eval, generation on the held-out prompts too (`eval/pass@k`, ...), through the
                rollout side's evaluation, the one training and `rlkit.eval` use (the weights pushed and verified)
    4 checkpoint every trainer.save_every steps, at the end and on SIGTERM / SIGINT; `checkpoints/step_<k>/model`
                is an HF model folder: `python -m rlkit.train model.path=.../model` starts RL from it

    python -m rlkit.sft +recipe=sft_quickstart
    python -m rlkit.sft +recipe=sft_quickstart sft.epochs=2 trainer.lr=5e-5
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, read_write

from rlkit import checkpoints, gcpolicy, learner, rundir, trainer
from rlkit.collectives import all_reduce, broadcast_object
from rlkit.config.rules import local_path_exists, parse, validate
from rlkit.config.schema import CONFIG_DIR, ConfigError, RLConfig, register_configs, to_dict
from rlkit.data import loading
from rlkit.data import sft as sft_data
from rlkit.data.prompts import PromptOrder
from rlkit.learner import Learner
from rlkit.learner.strategy import make_accelerator
from rlkit.logging import MetricsLogger
from rlkit.models import load_tokenizer
from rlkit.rollout.local import LocalRollouts
from rlkit.train import default_num_processes, launch, one_run_dir
from rlkit.vision import load_processor

__all__ = ["SFTRun", "load_config", "main", "run"]

log = logging.getLogger(__name__)

register_configs()

# Keys an SFT run sets itself: its loss is the NLL of the rows' tokens; rows are not groups (the estimator, unused,
# is one that needs none).
FIXED = {
    "algo.name": "sft", "algo.policy_loss": "nll", "algo.loss_agg_mode": "token-mean", "rollout.group_size": 1,
    "algo.dynamic_sampling": "off", "algo.rollout_is.enabled": False, "algo.adv_estimator": "reinforce_pp",
    "algo.norm_by_std": False, "algo.mask_zero_std_groups": False,
}  # fmt: skip
# Keys whose RL meaning an SFT step has not: any other value than this is refused, by name.
NEUTRAL = {
    "algo.kl_coef": 0.0, "algo.entropy_coef": 0.0, "algo.rollout_kl_coef": 0.0, "algo.distill_coef": 0.0,
    "algo.value_model": False, "algo.ppo_epochs": 1, "algo.mini_batches": 1, "rollout.temperature": 1.0,
    "rollout.top_p": 1.0, "rollout.top_k": 0, "trainer.mode": "sync",
}  # fmt: skip


def sft_config(cfg: DictConfig) -> DictConfig:
    """The composed config with the keys an SFT run fixes set (`FIXED`); a key of `NEUTRAL` set otherwise is a
    ConfigError naming it (an RL term that SFT would silently ignore)."""
    cfg = cfg.copy()
    for key, neutral in NEUTRAL.items():
        value = OmegaConf.select(cfg, key, default=neutral)
        if value != neutral:
            raise ConfigError(
                f"{key}={value!r} has no meaning in python -m rlkit.sft (a supervised step has no rollout, "
                f"reference or critic): leave it at {neutral!r}"
            )
    with read_write(cfg):
        for key, value in FIXED.items():
            OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def rows_and_steps(cfg: RLConfig):
    """(tokenizer, train SFTSet, eval SFTSet or None); sets trainer.steps from sft.epochs. Loads the data and
    the tokenizer, not the model: a data error stops the run here."""
    tokenizer = load_tokenizer(cfg.model.path)
    sft_data.check_tokenizer(tokenizer, cfg.model.path)
    processor = load_processor(cfg.model.path) if cfg.data.image_key is not None else None
    train, held_out = loading.load_splits(cfg.data, seed=cfg.trainer.seed)
    rows = sft_data.build_sft_set(
        train, tokenizer, cfg.data, cfg.sft, split=cfg.data.train_split, processor=processor
    )
    evals = None
    if len(held_out):
        evals = sft_data.build_sft_set(
            held_out, tokenizer, cfg.data, cfg.sft, split=cfg.data.eval_split or "eval", processor=processor
        )
    if cfg.sft.epochs is not None:
        cfg.trainer.steps = math.ceil(cfg.sft.epochs * len(rows) / cfg.trainer.train_batch_size)
    return tokenizer, rows, evals


def load_config(cfg, *, world_size: int = 1) -> RLConfig:
    """Composed Hydra config -> checked `RLConfig` for SFT: the fixed keys, the schema's rules, the components'
    checks, then the rows (which set trainer.steps under sft.epochs), before any model loads."""
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    config = parse(sft_config(cfg), world_size=world_size)
    learner.strategy.resolve_dtypes(config)
    local_path_exists("model.path", config.model.path)
    for check in (loading.check_config, learner.check_config, trainer.check_config, sft_data.check_config):
        check(config)
    steps = config.trainer.steps
    rows_and_steps(config)
    if config.trainer.steps != steps:  # sft.epochs set them: the rules that depend on the steps, again
        validate(config, world_size=world_size)
    return config


class SFTRun(contextlib.AbstractContextManager):
    """One rank of an SFT run: the learner, the rows, the run directory; `train()` runs to trainer.steps."""

    def __init__(self, cfg: RLConfig):
        self.cfg, t = cfg, cfg.trainer
        self.accelerator = make_accelerator(cfg)
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.is_main = self.rank == 0
        self.run_dir = Path(broadcast_object(str(Path(t.run_dir).resolve()), self.world))
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock, resume_from = trainer.guard_run_dir(self.run_dir, t.resume, self.world, self.is_main)
        self.tokenizer, self.rows, self.evals = rows_and_steps(cfg)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.learner = Learner(cfg, self.accelerator)
        self.rollouts = None  # sft.generation_eval: the rollout side, for its evaluation only
        if cfg.sft.generation_eval:
            self.rollouts = LocalRollouts(
                cfg, rank=self.rank, world=self.world, device=self.learner.device, tokenizer=self.tokenizer
            )
        self.order = PromptOrder(len(self.rows), t.seed)
        self.step, self.wandb_id, self._stop = 0, None, None
        if resume_from is not None:
            state = checkpoints.checkpoint_state(resume_from)
            self.learner.load_checkpoint(resume_from)
            self.step, self.order.position = state["step"], state["data_position"]
            self.wandb_id = state.get("wandb_id")
            if self.is_main:
                print(f"Resumed from {resume_from} at step {self.step}", flush=True)
        if self.rollouts is not None:  # the engine gets (and verifies) the weights of this step
            self.rollouts.start(self.learner.export(), self.step, evaluate=True)
        self.logger = None
        if self.is_main:
            lc = cfg.logger
            self.logger = MetricsLogger(
                lc.backend, self.run_dir, to_dict(cfg), project=lc.project, entity=lc.entity, name=lc.name,
                tags=lc.tags, resume_id=self.wandb_id,
            )  # fmt: skip
            self.wandb_id = self.logger.run_id
            rundir.write_own(self.run_dir / "config.json", json.dumps(to_dict(cfg), indent=2))

    def batch(self, indices: list[int]):
        """This rank's contiguous share of the global batch `indices`, as the learner's TrainBatch."""
        share = len(indices) // self.world
        mine = indices[self.rank * share : (self.rank + 1) * share]
        images = [self.rows.images[i] for i in mine] if self.rows.images is not None else None
        return sft_data.train_batch(
            [self.rows.token_ids[i] for i in mine],
            [self.rows.loss_masks[i] for i in mine],
            self.pad_id,
            images,
        )

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        batch = self.batch(self.order.next(self.cfg.trainer.train_batch_size))
        stats = self.learner.update(batch)
        metrics = {k: float(v) for k, v in stats.items()}
        metrics["loss"] = metrics["loss/policy"]
        metrics["perf/step_seconds"] = time.perf_counter() - start
        metrics["sft/epoch"] = self.order.position / len(self.rows)
        return metrics

    def eval_loss(self) -> dict[str, float]:
        """The held-out rows' token-mean NLL under the current weights. Every rank scores every eval row (they
        are few): the same number, no collective beyond the forward's own."""
        e = self.evals
        batch = sft_data.train_batch(e.token_ids, e.loss_masks, self.pad_id, e.images)
        logp = self.learner.forward(batch).logprobs.cpu()
        mask = batch.response_mask
        nll = -torch.where(mask, logp, 0.0).sum() / mask.sum()
        return {"eval/loss": float(nll), "eval/tokens": float(mask.sum())} | self.eval_generation()

    def eval_generation(self) -> dict[str, float]:
        """sft.generation_eval: the engine gets this step's weights (verified) and the rollout side's evaluation
        generates on the held-out prompts and scores them (`eval/pass@k`, `eval/reward_mean`, ...)."""
        if self.rollouts is None:
            return {}
        if self.step > 0:
            self.rollouts.push(self.learner.export(), self.step, evaluate=True)
        return self.rollouts.evaluate(self.step)

    def save_checkpoint(self) -> None:
        """`checkpoints/step_<k>` as RL writes it (`rlkit.trainer.write_checkpoint`), its state the step and the
        data position."""
        trainer.write_checkpoint(
            self.run_dir, self.step, self.learner, self.accelerator, self.tokenizer, is_main=self.is_main,
            world=self.world, keep_last=self.cfg.trainer.keep_last,
            state=lambda tmp: {"data_position": self.order.position, "wandb_id": self.wandb_id},
        )  # fmt: skip

    def _stopping(self) -> bool:
        device = self.learner.device
        flag = torch.tensor([1.0 if self._stop is not None else 0.0], device=device)
        return bool(all_reduce(flag, self.world, device)[0] > 0)

    def _on_signal(self, signum, frame):
        self._stop = signum
        log.warning("received signal %d: finishing this step, writing a checkpoint and exiting", signum)

    def train(self) -> list[dict[str, float]]:
        """Steps from the current one to trainer.steps; returns each step's logged metrics."""
        t, history = self.cfg.trainer, []
        previous = {}
        for sig in trainer.STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            if self.evals is not None and t.eval_at_start and self.step == 0:
                at_start = self.eval_loss()  # every rank runs the forward
                if self.logger is not None:
                    self.logger.log(at_start, step=0)
            while self.step < t.steps:
                metrics = self.train_step()
                self.step += 1
                last = self.step == t.steps
                if self.evals is not None and ((t.eval_every and self.step % t.eval_every == 0) or last):
                    metrics.update(self.eval_loss())
                self.learner.stop_after_nonfinite_steps(self.step, metrics)
                stop = self._stopping()
                history.append(metrics)
                if self.logger is not None:
                    self.logger.log(metrics, step=self.step)
                if (t.save_every and self.step % t.save_every == 0) or last or stop:
                    self.save_checkpoint()
                if stop:
                    log.warning("stopped by signal %s at step %d (checkpoint written)", self._stop, self.step)
                    break
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return history

    def __exit__(self, *exc) -> None:
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def run(cfg: RLConfig) -> list[dict[str, float]]:
    """Build this rank's SFTRun, train, clean up. Returns the per-step metrics."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with gcpolicy.setup_phase():
        sft_run = SFTRun(cfg)
    with sft_run:
        return sft_run.train()


def _worker(config: dict) -> None:
    """Entry of each process `rlkit.train.launch` starts for SFT (module level so it can be pickled)."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    run(load_config(config, world_size=int(os.environ.get("WORLD_SIZE", "1"))))


def main_from_config(cfg: DictConfig) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun / accelerate launch
        _worker(cfg)
        return
    n = default_num_processes(sft_config(cfg))
    config = load_config(cfg, world_size=n)
    if n == 1:
        run(config)
    else:
        launch(config, n, worker=_worker)


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    main_from_config(one_run_dir(cfg))


if __name__ == "__main__":
    main()
