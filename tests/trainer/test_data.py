import json

import pytest

from rlkit.config import DataConfig
from rlkit.data import PromptOrder, build_prompts, generate_arithmetic, load_splits, render_prompt
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
