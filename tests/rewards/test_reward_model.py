# ruff: noqa: F811  (the `tiny` fixture is imported from run_helpers and requested by name)
"""The neural reward model (`reward.model`): batched scores equal transformers' own per-sample forward,
a model whose score is a known function of the last token scores exactly that, and in training its
score joins the rule rewards with its weight."""

import pytest
import torch
from run_helpers import tiny, train  # noqa: F401

from rlkit.models import load_tokenizer, make_tiny_checkpoint
from rlkit.rewards.model import RewardModel

pytestmark = pytest.mark.slow  # a trainer run with a reward model: `make test-fast` leaves it out


def _tiny_rm(directory, *, embedding_only=False, seed=0):
    """A tiny Llama sequence classifier (one label) sharing SmolLM2's tokenizer.

    `embedding_only` zeroes every layer's output projections, so each position's hidden state is its
    token embedding and the score is  w . (g * e / rms(e))  with e the last token's embedding, g the
    final norm's weight and w the head: computable by hand.
    """
    from transformers import AutoConfig, LlamaForSequenceClassification

    make_tiny_checkpoint(directory, hidden_size=32, num_layers=2, seed=seed)
    config = AutoConfig.from_pretrained(directory)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
        if embedding_only:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(directory)
    return str(directory), model


CONVERSATIONS = [
    ([{"role": "user", "content": "What is 2 + 3?"}], "5"),
    (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        "Blue, or green.",
    ),
    ([{"role": "user", "content": "Count to five."}], "one two three four five" * 3),
]


def test_batched_scores_equal_transformers_per_sample_forward(tmp_path):
    path, model = _tiny_rm(tmp_path / "rm")
    rm = RewardModel(path, batch_size=2)  # a batch of 2 and one of 1: padding is exercised
    got = rm.score([m for m, _ in CONVERSATIONS], [r for _, r in CONVERSATIONS])
    tok = load_tokenizer(path)
    model.eval()
    model.config.pad_token_id = None  # batch of one, no padding: transformers scores the last token
    for i, (messages, response) in enumerate(CONVERSATIONS):
        text = tok.apply_chat_template(
            [*messages, {"role": "assistant", "content": response}], tokenize=False
        )
        ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
        with torch.no_grad():
            want = model(input_ids=ids).logits[0, 0]
        assert got[i].item() == pytest.approx(want.item(), abs=1e-5)
    assert len(set(got.tolist())) == 3


def test_embedding_only_model_scores_a_hand_computed_function_of_the_last_token(tmp_path):
    path, model = _tiny_rm(tmp_path / "rm", embedding_only=True)
    rm = RewardModel(path, batch_size=8)
    messages, response = CONVERSATIONS[0]
    tok = load_tokenizer(path)
    text = tok.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
    last = tok(text, add_special_tokens=False).input_ids[-1]
    e = model.model.embed_tokens.weight[last].detach().double()
    g = model.model.norm.weight.detach().double()
    w = model.score.weight[0].detach().double()
    eps = model.config.rms_norm_eps
    want = float((w * g * e / torch.sqrt((e * e).mean() + eps)).sum())
    got = rm.score([messages], [response])
    assert got.item() == pytest.approx(want, abs=1e-5)


def test_reward_model_score_joins_the_rule_reward_with_its_weight(tiny, tmp_path):
    path, model = _tiny_rm(tmp_path / "rm", embedding_only=True)
    # Every rendered conversation ends with the template's end-of-turn tokens, so every sample gets
    # the score of that last token (hand-computed as above).
    tok = load_tokenizer(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], tokenize=False
    )
    last = tok(text, add_special_tokens=False).input_ids[-1]
    e, g, w = (
        t.detach().double()
        for t in (model.model.embed_tokens.weight[last], model.model.norm.weight, model.score.weight[0])
    )
    c = float((w * g * e / torch.sqrt((e * e).mean() + model.config.rms_norm_eps)).sum())
    (m,) = train(tiny, tmp_path / "run", "trainer.steps=1", f"reward.model={path}", "reward.model_weight=0.5")
    assert m["reward/model"] == pytest.approx(c, abs=1e-5)
    assert m["reward/mean"] == pytest.approx(m["reward/length"] + 0.5 * c, abs=1e-5)
