"""A hostile or odd model folder is refused at start-up, naming the file or key (docs/guides/operations.md,
"Start-up checks"): only the files a tokenizer and a model read are keyed and read, as regular files of a
bounded size; a weights file that is not safetensors is named; config.json's sizes are checked against the
weights' shapes (safetensors headers) before anything is built. The reward model's folder is checked in the
preflight, before the policy loads."""

import json
import os
import shutil
import threading

import pytest
from cfg_helpers import as_in_cpu_ci

from rlkit.config.schema import ConfigError
from rlkit.model_files import ModelFolderError, check_model_folder
from rlkit.models import load_tokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, seed=0)


@pytest.fixture
def folder(tiny_folder, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_folder, path)
    return path


def _config(model_path, run_dir, *extra):
    from rlkit.train import compose, load_config

    overrides = [
        "+recipe=quickstart_1digit", f"model.path={model_path}", f"trainer.run_dir={run_dir}", "logger=none",
        "data.num_train=64", "data.num_eval=8", "data.eval_size=4", *extra,
    ]  # fmt: skip
    return load_config(compose(as_in_cpu_ci(overrides)))


def test_a_named_pipe_in_the_folder_does_not_hang_the_tokenizer(folder):
    """Before: the tokenizer's cache key hashed every non-weight file of the folder, so opening a named pipe
    blocked start-up forever (here: released by the test after 60 s, and failed)."""
    os.mkfifo(folder / "notes.txt")
    result = {}

    def load():
        try:
            result["tokenizer"] = load_tokenizer(str(folder))
        except Exception as e:  # noqa: BLE001 (reported below)
            result["error"] = e

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(60)
    hung = thread.is_alive()
    if hung:  # a writer's open releases the blocked reader, which then reads the end of the file
        os.close(os.open(folder / "notes.txt", os.O_WRONLY))
        thread.join(30)
    assert not hung, "loading the tokenizer blocked on the named pipe"
    assert "tokenizer" in result, result


@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja"])
def test_a_tokenizer_file_that_is_a_device_or_a_pipe_is_refused_naming_it(folder, name):
    """A link to /dev/zero under a name a tokenizer reads would be read until memory ran out: refused
    from its stat, never opened."""
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to("/dev/zero")
    with pytest.raises(ModelFolderError, match=rf"{folder / name} is a device \(a link to /dev/zero\)"):
        load_tokenizer(str(folder))
    with pytest.raises(ModelFolderError, match=rf"{folder / name} is a device"):
        check_model_folder(folder)


def test_an_oversized_config_file_is_refused_naming_it(folder, monkeypatch):
    import rlkit.model_files

    monkeypatch.setattr(rlkit.model_files, "FILE_MAX", 100)
    with pytest.raises(
        ModelFolderError,
        match=r"(chat_template.jinja|config.json) has \d+ bytes, more than the 100 a tokenizer or config file may",
    ):
        check_model_folder(folder)


def test_a_weights_file_that_is_not_safetensors_is_named_in_training(folder, tmp_path):
    """`model.safetensors -> /etc/passwd`. Before: the preflight passed and training ended in a bare
    `SafetensorError: header too large` when the model loaded."""
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/etc/passwd")
    with pytest.raises(ConfigError, match=r"model.path=.*model.safetensors is not a safetensors file"):
        _config(folder, tmp_path / "run")


def test_absurd_config_sizes_are_refused_against_the_weights_naming_the_key(folder, tmp_path):
    """`num_hidden_layers: 1000000`. Before: the preflight passed and building the model ran for minutes
    with memory growing; now the safetensors headers' shapes (nothing loaded) refuse it."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1000000}))
    with pytest.raises(
        ConfigError, match=r"model.path=.*num_hidden_layers=1000000, but the weights hold 2 layers"
    ):
        _config(folder, tmp_path / "run")
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] * 1000}))
    with pytest.raises(
        ModelFolderError,
        match=rf"vocab_size={config['vocab_size'] * 1000}, but the weights' embedding has {config['vocab_size']}",
    ):
        check_model_folder(folder)
    (folder / "config.json").write_text(json.dumps(config))
    check_model_folder(folder)  # the folder as written passes


def test_a_reward_model_folder_is_checked_before_the_policy_loads(folder, tiny_folder, tmp_path):
    """Before: a reward model's folder was opened by the rollout side, after the policy had loaded; a causal
    LM (no classification head with one output) and a damaged weights file are refused in the preflight."""
    with pytest.raises(
        ConfigError,
        match=r"reward.model=.*one output: its config.json has 2 labels and architectures \['LlamaForCausalLM'\]",
    ):
        _config(tiny_folder, tmp_path / "run", f"reward.model={folder}")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}
    )
    (folder / "config.json").write_text(json.dumps(config))
    _config(tiny_folder, tmp_path / "run", f"reward.model={folder}")  # a one-output classifier passes
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match=r"reward.model=.*model.safetensors is not a safetensors file"):
        _config(tiny_folder, tmp_path / "run", f"reward.model={folder}")
