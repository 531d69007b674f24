"""Distillation teachers are checked at start-up (issue #33, item 5), each refusal naming algo.teacher.path:
a vocabulary smaller than the tokenizer and a teacher stored only as a pickled pytorch_model.bin are refused
by the preflight before any model loads; a teacher whose weights hold NaN (all, or a single one) is refused
as it loads, before any step; a teacher with finite weights whose log-probs overflow stops the run with a
NonFiniteError that names the teacher, not the learning rate. Tiny random teachers sharing SmolLM2's
tokenizer (as in test_distill.py)."""

import json
import shutil
from pathlib import Path

import pytest
import run_helpers
import torch
import transformers
from run_helpers import overrides
from safetensors.torch import load_file, save_file

from rlkit.config.schema import ConfigError
from rlkit.models import load_tokenizer
from rlkit.train import compose, load_config

pytestmark = pytest.mark.slow  # a trainer run: `make test-fast` leaves it out

tiny = run_helpers.tiny  # the tiny model fixture (the policy)


def _distill(path):
    return (f"algo.teacher.path={path}", "algo.distill_coef=0.5")


def _no_model_loads(monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)


def _copy(model, directory: Path) -> Path:
    """A teacher made from a copy of the tiny policy (its weights are then altered)."""
    shutil.copytree(model, directory)
    return directory


def _small_vocabulary_teacher(directory: Path) -> str:
    """A tiny Llama with the policy's tokenizer but vocab_size=1000 (the tokenizer has 49152 tokens)."""
    tok = load_tokenizer("smollm2-135m")
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def test_a_small_vocabulary_teacher_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):
    small = _small_vocabulary_teacher(tmp_path / "small")
    assert len(load_tokenizer(small)) == 49152  # the same tokenizer: only the model's vocabulary is short
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as e:
        load_config(compose(overrides(tiny, tmp_path / "r", *_distill(small))))
    msg = str(e.value)
    assert f"algo.teacher.path={small!r}" in msg and "vocab_size=1000" in msg and "49152" in msg


def test_a_pickled_only_teacher_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):
    pickled = _copy(tiny, tmp_path / "pickled")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as e:
        load_config(compose(overrides(tiny, tmp_path / "r", *_distill(pickled))))
    msg = str(e.value)
    assert (
        f"algo.teacher.path={str(pickled)!r}" in msg and "pytorch_model.bin" in msg and "safetensors" in msg
    )


def test_an_unknown_architecture_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):
    other = _copy(tiny, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps({**config, "model_type": "t5", "architectures": ["T5Model"]})
    )
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as e:
        load_config(compose(overrides(tiny, tmp_path / "r", *_distill(other))))
    assert f"algo.teacher.path={str(other)!r}" in str(e.value) and "AutoModelForCausalLM" in str(e.value)


@pytest.mark.parametrize("where", ["all", "one"])
def test_a_nan_teacher_is_refused_as_it_loads_naming_the_path(tiny, tmp_path, where):
    from rlkit.learner import Learner

    nan = _copy(tiny, tmp_path / "nan")
    weights = load_file(nan / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    if where == "all":
        weights = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    else:
        weights[name] = weights[name].clone()
        weights[name][3, 5] = float("nan")  # a single element of one tensor
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    cfg = load_config(compose(overrides(tiny, tmp_path / "r", *_distill(nan))))  # the config is fine
    with pytest.raises(ConfigError) as e:
        Learner(cfg)
    msg = str(e.value)
    assert f"algo.teacher.path={str(nan)!r}" in msg and "NaN" in msg
    if where == "one":
        assert "1 parameter tensors" in msg and name in msg


def test_a_teacher_whose_logprobs_overflow_is_named_by_the_nonfinite_error(tiny, tmp_path):
    """Finite weights (the final norm's at float32's largest value) whose logits overflow: the distillation
    term is NaN, the step is skipped, and the error that stops the run names algo.teacher.path."""
    from rlkit.learner.optim import NonFiniteError

    big = _copy(tiny, tmp_path / "big")
    weights = load_file(big / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(
        weights["model.norm.weight"], torch.finfo(torch.float32).max
    )
    save_file(weights, big / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteError) as e:
        run_helpers.train(
            tiny, tmp_path / "r", "trainer.steps=2", "trainer.max_nonfinite_steps=1", "trainer.eval_at_start=false",
            *_distill(big),
        )  # fmt: skip
    msg = str(e.value)
    assert f"algo.teacher.path={str(big)!r}" in msg and "distill/teacher_logprob=nan" in msg, msg
    assert "trainer.lr" not in msg
