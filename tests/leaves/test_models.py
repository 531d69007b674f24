import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlkit import models
from rlkit.models import load_causal_lm, load_tokenizer, make_tiny_checkpoint, resolve_model

pytestmark = pytest.mark.slow  # converts and loads the embedded model: `make test-fast` leaves it out


def test_embedded_model_is_a_plain_cached_checkpoint():
    directory, gguf_file = resolve_model("smollm2-135m")
    assert gguf_file is None
    config = json.loads((Path(directory) / "config.json").read_text())
    # A leftover GGUF quantization marker would make every later load dequantise again.
    assert "quantization_config" not in config
    assert (Path(directory) / "chat_template.jinja").exists() or "chat_template" in json.loads(
        (Path(directory) / "tokenizer_config.json").read_text()
    )
    t0 = time.perf_counter()
    model = load_causal_lm("smollm2-135m")
    assert time.perf_counter() - t0 < 15  # converted once; later loads skip the GGUF path
    assert model.dtype == torch.float32
    assert getattr(model, "hf_quantizer", None) is None
    assert model.config.vocab_size == 49152
    # No leftover temporary directories from the atomic write.
    assert not [p for p in Path(directory).parent.iterdir() if p.name.startswith(".")]


def test_embedded_tokenizer_chat_template_and_padding():
    tok = load_tokenizer("smollm2-135m")
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_local_paths_pass_through(tiny_ckpt, tmp_path):
    assert resolve_model(tiny_ckpt) == (tiny_ckpt, None)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"")
    assert resolve_model(gguf) == (str(tmp_path), "x.gguf")
    with pytest.raises(FileNotFoundError, match="model.path='./no/such/dir'"):
        resolve_model("./no/such/dir")


def test_unreachable_hub_id_says_so_and_points_to_offline_choices(monkeypatch):
    import huggingface_hub.constants

    # Offline mode makes the hub client fail at once instead of retrying for ~25 s.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        OSError, match=r"could not be found in the local cache.*offline.*\+recipe=quickstart.*model.path="
    ):
        resolve_model("nobody-rlkit-test/not-a-model")


def test_without_a_resolving_hub_a_hub_id_is_read_from_the_cache_at_once(monkeypatch, tmp_path):
    """No network (the hub's host does not resolve): the hub client's offline mode is turned on, for this
    process and its children, so a cached id resolves and an uncached one is refused at once; the client's
    own retries took ~23 s (5 back-offs of 1-8 s) before either."""
    import socket

    import huggingface_hub.constants

    from rlkit import models

    asked = []

    def no_dns(host, *a, **kw):
        asked.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(models, "_HUB_OFFLINE", None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # put back as it was after the test
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    # Behind a proxy the local lookup says nothing (the proxy resolves the name): the hub stays online.
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert models.offline_without_hub() is False and asked == []
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(models, "_HUB_OFFLINE", None)
    # A hub cache as the client writes it: refs/main names the snapshot holding config.json.
    repo = tmp_path / "models--owner-rlkit--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text('{"model_type": "llama"}')
    t0 = time.monotonic()
    assert resolve_model("owner-rlkit/cached") == ("owner-rlkit/cached", None)
    with pytest.raises(
        OSError, match=r"could not be found in the local cache \(the hub is out of reach: offline\)"
    ):
        resolve_model("owner-rlkit/not-cached")
    assert time.monotonic() - t0 < 10  # no back-off: each retry alone sleeps 1-8 s
    assert asked == ["huggingface.co"]  # asked once per process
    assert huggingface_hub.constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"  # children too


def test_tiny_checkpoint_shares_the_real_tokenizer_and_is_seeded(tiny_ckpt, tmp_path):
    tok = load_tokenizer(tiny_ckpt)
    real = load_tokenizer("smollm2-135m")
    assert tok("hello world")["input_ids"] == real("hello world")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    assert model.config.vocab_size == len(tok)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    again = load_causal_lm(make_tiny_checkpoint(tmp_path / "again", seed=0))
    other = load_causal_lm(make_tiny_checkpoint(tmp_path / "other", seed=1))
    w = dict(model.named_parameters())
    assert all(torch.equal(p, w[n]) for n, p in again.named_parameters())
    assert not torch.equal(other.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_tokenizer_fallbacks_pad_and_chat_template(tiny_ckpt, tmp_path, caplog):
    # A copy of the tokenizer without pad token and without chat template (like many base models).
    bare = tmp_path / "bare"
    shutil.copytree(tiny_ckpt, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    cfg.pop("pad_token", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger=models.__name__):
        tok = load_tokenizer(bare)
    assert tok.pad_token_id == tok.eos_token_id
    assert "no pad token" in caplog.text and "no chat template" in caplog.text
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "system: Be brief.\nuser: Hi\nassistant: "


def test_a_directorys_tokenizer_is_parsed_once_and_every_load_is_its_own_copy(
    tiny_ckpt, tmp_path, monkeypatch
):
    """Loads of an unchanged directory parse its files once per process; each load is an independent
    tokenizer (a change to one is not seen by the next load); a change on disk is parsed again."""
    monkeypatch.setattr(models, "_PARSED", {})  # this process's earlier loads of the same files
    import transformers

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, folder)
    parse = transformers.AutoTokenizer.from_pretrained
    parsed = []
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: parsed.append(a[0]) or parse(*a, **k)
    )
    first = load_tokenizer(folder)
    first.add_tokens(["<rlkit-one-caller>"])
    first.pad_token = None
    second = load_tokenizer(folder)
    assert parsed == [str(folder)]  # the second load parsed nothing
    assert len(second) == len(first) - 1 and second.pad_token_id is not None
    assert second("hello world")["input_ids"] == parse(str(folder))("hello world")["input_ids"]
    first.save_pretrained(folder)  # the files change: the next load parses them again and sees the token
    third = load_tokenizer(folder)
    assert parsed == [str(folder), str(folder)] and len(third) == len(first)


def test_folders_with_the_same_tokenizer_files_share_one_parse_each_load_named_by_its_folder(
    tiny_ckpt, tmp_path, monkeypatch
):
    """Two checkpoints whose weights differ but whose tokenizer files are the same: one parse, each load named
    by (`name_or_path`) and encoding as its own folder's; a folder whose tokenizer files differ is parsed."""
    monkeypatch.setattr(models, "_PARSED", {})  # this process's earlier loads of the same files
    import transformers

    a, b, c = (tmp_path / name for name in ("a", "b", "c"))
    for folder in (a, b, c):
        shutil.copytree(tiny_ckpt, folder)
    (b / "model.safetensors").write_bytes(b"other weights")  # never read by the tokenizer's parse
    config = json.loads((c / "tokenizer_config.json").read_text())
    (c / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    parse = transformers.AutoTokenizer.from_pretrained
    parsed = []
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: parsed.append(a[0]) or parse(*a, **k)
    )
    ta, tb, tc = (load_tokenizer(folder) for folder in (a, b, c))
    assert parsed == [str(a), str(c)]
    for tok, folder in ((ta, a), (tb, b), (tc, c)):
        fresh = parse(str(folder))
        assert tok.name_or_path == tok.init_kwargs["name_or_path"] == fresh.name_or_path == str(folder)
        assert tok.model_max_length == fresh.model_max_length
        assert tok("hello world 12+7")["input_ids"] == fresh("hello world 12+7")["input_ids"]
    assert tc.model_max_length == 77 != ta.model_max_length


def test_a_copy_rebuilds_the_backend_equal_to_a_fresh_parse_and_shares_no_pipeline_part(tiny_ckpt, tmp_path):
    """A load's Rust backend is rebuilt around the parsed vocabulary (models._copy), not parsed again: it
    serialises exactly as transformers' own parse of the folder, encodes and decodes as it does, and a change
    to a part of one load's pipeline (in place) or to its padding reaches no later load."""
    import transformers

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, folder)
    fresh = transformers.AutoTokenizer.from_pretrained(str(folder))
    first = load_tokenizer(folder)
    assert first.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    text = "Hello  world <|im_start|>user\n12 + 7 = ?<|im_end|>"
    assert first(text)["input_ids"] == fresh(text)["input_ids"]
    assert first.decode(first(text)["input_ids"]) == fresh.decode(fresh(text)["input_ids"])
    before = load_tokenizer(folder).backend_tokenizer.to_str()
    first.backend_tokenizer.pre_tokenizer.add_prefix_space = True  # in place, on a part of the pipeline
    first.backend_tokenizer.enable_padding(pad_id=0, pad_token="<pad-of-one-caller>")
    assert first.backend_tokenizer.to_str() != before
    assert load_tokenizer(folder).backend_tokenizer.to_str() == before


def test_a_backend_that_does_not_rebuild_exactly_is_deep_copied(tiny_ckpt, tmp_path, monkeypatch):
    """Where the rebuilt backend would differ from the parsed one (checked at the first load), every load
    of that folder is a deep copy: equal to the parse."""
    monkeypatch.setattr(models, "_PARSED", {})  # this process's earlier loads of the same files
    import transformers

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, folder)
    rebuild = models._rebuilt_backend

    def lossy(backend):
        new = rebuild(backend)
        new.decoder = None
        return new

    monkeypatch.setattr(models, "_rebuilt_backend", lossy)
    want = transformers.AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer.to_str()
    for _ in range(2):
        assert load_tokenizer(folder).backend_tokenizer.to_str() == want


def test_a_folder_with_a_broken_link_still_loads_its_tokenizer(tiny_ckpt, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, folder)
    (folder / "stale.safetensors").symlink_to(tmp_path / "gone")
    assert (
        load_tokenizer(folder)("hello world")["input_ids"]
        == load_tokenizer(tiny_ckpt)("hello world")["input_ids"]
    )
