"""`trainer.compile` (rlkit/learner/compiled.py): the compiled policy's loss, metrics and gradient equal eager
ones, and micro-batches of varying widths reuse the dynamic-shape graphs instead of recompiling per width.

The default backend (inductor) compiles C++ on CPU: minutes on a loaded 2-core machine, so the tier-1
check runs `aot_eager` (the same dynamo capture, guards and AOT autograd graphs, hence the same recompiles),
and the inductor check is marked slow."""

from __future__ import annotations

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import make_batch

from rlkit.learner import Learner
from rlkit.learner.compiled import compiled_graphs

pytestmark = pytest.mark.slow  # torch.compile: `make test-fast` leaves it out

WIDTHS = (9, 12, 7, 15)  # response widths: each micro-batch a new shape


def _grads(learner):
    model = learner.accelerator.unwrap_model(learner.model)
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    learner.zero_grad()
    return out


def _check(tiny_model_dir, backend: str, widths, atol: float):
    kw = dict(model_path=tiny_model_dir, dtype="float32", max_grad_norm=None, entropy_coef=0.01)
    eager = Learner(learner_cfg(**kw))
    cfg = learner_cfg(**kw)
    cfg.trainer.compile, cfg.trainer.compile_backend = True, backend
    before = compiled_graphs()
    compiled = Learner(cfg)
    counts = []
    for i, w in enumerate(widths):
        batch = make_batch(n=4, prompt_width=6, response_width=w, seed=i, all_fields=False)
        want, got = eager.accumulate_gradients(batch), compiled.accumulate_gradients(batch)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=atol, rtol=atol, msg=k)
        g_want, g_got = _grads(eager), _grads(compiled)
        for n in g_want:
            torch.testing.assert_close(g_got[n], g_want[n], atol=atol, rtol=atol, msg=n)
        counts.append(compiled_graphs() - before)
    metrics = compiled.update(
        make_batch(n=4, prompt_width=6, response_width=widths[0], seed=9, all_fields=False)
    )
    assert (
        metrics["learner/compiled_graphs"] == compiled_graphs() and compiled_graphs() - before == counts[-1]
    )
    return counts


def test_compiled_equals_eager_and_varying_widths_do_not_recompile(tiny_model_dir):
    counts = _check(tiny_model_dir, "aot_eager", WIDTHS, atol=1e-5)
    assert counts[0] >= 1  # it did compile
    assert counts[-1] <= 3 and counts[-1] == counts[1]  # bounded, and no new graph after the second width


@pytest.mark.slow
def test_inductor_compiled_equals_eager(tiny_model_dir):
    counts = _check(tiny_model_dir, "inductor", WIDTHS, atol=1e-4)
    assert 1 <= counts[-1] <= 3
