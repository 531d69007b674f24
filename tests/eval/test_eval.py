"""`python -m rlkit.eval` and training's periodic evaluation are one code path: the same numbers on the same
checkpoint, seed and prompts; a LoRA adapter and the HF folder of its checkpoint evaluate alike; a dataset
with a `task` column gives one row per task; `trainer.log_samples` writes samples.jsonl and a W&B table."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from run_helpers import overrides, read_jsonl, tiny  # noqa: F401  (tiny: the session's tiny model fixture)

from rlkit.algos.evaluation import pass_at_k
from rlkit.eval import main_from_config
from rlkit.train import compose, load_config
from rlkit.trainer import run

pytestmark = pytest.mark.slow  # evaluation runs: `make test-fast` leaves it out

TASKS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b}


def _dataset(root: Path) -> Path:
    """A hand-made dataset with a `task` column: 16 training rows, 6 held-out rows of two tasks."""
    root.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 16), ("test", 6)):
        rows = []
        for i in range(count):
            task = "add" if i % 2 == 0 else "sub"
            a, b = 3 + i, 2 + i % 3
            op = "+" if task == "add" else "-"
            rows.append(
                {"question": f"What is {a} {op} {b}?", "answer": f"#### {TASKS[task](a, b)}", "task": task}
            )
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _overrides(tiny, run_dir, data, *extra):  # noqa: F811
    return overrides(
        tiny, run_dir, f"data.path={data}", "data.subset=null", "data.eval_size=6", "rollout.eval_group_size=3",
        "rollout.eval_temperature=1.0", "reward.fn=rlkit_test_rewards:lenient", "eval.ks=[1,2,3]", *extra,
    )  # fmt: skip


def _evaluate(tiny, tmp_path, data, model, *extra):  # noqa: F811
    out = tmp_path / f"eval-{len(list(tmp_path.glob('eval-*')))}.json"
    cfg = compose(_overrides(tiny, tmp_path / "unused", data, f"eval.model={model}", *extra))
    return main_from_config(cfg, out), out


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):  # noqa: F811
    """2 steps with LoRA adapters (so the checkpoint holds an adapter too), evaluated at the end, with samples
    logged to an offline W&B run."""
    root = tmp_path_factory.mktemp("evaltrain")
    data = _dataset(root / "data")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_DIR", str(root / "wb"))
    try:
        hist = run(
            load_config(
                compose(
                    _overrides(
                        tiny,
                        root / "run",
                        data,
                        "logger=wandb",
                        "trainer.log_samples=100",
                        "model.lora.rank=4",
                    )
                )
            )
        )
    finally:
        mp.undo()
    return root, data, hist


def test_rlkit_eval_gives_training_evaluation_numbers_on_its_checkpoint(tiny, trained, tmp_path):  # noqa: F811
    root, data, hist = trained
    in_loop = hist[-1]
    report, out = _evaluate(tiny, tmp_path, data, root / "run" / "checkpoints" / "step_2")
    total = report["metrics"]["total"]
    for key in ("pass@1", "pass@2", "pass@3", "maj@3", "reward"):
        assert total[key]["mean"] == pytest.approx(in_loop[f"eval/{key}"], abs=1e-12), key
        assert total[key]["stderr"] == pytest.approx(in_loop[f"eval/{key}_stderr"], abs=1e-12), key
    for task in TASKS:
        assert report["metrics"][task]["pass@1"]["mean"] == pytest.approx(
            in_loop[f"eval/pass@1/{task}"], abs=1e-12
        )
        assert report["metrics"][task]["prompts"] == 3
    # eval.json keeps each prompt's n and correct count: pass@k recomputed from them by a naive loop
    on_disk = json.loads(Path(out).read_text())
    prompts = on_disk["per_seed"][0]["prompts"]
    assert len(prompts) == 6 and {p["task"] for p in prompts} == set(TASKS)
    for k in (1, 2, 3):
        naive = sum(1 - math.comb(p["n"] - p["num_correct"], k) / math.comb(p["n"], k) for p in prompts) / 6
        assert on_disk["metrics"]["total"][f"pass@{k}"]["mean"] == pytest.approx(naive, abs=1e-12)
    assert on_disk["model"]["weights_sha256"] and on_disk["config"]["eval"]["ks"] == [1, 2, 3]


def test_samples_jsonl_rewards_match_the_logged_reward_mean_and_wandb_holds_the_table(trained):
    from wandb_files import history

    root, _, hist = trained
    samples = read_jsonl(root / "run" / "samples.jsonl")
    metrics = {line["step"]: line for line in read_jsonl(root / "run" / "metrics.jsonl")}
    for step in (1, 2):
        rows = [r for r in samples if r["kind"] == "train" and r["step"] == step]
        assert len(rows) == 8  # the whole batch of 8 samples (log_samples=100)
        assert sum(r["reward"] for r in rows) / 8 == pytest.approx(metrics[step]["reward/mean"], rel=1e-6)
        assert {"prompt", "response", "parts", "correct", "finish_reason", "length"} <= set(rows[0])
        assert all(r["parts"]["rlkit_test_rewards:lenient"] == pytest.approx(r["reward"]) for r in rows)
    evals = [r for r in samples if r["kind"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, 2] and sum(r["step"] == 2 for r in evals) == 18
    (wandb_file,) = (root / "wb").glob("wandb/offline-run-*/run-*.wandb")
    rows = history(wandb_file)
    tables = {(r["_step"], key.rsplit("/", 1)[0]): r for r in rows for key in r if key.endswith("/_type")}
    assert {(1, "samples/train"), (2, "samples/train"), (0, "samples/eval"), (2, "samples/eval")} <= set(
        tables
    )
    row = tables[(1, "samples/train")]
    assert row["samples/train/_type"] == "table-file" and row["samples/train/nrows"] == 8
    # the table's file in the offline run holds the rows of samples.jsonl
    table = json.loads((wandb_file.parent / "files" / row["samples/train/path"]).read_text())
    rewards = [d[table["columns"].index("reward")] for d in table["data"]]
    assert rewards == pytest.approx([r["reward"] for r in samples if r["kind"] == "train" and r["step"] == 1])


def test_lora_adapter_and_exported_hf_folder_evaluate_like_their_checkpoint(tiny, trained, tmp_path):  # noqa: F811
    root, data, hist = trained
    ckpt = root / "run" / "checkpoints" / "step_2"
    exported = tmp_path / "exported"
    shutil.copytree(ckpt / "model", exported)  # the checkpoint's HF folder (merged weights), on its own
    from_hf, _ = _evaluate(tiny, tmp_path, data, exported)
    from_adapter, _ = _evaluate(tiny, tmp_path, data, ckpt / "adapter")  # merged onto its base by peft
    assert from_adapter["model"]["base"] == tiny and from_adapter["model"]["adapter_sha256"]
    for report in (from_hf, from_adapter):
        for key in ("pass@1", "pass@3", "maj@3", "reward"):
            assert report["metrics"]["total"][key]["mean"] == pytest.approx(hist[-1][f"eval/{key}"], abs=1e-9)
        assert [p["num_correct"] for p in report["per_seed"][0]["prompts"]] == [
            p["num_correct"] for p in from_hf["per_seed"][0]["prompts"]
        ]


def test_seeds_give_a_mean_and_spread_and_greedy_with_several_samples_is_refused(tiny, trained, tmp_path):  # noqa: F811
    from rlkit.config.schema import ConfigError

    root, data, _ = trained
    report, _ = _evaluate(
        tiny,
        tmp_path,
        data,
        root / "run" / "checkpoints" / "step_2",
        "eval.seeds=[0,5]",
        "eval.n=2",
        "eval.ks=[1,2]",
    )
    p1 = report["metrics"]["total"]["pass@1"]
    per_seed = [s["summary"]["total"]["pass@1"] for s in report["per_seed"]]
    assert p1["per_seed"] == pytest.approx(per_seed) and p1["mean"] == pytest.approx(sum(per_seed) / 2)
    assert p1["seed_std"] == pytest.approx(abs(per_seed[0] - per_seed[1]) / math.sqrt(2))
    assert report["settings"]["ks"] == [1, 2] and all(p["n"] == 2 for p in report["per_seed"][1]["prompts"])
    counts = [[p["num_correct"] for p in s["prompts"]] for s in report["per_seed"]]
    assert per_seed == pytest.approx([float(pass_at_k([2] * 6, c, 1).mean()) for c in counts])
    with pytest.raises(ConfigError, match="eval.n=3 samples per prompt with temperature 0"):
        _evaluate(tiny, tmp_path, data, root / "run" / "checkpoints" / "step_2", "eval.temperature=0")


def test_cfg_job_prints_the_config_without_evaluating(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    from omegaconf import OmegaConf

    from rlkit import eval as rlkit_eval

    monkeypatch.chdir(tmp_path)
    argv = ["+recipe=quickstart_1digit", f"model.path={tiny}", "eval.n=4", "--cfg", "job"]
    monkeypatch.setattr(sys, "argv", ["rlkit.eval", *rlkit_eval.default_output_dir(argv)])
    rlkit_eval.main()  # Hydra's --cfg prints the composed config and returns without running the job
    shown = OmegaConf.create(capsys.readouterr().out)
    assert shown.eval.n == 4 and shown.model.path == tiny
    assert not (tmp_path / "outputs").exists()


# -- evaluation trusts only what verifies, and loses no result ------------------------------------------


def _no_model_loads(monkeypatch):
    from rlkit import eval as rlkit_eval

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(rlkit_eval, "LocalRollouts", refuse)
    monkeypatch.setattr(rlkit_eval, "load_causal_lm", refuse)


def _flip(path: Path, offset: int, count: int = 2) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _nan_weights(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, path, metadata={"format": "pt"})


DAMAGED = {  # what is damaged (a copy of the checkpoint, its model/ folder or its adapter/) -> named file, why
    "checksum": ("step", "model/model.safetensors", lambda p: _flip(p, p.stat().st_size // 2), "does not match its sha256"),
    "checksum_of_model": ("step/model", "model/model.safetensors", lambda p: _flip(p, p.stat().st_size // 2),
                          "does not match its sha256"),
    # the folder check (a safetensors header, before any model loads) names these two first
    "zero_byte": ("model", "model.safetensors", lambda p: p.write_bytes(b""), "is not a safetensors file"),
    "truncated": ("model", "model.safetensors", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
                  "is not readable safetensors"),
    "header": ("model", "model.safetensors", lambda p: _flip(p, 10), "is not a safetensors file"),
    "nan": ("model", "model.safetensors", _nan_weights, "holds NaN or inf"),
    "adapter_config": ("adapter", "adapter_config.json", lambda p: p.write_text('{"r": 4,'), "is not valid JSON"),
    "adapter_weights": ("adapter", "adapter_model.safetensors",
                        lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size - 100]), "is not readable safetensors"),
}  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGED)
def test_rlkit_eval_refuses_a_damaged_model_naming_the_file_before_any_model_loads(
    tiny,  # noqa: F811
    trained,
    tmp_path,
    monkeypatch,
    damage,
):
    from rlkit.config.schema import ConfigError

    root, data, _ = trained
    what, name, spoil, why = DAMAGED[damage]
    ckpt = root / "run" / "checkpoints" / "step_2"
    copy = tmp_path / "copy"
    shutil.copytree(ckpt if what.startswith("step") else ckpt / what, copy)
    spoil(copy / name)
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as e:
        _evaluate(tiny, tmp_path, data, copy / "model" if what == "step/model" else copy)
    assert name in str(e.value) and why in str(e.value), str(e.value)


def test_results_are_printed_and_kept_when_eval_json_cannot_be_written(tiny, trained, tmp_path, capsys):  # noqa: F811
    root, data, _ = trained
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "eval.json"  # a disk that fills after the start-up check: the write fails
    cfg = compose(
        _overrides(tiny, tmp_path / "unused", data, f"eval.model={root / 'run' / 'checkpoints' / 'step_2'}")
    )
    with pytest.raises(OSError, match="the report was written to"):
        main_from_config(cfg, out)
    printed = capsys.readouterr().out
    assert "pass@1" in printed and "total" in printed  # the table
    kept = Path(printed.split("the report is in ")[1].split()[0])
    assert json.loads(kept.read_text())["metrics"]["total"]["prompts"] == 6
    kept.unlink()
