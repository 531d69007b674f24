"""FSDP2 over a vision-language model (the tiny Qwen2.5-VL, vision tower frozen by default) under 2 gloo
processes on CPU, fp32, padded and packed (`trainer.pack_sequences`: each rank's two rows in one sequence, their
pictures in row order, Qwen's 3D positions per row): each rank's log-probs of its rows with images equal the
model's on each row alone, and the gradient of the whole batch (each rank half of the rows) equals one process's
over all rows, padded; the frozen tower gets no gradient."""

from __future__ import annotations

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import FULL_LOSS, init_worker_env, spawn_ranks
from test_vl_learner import sequences
from vl_families import build_vl_family, logprobs_alone, picture

from rlkit.batch import TrainBatch
from rlkit.config.schema import DataConfig
from rlkit.data.prompts import build_prompts
from rlkit.vision import load_processor

pytestmark = pytest.mark.slow  # FSDP2 in 2 processes

ROWS = [
    {"q": "Colour?", "a": "r", "image": picture((255, 0, 0))},
    {"q": "A longer question that pads the other rows?", "a": "x", "image": picture(seed=1, size=(112, 56))},
    {"q": "<image> and <image>: which?", "a": "y", "image": [picture(seed=2), picture((0, 0, 255))]},
    {"q": "Another picture?", "a": "z", "image": picture(seed=4, size=(56, 112))},
]


def prompts(path):
    processor = load_processor(path)
    cfg = DataConfig(path="/nonexistent", image_key="image", prompt_key="q", answer_key="a", instruction="")
    return processor, build_prompts(ROWS, processor.tokenizer, cfg, processor=processor)


def train_batch(ps) -> TrainBatch:
    s = sequences(ps)
    n, t = s.response_ids.shape
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])[:, None].expand(n, t).clone()
    g = torch.Generator().manual_seed(1)
    extra = {
        k: torch.randn(n, t, generator=g) * 0.3 - 5.0
        for k in ("old_logprobs", "ref_logprobs", "rollout_logprobs")
    }
    extra["is_weights"] = torch.rand(n, t, generator=g) + 0.5
    return TrainBatch(
        s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask, advantages=adv, images=s.images, **extra
    )


def cfg(path, strategy, pack=False):
    # A budget that holds a rank's two rows in one micro-batch: packed, one sequence of two rows with pictures.
    flat = dict(
        FULL_LOSS, strategy=strategy, dtype="float32", pack_sequences=pack, max_tokens_per_microbatch=10_000
    )
    c = learner_cfg(model_path=path, **flat)
    c.data.image_key = "image"
    return c


def grads(learner) -> dict[str, torch.Tensor | None]:
    from torch.distributed.tensor import DTensor

    model = learner.accelerator.unwrap_model(learner.model)
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return out


LAYOUTS = {"padded": False, "packed": True}


def _worker(rank, world, port, path, out_dir):
    """Both layouts in one launch (one process group, a learner each): rank{rank}-{layout}.pt."""
    from rlkit.learner import Learner

    init_worker_env(rank, world, port)
    _, ps = prompts(path)
    batch = train_batch(ps)
    mine = batch.select([rank * 2, rank * 2 + 1])
    for layout, pack in LAYOUTS.items():
        learner = Learner(cfg(path, "fsdp2", pack))
        assert learner.accelerator.is_fsdp2 and learner.world_size == 2 and learner.packed is pack
        logp = learner.forward(mine).logprobs
        learner.accumulate_gradients(mine)
        torch.save({"logp": logp, "grads": grads(learner)}, f"{out_dir}/rank{rank}-{layout}.pt")
        del learner
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The tiny Qwen2.5-VL and its 2-rank FSDP2 launch: (path, out dir)."""
    root = tmp_path_factory.mktemp("vl_fsdp2")
    path = build_vl_family("qwen2.5-vl", root / "qwen25vl")
    spawn_ranks(_worker, path, str(root))
    return path, root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp2_over_a_vl_model(launched, layout):
    from rlkit.learner import Learner
    from rlkit.models import load_causal_lm

    path, root = launched
    ranks = [torch.load(root / f"rank{r}-{layout}.pt", weights_only=False) for r in range(2)]
    processor, ps = prompts(path)
    batch = train_batch(ps)
    model = load_causal_lm(path, vision=True)
    for r, out in enumerate(ranks):
        for j in range(2):
            i = 2 * r + j
            keep = batch.response_mask[i]
            pictures = ps.images[i].pictures if ps.images[i] is not None else ()
            ref = logprobs_alone(
                model, processor, ps.texts[i], pictures, batch.response_ids[i][keep].tolist()
            )
            assert torch.allclose(out["logp"][j][keep], ref, atol=1e-4), (
                i,
                (out["logp"][j][keep] - ref).abs().max(),
            )
    single = Learner(cfg(path, "auto"))  # one process: no wrapper
    single.accumulate_gradients(batch)
    expected = grads(single)
    got = ranks[0]["grads"]
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        if ".visual." in f".{name}":
            assert g is None and got[name] is None, name  # the frozen tower
            continue
        # Relative to the tensor's norm: packed, a row's terms are summed in another order (|dg| up to 6e-6 on
        # entries near 0 of a bias whose entries reach 9).
        rel = float((got[name] - g).norm() / g.norm())
        assert rel < 1e-5, (name, rel, (got[name] - g).abs().max())
