"""Reliability (issue #24, items 1 and 3), with the tiny model of run_helpers:

- a non-finite loss or gradient norm never reaches the optimizer: the step is skipped and counted, and
  `trainer.max_nonfinite_steps` skipped steps in a row stop the run with an error naming the step;
- rewards beyond `MAX_ABS_REWARD` are reward errors, never advantages;
- a checkpoint is never written from non-finite weights;
- every checkpoint records the size and sha256 of its files (`checksums.json`); a resume skips a newest
  checkpoint with NaN weights, a zero-byte, truncated or empty file, naming the file, and falls back to
  the previous one; pruning keeps the last good checkpoint;
- a full disk says "no space left", names the file, removes the temporary directory and leaves the previous
  checkpoint intact.

The names these tests check are imported inside them, so that each test fails on its own against the code
before these guarantees (run with PYTHONPATH pointing at it)."""

import errno
import hashlib
import json
import logging
import math
import re
import shutil
from pathlib import Path

import pytest
import run_helpers
import torch
from run_helpers import read_jsonl, train
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow  # trainer runs: `make test-fast` leaves it out

tiny = run_helpers.tiny  # the tiny model fixture


def _finite_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    weights = load_file(ckpt / "model" / "model.safetensors")
    for name, t in weights.items():
        assert torch.isfinite(t).all(), f"{ckpt}: {name} holds NaN or inf"
    return weights


def _steps(run_dir: Path) -> list[int]:
    return [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")]


# -- 1. non-finite steps and rewards -------------------------------------------------------------------


def test_lr_1e3_skips_nonfinite_steps_writes_no_nan_checkpoint_and_stops_naming_the_step(tiny, tmp_path):
    """lr=1e3: step 1 blows the weights up to ~1e3 (finite), the loss of every later step is NaN. Before the
    guard, step 2 wrote a NaN checkpoint and step 3 crashed in sampling ("probability tensor contains inf")."""
    run_dir = tmp_path / "r"
    args = ["trainer.lr=1e3", "trainer.steps=8", "trainer.save_every=1", "trainer.keep_last=0"]
    with pytest.raises(RuntimeError) as e:
        train(tiny, run_dir, *args, "trainer.eval_at_start=false")
    # Steps 2 and 3 were checkpointed (the stop comes at step 4, before its checkpoint): finite weights,
    # equal to step 1's, since a skipped step changes nothing.
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    first = _finite_weights(ckpts[0])
    for ckpt in ckpts[1:]:
        weights = _finite_weights(ckpt)
        assert all(torch.equal(weights[k], first[k]) for k in first), ckpt
    assert [p.name for p in ckpts] == ["step_1", "step_2", "step_3"]
    from rlkit.learner.optim import NonFiniteError

    assert isinstance(e.value, NonFiniteError), e.value
    assert str(e.value).startswith("step 4: 3 optimizer steps in a row were skipped")
    assert "trainer.max_nonfinite_steps=3" in str(e.value) and "trainer.lr=1000.0" in str(e.value)
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]  # the stopping step's line is written
    assert [line["train/nonfinite_steps"] for line in lines] == [0, 1, 1, 1]
    assert all(math.isnan(float(line["grad_norm"])) for line in lines[1:])  # the per-step value is kept
    # The LR schedule counts applied steps only: one optimizer step was taken.
    schedulers = json.loads((ckpts[-1] / "state" / "schedulers.json").read_text())
    assert schedulers[0]["last_epoch"] == 1


def test_a_skipped_step_changes_nothing_and_the_schedule_counts_applied_steps():
    """The optimizer step alone (rlkit/learner/optim.py): skipped on a device flag, no host sync."""
    from types import SimpleNamespace

    from rlkit.learner import optim

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    trainer = SimpleNamespace(
        lr=0.1, betas=(0.9, 0.999), weight_decay=0.1, warmup_steps=2, lr_schedule="cosine"
    )
    opt = optim.adamw(model, trainer)
    sched = optim.scheduler(opt, trainer, total_steps=10)

    def set_grads(value):
        for p in model.parameters():
            p.grad = torch.full_like(p, value)

    set_grads(1.0)
    optim.step(opt, sched, torch.tensor(False))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model.weight].items()}
    lr = sched.get_last_lr()
    set_grads(float("nan"))
    optim.step(opt, sched, torch.tensor(True))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, moments[k]) for k, v in opt.state[model.weight].items())  # step count too
    assert all(p.grad is None for p in model.parameters())
    optim.unschedule(sched, 1)
    assert sched.last_epoch == 1 and sched.get_last_lr() == lr and opt.param_groups[0]["lr"] == lr[0]
    set_grads(1.0)
    optim.step(opt, sched, torch.tensor(False))
    assert not torch.equal(model.weight, weights["weight"]) and sched.last_epoch == 2


def test_a_reward_beyond_the_bound_is_a_reward_error(tiny, tmp_path):
    """1e308 is finite, but a batch's mean and std of it are not: before the bound it made NaN advantages,
    NaN weights and a crash in sampling."""
    run_dir = tmp_path / "r"
    hist = train(
        tiny, run_dir, "reward.fn=rlkit_test_rewards:huge", "trainer.steps=2", "trainer.eval_at_start=false"
    )
    assert sum(m["reward/errors"] for m in hist) > 0
    for m in hist:
        assert math.isfinite(m["grad_norm"]) and math.isfinite(m["loss/total"]) and m["reward/max"] <= 1e6
        assert m["train/nonfinite_steps"] == 0
    from rlkit.rewards.functions import MAX_ABS_REWARD, call_reward

    assert MAX_ABS_REWARD == 1e6
    ((value, error),) = call_reward("rlkit_test_rewards:huge", [("q", "odd", "a", {})])
    assert value == 0.0 and "out of range" in error and "1e+06" in error
    assert call_reward("rlkit_test_rewards:huge", [("q", "even", "a", {})]) == [(0.0, None)]
    _finite_weights(run_dir / "checkpoints" / "step_2")


def test_a_checkpoint_is_never_written_from_nonfinite_weights(tiny, tmp_path, monkeypatch):
    from rlkit.trainer import Trainer

    real_step = Trainer.train_step

    def poison_step_2(self):
        metrics = real_step(self)
        if self.global_step == 1:  # the step that becomes step 2
            with torch.no_grad():
                next(self.learner.model.parameters()).fill_(float("nan"))
        return metrics

    monkeypatch.setattr(Trainer, "train_step", poison_step_2)
    run_dir = tmp_path / "r"
    with pytest.raises(RuntimeError) as e:
        train(tiny, run_dir, "trainer.steps=3", "trainer.save_every=1", "trainer.eval_at_start=false")
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_1"]  # no step_2, no .tmp-step_2
    from rlkit.checkpoints import CheckpointError, check_checkpoint

    assert isinstance(e.value, CheckpointError), e.value
    assert re.match(
        r"step 2: checkpoint .*step_2: refusing to write it, parameters hold NaN or inf "
        r"\(model.embed_tokens.weight\); the previous checkpoint \(.*step_1\) is kept",
        str(e.value),
    )
    assert check_checkpoint(run_dir / "checkpoints" / "step_1") is None


# -- 3. checkpoints you can trust ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tiny, tmp_path_factory):
    """A run with checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("two") / "run"
    train(tiny, run_dir, "trainer.steps=2", "trainer.save_every=1", "trainer.eval_at_start=false")
    return run_dir


def test_every_file_of_a_checkpoint_has_its_size_and_sha256_recorded(two_checkpoints):
    ckpt = two_checkpoints / "checkpoints" / "step_2"
    recorded = json.loads((ckpt / "checksums.json").read_text())["files"]
    on_disk = {p.relative_to(ckpt).as_posix(): p for p in ckpt.rglob("*") if p.is_file()}
    assert set(recorded) == set(on_disk) - {"checksums.json"}
    for required in (
        "model/model.safetensors",
        "model/config.json",
        "state/optimizer.bin",
        "trainer_state.json",
    ):
        assert required in recorded, required
    for rel, path in on_disk.items():
        if rel != "checksums.json":
            assert recorded[rel] == {
                "size": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }


def _zero(path: Path) -> None:
    path.write_bytes(b"")


def _halve(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "rel, damage, why",
    [
        ("model/model.safetensors", _zero, "has 0 bytes"),
        ("state/optimizer.bin", _halve, "bytes, checksums.json recorded"),
        ("trainer_state.json", _zero, "has 0 bytes"),
        ("model/model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-8] + b"\0" * 8), "sha256"),
    ],
    ids=["zero-byte-model", "truncated-optimizer", "empty-trainer-state", "corrupted-model"],
)
def test_resume_skips_a_damaged_newest_checkpoint_naming_the_file(tiny, two_checkpoints, tmp_path, caplog, rel, damage, why):  # fmt: skip
    run_dir = tmp_path / "r"
    shutil.copytree(two_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step_2"
    damage(newest / rel)
    with caplog.at_level(logging.WARNING, logger="rlkit.rundir"):
        hist = train(tiny, run_dir, "trainer.steps=3", "trainer.save_every=1", "trainer.eval_at_start=false")
    assert f"checkpoint {newest} is not usable: {rel}" in caplog.text and why in caplog.text
    assert (
        f"resuming from the previous complete checkpoint {run_dir / 'checkpoints' / 'step_1'}" in caplog.text
    )
    assert len(hist) == 2  # steps 2 and 3, from step 1
    assert _steps(run_dir) == [1, 2, 3]
    _finite_weights(newest)  # step 2 rewritten, whole


def test_resume_skips_a_newest_checkpoint_with_nan_weights(tiny, two_checkpoints, tmp_path, caplog):
    """As a writer without the guard left it: NaN weights (in the HF export and in the learner's state)
    and no checksums.json."""
    run_dir = tmp_path / "r"
    shutil.copytree(two_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step_2"
    for path in (newest / "model" / "model.safetensors", newest / "state" / "model.safetensors"):
        weights = load_file(path)
        name = sorted(weights)[0]
        weights[name] = torch.full_like(weights[name], float("nan"))
        save_file(weights, path, metadata={"format": "pt"})
    (newest / "checksums.json").unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING, logger="rlkit.rundir"):
        hist = train(tiny, run_dir, "trainer.steps=3", "trainer.save_every=1", "trainer.eval_at_start=false")
    assert f"checkpoint {newest} is not usable: " in caplog.text and "holds NaN or inf" in caplog.text
    assert len(hist) == 2 and _steps(run_dir) == [1, 2, 3]
    _finite_weights(newest)


def test_a_full_disk_says_no_space_left_removes_the_partial_checkpoint_and_keeps_the_previous(
    tiny, tmp_path, monkeypatch
):
    from rlkit.learner import checkpoint

    real_save = checkpoint.save

    def save_until_full(learner, directory):
        if Path(directory).name != ".tmp-step_2":
            return real_save(learner, directory)
        target = Path(directory) / "model" / "model.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"\0" * 100)  # the part that fit
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr(checkpoint, "save", save_until_full)
    run_dir = tmp_path / "r"
    with pytest.raises((OSError, RuntimeError)) as e:  # before the guarantee: the bare OSError
        train(tiny, run_dir, "trainer.steps=3", "trainer.save_every=1", "trainer.eval_at_start=false")
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]  # the temporary directory is gone
    from rlkit.checkpoints import CheckpointError, check_checkpoint

    assert isinstance(e.value, CheckpointError), e.value
    assert re.match(r"no space left on device writing .*tmp-step_2/model/model.safetensors", str(e.value))
    assert check_checkpoint(root / "step_1") is None
    monkeypatch.setattr(checkpoint, "save", real_save)
    hist = train(tiny, run_dir, "trainer.steps=3", "trainer.save_every=1", "trainer.eval_at_start=false")
    assert len(hist) == 2 and _steps(run_dir) == [1, 2, 3]


def _fake_checkpoint(run_dir: Path, step: int) -> Path:
    from rlkit.checkpoints import checkpoint_dirs, commit_checkpoint

    tmp, final = checkpoint_dirs(run_dir, step)
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "weights.bin").write_bytes(bytes(range(256)) * 4)
    commit_checkpoint(tmp, final, {"step": step})
    return final


def test_pruning_keeps_the_last_good_checkpoint_until_newer_ones_verify(tmp_path):
    from rlkit.checkpoints import prune_checkpoints

    ckpts = [_fake_checkpoint(tmp_path, step) for step in (1, 2, 3)]
    _halve(ckpts[2] / "model" / "weights.bin")  # step 3 is damaged
    prune_checkpoints(tmp_path, keep=1)
    # step 2 is the newest good one: kept; step 1 is older than it: deleted; step 3 is left for a human.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_3"]
    _zero(ckpts[1] / "trainer_state.json")
    _fake_checkpoint(tmp_path, 4)
    prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4"]
