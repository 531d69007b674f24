"""`python -m rlkit.eval +recipe=NAME eval.model=PATH [key=value ...]`: evaluate a model without training.

The same Hydra config groups and recipes as `python -m rlkit.train`, and the same code as training's
periodic evaluation (rlkit/rollout/evaluation.py through `LocalRollouts.evaluate_prompts`): the same
engine, prompt template, held-out prompts (data.*), reward functions / environment and verdict of
"correct". `eval.model` is a training checkpoint (`checkpoints/step_<k>` or its `model/`), an HF model
folder, a peft LoRA adapter folder (merged onto its base first), a hub id or a short name (null =
model.path). For every seed of `eval.seeds` it draws `eval.n` samples per prompt, prints a table (one row
per task of the `eval.task_key` column, plus the total) and writes `eval.json`: every metric with its
standard error over prompts and its mean and spread over seeds, each prompt's n and number of correct
samples (any pass@k can be recomputed) and every sample's response, the model's identity (path, sha256 of
its weight files) and the config. `--cfg job` prints the composed config (Hydra's own) without running.

    python -m rlkit.eval +recipe=quickstart eval.model=runs/quickstart/checkpoints/step_25 'eval.seeds=[0,1,2]'
    python scripts/compare_evals.py step0/eval.json step25/eval.json     # paired difference of pass@1
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, read_write

from rlkit.algos.evaluation import mean_and_spread, stderr
from rlkit.checkpoints import check_checkpoint, model_folder_problem
from rlkit.config.rules import model_folder_ok
from rlkit.config.schema import CONFIG_DIR, ConfigError, RLConfig, register_configs, to_dict
from rlkit.models import load_causal_lm, load_tokenizer, resolve_model
from rlkit.rollout.evaluation import EvalSettings, default_ks, per_prompt, summarize
from rlkit.rollout.local import LocalRollouts
from rlkit.rundir import CHECKSUMS, TRAINER_STATE
from rlkit.train import load_config

__all__ = ["evaluate_model", "main", "model_identity", "resolve_eval_model", "weights_sha256"]

log = logging.getLogger(__name__)

register_configs()

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def weights_sha256(directory: str | Path) -> str | None:
    """sha256 over the weight files of a model folder (names and contents, in name order); None if none."""
    files = sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _merge_adapter(adapter: Path, base: str | None, out: Path) -> str:
    """Merge a peft LoRA adapter onto its base into the HF folder `out` (fp32); returns the base used."""
    from peft import PeftConfig, PeftModel

    base = base or PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    if not base:
        raise ConfigError(
            f"eval.model={str(adapter)!r} is a LoRA adapter without a base model: set eval.base"
        )
    model = PeftModel.from_pretrained(load_causal_lm(base), str(adapter)).merge_and_unload()
    model.save_pretrained(out)
    has_tokenizer = any((adapter / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    load_tokenizer(str(adapter) if has_tokenizer else base).save_pretrained(out)
    return base


def check_eval_model(spec: str) -> None:
    """Before any model loads, trust only what verifies: a training checkpoint (`step_<k>`, its `model/` or
    `adapter/`) is checked as resume checks it (every file against `checksums.json`, the weights finite); a
    model or adapter folder's configs must parse and its safetensors weights be readable and finite. Raises
    ConfigError naming eval.model and the first bad file."""
    p = Path(spec).expanduser()
    if not p.is_dir():
        return  # a hub id or a short name
    model_folder_ok(
        "eval.model", str(p / "model" if (p / "model").is_dir() and not (p / "config.json").exists() else p)
    )
    inside = p.name in ("model", "adapter") and (p.parent / CHECKSUMS).exists()  # a checkpoint's folder
    checkpoint = p.parent if inside else p
    if (checkpoint / CHECKSUMS).exists() or (checkpoint / TRAINER_STATE).exists():
        problem = check_checkpoint(checkpoint)
        where = f"checkpoint {checkpoint}"
    else:
        problem = model_folder_problem(p)
        where = f"folder {p}"
    if problem is not None:
        raise ConfigError(f"eval.model={spec!r}: {where} is not usable: {problem}")


def resolve_eval_model(spec: str, base: str | None, workdir: Path) -> tuple[str, dict]:
    """(the model folder or hub id the engine loads, its identity for eval.json) of `eval.model`."""
    check_eval_model(spec)
    p = Path(spec).expanduser()
    identity: dict = {"spec": spec}
    if p.is_dir():
        if (p / "model").is_dir() and not (p / "config.json").exists():  # a training checkpoint step_<k>
            p = p / "model"
        if (p / "adapter_config.json").exists():
            merged = workdir / "merged"
            identity["adapter"] = str(p.resolve())
            identity["adapter_sha256"] = weights_sha256(p)
            identity["base"] = _merge_adapter(p, base, merged)
            p = merged
        elif not (p / "config.json").exists():
            raise ConfigError(
                f"eval.model={spec!r} is a folder with neither config.json (an HF model), adapter_config.json "
                "(a LoRA adapter) nor model/ (a training checkpoint)"
            )
        identity["path"] = str(p.resolve())
        identity["weights_sha256"] = weights_sha256(p)
        return str(p), identity
    directory, gguf = resolve_model(spec)  # a short name (converted once into a cache folder) or a hub id
    identity["path"] = directory
    local = Path(directory)
    if not local.is_dir():
        try:
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(directory, local_files_only=True))
        except Exception:  # not cached: the engine downloads it; the hash is then unknown
            local = None
    identity["weights_sha256"] = weights_sha256(local) if local is not None else None
    return spec, identity


def model_identity(cfg: RLConfig) -> str:
    return cfg.eval.model if cfg.eval.model is not None else cfg.model.path


def _aggregate(per_seed: list[list], ks: list[int]) -> dict[str, dict[str, dict]]:
    """{task: {metric: {mean, stderr, seed_std, per_seed}}} over seeds; the standard error is over
    prompts, of each prompt's value averaged over the seeds."""
    tasks = {"total": None}
    for r in per_seed[0]:
        if r.task is not None:
            tasks.setdefault(r.task, None)
    out = {}
    for task in tasks:
        pick = [[r for r in results if task == "total" or r.task == task] for results in per_seed]
        values = [per_prompt(rs, ks) for rs in pick]
        row = {"prompts": len(pick[0])}
        for key in values[0]:
            seed_means = [float(v[key].mean()) for v in values]
            mean, spread = mean_and_spread(seed_means)
            prompt_avg = sum(v[key] for v in values) / len(values)
            row[key] = {
                "mean": mean,
                "stderr": stderr(prompt_avg),
                "seed_std": spread,
                "per_seed": seed_means,
            }
        out[task] = row
    return out


def _fmt(m: dict) -> str:
    s = f"{m['mean']:.3f}"
    if not math.isnan(m["stderr"]):
        s += f" ± {m['stderr']:.3f}"
    if not math.isnan(m["seed_std"]):
        s += f" (sd {m['seed_std']:.3f})"
    return s


def format_table(metrics: dict[str, dict], ks: list[int]) -> str:
    """The printed table: one row per task and the total; mean ± standard error over prompts (sd over seeds)."""
    cols = [*(f"pass@{k}" for k in ks), *(f"maj@{k}" for k in ks if k > 1), "reward"]
    rows = [["task", "prompts", *cols]]
    for task in [t for t in metrics if t != "total"] + ["total"]:
        row = metrics[task]
        rows.append([task, str(row["prompts"]), *(_fmt(row[c]) for c in cols)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def evaluate_model(cfg: RLConfig, output: str | Path) -> dict:
    """Evaluate `eval.model` under `cfg` on every seed of eval.seeds; write and return eval.json's content."""
    e = cfg.eval
    spec = model_identity(cfg)
    seeds = list(e.seeds) or [cfg.trainer.seed]
    n = e.n if e.n is not None else cfg.rollout.eval_group_size
    temperature = e.temperature if e.temperature is not None else cfg.rollout.eval_temperature
    ks = default_ks(e.ks, n)
    with tempfile.TemporaryDirectory(prefix="rlkit-eval-") as tmp:
        path, identity = resolve_eval_model(spec, e.base, Path(tmp))
        cfg.model.path = path
        tokenizer = load_tokenizer(path)
        device = torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu")
        rollouts = LocalRollouts(cfg, rank=0, world=1, device=device, tokenizer=tokenizer)
        try:
            if rollouts.eval_prompts is None:
                raise ConfigError("no evaluation prompts: data.eval_size=0 or an empty data.eval_split")
            per_seed = [
                rollouts.evaluate_prompts(EvalSettings(n=n, temperature=temperature, seed=s)) for s in seeds
            ]
        finally:
            rollouts.close()
    metrics = _aggregate(per_seed, ks)
    report = {
        "model": identity,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "n": n,
            "temperature": temperature,
            "ks": ks,
            "seeds": seeds,
            "task_key": e.task_key,
            "prompts": len(per_seed[0]),
            "engine": rollouts.engine_name,
        },
        "metrics": metrics,
        "per_seed": [
            {
                "seed": s,
                "summary": summarize(results, ks),
                "prompts": [r.record(with_samples=True) for r in results],
            }
            for s, results in zip(seeds, per_seed)
        ],
        "config": to_dict(cfg),
    }
    # Printed first: a failing write (checked at start-up, but a disk can fill) loses no result.
    print(f"model: {identity.get('path')} (weights sha256 {str(identity.get('weights_sha256'))[:16]}...)")
    print(f"{len(per_seed[0])} prompts x {n} samples, temperature {temperature}, seeds {seeds}")
    print(format_table(metrics, ks))
    _write_report(report, Path(output))
    return report


def _write_report(report: dict, out: Path) -> None:
    """Write eval.json; when that fails, write it to a temporary file instead, say where, and raise."""
    text = json.dumps(_no_nan(report), indent=1)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        with tempfile.NamedTemporaryFile("w", prefix="rlkit-eval-", suffix=".json", delete=False) as f:
            f.write(text)
        print(f"eval.json: could not write {out} ({e}); the report is in {f.name}")
        raise OSError(f"eval.output: could not write {out} ({e}); the report was written to {f.name}") from e
    print(f"eval.json: {out}")


def _no_nan(x):
    """NaN (a standard error of one prompt, the spread of one seed) as JSON null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


def main_from_config(cfg: DictConfig, output: str | Path) -> dict:
    with read_write(cfg):
        OmegaConf.resolve(cfg)
    config = load_config(cfg)  # the schema's rules and every component's checks, before any model loads
    return evaluate_model(config, output)


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    output = cfg.eval.output or Path(HydraConfig.get().runtime.output_dir) / "eval.json"
    main_from_config(cfg, output)


def default_output_dir(argv: list[str]) -> list[str]:
    """Hydra's output dir for an evaluation: outputs/eval/<date>/<time> (never the training run's directory,
    which `hydra.run.dir: ${trainer.run_dir}` would pick), unless the command line sets one."""
    if any(a.startswith(("hydra.run.dir=", "+hydra.run.dir=")) for a in argv):
        return argv
    return ["hydra.run.dir=outputs/eval/${now:%Y-%m-%d}/${now:%H-%M-%S}", *argv]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.argv = [sys.argv[0], *default_output_dir(sys.argv[1:])]
    main()
