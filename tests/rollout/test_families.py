"""Every model family users train, on both engines: a tiny random checkpoint of each (tests/
model_families.py), its weights pushed into the engine unchanged and changed, each push verified and the
engine's log-probs probed against the learner's (a transformers model with the same weights), or the family
refused at start-up with the reason and the alternative. Never a drift.

For each family the outcome is compared with docs/supported-models.json, from which the "Supported models"
page is written (scripts/supported_models.py; tests/docs/test_supported_models.py holds the page to it).
`RLKIT_WRITE_SUPPORTED=1` rewrites the JSON from this run instead (then run the script)."""

import json
import os

import pytest
import torch
from model_families import FAMILIES, build_family, learner_logprobs, sampled_gap
from vllm_import import import_vllm

from rlkit.config.schema import REPO_ROOT
from rlkit.models import load_causal_lm, stateful_layers
from rlkit.verify import check_probe, probe_bound, probe_gap, probe_tokens, verify_push
from rlkit.weights import Export, WeightSyncError, iter_full_parameters, module_manifest

pytestmark = pytest.mark.slow  # builds a vLLM engine per model family: `make test-fast` leaves it out

SUPPORTED = REPO_ROOT / "docs" / "supported-models.json"
BOUND = probe_bound(torch.float32)


@pytest.fixture(scope="session")
def family_ckpt(tmp_path_factory):
    """family name -> its tiny checkpoint, each written once per session (on first use)."""
    built = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


def _expected(name: str) -> dict:
    return json.loads(SUPPORTED.read_text())["families"][name]


def _record(name: str, row: dict) -> None:
    if os.environ.get("RLKIT_WRITE_SUPPORTED") != "1":
        return
    import importlib
    import time

    data = json.loads(SUPPORTED.read_text()) if SUPPORTED.exists() else {"families": {}}
    data["families"][name] = row
    data["versions"] = {p: importlib.import_module(p).__version__ for p in ("vllm", "transformers", "torch")}
    data["date"] = time.strftime("%Y-%m-%d")
    SUPPORTED.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def engine_dtype(model) -> str:
    """fp32, except for gated DeltaNet layers, which vLLM's CPU kernel runs in bf16 only (rlkit refuses fp32)."""
    return "bfloat16" if getattr(model.config, "linear_key_head_dim", None) else "float32"


def vllm_outcome(ckpt: str) -> dict:
    """What happens to the family on vLLM, as a trainer would meet it: the probe on the engine as loaded, the
    same weights pushed (no engine digest may change, the probe must still agree), changed weights pushed
    (every engine tensor built from them must change, the probe must agree). The learner's model exists before
    the engine is built and must still run after (colocated). The learner is fp32; the engine too unless
    `engine_dtype` says otherwise, and the probe's bound is then the engine dtype's."""
    from rlkit.rollout.engines.vllm import VLLMEngine

    model = load_causal_lm(ckpt)
    export = Export(module_manifest(model), lambda: iter_full_parameters(model))
    tokens = probe_tokens()
    dtype = engine_dtype(model)
    bound = probe_bound(getattr(torch, dtype))
    try:
        engine = VLLMEngine(ckpt, dtype=dtype, seed=0, kv_cache_gib=0.05, max_model_len=256)
    except RuntimeError as e:  # refused before vLLM builds anything (e.g. layers with state: a hybrid family)
        assert "cannot run here" in str(e), e
        return {"vllm": "refused", "reason": str(e), "at_build": True}
    try:
        learner_logprobs(model, tokens)  # the colocated learner still runs (vLLM's Transformers backend)
        out = {
            "dtype": dtype,
            "load_gap": probe_gap(engine.prompt_logprobs(tokens), learner_logprobs(model, tokens)),
        }
        try:
            check_probe(out["load_gap"], bound, when="as loaded", engine="vllm", at_load=True)
            before = verify_push(export, engine)
            engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
            # Nothing changed: every engine tensor holds what the push wrote (by content), and the ones that check
            # cannot read (values changed by processing) are as they were (by change); either raises.
            same = verify_push(export, engine, before)
            check_probe(probe_gap(engine.prompt_logprobs(tokens), learner_logprobs(model, tokens)), bound,
                        when="after the same weights", engine="vllm")  # fmt: skip
            _perturb(model, 1)
            engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
            changed = verify_push(export, engine, same)
            moved = {e for e, d in changed["engine"].items() if d != same["engine"][e]}
            determined = set(engine.digest_sources()) & set(changed["engine"])
            assert determined and moved >= determined, "a digest the push determines did not move"
            out["push_gap"] = probe_gap(engine.prompt_logprobs(tokens), learner_logprobs(model, tokens))
            check_probe(out["push_gap"], bound, when="after changed weights", engine="vllm")
            if stateful_layers(
                model.config
            ):  # the probe prefills only: sampling runs the state's decode path
                out["sample_gap"] = sampled_gap(engine, model)
                assert out["sample_gap"] <= bound, (
                    f"sampled log-probs differ from the learner's: {out['sample_gap']}"
                )
            out["vllm"] = "trains"
        except WeightSyncError as e:
            out["vllm"] = "refused"
            out["reason"] = str(e)
        return out
    finally:
        engine.close()


def hf_outcome(ckpt: str) -> str:
    """The HF engine: changed weights pushed and verified tensor for tensor, then sampling with the learner's
    log-probs (a hybrid family's cache is not repeated but prefilled per sample)."""
    from rlkit.rollout.engines.hf import HFEngine

    model = load_causal_lm(ckpt)
    engine = HFEngine(ckpt, dtype=torch.float32)
    export = Export(module_manifest(model), lambda: iter_full_parameters(model))
    verify_push(export, engine)
    _perturb(model, 2)
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
    verify_push(export, engine)
    gap = sampled_gap(engine, model)
    assert gap <= BOUND, f"the HF engine's log-probs of its samples differ from the learner's: {gap:.2g}"
    return "trains"


def _reason(error: str, load_gap: float) -> str:
    """The cause of a refusal, for the page: the build's check, the probe's at load, or the reload's stale layers."""
    if "cannot run here: " in error:
        return error.split("cannot run here: ")[1].split("; use rollout.engine=hf")[0]
    if "as loaded" in error:
        return (
            f"vLLM's forward differs from the learner's at load (mean abs dlogp {load_gap:.1e}, fp32 bound "
            f"{BOUND:g}): refused unless rollout.accept_engine_gap accepts the gap"
        )
    return error.split(". vLLM")[0]  # "vLLM's weight reload left [...] stale: ..."


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_or_is_refused_never_drifts(name, family_ckpt):
    import_vllm()
    ckpt = family_ckpt(name)
    out = vllm_outcome(ckpt)
    row = {"hf": hf_outcome(ckpt), "vllm": out["vllm"]}
    if "load_gap" in out:
        row["load_gap"] = float(f"{out['load_gap']:.2g}")
        if out["dtype"] != "float32":
            row["vllm_dtype"] = out["dtype"]
    if out["vllm"] == "trains":
        bound = probe_bound(getattr(torch, out["dtype"]))
        assert out["load_gap"] <= bound and out["push_gap"] <= bound
        row["push_gap"] = float(f"{out['push_gap']:.2g}")
        if "sample_gap" in out:
            row["sample_gap"] = float(f"{out['sample_gap']:.2g}")
    else:
        assert "rollout.engine=hf" in out["reason"] or "accept_engine_gap" in out["reason"], out["reason"]
        row["reason"] = _reason(out["reason"], out.get("load_gap"))
    _record(name, row)
    expected = _expected(name)
    assert (row["hf"], row["vllm"]) == (expected["hf"], expected["vllm"]), out.get("reason")
