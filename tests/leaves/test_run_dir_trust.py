"""A run directory is trusted no further than rlkit needs (docs/guides/operations.md, "Run directories"):
files rlkit writes there are never written through a symlink, a pipe or a hard link; a resume refuses a
checkpoint written by another model, algorithm, group size or critic, naming the key and both values; a
checkpoint step written again keeps the old folder aside, with a warning naming it."""

import json
import logging
import os

import pytest

from rlkit import checkpoints, rundir


@pytest.fixture
def victim(tmp_path):
    """A file outside the run directory that a hostile run directory points at."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text("precious\n")
    return path


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.mark.parametrize("name", [rundir.LOCK_FILE, "config.json", rundir.METRICS_FILE, "train.log"])
def test_a_symlinked_file_in_the_run_dir_is_refused_naming_it(run_dir, victim, name):
    (run_dir / name).symlink_to(victim)
    with pytest.raises(rundir.RunDirError, match=rf"{run_dir / name} is a symlink"):
        rundir.check_own_files(run_dir)
    assert victim.read_text() == "precious\n"


def test_the_lock_is_never_taken_through_a_symlink(run_dir, victim):
    """Before: the lock file was opened with open(path, "a+") and truncated to the pid: the victim held the pid."""
    (run_dir / rundir.LOCK_FILE).symlink_to(victim)
    with pytest.raises(rundir.RunDirError, match="rlkit.lock is a symlink"):
        rundir.RunDirLock(run_dir)
    assert victim.read_text() == "precious\n"


def test_own_files_are_opened_as_regular_files_only(run_dir, victim):
    with pytest.raises(rundir.RunDirError, match="metrics.jsonl is a symlink"):
        (run_dir / rundir.METRICS_FILE).symlink_to(victim)
        rundir.open_own(run_dir / rundir.METRICS_FILE)
    pipe = run_dir / rundir.SAMPLES_FILE
    os.mkfifo(pipe)  # opening it for writing would block until a reader came: refused at once instead
    with pytest.raises(rundir.RunDirError, match="samples.jsonl is not a regular file"):
        rundir.open_own(pipe)
    os.link(victim, run_dir / "curves.png")  # a hard link writes into the victim as well as a symlink does
    with pytest.raises(rundir.RunDirError, match="curves.png is a hard link"):
        rundir.open_own(run_dir / "curves.png", "wb")
    assert victim.read_text() == "precious\n"
    with rundir.open_own(run_dir / "fresh.jsonl") as f:  # an ordinary file is created and appended to
        f.write("a\n")
    with rundir.open_own(run_dir / "fresh.jsonl") as f:
        f.write("b\n")
    assert (run_dir / "fresh.jsonl").read_text() == "a\nb\n"


def test_write_own_replaces_a_symlink_instead_of_writing_through_it(run_dir, victim):
    (run_dir / "config.json").symlink_to(victim)
    rundir.write_own(run_dir / "config.json", "{}")
    assert victim.read_text() == "precious\n"
    assert not (run_dir / "config.json").is_symlink() and (run_dir / "config.json").read_text() == "{}"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json"]  # no temporary file left


def test_cutting_metrics_back_never_writes_through_a_symlink(run_dir, victim):
    lines = [json.dumps({"step": s}) for s in (1, 2, 3)]
    (run_dir / rundir.METRICS_FILE).write_text("\n".join(lines) + "\n")
    (run_dir / f".{rundir.METRICS_FILE}.tmp").symlink_to(victim)  # the temporary name the cut used before
    assert rundir.truncate_metrics(run_dir, 1) == 2
    assert victim.read_text() == "precious\n"
    assert (run_dir / rundir.METRICS_FILE).read_text() == lines[0] + "\n"


def _checkpoint(run_dir, step, resume_keys=None, critic=False):
    tmp, final = checkpoints.checkpoint_dirs(run_dir, step)
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "weights.bin").write_bytes(bytes(range(256)) * 4)
    if critic:
        (tmp / "value_model").mkdir()
    state = {"step": step} if resume_keys is None else {"step": step, "resume_keys": resume_keys}
    checkpoints.commit_checkpoint(tmp, final, state)
    return final


def test_a_damaged_checkpoint_written_again_is_kept_aside_with_a_warning(run_dir, caplog):
    """Before: commit_checkpoint deleted the existing folder of the step (shutil.rmtree) without a word."""
    _checkpoint(run_dir, 1)
    damaged = _checkpoint(run_dir, 2)
    weights = damaged / "model" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated: does not verify
    assert checkpoints.newest_good_checkpoint(run_dir).name == "step_1"
    with caplog.at_level(logging.WARNING, logger="rlkit.rundir"):
        _checkpoint(run_dir, 2)  # the resumed run writes step 2 again
    aside = run_dir / "checkpoints" / "step_2.replaced-1"
    assert (aside / "model" / "weights.bin").read_bytes() == bytes(range(100))  # the damaged files, intact
    assert checkpoints.check_checkpoint(run_dir / "checkpoints" / "step_2") is None
    assert str(aside) in caplog.text and "did not verify" in caplog.text
    _checkpoint(run_dir, 3)
    checkpoints.prune_checkpoints(run_dir, keep=1)  # pruning never touches a folder kept aside
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2.replaced-1", "step_3"]


RECORD = {
    "model.path": "/models/a", "model.shape": {"hidden_size": 64, "num_hidden_layers": 2},
    "model.lora.rank": 0, "algo.adv_estimator": "grpo", "algo.policy_loss": "ppo_clip",
    "algo.value_model": False, "rollout.group_size": 4,
}  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model.path", "/models/b"),  # another model of the same shape
        ("model.shape", {"hidden_size": 64, "num_hidden_layers": 3}),
        ("algo.adv_estimator", "rloo"),
        ("rollout.group_size", 8),
        ("algo.value_model", True),
    ],
)
def test_a_resume_with_another_run_key_is_refused_naming_it_and_both_values(run_dir, key, value):
    ckpt = _checkpoint(run_dir, 1, resume_keys=RECORD)
    checkpoints.check_resume_keys(ckpt, RECORD)  # the same run resumes
    with pytest.raises(RuntimeError, match=rf"{key} was {RECORD[key]!r}.*this run has {value!r}") as e:
        checkpoints.check_resume_keys(ckpt, {**RECORD, key: value})
    assert str(ckpt) in str(e.value)


def test_a_checkpoint_without_a_record_is_checked_for_its_critic(run_dir):
    """A checkpoint written before rlkit recorded its keys: its value_model/ folder says whether it had a critic."""
    plain = _checkpoint(run_dir, 1)
    with pytest.raises(RuntimeError, match="algo.value_model was False.*this run has True"):
        checkpoints.check_resume_keys(plain, {**RECORD, "algo.value_model": True})
    checkpoints.check_resume_keys(plain, {**RECORD, "rollout.group_size": 16})  # nothing else is known


def test_resume_record_reads_the_keys_from_a_config():
    config = {
        "model": {"path": "/m", "lora": {"rank": 8}},
        "algo": {"adv_estimator": "gae", "policy_loss": "ppo_clip", "value_model": True},
        "rollout": {"group_size": 1},
    }
    assert checkpoints.resume_record(config, {"hidden_size": 8}) == {
        "model.path": "/m", "model.shape": {"hidden_size": 8}, "model.lora.rank": 8, "algo.adv_estimator": "gae",
        "algo.policy_loss": "ppo_clip", "algo.value_model": True, "rollout.group_size": 1,
    }  # fmt: skip
