"""The learner's part of a checkpoint: `model/` (HF format), `adapter/` (LoRA), `value_model/` (critic) and
`state/` (optimizer, schedulers, RNG). Loading never runs code: tensors load with `weights_only=True`,
the schedulers from JSON, and a checkpoint holding pickled objects is refused."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import pickle
from pathlib import Path

from torch import Tensor

from rlkit.learner.lora import base_name
from rlkit.weights import iter_full_parameters, tied_aliases

SCHEDULERS_FILE = "schedulers.json"  # LR scheduler states, in a checkpoint's state/ directory


def _schedulers(learner) -> list:
    return [s for s in (learner.scheduler, learner.value_scheduler) if s is not None]


def save(learner, directory: str | Path) -> None:
    """Write the learner's part of a checkpoint into `directory`. Every rank must call it.

    Under FSDP2 `dir/state` holds sharded DCP checkpoints (each rank writes its own shards) instead of one
    full copy. Ordering: the main process writes the HF files and the unsharded state files alone, so the
    closing barrier keeps every rank from returning (and, say, loading the checkpoint) while the main
    process is still writing it.
    """
    directory = Path(directory)
    acc = learner.accelerator
    for name, model in (("model", learner.model), ("value_model", learner.value_model)):
        if model is None:
            continue
        if name == "model" and learner.lora:
            _save_lora(learner, directory)
            continue
        state_dict = acc.get_state_dict(model)  # full weights, gathered on the main process
        unwrapped = acc.unwrap_model(model)
        # FSDP2's gathered state dict gives a tied head its own copy, which save_pretrained (deduplicating by
        # storage) would write twice; saved once under its first name it reloads tied, as in one process.
        for alias in _alias_names(unwrapped):
            state_dict.pop(alias, None)
        unwrapped.save_pretrained(
            directory / name, state_dict=state_dict, is_main_process=acc.is_main_process
        )
    with _tied_heads_expected(acc.unwrap_model(learner.model)):
        acc.save_state(str(directory / "state"))
    if acc.is_main_process:  # plain JSON, not a pickle: loading a checkpoint never runs code
        states = [s.state_dict() for s in _schedulers(learner)]
        (directory / "state" / SCHEDULERS_FILE).write_text(json.dumps(states))
    acc.wait_for_everyone()


class _TiedFilter(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...} while saving" when every tensor it names is a tied alias
    of the model (a tied head is saved once, under its first name, and reloads tied): expected, not a problem."""

    def __init__(self, aliases: set[str]):
        super().__init__()
        self.aliases = aliases

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()  # accelerate may prefix "[RANK 0] "
        if "Removed shared tensor " not in message:
            return True
        try:
            names = ast.literal_eval(message.split("Removed shared tensor ", 1)[1].split(" while saving")[0])
        except (ValueError, SyntaxError):
            return True
        return not (names and set(names) <= self.aliases)


def _alias_names(model) -> set[str]:
    """Every name of a tied parameter other than its first (e.g. a tied `lm_head.weight`)."""
    return {a for names in tied_aliases(model).values() for a in names}


@contextlib.contextmanager
def _tied_heads_expected(model):
    f = _TiedFilter(_alias_names(model))
    logger = logging.getLogger("accelerate.utils.other")
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _save_lora(learner, directory: Path) -> None:
    """`dir/model`: the merged weights as a plain HF checkpoint, as without LoRA; `dir/adapter`: the
    adapter alone in peft's format (PeftModel.from_pretrained). One gathering pass over the parameters
    serves both (every rank iterates it in step)."""
    acc, peft_model = learner.accelerator, learner.accelerator.unwrap_model(learner.model)
    adapters: dict[str, Tensor] = {}

    def keep_adapters(named):
        for n, t in named:
            if base_name(n) is None:
                adapters[n] = t.clone()
            yield n, t

    merged = {n: t.clone() for n, t in learner.merged(keep_adapters(iter_full_parameters(peft_model)))}
    peft_model.get_base_model().save_pretrained(
        directory / "model", state_dict=merged, is_main_process=acc.is_main_process
    )
    peft_model.save_pretrained(
        directory / "adapter", state_dict=adapters, is_main_process=acc.is_main_process
    )


def load(learner, directory: str | Path) -> None:
    """Restore what `save` wrote (weights, optimizer and scheduler states, RNG).

    Nothing in a checkpoint can run code: tensors load with torch's `weights_only=True` (accelerate's
    default), the schedulers from JSON; a checkpoint holding pickled objects (accelerate's
    `custom_checkpoint_*.pkl`, which it unpickles with `weights_only=False`) is refused.
    Every rank must call it, with the world size of the save (RNG states are per rank).
    """
    learner.accelerator.wait_for_everyone()  # no rank reads before every rank is done writing
    state = Path(directory) / "state"
    pickled = sorted(p.name for p in state.glob("custom_checkpoint_*.pkl"))
    if pickled:
        raise RuntimeError(
            f"checkpoint {directory} holds pickled objects ({', '.join(pickled)}): rlkit never unpickles "
            "them, since a crafted file would run code on resume. Resume from a checkpoint written by this "
            "version of rlkit, or start a new run (trainer.run_dir=NEW_DIR)."
        )
    try:
        from accelerate.utils import load as accelerate_load

        # accelerate loads the RNG states with weights_only=True too, but ignores a failure silently.
        rng = state / f"random_states_{learner.accelerator.process_index}.pkl"
        if rng.exists():
            accelerate_load(rng)
        learner.accelerator.load_state(str(state))
    except pickle.UnpicklingError as e:
        raise RuntimeError(
            f"checkpoint {directory}: a file is not plain tensors and was refused by torch.load("
            f"weights_only=True), so it was not run: {str(e).splitlines()[0]}"
        ) from e
    states = json.loads((state / SCHEDULERS_FILE).read_text())
    schedulers = _schedulers(learner)
    if len(states) != len(schedulers):
        raise RuntimeError(
            f"checkpoint {directory} holds {len(states)} LR scheduler states, this run has "
            f"{len(schedulers)} (algo.value_model differs?)"
        )
    for scheduler, sd in zip(schedulers, states):
        scheduler.load_state_dict(sd)
    learner.global_step = learner.scheduler.last_epoch
