"""docs/concepts/step-in-40-lines.md: its code runs on a tiny model, and on the batch `Trainer` produced at its
first step its loss and gradient equal those of rlkit's learner (phases 3-6 of rlkit/learn.py, without the
optimizer step)."""

import dataclasses
import re
import types

import pytest
import torch

from rlkit.config.schema import REPO_ROOT
from rlkit.metrics import MetricMerger
from rlkit.models import load_causal_lm, load_tokenizer, make_tiny_checkpoint
from rlkit.timing import Timers
from rlkit.train import compose, load_config
from rlkit.trainer import Trainer

pytestmark = pytest.mark.slow  # a Trainer's first step: `make test-fast` leaves it out

PAGE = REPO_ROOT / "docs" / "concepts" / "step-in-40-lines.md"


def page_code() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    return code


def page_module() -> types.ModuleType:
    module = types.ModuleType("step_in_40_lines")
    exec(compile(page_code(), str(PAGE), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny40"), hidden_size=32, num_layers=2, seed=0)


def test_the_page_is_about_forty_lines_of_code():
    code = [line for line in page_code().splitlines() if line.strip() and not line.strip().startswith("#")]
    docstrings = [line for line in code if line.strip().startswith('"""') or line.strip().endswith('"""')]
    assert 30 <= len(code) - len(docstrings) <= 45, len(code) - len(docstrings)


def test_the_pages_train_step_runs_and_learns_something(tiny):
    torch.manual_seed(0)
    step = page_module()
    model, tok = load_causal_lm(tiny), load_tokenizer(tiny)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prompts = ["What is 1 + 2?", "What is 3 + 4?"]
    losses = [
        step.train_step(model, optimizer, tok, prompts, lambda i, text: float(len(text) % 3), group_size=4)
        for _ in range(2)
    ]
    assert all(torch.isfinite(x) for x in losses)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_the_pages_loss_and_gradient_equal_the_trainers_first_step(tiny, tmp_path):
    cfg = load_config(
        compose(
            [
                "+recipe=quickstart_1digit",
                f"model.path={tiny}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.steps=1",
                "trainer.train_batch_size=8",
                "rollout.max_new_tokens=12",
                "data.num_train=64",
                "data.num_eval=8",
                "data.eval_size=4",
                "trainer.eval_every=0",
                "trainer.eval_at_start=false",
                "trainer.save_every=0",
                "trainer.progress_bar=false",
                "reward.num_workers=1",
                "logger=none",
            ]  # fmt: skip
        )
    )
    trainer = Trainer(cfg)
    try:
        trainer.sync.start(trainer.learner.export(), 0)
        produced = trainer.rollouts.produce(0, Timers())
        rb = produced.rollout
        # A reward that depends on the response (the random model never answers right): groups with a spread.
        rewards = ((rb.response_ids * rb.response_mask).sum(1) % 3).float()
        assert (rewards.view(-1, 4).std(1) > 0).any()
        produced = dataclasses.replace(produced, rewards=rewards)

        # rlkit: phases 3-5 as the step runs them, then the update's gradient without its optimizer step.
        phases, learner = trainer.learn, trainer.learner
        mask, merger = rb.response_mask.bool(), MetricMerger()
        scores = phases.score(rb, mask, merger)
        prepared = phases.correct(
            rb, mask, phases.advantages(produced, mask, scores, merger), scores, 0, merger
        )
        learner.zero_grad()
        metrics = learner.accumulate_gradients(phases.train_batch(rb, prepared))
        policy = learner.accelerator.unwrap_model(learner.model)
        want = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    finally:
        trainer.close()

    # The page, on the same batch (clones: the engine made inference-mode tensors), from the same weights.
    step = page_module()
    model = load_causal_lm(tiny)
    rewards, mask = rewards.clone(), mask.clone()
    advantages, trains = step.group_advantages(rewards, 4)
    logp = step.token_logprobs(model, rb.prompt_ids.clone(), rb.prompt_mask.long(), rb.response_ids.clone())
    loss = step.loss_fn(logp, advantages, mask & trains[:, None])
    loss.backward()
    torch.testing.assert_close(loss.detach(), metrics["loss/total"].to(loss.dtype), rtol=1e-5, atol=1e-6)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want) and any(g.abs().sum() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
