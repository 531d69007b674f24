import json

import pytest

from rlkit.config.schema import DataConfig
from rlkit.data.arithmetic import generate_arithmetic
from rlkit.data.loading import load_splits
from rlkit.data.prompts import PromptOrder, build_prompts, render_prompt
from rlkit.rewards import extract_gsm8k_answer


def test_arithmetic_dataset_is_gsm8k_format_and_correct(tmp_path):
    d = generate_arithmetic(tmp_path / "arith", num_train=50, num_eval=10, seed=0)
    train = [json.loads(line) for line in open(d / "train.jsonl")]
    test = [json.loads(line) for line in open(d / "test.jsonl")]
    assert len(train) == 50 and len(test) == 10
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for row in train + test:
        work = row["answer"].split("\n")[0]
        lhs, rhs = work.split("=")
        assert eval(lhs) == int(rhs) == int(extract_gsm8k_answer(row["answer"]))  # independent check
    again = generate_arithmetic(tmp_path / "arith2", num_train=50, num_eval=10, seed=0)
    assert (again / "train.jsonl").read_text() == (d / "train.jsonl").read_text()


def test_load_splits_local_dir_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    train, ev = load_splits(DataConfig(path="arithmetic", num_train=40, num_eval=8, eval_size=5))
    assert len(train) == 40 and len(ev) == 5
    # a single file has no test split: eval rows are held out of train
    f = tmp_path / "one.jsonl"
    f.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(20)))
    train, ev = load_splits(DataConfig(path=str(f), eval_size=4))
    assert len(train) == 16 and len(ev) == 4
    assert not set(train["question"]) & set(ev["question"])


def test_missing_local_file_and_bad_column(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_splits(DataConfig(path=str(tmp_path / "nope.jsonl")))
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"problem": "a", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="'question' is not a column"):
        load_splits(DataConfig(path=str(f), eval_size=0))


class _Tok:
    """A whitespace tokenizer (no chat template) to test templating and filtering without a model."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        class R:
            input_ids = [1] * add_special_tokens + [len(w) for w in text.split()]

        return R()


def test_plain_template_and_length_filter():
    cfg = DataConfig(template="plain", instruction="", max_prompt_tokens=6)
    text, ids = render_prompt("What is 1 + 2?", _Tok(), cfg)
    assert text == "Question: What is 1 + 2?\nAnswer:"
    assert len(ids) == 1 + 7
    rows = [{"question": "a b", "answer": "1"}, {"question": "a b c d e f g", "answer": "2"}]
    ps = build_prompts(rows, _Tok(), cfg)
    assert len(ps) == 1 and ps.answers == ["1"]  # "Question: a b Answer:" = 1 + 4 tokens kept


def test_prompt_order_deterministic_resumable_and_epochs():
    a = PromptOrder(10, seed=3)
    full = [a.next(4) for _ in range(5)]  # 20 prompts = 2 epochs
    assert sorted(full[0] + full[1] + full[2][:2]) == list(range(10))  # first epoch is a permutation
    b = PromptOrder(10, seed=3, position=8)
    assert b.next(4) == full[2] and b.next(4) == full[3]
    assert PromptOrder(10, seed=4).next(10) != full[0] + full[1] + full[2][:2]


def test_unreachable_hub_dataset_points_to_offline_options(monkeypatch):
    import datasets
    import huggingface_hub

    # Offline mode (read at import time, hence setattr): fails fast instead of retrying a dead network.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match=r"\+recipe=quickstart.*data.path="):
        load_splits(DataConfig(path="no-such-org/no-such-dataset", subset=None))


def test_arithmetic_kinds_select_problem_types(tmp_path):
    import json

    d = generate_arithmetic(tmp_path / "plain", num_train=30, num_eval=5, seed=0, kinds=("plain_add",))
    rows = [
        json.loads(line) for f in ("train.jsonl", "test.jsonl") for line in (d / f).read_text().splitlines()
    ]
    for r in rows:
        a, b = (int(x) for x in r["question"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert r["answer"].endswith(f"#### {a + b}")
    with pytest.raises(ValueError, match="arithmetic_kinds"):
        generate_arithmetic(tmp_path / "bad", num_train=3, num_eval=1, kinds=("multiply",))


@pytest.mark.parametrize(
    "kind, numbers, result",
    [
        ("plain_add2", 2, lambda a, b: a + b),
        ("plain_add3", 3, lambda a, b, c: a + b + c),
        ("story_two_step", 3, lambda a, b, c: a + b - c),
    ],
)
def test_harder_arithmetic_kinds_are_right_and_within_their_ranges(tmp_path, kind, numbers, result):
    import re

    from rlkit.data.arithmetic import KINDS

    d = generate_arithmetic(tmp_path / kind, num_train=300, num_eval=20, seed=1, kinds=(kind,))
    rows = [
        json.loads(line) for f in ("train.jsonl", "test.jsonl") for line in (d / f).read_text().splitlines()
    ]
    assert len({r["question"] for r in rows}) == 320
    for r in rows:
        values = [int(x) for x in re.findall(r"\d+", r["question"])]
        assert len(values) == numbers, r["question"]
        expected = result(*values)
        assert expected >= 0 and r["answer"].endswith(f"#### {expected}")
        if kind == "plain_add2":
            assert all(10 <= v <= 99 for v in values)
        elif kind == "plain_add3":
            assert all(1 <= v <= 20 for v in values)
        else:
            assert all(1 <= v <= 20 for v in values[:2]) and 1 <= values[2] <= values[0] + values[1]
    # The declared number of distinct problems (checked at start-up against num_train + num_eval), counted
    # here by hand from the ranges: 2-digit pairs; three numbers in 1..20; c in 1..a+b with 6 names x 5 things.
    by_hand = {
        "plain_add2": 90 * 90,
        "plain_add3": 20**3,
        "story_two_step": 30 * sum(a + b for a in range(1, 21) for b in range(1, 21)),
    }
    assert KINDS[kind].size == by_hand[kind]


# ------------------------------------------------------------------------------------------ bad data
# Each bad file gives an error naming the file, the 1-based line and (for a bad value) the key, or a
# counted, logged skip. Line numbers below are counted by hand from the text written.


def _rows(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(start, n))


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    from rlkit.data.loading import DataError

    f = tmp_path / "bad.jsonl"
    f.write_text(_rows(3) + '{"question": "q3" "answer": "#### 3"}\n' + _rows(5, 4))  # line 4 lacks a comma
    with pytest.raises(DataError, match=rf"^{f}:4: malformed JSON \(Expecting ',' delimiter, column 19\)"):
        load_splits(DataConfig(path=str(f), eval_size=0))
    f.write_text(_rows(2) + "\n\n" + '["not", "an", "object"]\n')  # blank lines 3-4, then line 5
    with pytest.raises(DataError, match=rf"^{f}:5: a row must be a JSON object, not list"):
        load_splits(DataConfig(path=str(f), eval_size=0))
    a = tmp_path / "arr.json"
    a.write_text('[\n  {"question": "q0", "answer": "1"},\n  {"question": "q1", "answer": 2,}\n]\n')
    with pytest.raises(DataError, match=rf"^{a}:3: malformed JSON"):
        load_splits(DataConfig(path=str(a), eval_size=0))


def test_empty_file_names_the_file(tmp_path):
    from rlkit.data.loading import DataError

    for text in ("", "\n  \n"):
        f = tmp_path / "empty.jsonl"
        f.write_text(text)
        with pytest.raises(DataError, match=rf"^{f}: the file holds no rows"):
            load_splits(DataConfig(path=str(f), eval_size=0))
    # an empty test split in a directory is named too
    d = tmp_path / "dir"
    d.mkdir()
    (d / "train.jsonl").write_text(_rows(4))
    (d / "test.jsonl").write_text("")
    with pytest.raises(DataError, match=rf"{d / 'test.jsonl'}: the file holds no rows"):
        load_splits(DataConfig(path=str(d)))


def test_non_utf8_byte_names_file_line_and_byte(tmp_path):
    from rlkit.data.loading import DataError

    f = tmp_path / "latin1.jsonl"
    f.write_bytes(_rows(2).encode() + '{"question": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(
        DataError, match=rf"^{f}:3: not UTF-8 \(byte 0xe9 at column 18\)"
    ):  # {"question": "caf = 17 characters
        load_splits(DataConfig(path=str(f), eval_size=0))


def test_eval_size_holding_out_every_row_names_the_key(tmp_path):
    from rlkit.data.loading import DataError

    f = tmp_path / "five.jsonl"
    f.write_text(_rows(5))
    for size in (5, 9):
        with pytest.raises(DataError, match=rf"data.eval_size={size} would hold out all 5 usable rows"):
            load_splits(DataConfig(path=str(f), eval_size=size))
    train, ev = load_splits(DataConfig(path=str(f), eval_size=4))
    assert len(train) == 1 and len(ev) == 4


def test_null_or_empty_prompt_and_answer_are_skipped_counted_and_logged(tmp_path, caplog):
    from rlkit.data.loading import DataError

    f = tmp_path / "nulls.jsonl"
    lines = [
        {"question": "q0", "answer": "#### 0"},  # line 1
        {"question": None, "answer": "#### 1"},  # line 2: null question
        {"question": "q2", "answer": "#### 2"},  # line 3
        {"answer": "#### 3"},  # line 4: no question at all (pyarrow fills null)
        {"question": "  ", "answer": "#### 4"},  # line 5: blank question
        {"question": "q5", "answer": None},  # line 6: null answer
        {"question": "q6", "answer": "#### 6"},  # line 7
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with caplog.at_level("WARNING", logger="rlkit.data"):
        train, _ = load_splits(DataConfig(path=str(f), eval_size=0))
    assert train["question"] == ["q0", "q2", "q6"]  # never the text "None"
    assert "skipped 4 of 7 rows" in caplog.text
    assert f"{f}:2: data.prompt_key 'question' is None" in caplog.text
    assert f"{f}:4: data.prompt_key 'question' is None" in caplog.text
    assert f"{f}:5: data.prompt_key 'question' is '  '" in caplog.text
    assert f"{f}:6: data.answer_key 'answer' is None" in caplog.text
    f.write_text(json.dumps({"question": None, "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=rf"no usable row .*{f}:1: data.prompt_key 'question' is None"):
        load_splits(DataConfig(path=str(f), eval_size=0))


def test_unreadable_csv_names_the_file(tmp_path):
    from rlkit.data.loading import DataError

    f = tmp_path / "empty.csv"
    f.write_text("")
    with pytest.raises(DataError, match=rf"could not read data.path='{f}'"):
        load_splits(DataConfig(path=str(f), eval_size=0))


def test_the_longest_vocabulary_entry_is_measured_once_per_vocabulary():
    """Every generation call asks for the longest entry (the observation bound): the vocabulary is built once
    per tokenizer, and again only when the tokenizer's size changed (tokens added since)."""
    from rlkit.data.prompts import max_token_chars

    class Vocab:
        def __init__(self):
            self.entries, self.built = {"a": 0, "abcd": 1}, 0

        def get_vocab(self):
            self.built += 1
            return dict(self.entries)

        def __len__(self):
            return len(self.entries)

    tok = Vocab()
    assert [max_token_chars(tok) for _ in range(3)] == [4, 4, 4] and tok.built == 1
    tok.entries["<|a_long_added_token|>"] = 2
    assert max_token_chars(tok) == 22 and tok.built == 2
    assert max_token_chars(Vocab()) == 4  # another tokenizer is measured for itself
