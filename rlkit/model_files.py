"""The files of a model folder, read safely: only the files a tokenizer or a model reads, and only as regular files
of a bounded size (following links: the hub's cache links every file to a blob), so that a link to /dev/zero is
not read until memory runs out and a named pipe does not block start-up forever; the folder checked before a
model loads (`check_model_folder`: config.json parses, the weights are safetensors files whose shapes agree with
it). Used by rlkit.models (tokenizer keys, configs), the config rules and the reward models."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

# Only the files a tokenizer or a model reads are keyed and read, and only as regular files of a bounded size
# (following links: the hub's cache links every file to a blob): a link to /dev/zero would be read until
# memory ran out, a named pipe would block start-up forever.

TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "vocab.txt", "chat_template.json", "config.json", "generation_config.json",
})  # fmt: skip
TOKENIZER_SUFFIXES = (
    ".jinja",
    ".model",
    ".tiktoken",
)  # chat templates, sentencepiece and tiktoken vocabularies
TEMPLATE_DIRS = ("additional_chat_templates",)
FILE_MAX = 1 << 30
"""A tokenizer or config file larger than this is refused (the largest tokenizer.json known is ~35 MB)."""
HEADER_MAX = 100 << 20  # safetensors' own limit on a header
LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


class ModelFolderError(ValueError):
    """A file of a model folder that rlkit does not read (not a regular file, too large, not what its name
    says), or a config.json that disagrees with the weights; the message names the file or the key."""


def regular_file(path: Path, limit: int | None = -1) -> os.stat_result:
    """`path`'s stat (through links) when it is a regular file of at most `limit` bytes (-1: FILE_MAX; None: any
    size), else ModelFolderError."""
    limit = FILE_MAX if limit == -1 else limit
    try:
        st = path.stat()
    except OSError as e:
        raise ModelFolderError(f"{path} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a named pipe"
            if stat.S_ISFIFO(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode)
            else "not a file"
        )
        raise ModelFolderError(
            f"{path} is {kind}{f' (a link to {os.path.realpath(path)})' if path.is_symlink() else ''}, not a "
            "regular file: rlkit reads only regular files from a model folder"
        )
    if limit is not None and st.st_size > limit:
        raise ModelFolderError(
            f"{path} has {st.st_size} bytes, more than the {limit} a tokenizer or config file may"
        )
    return st


def read_regular(path: Path, limit: int = -1) -> bytes:
    """The bytes of the regular file `path` (`regular_file`), at most `limit` (-1: FILE_MAX)."""
    limit = FILE_MAX if limit == -1 else limit
    regular_file(path, limit)
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ModelFolderError(f"{path} grew past {limit} bytes while read")
    return data


def tokenizer_files(folder: Path) -> list[Path]:
    """The files of `folder` a tokenizer reads (TOKENIZER_FILES, TOKENIZER_SUFFIXES, TEMPLATE_DIRS), sorted."""
    files = [f for f in folder.iterdir() if f.name in TOKENIZER_FILES or f.name.endswith(TOKENIZER_SUFFIXES)]
    for sub in TEMPLATE_DIRS:
        if (folder / sub).is_dir():
            files += [f for f in (folder / sub).iterdir() if f.name.endswith(".jinja")]
    return sorted(files)


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """The tensor shapes a safetensors file's header gives (nothing else is read); ModelFolderError naming the
    file when it is not a safetensors file."""
    size = regular_file(path, None).st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(HEADER_MAX, size - 8):
            raise ModelFolderError(
                f"{path} is not a safetensors file (its first 8 bytes give a header of {n} bytes; the file has {size})"
            )
        try:
            header = json.loads(f.read(n))
            return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelFolderError(
                f"{path} is not a safetensors file (its header does not parse: {e})"
            ) from None


def check_sizes(config: dict, shapes: dict[str, list[int]], folder: Path) -> None:
    """config.json's sizes against the weights' shapes (safetensors headers): the number of layers, and the
    embedding's rows and width; a mismatch is a ModelFolderError naming the key and both numbers (a config
    with absurd sizes would otherwise build for minutes before the load failed)."""
    layers = {int(m.group(1)) for name in shapes if (m := LAYER_RE.search(name))}
    n = config.get("num_hidden_layers")
    if layers and isinstance(n, int) and n != max(layers) + 1:
        raise ModelFolderError(
            f"{folder / 'config.json'}: num_hidden_layers={n}, but the weights hold {max(layers) + 1} layers"
        )
    embed = next((s for k, s in shapes.items() if k.endswith(("embed_tokens.weight", "wte.weight"))), None)
    if embed is not None and len(embed) == 2:
        for key, got in (("vocab_size", embed[0]), ("hidden_size", embed[1])):
            if isinstance(config.get(key), int) and config[key] != got:
                raise ModelFolderError(
                    f"{folder / 'config.json'}: {key}={config[key]}, but the weights' embedding has {got}"
                )


def check_model_folder(path: str | os.PathLike) -> None:
    """Before a model of `path` loads (a local folder; hub ids and GGUF files are left to their loaders): its
    tokenizer and config files are regular files of a bounded size, config.json parses, every *.safetensors
    is a safetensors file, and config.json's sizes agree with the weights' shapes. ModelFolderError names
    the file or key."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    for f in tokenizer_files(folder):
        regular_file(f)
    config = {}
    if (folder / "config.json").exists() or (folder / "config.json").is_symlink():
        try:
            config = json.loads(read_regular(folder / "config.json"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelFolderError(f"{folder / 'config.json'} is not valid JSON ({e})") from None
    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        shapes.update(safetensors_shapes(f))
    if isinstance(config, dict):
        check_sizes(config, shapes, folder)
