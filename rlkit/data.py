"""Datasets: loading (hub / local files / the generated arithmetic set), prompt templating, length
filtering, the train/eval split and a deterministic, resumable prompt order.

Every source goes through `datasets.load_dataset`, so the offline arithmetic set exercises the same
code path as GSM8K from the hub.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlkit.config import ARITHMETIC_KINDS, DataConfig, check_arithmetic_kinds

log = logging.getLogger(__name__)

ARITHMETIC = "arithmetic"
FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def cache_dir() -> Path:
    return Path(os.environ.get("RLKIT_CACHE", Path.home() / ".cache" / "rlkit"))


# ----------------------------------------------------------------------------------------------- arithmetic


def _arithmetic_problem(rng: random.Random, kinds: tuple[str, ...] = ARITHMETIC_KINDS) -> dict:
    """One GSM8K-format problem: small-number addition or subtraction, answer ending in `#### N`."""
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    name = rng.choice(["Tom", "Sara", "Ali", "Mia", "Ken", "Lea"])
    thing = rng.choice(["apples", "pencils", "stickers", "marbles", "books"])
    kind = rng.choice(kinds)
    if kind == "plain_add":
        question, work, result = f"What is {a} + {b}?", f"{a} + {b} = {a + b}", a + b
    elif kind == "story_add":
        question = f"{name} has {a} {thing}. {name} gets {b} more. How many {thing} does {name} have now?"
        work, result = f"{a} + {b} = {a + b}", a + b
    elif kind == "plain_mul":
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        question, work, result = f"What is {a} * {b}?", f"{a} * {b} = {a * b}", a * b
    elif kind == "plain_add2":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question, work, result = f"What is {a} + {b}?", f"{a} + {b} = {a + b}", a + b
    elif kind == "plain_add3":
        c = rng.randint(1, 20)
        question, work, result = f"What is {a} + {b} + {c}?", f"{a} + {b} + {c} = {a + b + c}", a + b + c
    elif kind == "story_two_step":
        c = rng.randint(1, a + b)
        question = (
            f"{name} has {a} {thing}. {name} gets {b} more, then gives away {c}. "
            f"How many {thing} does {name} have now?"
        )
        work, result = f"{a} + {b} = {a + b}, {a + b} - {c} = {a + b - c}", a + b - c
    else:
        a, b = max(a, b), min(a, b)
        question = f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?"
        work, result = f"{a} - {b} = {a - b}", a - b
    return {"question": question, "answer": f"{work}\n#### {result}"}


def generate_arithmetic(
    directory: str | Path,
    *,
    num_train: int,
    num_eval: int,
    seed: int = 0,
    kinds: tuple[str, ...] = ARITHMETIC_KINDS,
) -> Path:
    """Write `train.jsonl` and `test.jsonl` of arithmetic word problems into `directory` (atomically).

    The set is a pure function of (num_train, num_eval, seed, kinds); eval questions never appear in
    train. `kinds` picks the problem types among ARITHMETIC_KINDS ("What is a + b?", a story with an
    addition, a story with a subtraction).
    """
    kinds = tuple(kinds)
    check_arithmetic_kinds(kinds)
    directory = Path(directory)
    if (directory / "train.jsonl").exists() and (directory / "test.jsonl").exists():
        return directory
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    # The space of distinct problems is a few thousand; stop early rather than loop forever.
    for _ in range(50 * (num_train + num_eval)):
        if len(rows) == num_train + num_eval:
            break
        p = _arithmetic_problem(rng, kinds)
        if p["question"] not in seen:
            seen.add(p["question"])
            rows.append(p)
    if len(rows) < num_train + num_eval:
        raise ValueError(
            f"data.num_train + data.num_eval = {num_train + num_eval} exceeds the {len(rows)} distinct "
            "arithmetic problems available"
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".tmp-arith-"))
    for name, part in (("test.jsonl", rows[:num_eval]), ("train.jsonl", rows[num_eval:])):
        with open(tmp / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    try:
        tmp.rename(directory)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


# ----------------------------------------------------------------------------------------------- loading


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, the 1-based line and the key."""


def _json_rows(path: Path) -> list[str]:
    """Check a local JSON file row by row and return where each row is (`file:line`, or `file item i`
    for a JSON array), in the order `datasets` loads them.

    pyarrow's own errors name no file and count rows from 0, and an empty file gives a bare
    StopIteration, so every row is decoded (UTF-8) and parsed here first.
    """
    raw = path.read_bytes()
    rows: list[str] = []
    if raw.lstrip()[:1] == b"[":  # one JSON array of objects
        try:
            items = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise DataError(f"{path}:{line}: not UTF-8 (byte {raw[e.start]:#04x})") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg}, column {e.colno})") from None
        for i, item in enumerate(items, 1):
            if not isinstance(item, dict):
                raise DataError(f"{path} item {i}: a row must be a JSON object, not {type(item).__name__}")
            rows.append(f"{path} item {i}")
    else:  # JSON Lines (blank lines are skipped, as pyarrow does)
        for n, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{n}: not UTF-8 (byte {line[e.start]:#04x} at column {e.start + 1})"
                ) from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: malformed JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{n}: a row must be a JSON object, not {type(obj).__name__}")
            rows.append(f"{path}:{n}")
    if not rows:
        raise DataError(f"{path}: the file holds no rows")
    return rows


def _usable(ds, cfg: DataConfig, where: list[str] | None, split: str):
    """`ds` without the rows whose prompt is not a non-empty string or whose answer is null or empty
    (a null question would otherwise be trained on as the text "None"); the skip is counted and logged
    with the first few rows. Raises when no row is left."""
    if where is not None and len(where) != len(ds):
        where = None  # not the rows we scanned: fall back to row numbers
    bad = []
    for i, (q, a) in enumerate(zip(ds[cfg.prompt_key], ds[cfg.answer_key])):
        if not isinstance(q, str) or not q.strip():
            bad.append((i, "prompt_key", cfg.prompt_key, q))
        elif a is None or not str(a).strip():
            bad.append((i, "answer_key", cfg.answer_key, a))
    if not bad:
        return ds
    shown = "; ".join(
        f"{where[i] if where else f'split {split!r} row {i + 1}'}: data.{key} {col!r} is {value!r}"
        for i, key, col, value in bad[:5]
    )
    if len(bad) == len(ds):
        raise DataError(f"no usable row in split {split!r} of data.path={cfg.path!r}: {shown}")
    log.warning(
        "data: skipped %d of %d rows of split %r with a missing or empty prompt / answer: %s%s",
        len(bad), len(ds), split, shown, " ..." if len(bad) > 5 else "",
    )  # fmt: skip
    drop = {i for i, *_ in bad}
    return ds.select([i for i in range(len(ds)) if i not in drop])


def _local_data_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """(builder, {split: files}) for a local file or a directory of train.* / test.* files."""
    if path.is_file():
        builder = FILE_TYPES.get(path.suffix)
        if builder is None:
            raise DataError(
                f"data.path={str(path)!r}: unknown file type {path.suffix!r}, not one of {list(FILE_TYPES)}"
            )
        return builder, {"train": [str(path)]}
    files: dict[str, list[str]] = {}
    builders = set()
    for f in sorted(path.iterdir()):
        if f.suffix in FILE_TYPES:
            files.setdefault(f.stem.split(".")[0].split("-")[0], []).append(str(f))
            builders.add(FILE_TYPES[f.suffix])
    if not files or len(builders) != 1:
        raise DataError(
            f"data.path={str(path)!r}: expected train.* / test.* files of one type {list(FILE_TYPES)}"
        )
    return builders.pop(), files


def load_splits(cfg: DataConfig, *, seed: int = 0):
    """(train, eval) `datasets.Dataset`s for `cfg`; eval has at most `cfg.eval_size` rows."""
    import datasets

    path = cfg.path
    if path == ARITHMETIC:
        path = str(
            generate_arithmetic(
                cache_dir()
                / "data"
                / f"arithmetic-{cfg.num_train}-{cfg.num_eval}-{'-'.join(cfg.arithmetic_kinds)}",
                num_train=cfg.num_train,
                num_eval=cfg.num_eval,
                kinds=tuple(cfg.arithmetic_kinds),
            )
        )
    local = Path(path).expanduser()
    where: dict[str, list[str]] = {}  # split -> where each row is, for local JSON files
    if local.exists():
        builder, files = _local_data_files(local)
        if builder == "json":
            where = {split: [w for f in fs for w in _json_rows(Path(f))] for split, fs in files.items()}
        try:
            ds = datasets.load_dataset(builder, data_files=files)
        except Exception as e:  # pyarrow / pandas errors name no file
            raise DataError(f"could not read data.path={path!r} ({files}): {type(e).__name__}: {e}") from e
    elif path.startswith((".", "/", "~")) or Path(path).suffix in FILE_TYPES:
        raise FileNotFoundError(f"data.path={path!r} does not exist")
    else:
        try:
            ds = datasets.load_dataset(path, cfg.subset)
        except Exception as e:
            raise RuntimeError(
                f"could not load dataset data.path={path!r} (subset {cfg.subset!r}) from the Hugging Face hub "
                f"({type(e).__name__}: {e}). If the hub is unreachable, run offline with +recipe=quickstart, or "
                "point data.path= at a local JSON/JSONL/Parquet file or directory (and model.path= at a local model)."
            ) from e
    if cfg.train_split not in ds:
        raise DataError(f"data.train_split={cfg.train_split!r} is not one of {list(ds)}")
    has_eval = bool(cfg.eval_split) and cfg.eval_split in ds
    for split in [cfg.train_split] + ([cfg.eval_split] if has_eval else []):
        for name, key in (("prompt_key", cfg.prompt_key), ("answer_key", cfg.answer_key)):
            if key not in ds[split].column_names:
                raise DataError(
                    f"data.{name}={key!r} is not a column of split {split!r} of data.path={path!r}: "
                    f"{ds[split].column_names}"
                )
    train = _usable(ds[cfg.train_split], cfg, where.get(cfg.train_split), cfg.train_split)
    if has_eval:
        eval_ds = _usable(ds[cfg.eval_split], cfg, where.get(cfg.eval_split), cfg.eval_split)
    elif cfg.eval_size > 0:
        if cfg.eval_size >= len(train):
            raise DataError(
                f"data.eval_size={cfg.eval_size} would hold out all {len(train)} usable rows of split "
                f"{cfg.train_split!r} of data.path={path!r} (it has no data.eval_split={cfg.eval_split!r}), "
                "leaving none to train on: use a smaller data.eval_size, or 0 for no eval"
            )
        split = train.train_test_split(test_size=cfg.eval_size, seed=seed, shuffle=True)
        train, eval_ds = split["train"], split["test"]
        log.info("no %r split: held out %d training rows for eval", cfg.eval_split, cfg.eval_size)
    else:
        eval_ds = train.select([])
    eval_ds = eval_ds.select(range(min(cfg.eval_size, len(eval_ds))))
    return train, eval_ds


# ----------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PromptSet:
    """Tokenised prompts with their reference answers (index i of every list is one problem)."""

    token_ids: list[list[int]]
    texts: list[str]
    answers: list[str]
    messages: list[list[dict]] = field(default_factory=list)
    """The chat messages of each prompt (system + user), before any template: a reward model renders
    them with its own chat template."""
    rows: list[dict] = field(default_factory=list)
    """Every column of each prompt's dataset row."""

    def __len__(self) -> int:
        return len(self.token_ids)


def prompt_messages(question: str, cfg: DataConfig) -> list[dict]:
    """The chat messages of one question: the optional system prompt, then the question + instruction."""
    user = f"{question}\n{cfg.instruction}" if cfg.instruction else question
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return [*system, {"role": "user", "content": user}]


def render_prompt(question: str, tokenizer, cfg: DataConfig) -> tuple[str, list[int]]:
    """Prompt text and token ids for one question (chat template, or the plain template as fallback)."""
    messages = prompt_messages(question, cfg)
    if cfg.template == "chat" and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already contains BOS where the model wants it.
        return text, tokenizer(text, add_special_tokens=False).input_ids
    text = f"Question: {messages[-1]['content']}\nAnswer:"
    return text, tokenizer(text).input_ids


def build_prompts(dataset, tokenizer, cfg: DataConfig, *, name: str = "train") -> PromptSet:
    """Template and tokenise every row; drop prompts over `cfg.max_prompt_tokens` (count logged)."""
    if cfg.template == "chat" and not getattr(tokenizer, "chat_template", None):
        log.warning("data.template='chat' but the tokenizer has no chat template: using the plain template")
    ids, texts, answers, messages, rows = [], [], [], [], []
    dropped = 0
    for row in dataset:
        text, tok = render_prompt(row[cfg.prompt_key], tokenizer, cfg)
        if len(tok) > cfg.max_prompt_tokens:
            dropped += 1
            continue
        ids.append(tok)
        texts.append(text)
        answers.append(str(row[cfg.answer_key]))
        messages.append(prompt_messages(row[cfg.prompt_key], cfg))
        rows.append(dict(row))
    log.info(
        "%s prompts: %d kept, %d dropped (longer than data.max_prompt_tokens=%d)",
        name,
        len(ids),
        dropped,
        cfg.max_prompt_tokens,
    )
    if not ids:
        raise ValueError(f"no {name} prompt fits data.max_prompt_tokens={cfg.max_prompt_tokens}")
    return PromptSet(ids, texts, answers, messages, rows)


class PromptOrder:
    """A deterministic, endless prompt order: epoch e is a permutation seeded by (seed, e).

    The whole state is `position` (prompts consumed so far over all ranks), so resuming is setting it.
    """

    def __init__(self, num_prompts: int, seed: int, position: int = 0):
        self.num_prompts = num_prompts
        self.seed = seed
        self.position = position
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
            self._perm_epoch = epoch
        return self._perm

    def next(self, count: int) -> list[int]:
        """The next `count` prompt indices (the global batch; ranks slice their share)."""
        out = []
        for i in range(self.position, self.position + count):
            out.append(int(self._permutation(i // self.num_prompts)[i % self.num_prompts]))
        self.position += count
        return out
