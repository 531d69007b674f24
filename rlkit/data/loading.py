"""Loading datasets (hub / local files / the generated arithmetic set) and the train/eval split.

Every source goes through `datasets.load_dataset`, so the offline arithmetic set exercises the same
code path as GSM8K from the hub. `check_config` checks the `data.*` keys before any model loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
from pathlib import Path

from rlkit.config.schema import ConfigError, DataConfig
from rlkit.data import pictures, reasoning_gym
from rlkit.data.arithmetic import check_kinds, distinct_problems, generate_arithmetic
from rlkit.data.prompts import TEMPLATES
from rlkit.envs import environment_rows

log = logging.getLogger(__name__)

ARITHMETIC = "arithmetic"
ENV = "env"
"""data.path=env: the rows come from the environment (env.name, e.g. verifiers:<taskset id>)."""
FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def cache_dir() -> Path:
    return Path(os.environ.get("RLKIT_CACHE", Path.home() / ".cache" / "rlkit"))


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
    if where is not None and len(where) != len(ds):  # _load_local makes sure they agree
        raise DataError(
            f"split {split!r} of data.path={cfg.path!r}: {len(ds)} rows loaded, {len(where)} in the files"
        )
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


_LOADED: dict[str, tuple] = {}  # load_splits' results in this process, by `_load_key`
HASHED_MAX = 32 << 20
"""A local data file up to this size is keyed by its content (sha256); a larger one by (size, mtime_ns, inode,
ctime_ns): a rewrite in place with its mtime restored (`cp -p`, `rsync -t`) still changes its ctime."""


def file_key(path: Path) -> list:
    """What the rows of the data file `path` depend on: its content, or beyond HASHED_MAX its identity and
    change times (`HASHED_MAX`)."""
    st = path.stat()
    if st.st_size <= HASHED_MAX:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return [str(path), st.st_size, digest.hexdigest()]
    return [str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _load_key(cfg: DataConfig, seed: int, env) -> str:
    """What `load_splits` depends on: the config, the seed, the environment (data.path=env only: the preflight
    and the rollout side load a file with the same key) and each local file (`file_key`)."""
    local = Path(cfg.path).expanduser()
    files = sorted(local.rglob("*")) if local.is_dir() else [local] if local.is_file() else []
    stats = [file_key(f) for f in files if f.is_file()]
    env_key = None if env is None or cfg.path != ENV else [env.name, dict(env.kwargs)]
    return json.dumps([dataclasses.asdict(cfg), seed, env_key, stats, str(cache_dir())], default=str)


def load_splits(cfg: DataConfig, *, seed: int = 0, env=None):
    """(train, eval) `datasets.Dataset`s for `cfg`; eval has at most `cfg.eval_size` rows. `env`: the
    `env.*` config, whose environment gives the rows of `data.path=env` (eval rows held out of them).

    The preflight loads them (`check_data`: a data error stops the run before any model loads) and the rollout
    side again: the second call in a process returns the first one's datasets (the files unchanged)."""
    key = _load_key(cfg, seed, env)
    if key not in _LOADED:
        _LOADED.clear()  # one data config per run: keep only the latest
        _LOADED[key] = _load_splits(cfg, seed=seed, env=env)
    return _LOADED[key]


def check_data(cfg) -> None:
    """Load local data (files, a directory, the arithmetic set, an environment's dataset: `load_splits`) in
    the preflight, so that a data error (a malformed or empty file, a missing column, no usable row,
    data.eval_size too large, an environment's `rows` that raises, exits or hangs) stops the run before any
    model loads. A hub dataset is left to the rollout side, which downloads it once."""
    d = cfg.data
    if d.path == ENV:
        load_splits(d, seed=cfg.trainer.seed, env=cfg.env)
    elif d.path in (ARITHMETIC, pictures.PICTURES) or Path(d.path).expanduser().exists():
        load_splits(d, seed=cfg.trainer.seed)


def _load_splits(cfg: DataConfig, *, seed: int = 0, env=None):
    import datasets

    path = cfg.path
    if path == ENV:
        if env is None:
            raise DataError("data.path=env needs the env.* config (the environment gives the rows)")
        try:
            rows = environment_rows(env)  # in an environment worker
        except ValueError as e:
            raise DataError(str(e)) from e
        ds = datasets.DatasetDict({cfg.train_split: datasets.Dataset.from_list(rows)})
        return _split(ds, cfg, {}, f"env.name={env.name}", seed)
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
    elif path == pictures.PICTURES:
        kinds = tuple(cfg.picture_kinds)
        path = str(
            pictures.generate_pictures(
                cache_dir() / "data" / pictures.cache_name(cfg.num_train, cfg.num_eval, kinds),
                num_train=cfg.num_train,
                num_eval=cfg.num_eval,
                kinds=kinds,
            )
        )
    elif path == reasoning_gym.REASONING_GYM:
        tasks = reasoning_gym.plain(cfg.tasks)
        name = reasoning_gym.cache_name(tasks, cfg.num_train, cfg.num_eval)
        path = str(
            reasoning_gym.generate(
                cache_dir() / "data" / name, tasks, num_train=cfg.num_train, num_eval=cfg.num_eval
            )
        )
    local = Path(path).expanduser()
    where: dict[str, list[str]] = {}  # split -> where each row is, for local JSON files
    if local.exists():
        builder, files = _local_data_files(local)
        if builder == "json":
            where = {split: [w for f in fs for w in _json_rows(Path(f))] for split, fs in files.items()}
        ds = _load_local(builder, files, where, path)
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
    return _split(ds, cfg, where, path, seed)


def _load_local(builder: str, files: dict[str, list[str]], where: dict[str, list[str]], path: str):
    """`datasets.load_dataset` of local `files`, its on-disk cache keyed by their content (`file_key`, as the
    builder config's description, which datasets' cache folder name hashes; by itself datasets keys local
    files by mtime, and serves the old rows of a file rewritten with its mtime restored). Rows that disagree
    with rlkit's scan of the files (`where`: their number) are never used: the load is redone without the
    cache, loudly, and a second disagreement is an error naming the file."""
    import datasets

    content = hashlib.sha256(
        json.dumps({split: [file_key(Path(f)) for f in fs] for split, fs in sorted(files.items())}).encode()
    ).hexdigest()
    for attempt in ("cached", "fresh"):
        mode = "force_redownload" if attempt == "fresh" else None
        try:
            ds = datasets.load_dataset(
                builder, data_files=files, description=f"rlkit-content-{content}", download_mode=mode
            )
        except Exception as e:  # pyarrow / pandas errors name no file
            raise DataError(f"could not read data.path={path!r} ({files}): {type(e).__name__}: {e}") from e
        wrong = [(s, len(ds[s]), len(w)) for s, w in where.items() if s in ds and len(ds[s]) != len(w)]
        if not wrong:
            return ds
        shown = ", ".join(
            f"split {s!r} ({files[s]}): {got} rows loaded, {want} in the file" for s, got, want in wrong
        )
        if attempt == "cached":
            log.warning(
                "data: the rows datasets loaded disagree with the files (%s): loading again without its cache",
                shown,
            )
    raise DataError(
        f"data.path={path!r}: the rows loaded disagree with the files ({shown}); was a file rewritten while loading?"
    )


def _hold_out(train, cfg: DataConfig, path: str, seed: int):
    """(train, eval) with `cfg.eval_size` rows held out of `train`. A prompt that several rows repeat is held
    out whole (one row of it in eval, none in train) and the repeats are counted in a warning: a held-out
    prompt that is also trained on measures memory, not generalisation."""
    prompts = train[cfg.prompt_key]
    first: dict = {}
    for i, prompt in enumerate(prompts):
        first.setdefault(prompt, i)
    if len(first) == len(prompts):
        split = train.train_test_split(test_size=cfg.eval_size, seed=seed, shuffle=True)
        return split["train"], split["test"]
    repeats = [(i, p) for i, p in enumerate(prompts) if first[p] != i]
    log.warning(
        "data: %d of %d rows of split %r of data.path=%r repeat the prompt of an earlier row (row %d repeats "
        "row %d%s): each prompt is held out for eval whole, never trained on too",
        len(repeats), len(prompts), cfg.train_split, path, repeats[0][0] + 1, first[repeats[0][1]] + 1,
        ", ..." if len(repeats) > 1 else "",
    )  # fmt: skip
    if cfg.eval_size >= len(first):
        raise DataError(
            f"data.eval_size={cfg.eval_size} would hold out all {len(first)} distinct prompts of split "
            f"{cfg.train_split!r} of data.path={path!r}, leaving none to train on: use a smaller data.eval_size"
        )
    distinct = list(first)
    random.Random(seed).shuffle(distinct)
    held = set(distinct[: cfg.eval_size])
    eval_ds = train.select(sorted(first[p] for p in held))
    return train.select([i for i, p in enumerate(prompts) if p not in held]), eval_ds


def _split(ds, cfg: DataConfig, where: dict, path: str, seed: int):
    """(train, eval) of the loaded splits `ds` (eval held out of train when there is no eval split)."""
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
        train, eval_ds = _hold_out(train, cfg, path, seed)
        log.info("no %r split: held out %d training rows for eval", cfg.eval_split, cfg.eval_size)
    else:
        eval_ds = train.select([])
    eval_ds = eval_ds.select(range(min(cfg.eval_size, len(eval_ds))))
    return train, eval_ds


def check_config(cfg) -> None:
    """The `data.*` keys of an `RLConfig`, before anything loads (raises ConfigError)."""
    d = cfg.data
    if not d.path:
        raise ConfigError("data.path is missing: set data.path=<hub id | local file | arithmetic>")
    if d.template not in TEMPLATES:
        raise ConfigError(f"data.template={d.template!r} is not one of {list(TEMPLATES)}")
    try:
        check_kinds(d.arithmetic_kinds)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for key in ("train_split", "prompt_key", "answer_key"):
        value = getattr(d, key)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"data.{key}={value!r} must be a non-empty string")
    if d.prompt_key == d.answer_key:
        raise ConfigError(f"data.prompt_key and data.answer_key are both {d.prompt_key!r}: use two columns")
    check_images(cfg)
    if d.path == reasoning_gym.REASONING_GYM:
        reasoning_gym.check_tasks(reasoning_gym.plain(d.tasks))
    elif d.tasks:
        raise ConfigError(
            f"data.tasks is set but data.path={d.path!r}: data.tasks are reasoning-gym tasks, read only with "
            f"data.path={reasoning_gym.REASONING_GYM} (+recipe=reasoning_gym)"
        )
    if d.system_prompt and d.system_prompt.startswith(reasoning_gym.SYSTEM_PROMPT_PREFIX):
        reasoning_gym.system_prompt(d.system_prompt.removeprefix(reasoning_gym.SYSTEM_PROMPT_PREFIX))
    if d.path == reasoning_gym.REASONING_GYM:
        return
    if d.path == pictures.PICTURES:
        try:
            pictures.check_kinds(d.picture_kinds)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        reward = getattr(cfg, "reward", None)  # an SFT config has none
        wanted = pictures.rewards_of(d.picture_kinds)
        if reward is not None and not reward.route_by and wanted != {reward.fn}:
            raise ConfigError(
                f"data.picture_kinds={list(d.picture_kinds)} are checked by the reward(s) {sorted(wanted)}, "
                f"not reward.fn={reward.fn!r}: set reward.fn (or reward.route_by=kind with reward.routes)"
            )
        return
    if d.path == ARITHMETIC:
        size = distinct_problems(d.arithmetic_kinds)
        if d.num_train + d.num_eval > size:
            raise ConfigError(
                f"data.num_train + data.num_eval = {d.num_train + d.num_eval} exceeds the {size} distinct "
                f"problems of data.arithmetic_kinds={list(d.arithmetic_kinds)}"
            )
        return
    local = Path(d.path).expanduser()
    looks_local = d.path.startswith((".", "/", "~")) or local.suffix in FILE_TYPES
    if looks_local and not local.exists():
        raise ConfigError(f"data.path={d.path!r} does not exist")
    if local.is_file() and local.suffix not in FILE_TYPES:
        raise ConfigError(
            f"data.path={d.path!r}: file type {local.suffix!r} is not one of {list(FILE_TYPES)}"
        )


def check_images(cfg) -> None:
    """`data.image_key` and its keys against the model: images need a vision-language checkpoint with its
    processor (read from the folder's files, nothing loads); a VL checkpoint may train on text-only data."""
    d = cfg.data
    if d.max_image_pixels < 1:
        raise ConfigError(f"data.max_image_pixels={d.max_image_pixels} must be at least 1")
    if d.image_key is None:
        return
    if (
        not isinstance(d.image_key, str)
        or not d.image_key.strip()
        or d.image_key in (d.prompt_key, d.answer_key)
    ):
        raise ConfigError(
            f"data.image_key={d.image_key!r} must be a column name other than data.prompt_key and data.answer_key"
        )
    path = getattr(getattr(cfg, "model", None), "path", None)
    if not path:
        return
    from rlkit.vision import images_problem  # defers torch

    problem = images_problem(path)
    if problem is not None:
        raise ConfigError(
            f"data.image_key={d.image_key!r} gives images, but model.path={path!r} {problem} (or data.image_key=null)"
        )
