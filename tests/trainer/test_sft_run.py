"""`python -m rlkit.sft` end to end on a model_dir model: steps, eval loss and checkpoints as RL's; a resume after a
kill continues exactly; the final checkpoint loads in transformers and starts `python -m rlkit.train` unconverted;
the recipe composes; RL-only keys are refused at start-up."""

import shutil

import pytest
import torch
from run_helpers import checkpoint_weights, read_jsonl, train

from rlkit import sft
from rlkit.config.schema import ConfigError
from rlkit.train import compose

pytestmark = pytest.mark.slow  # whole SFT runs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """run_helpers' tiny model (a random 2-layer Llama with SmolLM2's tokenizer and chat template)."""
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, seed=0)


def sft_overrides(model_dir, run_dir, *extra):
    return [
        "+recipe=sft_quickstart", f"model.path={model_dir}", f"trainer.run_dir={run_dir}", "sft.epochs=null",
        "trainer.steps=4", "trainer.train_batch_size=4", "data.num_train=64", "data.num_eval=8", "data.eval_size=4",
        "trainer.eval_every=2", "trainer.save_every=2", "trainer.lr=1e-3", "trainer.warmup_steps=1",
        "trainer.device=cpu", "trainer.progress_bar=false", "trainer.curves=false", "logger=none", *extra,
    ]  # fmt: skip


def run_sft(model_dir, run_dir, *extra):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the straight and the resumed run sum in the same order
    try:
        return sft.run(sft.load_config(compose(sft_overrides(model_dir, run_dir, *extra))))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def straight(model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sft") / "run"
    history = run_sft(model_dir, run_dir)
    return run_dir, history


def test_steps_eval_and_checkpoints(straight):
    run_dir, history = straight
    assert len(history) == 4
    losses = [h["loss"] for h in history]
    assert all(0 < v < 20 for v in losses)
    assert [("eval/loss" in h) for h in history] == [False, True, False, True]
    assert (
        history[-1]["eval/loss"] < history[1]["eval/loss"]
    )  # lr 1e-3 on a random model_dir model: it learns
    assert history[0]["lr"] < history[1]["lr"]  # warm-up, then cosine down
    assert history[3]["lr"] < history[1]["lr"]
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines if "loss" in line] == [1, 2, 3, 4]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4"]
    for name in ckpts:
        assert (run_dir / "checkpoints" / name / "checksums.json").is_file()


def test_resume_after_a_kill_is_exact(straight, tmp_path, model_dir):
    run_dir, history = straight
    killed = tmp_path / "run"
    shutil.copytree(run_dir, killed)
    # as if SIGKILLed during step 4's checkpoint: its line is written, the checkpoint is not
    shutil.rmtree(killed / "checkpoints" / "step_4")
    resumed = run_sft(model_dir, killed)
    assert [h["loss"] for h in resumed] == [h["loss"] for h in history[2:]]
    assert [h["eval/loss"] for h in resumed if "eval/loss" in h] == [history[3]["eval/loss"]]
    want, got = (
        checkpoint_weights(run_dir / "checkpoints" / "step_4"),
        checkpoint_weights(killed / "checkpoints" / "step_4"),
    )
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert [line["step"] for line in read_jsonl(killed / "metrics.jsonl") if "loss" in line] == [1, 2, 3, 4]


def test_final_checkpoint_loads_in_transformers(straight):
    """from_pretrained gives the trained weights: its labels loss on the eval rows is the logged eval/loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.data.loading import load_splits
    from rlkit.data.sft import build_sft_set

    run_dir, history = straight
    folder = run_dir / "checkpoints" / "step_4" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cfg = sft.load_config(compose(sft_overrides(str(folder), run_dir.parent / "unused")))
    _, held_out = load_splits(cfg.data, seed=cfg.trainer.seed)
    rows = build_sft_set(held_out, tokenizer, cfg.data, cfg.sft)
    total = count = 0.0
    for ids, mask in zip(rows.token_ids, rows.loss_masks):
        labels = torch.where(torch.tensor(mask), torch.tensor(ids), -100)[None]
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([ids]), labels=labels).loss
        n = sum(mask[1:])
        total, count = total + float(loss) * n, count + n
    assert total / count == pytest.approx(history[3]["eval/loss"], rel=1e-5)


def test_final_checkpoint_starts_rl_unconverted(straight, tmp_path):
    run_dir, _ = straight
    history = train(str(run_dir / "checkpoints" / "step_4" / "model"), tmp_path / "rl", "trainer.steps=1")
    assert len(history) == 1 and "loss/total" in history[0]


def test_epochs_set_the_steps(model_dir, tmp_path):
    cfg = sft.load_config(
        compose(sft_overrides(model_dir, tmp_path / "r", "sft.epochs=2", "trainer.train_batch_size=16"))
    )
    assert cfg.trainer.steps == 2 * 64 // 16 and cfg.algo.policy_loss == "nll" and cfg.rollout.group_size == 1


def test_steps_from_epochs_are_checked_like_given_steps(model_dir, tmp_path):
    """64 rows, 16 a step: 4 steps, fewer than the 5 warm-up steps (trainer.steps=25 alone would pass)."""
    extra = ("sft.epochs=1", "trainer.train_batch_size=16", "trainer.steps=25", "trainer.warmup_steps=5")
    with pytest.raises(ConfigError, match=r"trainer.warmup_steps=5 exceeds the run's 4 optimizer steps"):
        sft.load_config(compose(sft_overrides(model_dir, tmp_path / "r", *extra)))


@pytest.mark.parametrize(
    "key, value", [("algo.kl_coef", 0.1), ("rollout.temperature", 0.7), ("algo.ppo_epochs", 2)]
)
def test_rl_only_keys_are_refused(model_dir, tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"{key}={value!r} has no meaning in python -m rlkit.sft"):
        sft.load_config(compose(sft_overrides(model_dir, tmp_path / "r", f"{key}={value}")))


def test_the_recipe_composes_and_counts_its_steps(tmp_path):
    cfg = sft.load_config(compose(["+recipe=sft_quickstart", f"trainer.run_dir={tmp_path / 'r'}"]))
    assert cfg.trainer.steps == 63 and cfg.data.num_train == 1000  # one epoch of 1000 rows, 16 a step


def test_lora_sft_checkpoint_holds_merged_weights_and_the_adapter(model_dir, tmp_path):
    """With LoRA the checkpoint's model/ is the merged model (what RL and transformers load), adapter/ peft's."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "lora"
    history = run_sft(model_dir, run_dir, "trainer.steps=2", "trainer.save_every=0", "model.lora.rank=4")
    assert len(history) == 2
    ckpt = run_dir / "checkpoints" / "step_2"
    assert (ckpt / "adapter" / "adapter_config.json").is_file()
    merged = checkpoint_weights(ckpt)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert not any("lora" in name for name in merged)
    changed = [n for n in merged if n in base and not torch.equal(merged[n], base[n])]
    assert any("q_proj" in n for n in changed)  # the adapters' update is merged in
    AutoModelForCausalLM.from_pretrained(ckpt / "model")


def test_generation_eval_is_rlkit_evals_on_the_same_weights(model_dir, tmp_path):
    """sft.generation_eval runs the rollout side's evaluation (training's, rlkit.eval's) on the weights of each
    eval step: at the end, `python -m rlkit.eval` on the final checkpoint, with the same settings, gives the
    very numbers the SFT run logged."""
    from rlkit.eval import main_from_config

    gen = (
        "sft.generation_eval=true", "rollout.engine=hf", "rollout.eval_group_size=2", "data.eval_size=4",
        # a reward that varies with the response (a tiny random model solves no sum), half of it "correct"
        "reward.fn=rlkit_test_rewards:length", "reward.correct_threshold=0.5",
    )  # fmt: skip
    history = run_sft(model_dir, tmp_path / "run", *gen)
    assert [("eval/pass@1" in h) for h in history] == [False, True, False, True]
    final = history[-1]
    assert 0 < final["eval/reward"] < 1 and final["eval/pass@2"] > 0  # something to compare
    cfg = compose(
        sft_overrides(
            model_dir, tmp_path / "unused", *gen, f"eval.model={tmp_path / 'run/checkpoints/step_4'}"
        )
    )
    report = main_from_config(cfg, tmp_path / "eval.json")
    total = report["metrics"]["total"]
    assert report["settings"]["prompts"] == 4 and report["settings"]["n"] == 2
    for key in ("pass@1", "pass@2", "reward"):
        assert total[key]["mean"] == pytest.approx(final[f"eval/{key}"], abs=1e-12), key
