"""The update's first forward as the scoring pass (rlkit/learner/reuse.py): the same log-probs, entropy, IS
weights, mismatch and IS metrics, loss and gradient as today's separate pass (`Learner.forward`, then
`rollout_is` over the whole batch, then the update with those weights), in 1 process and under 2-process
FSDP2 over gloo (that half runs in test_fsdp2.py's launch)."""

from __future__ import annotations

import pytest
import torch
from cfg_helpers import learner_cfg
from reuse_helpers import LEVELS, LOSS, assert_same, both_paths, reuse_batches, rollout_logprobs

from rlkit.config.schema import RLConfig, RolloutISConfig
from rlkit.learner import Learner
from rlkit.learner.reuse import has_dropout, reusable


@pytest.mark.parametrize("level", LEVELS)
def test_reused_forward_equals_the_separate_pass_in_one_process(tiny_model_dir, level):
    learner = Learner(learner_cfg(model_path=tiny_model_dir, **LOSS))
    sampled, train = reuse_batches()
    rollout = rollout_logprobs(learner, sampled, seed=1)
    is_cfg = RolloutISConfig(enabled=True, level=level, upper=1.5)
    result = both_paths(learner, sampled, train, rollout, is_cfg)
    assert_same(result)
    w = result["separate"]["weights"][sampled.response_mask]
    assert (w < 1.5).any() and (w > 0).all()  # a real mix of weights, not all truncated
    if level == "token":
        assert (w == 1.5).any()  # some truncated
    # The untrained rows (2 and 6) were scored too: their log-probs are the forward's, not zeros.
    assert (result["reused"]["logprobs"][[2, 6]][sampled.response_mask[[2, 6]]] < 0).all()


def test_reusable_names_what_needs_the_separate_pass():
    cfg = RLConfig()
    assert reusable(cfg, dropout=False) == (True, "")
    cases = [
        ("trainer", "reuse_update_forward", False, "trainer.reuse_update_forward=false"),
        ("algo", "ppo_epochs", 2, "off-policy"),
        ("algo", "kl_coef", 0.1, "reference"),
        ("algo", "value_model", True, "critic"),
        ("algo", "distill_coef", 1.0, "teacher"),
    ]
    for section, key, value, why in cases:
        c = RLConfig()
        setattr(getattr(c, section), key, value)
        ok, reason = reusable(c, dropout=False)
        assert not ok and why in reason, key
    c = RLConfig()
    c.algo.rollout_is = RolloutISConfig(enabled=True, mode="mask")
    assert "rejection" in reusable(c, dropout=False)[1]
    c.algo.rollout_is = RolloutISConfig(enabled=True, veto_upper=10.0)
    assert "veto" in reusable(c, dropout=False)[1]
    assert not reusable(RLConfig(), dropout=True)[0]


def test_has_dropout_reads_modules_and_config():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    assert not has_dropout(LlamaForCausalLM(cfg))
    cfg.attention_dropout = 0.1
    assert has_dropout(LlamaForCausalLM(cfg))
    assert has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
