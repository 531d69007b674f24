"""No input stalls start-up (issue #33, item 6): a row far longer than data.max_prompt_tokens could ever hold
is dropped by its length in characters without being tokenized (counted, one warning), and data errors and a
run directory whose checkpoints cannot be written stop the run in the preflight, before any model loads."""

import json
import logging
import os
import time

import pytest
import run_helpers
import transformers
from run_helpers import overrides

from rlkit.config.schema import ConfigError
from rlkit.data.loading import DataError, load_splits
from rlkit.data.prompts import build_prompts
from rlkit.models import load_tokenizer
from rlkit.train import compose, load_config

tiny = run_helpers.tiny  # the tiny model fixture


def _no_model_loads(monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)


def _rows(n, start=0):
    return [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(start, start + n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class _NoHugeText:
    """The real tokenizer, refusing to tokenize a text of a million characters or more (which for 50 MB
    takes minutes): the huge row must be dropped before it gets here."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, text, **kwargs):
        assert len(text) < 1_000_000, f"a text of {len(text)} characters was tokenized"
        return self._tokenizer(text, **kwargs)


def test_a_50_mb_row_is_dropped_by_length_without_tokenizing_counted_and_warned(
    tiny, tmp_path, monkeypatch, caplog
):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))  # no 50 MB left behind
    data = tmp_path / "data"
    data.mkdir()
    huge = "9 + " * (50 * 2**20 // 4)  # 50 MiB of characters
    train_rows = _rows(6)
    train_rows.insert(3, {"question": huge, "answer": "#### 1"})
    _write_jsonl(data / "train.jsonl", train_rows)
    _write_jsonl(data / "test.jsonl", _rows(4, start=10))
    start = time.perf_counter()
    cfg = load_config(compose(overrides(tiny, tmp_path / "r", f"data.path={data}")))
    train, _ = load_splits(cfg.data, seed=cfg.trainer.seed)
    with caplog.at_level(logging.WARNING, logger="rlkit.data.prompts"):
        prompts = build_prompts(train, _NoHugeText(load_tokenizer(tiny)), cfg.data)
    elapsed = time.perf_counter() - start
    assert len(prompts) == 6 and prompts.dropped == 1
    assert "What is 3 + 1?" in prompts.texts[3]  # the rows after the dropped one, in order
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"row 4 ({len(huge)} characters)" in warnings[0], warnings
    assert "data.max_prompt_tokens" in warnings[0]
    assert elapsed < 120, elapsed  # tokenizing the row took minutes (8 on the red team's machine)


def test_a_long_prompt_that_could_fit_is_still_measured_in_tokens(tiny):
    """The character bound only drops what cannot fit: a prompt a little over the token limit is dropped by
    its token count, one just under it is kept (limits worked out from the tokenizer itself)."""
    from rlkit.config.schema import DataConfig
    from rlkit.data.prompts import max_prompt_chars, render_prompt

    tok = load_tokenizer(tiny)
    cfg = DataConfig(max_prompt_tokens=64)
    longest = max(len(t) for t in tok.get_vocab())
    assert max_prompt_chars(tok, cfg) == 2 * 64 * longest
    fits = "1 + " * 5
    over = "1 + " * 40
    assert len(render_prompt(fits, tok, cfg)[1]) <= 64 < len(render_prompt(over, tok, cfg)[1])
    prompts = build_prompts([{"question": fits, "answer": "1"}, {"question": over, "answer": "2"}], tok, cfg)
    assert prompts.answers == ["1"] and prompts.dropped == 1


def test_a_data_error_stops_the_run_before_any_model_loads(tiny, tmp_path, monkeypatch):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(_rows(1)[0]) + "\n" + '{"question": "What is 2 + 2?", "answer": \n')
    _no_model_loads(monkeypatch)
    with pytest.raises(DataError, match=rf"{data}:2: malformed JSON"):
        load_config(compose(overrides(tiny, tmp_path / "r", f"data.path={data}")))


@pytest.fixture
def read_only_checkpoints(tmp_path):
    """A run directory whose checkpoints/ folder cannot be written."""
    with run_helpers.read_only(tmp_path / "r" / "checkpoints"):
        yield tmp_path / "r"


def test_an_unwritable_checkpoints_folder_stops_the_run_before_any_model_loads(
    tiny, read_only_checkpoints, monkeypatch
):
    run_dir = read_only_checkpoints
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as e:
        load_config(compose(overrides(tiny, run_dir, "trainer.resume=auto")))
    msg = str(e.value)
    assert f"trainer.run_dir={str(run_dir)!r}" in msg and f"{run_dir}/checkpoints is not writable" in msg, msg
    assert os.listdir(run_dir / "checkpoints") == []


def test_a_checkpoints_file_stops_the_run_before_any_model_loads(tiny, tmp_path, monkeypatch):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder")
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError, match=r"trainer.run_dir=.*checkpoints is a file, not a directory"):
        load_config(compose(overrides(tiny, run_dir, "trainer.resume=auto")))
