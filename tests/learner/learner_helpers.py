"""Helpers for the learner tests: a tiny random Llama, random batches with every field, independent
reference computations (no learner code), and the environment of spawned gloo workers."""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from rlkit.algos import correction, kl, losses
from rlkit.batch import TrainBatch

VOCAB = 128


def write_tiny_llama(directory, *, seed: int = 0, tie: bool = True) -> str:
    """A random 2-layer Llama (hidden 32) saved with save_pretrained; fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return str(directory)


def make_batch(
    n: int = 6,
    prompt_width: int = 7,
    response_width: int = 9,
    *,
    seed: int = 0,
    prompt_lens: list[int] | None = None,
    response_lens: list[int] | None = None,
    all_fields: bool = True,
) -> TrainBatch:
    """A TrainBatch with ragged left-padded prompts and right-padded responses.

    Padding positions hold pad id 0 (prompt) and random ids (response; they must never matter).
    With `all_fields`, every optional per-token field is set to random values.
    """
    g = torch.Generator().manual_seed(seed)
    if prompt_lens is None:
        prompt_lens = torch.randint(1, prompt_width + 1, (n,), generator=g).tolist()
    if response_lens is None:
        response_lens = torch.randint(1, response_width + 1, (n,), generator=g).tolist()
    prompt_ids = torch.zeros(n, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros(n, prompt_width, dtype=torch.bool)
    response_ids = torch.randint(3, VOCAB, (n, response_width), generator=g)
    response_mask = torch.zeros(n, response_width, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompt_ids[i, prompt_width - p :] = torch.randint(3, VOCAB, (p,), generator=g)
        prompt_mask[i, prompt_width - p :] = True
        response_mask[i, :r] = True

    def rand(scale=1.0, shift=0.0):
        return torch.randn(n, response_width, generator=g) * scale + shift

    optional = {}
    if all_fields:
        optional = dict(
            old_logprobs=rand(0.3, -5.0),
            ref_logprobs=rand(0.3, -5.0),
            rollout_logprobs=rand(0.3, -5.0),
            is_weights=torch.rand(n, response_width, generator=g) + 0.5,
            values=rand(),
            returns=rand(),
            # two policy versions within each row (no generator draw: the other fields stay as they were)
            token_versions=(torch.arange(response_width) >= response_width // 2).long().expand(n, -1).clone(),
        )
    return TrainBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        advantages=torch.randn(n, 1, generator=g).expand(n, response_width).clone(),
        **optional,
    )


def spawn_ranks(worker, *args, nprocs: int = 2, timeout_s: float = 600.0) -> None:
    """Run `worker(rank, nprocs, port, *args)` in `nprocs` spawned processes and wait for them.

    The rendezvous store listens here before any rank starts, on a port the OS gives it (port 0), so no other
    process can take that port between choosing and binding it (a port chosen, released and bound again by a
    rank seconds later, after its imports, could be taken meanwhile by the other pytest worker's vLLM engine or
    gloo connections: the ranks then waited on a stranger's store). A rank that hangs fails the test after
    `timeout_s`, naming the worker, instead of holding the suite.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.spawn(worker, args=(nprocs, store.port, *args), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=2.0):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{worker.__qualname__}: {nprocs} ranks still running after {timeout_s:.0f} s"
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        del store


def init_worker_env(rank: int, world_size: int, port: int) -> None:
    """Join the gloo process group of `spawn_ranks` (its store on 127.0.0.1:`port`), with the environment
    accelerate reads in a spawned CPU worker; accelerate then finds the group joined and keeps it."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def load_fp32(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def full_batch_logprobs(model, batch, temperature: float, generated=None):
    """log_softmax(logits / T) at the sampled tokens, one forward over the whole padded batch.

    Attention over prompt_mask + `generated` (the generation mask, as HF generate sees it; default
    response_mask), position ids cumsum(mask) - 1. Returns (logp [N, T], entropy [N, T]) from the full
    log-softmax tensor.
    """
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    generated = batch.response_mask if generated is None else generated
    attn = torch.cat([batch.prompt_mask, generated], 1).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logsm = torch.log_softmax(logits[:, p - 1 : p + t - 1].float() / temperature, -1)
    logp = logsm.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def reference_loss(model, batch, cfg, generated=None):
    """The configured loss on the whole batch in one piece (policy x IS + KL + rollout KL - entropy); `cfg` is
    an RLConfig (tests/cfg_helpers.py)."""
    logp, entropy = full_batch_logprobs(model, batch, cfg.rollout.temperature, generated)
    a = cfg.algo
    mask = batch.response_mask
    old = logp.detach() if batch.old_logprobs is None else batch.old_logprobs
    fn = {"ppo_clip": losses.ppo_clip, "gspo": losses.gspo, "cispo": losses.cispo}[a.policy_loss]
    extra = {"dual_clip": a.dual_clip} if a.policy_loss == "ppo_clip" else {}
    pg, _ = fn(logp, old, batch.advantages, mask, clip_low=a.clip_low, clip_high=a.clip_high, **extra)
    if batch.is_weights is not None:
        pg = pg * batch.is_weights
    norm_len = a.norm_len if a.norm_len is not None else cfg.rollout.max_new_tokens

    def agg(x):
        return losses.aggregate(x, mask, a.loss_agg_mode, norm_len=norm_len)

    loss = agg(pg)
    if a.kl_coef > 0:
        loss = loss + a.kl_coef * agg(kl.kl_estimate(logp, batch.ref_logprobs, a.kl_estimator))
    if a.rollout_kl_coef > 0:
        rk = correction.rollout_kl(logp, batch.rollout_logprobs, kind=a.rollout_kl_estimator)
        loss = loss + a.rollout_kl_coef * agg(rk)
    if a.entropy_coef > 0:
        loss = loss - a.entropy_coef * agg(entropy)
    return loss


def reference_grads(path: str, batch, cfg, generated=None) -> dict[str, torch.Tensor]:
    model = load_fp32(path)
    reference_loss(model, batch, cfg, generated).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def learner_grads(learner) -> dict[str, torch.Tensor]:
    model = learner.accelerator.unwrap_model(learner.model)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, expected: dict, atol: float = 1e-5) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            got[name], expected[name], atol=atol, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


# -- the 2-process setup shared by the DDP and FSDP2 tests ----------------------------------------

FULL_LOSS = dict(
    dtype="float32",
    max_grad_norm=None,
    lr=1e-3,
    clip_high=0.28,
    dual_clip=3.0,
    kl_coef=0.1,
    kl_estimator="k3",
    rollout_kl_coef=0.05,
    entropy_coef=0.01,
    max_tokens_per_microbatch=25,
)


def global_batch():
    """8 rows with every field set; row 6 fully masked (zero-std group), a hole in row 1's loss mask."""
    batch = make_batch(
        n=8,
        prompt_width=6,
        response_width=8,
        seed=5,
        prompt_lens=[6, 5, 6, 4, 2, 1, 3, 2],
        response_lens=[8, 7, 8, 6, 2, 1, 3, 1],
    )
    mask = batch.response_mask.clone()
    mask[6] = False
    mask[1, 2] = False
    return batch, dataclasses.replace(batch, response_mask=mask)


# Rank 0 gets the four long rows (several micro-batches), rank 1 the four short ones (one micro-batch).
RANK_ROWS = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


# The 4-step runs: on top of FULL_LOSS, a learning rate that moves the weights, a schedule, the critic.
RESUME = dict(lr=1e-2, warmup_steps=1, lr_schedule="cosine", total_steps=4, value_model=True)


def step_batches():
    """Four global batches of 8 rows (every field set) for the 4-step / 2+2-step runs."""
    return [make_batch(n=8, prompt_width=6, response_width=8, seed=10 + k) for k in range(4)]


def local_rows(batch, rank: int):
    return batch.select(RANK_ROWS[rank])


def four_steps_then_two_plus_two(make_learner, rank: int, ckpt_dir: str, out: dict):
    """In a worker: 4 updates in one learner; 2 updates, checkpoint, a fresh learner loads it, 2 more.

    Fills `out` (metrics, gathered weights) and returns the 4-step learner.
    """
    batches = [local_rows(b, rank) for b in step_batches()]
    straight = make_learner()
    out["straight"] = [straight.update(b) for b in batches]
    out["straight_weights"] = dict(straight.named_weights())
    first = make_learner()
    for b in batches[:2]:
        first.update(b)
    first.save_checkpoint(ckpt_dir)
    out["saved_weights"] = dict(first.named_weights())
    resumed = make_learner()
    resumed.load_checkpoint(ckpt_dir)
    out["resumed"] = [resumed.update(b) for b in batches[2:]]
    out["resumed_weights"] = dict(resumed.named_weights())
    out["resumed_step"] = resumed.global_step
    return straight


# Wall-clock metrics of an update: they differ between any two runs.
TIMING = ("learner/tokens_per_s", "learner/seconds")


def assert_resume_exact(ranks: list[dict]) -> None:
    """Steps 3-4 after the resume equal steps 3-4 of the straight run, bit for bit, on every rank."""
    for r in ranks:
        assert r["resumed_step"] == 4
        for step in (0, 1):
            got, expected = r["resumed"][step], r["straight"][step + 2]
            for k, v in expected.items():
                if k not in TIMING:
                    assert torch.equal(got[k], v) or torch.isnan(v).all(), (step, k, got[k], v)
        for k, v in r["straight_weights"].items():
            assert torch.equal(r["resumed_weights"][k], v), k
