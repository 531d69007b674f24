"""Data is never served stale (docs/guides/operations.md, "Data"): a file rewritten in place with its mtime
restored (`cp -p`, `rsync -t`) is read again, by rlkit's in-process cache and by datasets' on-disk one; rows
that disagree with rlkit's scan of the file are never used; the preflight's load is the rollout side's; a
prompt repeated in a file is never both trained on and held out."""

import json
import logging
import os
from types import SimpleNamespace

import pytest

from rlkit.config.schema import DataConfig, EnvConfig
from rlkit.data import loading


@pytest.fixture(autouse=True)
def fresh_caches(tmp_path, monkeypatch):
    """datasets' on-disk cache in the test's folder; rlkit's in-process cache empty."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "rlkit-cache"))
    loading._LOADED.clear()
    yield
    loading._LOADED.clear()


def _write(path, answers, mtime_ns=None):
    """Rows q0.. with the given answers (each the same length: the file keeps its size); the mtime restored."""
    path.write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers))
    )
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def _answers(path, **kw):
    train, ev = loading.load_splits(DataConfig(path=str(path), eval_size=0, **kw))
    return sorted(train["answer"])


@pytest.mark.parametrize("new_process", [False, True], ids=["same process", "new process"])
def test_a_file_rewritten_with_its_mtime_restored_is_read_again(tmp_path, new_process):
    """Before: the same process got the old rows from rlkit's cache (keyed by size and mtime), and a new one
    from datasets' cache (keyed by mtime)."""
    f = tmp_path / "rows.jsonl"
    _write(f, ["#### 1", "#### 2", "#### 3"])
    assert _answers(f) == ["#### 1", "#### 2", "#### 3"]
    mtime, size = f.stat().st_mtime_ns, f.stat().st_size
    _write(f, ["#### 7", "#### 8", "#### 9"], mtime_ns=mtime)  # as `cp -p` leaves it
    assert (f.stat().st_mtime_ns, f.stat().st_size) == (mtime, size)
    if new_process:  # what a new process has: datasets' cache on disk, nothing in memory
        loading._LOADED.clear()
    assert _answers(f) == ["#### 7", "#### 8", "#### 9"]


def test_a_large_file_is_keyed_by_its_change_time_and_inode(tmp_path, monkeypatch):
    """Beyond HASHED_MAX the key is (size, mtime, inode, ctime): a rewrite in place with the mtime restored
    still changes the ctime, which no user tool sets back."""
    monkeypatch.setattr(loading, "HASHED_MAX", 8)
    f = tmp_path / "rows.jsonl"
    _write(f, ["#### 1", "#### 2"])
    key = loading.file_key(f)
    assert key[2:4] == [f.stat().st_mtime_ns, f.stat().st_ino]  # not hashed
    assert _answers(f) == ["#### 1", "#### 2"]
    _write(f, ["#### 5", "#### 6"], mtime_ns=f.stat().st_mtime_ns)
    assert loading.file_key(f) != key
    loading._LOADED.clear()
    assert _answers(f) == ["#### 5", "#### 6"]


def test_rows_that_disagree_with_the_scan_are_loaded_again_loudly_or_refused(tmp_path, monkeypatch, caplog):
    """Before: rlkit's scan saw the row count differ and dropped its row locations without a word."""
    import datasets

    f = tmp_path / "rows.jsonl"
    _write(f, ["#### 1", "#### 2", "#### 3"])
    real = datasets.load_dataset
    calls = []

    def stale_once(*args, **kwargs):  # the first load serves two rows of an older file, as a stale cache does
        calls.append(kwargs.get("download_mode"))
        ds = real(*args, **kwargs)
        return datasets.DatasetDict({"train": ds["train"].select([0, 1])}) if len(calls) == 1 else ds

    monkeypatch.setattr(datasets, "load_dataset", stale_once)
    with caplog.at_level(logging.WARNING, logger="rlkit.data.loading"):
        assert _answers(f) == ["#### 1", "#### 2", "#### 3"]
    assert calls == [None, "force_redownload"]
    assert "2 rows loaded, 3 in the file" in caplog.text and "loading again without its cache" in caplog.text

    def always_stale(*args, **kwargs):
        return datasets.DatasetDict({"train": real(*args, **kwargs)["train"].select([0])})

    monkeypatch.setattr(datasets, "load_dataset", always_stale)
    loading._LOADED.clear()
    with pytest.raises(loading.DataError, match=rf"{f}.*1 rows loaded, 3 in the file"):
        _answers(f)


def test_the_preflight_and_the_rollout_side_load_a_file_once(tmp_path, monkeypatch):
    """Before: the preflight's key had no environment and the rollout side's had `env`, so a local file was
    loaded (and scanned) twice at start-up."""
    f = tmp_path / "rows.jsonl"
    _write(f, ["#### 1", "#### 2", "#### 3"])
    cfg = SimpleNamespace(
        data=DataConfig(path=str(f), eval_size=1), trainer=SimpleNamespace(seed=3), env=EnvConfig()
    )
    loads = []
    real = loading._load_splits
    monkeypatch.setattr(loading, "_load_splits", lambda *a, **k: loads.append(1) or real(*a, **k))
    loading.check_data(cfg)  # the preflight
    train, ev = loading.load_splits(cfg.data, seed=cfg.trainer.seed, env=cfg.env)  # rlkit/rollout/local.py
    assert len(loads) == 1 and len(train) == 2 and len(ev) == 1


def test_a_repeated_prompt_is_held_out_whole_with_a_warning(tmp_path, caplog):
    """Before: the rows of a repeated prompt were split at random between train and eval, without a word."""
    f = tmp_path / "rows.jsonl"
    rows = [{"question": f"q{i % 10}", "answer": f"#### {i}"} for i in range(30)]  # each prompt 3 times
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="rlkit.data.loading"):
        train, ev = loading.load_splits(DataConfig(path=str(f), eval_size=4), seed=0)
    assert "20 of 30 rows" in caplog.text and "row 11 repeats row 1" in caplog.text
    assert len(set(ev["question"])) == len(ev) == 4
    assert not set(train["question"]) & set(ev["question"])
    assert len(train) == 30 - 4 * 3  # every row of a held-out prompt left train
    with pytest.raises(loading.DataError, match="data.eval_size=10 would hold out all 10 distinct prompts"):
        loading.load_splits(DataConfig(path=str(f), eval_size=10), seed=0)
