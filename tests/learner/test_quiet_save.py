"""A checkpoint of a model with a tied head logs no "Removed shared tensor" warning (the tie is expected), while
that warning about a tensor that is not a tied alias still reaches the user."""

import logging

import torch

from rlkit.learner.checkpoint import _tied_heads_expected
from rlkit.models import load_causal_lm, make_tiny_checkpoint


def _warn(message):
    logging.getLogger("accelerate.utils.other").warning(message)


def test_only_the_models_own_tied_aliases_are_quieted(tmp_path, caplog):
    torch.manual_seed(0)
    model = load_causal_lm(make_tiny_checkpoint(tmp_path / "tiny", hidden_size=32, num_layers=1, seed=0))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tiny checkpoint ties its head
    with caplog.at_level(logging.WARNING), _tied_heads_expected(model):
        _warn(
            "[RANK 0] Removed shared tensor {'lm_head.weight'} while saving. This should be OK, but check ..."
        )
        _warn(
            "[RANK 0] Removed shared tensor {'model.layers.0.mlp.up_proj.weight'} while saving. This should ..."
        )
        _warn("something else")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "up_proj" in messages[0] and messages[1] == "something else"
    with caplog.at_level(logging.WARNING):  # outside the block nothing is filtered
        _warn("[RANK 0] Removed shared tensor {'lm_head.weight'} while saving.")
    assert len(caplog.records) == 3
