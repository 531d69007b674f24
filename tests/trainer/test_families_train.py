"""Whole training runs on the families whose push was once broken, 2 steps each with `rollout.engine=vllm`; the async
run is a `python -m rlkit.train` launch as for a user (its rollout worker is a process of its own), the others
run in the test's process with one thread, as the launched one (the per-family push and probe checks of every
family are in tests/rollout/test_families.py; these prove the trainer's wiring):

- Qwen3-MoE, colocated and async: the pushes verified (digests, the probe at start-up and after every push)
  and the engine's log-probs the learner's after each push, as for a dense model;
- Nemotron-H (a hybrid: Mamba-2 beside attention), colocated and async, the same, without vLLM's prefix cache;
- DeepSeek-V2, colocated: refused at start-up with the measured gap of vLLM's CPU MLA forward and the key that
  would accept it; with that key set, it trains;
- a push that leaves the engine computing something else with bytes the digests accept (Qwen3-MoE with vLLM's
  CPU expert prepack skipped after the start-up push) stops the run at the batch that push samples: the probe
  a colocated push leaves to its batch (rlkit/sync.py)."""

import json
from pathlib import Path

import pytest
from model_families import build_family
from run_helpers import finish, read_jsonl, run_args, start, train
from vllm_import import import_vllm

import_vllm()

from rlkit.weights import WeightSyncError  # noqa: E402

pytestmark = pytest.mark.slow  # trainer runs with vLLM: `make test-fast` leaves it out


def _args(ckpt, run_dir, *extra) -> list[str]:
    return [
        "+recipe=quickstart_1digit", f"model.path={ckpt}", f"trainer.run_dir={run_dir}", "trainer.steps=2",
        "trainer.train_batch_size=4", "rollout.group_size=2", "rollout.max_new_tokens=6", "data.eval_size=4",
        "data.num_train=32", "data.num_eval=4", "trainer.eval_every=0", "trainer.save_every=0", "trainer.lr=1e-3",
        "trainer.progress_bar=false", "reward.fn=rlkit_test_rewards:length", "reward.num_workers=1",
        "algo.mask_zero_std_groups=false", "logger=none", "rollout.engine=vllm",
        "+rollout.engine_kwargs.kv_cache_gib=0.05", "+rollout.engine_kwargs.max_model_len=256",
        "rollout.seed_per_prompt=true", "rollout.weight_sync_kl_threshold=1e-3", "trainer.eval_at_start=false",
        *extra,
    ]  # fmt: skip


def _steps(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "reward/mean" in m]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The async run launched; beside it, the three others in this process: {name: (error or None, dir)}."""
    root = tmp_path_factory.mktemp("family_runs")
    moe = build_family("qwen3-moe", root / "qwen3-moe")
    mla = build_family("deepseek-v2", root / "deepseek-v2")
    launched = start(*_args(moe, root / "moe_async", "trainer.mode=async", "trainer.max_staleness=0"))
    plan = {
        "moe": (moe, ()),
        "mla": (mla, ()),
        "mla_accepted": (mla, ("rollout.accept_engine_gap=0.01", "rollout.weight_sync_kl_threshold=0.05")),
    }
    out = {}
    for name, (ckpt, extra) in plan.items():
        try:
            run_args(_args(ckpt, root / name, *extra))
            out[name] = (None, root / name)
        except Exception as e:  # what a user's launch prints last
            out[name] = (f"{type(e).__name__}: {e}", root / name)
    out["moe_async"] = (finish(launched), root / "moe_async")
    return out


@pytest.mark.parametrize("name", ["moe", "moe_async"])
def test_trains_with_every_push_verified_and_no_drift(runs, name):
    err, run_dir = runs[name]
    assert err is None, err[-6000:]
    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == [1, 2] and steps[0]["grad_norm"] > 0
    for m in steps:  # the dense families' agreement (fp32: ~1e-7), where the MoE drift read 0.017-0.026
        assert abs(m["mismatch/kl"]) < 1e-5 and m["mismatch/logprob_abs_diff"] < 1e-4


def test_the_gap_accepted_by_the_key_trains_and_every_push_still_verifies(runs):
    """rollout.accept_engine_gap above DeepSeek-V2's measured 2.5e-3: it trains, its pushes verified (digests,
    and the probe within the accepted gap), the engine-learner drift that of its forward, not growing."""
    err, run_dir = runs["mla_accepted"]
    assert err is None, err[-6000:]
    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["mismatch/logprob_abs_diff"] < 0.01


def test_an_engine_whose_forward_differs_is_refused_at_start_up_with_its_gap_and_the_key(runs):
    err, run_dir = runs["mla"]
    assert err is not None
    assert "WeightSyncError" in err and "as loaded, before training" in err and "mean |dlogp|" in err
    assert "accept_engine_gap" in err
    assert not (run_dir / "metrics.jsonl").exists() or not _steps(run_dir)


def test_a_push_that_drifts_stops_the_run_at_the_batch_it_samples(tmp_path, monkeypatch):
    """The MoE drift once found (pushed experts not repacked), brought back after start-up: the push of version 1 copies the changed expert
    weights in (every digest moves as the learner's did) but skips the CPU prepack, so the engine samples step
    2's batch from mangled experts; that batch's mean |dlogp| (2e-2 when it was found) against the fp32
    bound of 1e-4 stops the run before step 2 is logged or saved (its update was pushed as version 2 already: the
    step's metrics exist only after its push)."""
    from vllm.platforms import current_platform

    from rlkit.rollout.engines.vllm import reload as vllm_reload

    if not current_platform.is_cpu():
        pytest.skip("the expert prepack vLLM skips on a weight update is its CPU platform's")
    real, calls = vllm_reload._redo_cpu_expert_prepack, []

    def start_up_only(model, touched):  # the start-up push (same weights) is prepacked; later ones are not
        calls.append(sorted(touched))
        return real(model, touched) if len(calls) == 1 else []

    monkeypatch.setattr(vllm_reload, "_redo_cpu_expert_prepack", start_up_only)
    ckpt = build_family("qwen3-moe", tmp_path / "qwen3-moe")
    run_dir = tmp_path / "run"
    with pytest.raises(WeightSyncError) as caught:
        train(
            ckpt, run_dir, "rollout.engine=vllm", "+rollout.engine_kwargs.kv_cache_gib=0.05",
            "+rollout.engine_kwargs.max_model_len=256", "trainer.steps=3", "trainer.eval_at_start=false",
        )  # fmt: skip
    message = str(caught.value)
    assert "after the push of version 1" in message and "on the tokens it sampled for step 2" in message
    gap = float(message.split("mean |dlogp| = ")[1].split(" ")[0])
    assert gap > 100 * 1e-4  # the drift, not fp32 noise (1e-7)
    assert len(calls) == 3  # the start-up push, version 1's and version 2's; no step after the check
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1]  # step 1 logged, step 2 not


def test_a_hybrid_family_trains_on_the_engine_auto_picks_with_packing_turned_off(tmp_path, caplog):
    """Qwen3.5 (gated DeltaNet beside gated attention), as a user would start it: `rollout.engine=auto` picks the HF
    engine (vLLM's CPU build cannot run it, naming why), `trainer.pack_sequences=true` is turned
    off with one INFO line (a packed row would start from the previous row's state), and the engine's log-probs
    are the learner's after every push (fp32), on the left-padded prompts of different lengths the task gives."""
    import logging

    ckpt = build_family("qwen3.5-text", tmp_path / "qwen3.5-text")
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        vllm_only = ("rollout.engine=", "+rollout.engine_kwargs.")
        args = [a for a in _args(ckpt, run_dir) if not a.startswith(vllm_only)]
        run_args([*args, "rollout.engine=auto", "trainer.pack_sequences=true"])
    picked = [r.message for r in caplog.records if "rollout.engine=auto picked" in r.message]
    # vLLM's CPU build: its Qwen3.5 module does not import without torchvision; with it, its gated-DeltaNet kernel
    # takes no fp32 (the recipe's model.dtype)
    assert len(picked) == 1 and "picked hf" in picked[0], picked
    assert "torchvision" in picked[0] or "bfloat16 only" in picked[0], picked
    assert [r for r in caplog.records if "packing is off for this model" in r.message]
    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == [1, 2] and steps[0]["grad_norm"] > 0
    for m in steps:
        assert abs(m["mismatch/kl"]) < 1e-5 and m["mismatch/logprob_abs_diff"] < 1e-4


def test_a_hybrid_family_trains_on_vllm_colocated_and_async(tmp_path, caplog):
    """Nemotron-H (a Mamba-2 layer beside attention) on vLLM, 2 steps colocated (in this process, with
    `trainer.pack_sequences=true`) and async (launched: its rollout worker a process of its own): the engine runs
    without its prefix cache (one INFO line: a state computed before a push must not be reused), packing is off,
    every push is verified and the engine's log-probs are the learner's after each push (fp32)."""
    import logging

    ckpt = build_family("nemotron-h", tmp_path / "nemotron-h")
    launched = start(*_args(ckpt, tmp_path / "async", "trainer.mode=async", "trainer.max_staleness=0"))
    with caplog.at_level(logging.INFO):
        run_args(_args(ckpt, tmp_path / "sync", "trainer.pack_sequences=true"))
    err = finish(launched)
    assert err is None, err[-6000:]
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if m.startswith("vLLM prefix caching off: the model's")]
    assert [m for m in messages if "packing is off for this model" in m]
    for run in ("sync", "async"):
        steps = _steps(tmp_path / run)
        assert [m["step"] for m in steps] == [1, 2] and steps[0]["grad_norm"] > 0, run
        for m in steps:
            assert abs(m["mismatch/kl"]) < 1e-5 and m["mismatch/logprob_abs_diff"] < 1e-4, (run, m)
