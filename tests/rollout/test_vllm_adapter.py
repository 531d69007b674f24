"""The vLLM adapter's CPU-testable parts, against the real vllm package (skipped where it does not import)."""

import subprocess
import sys

import pytest
import torch
from vllm_import import import_vllm

vllm = import_vllm()

from vllm.logprobs import FlatLogprobs, Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402

from rlkit.rollout.engines.base import Sampling  # noqa: E402
from rlkit.rollout.engines.vllm import request_outputs_to_batch, sampling_params_from, vllm_weight_name  # noqa: E402

pytestmark = pytest.mark.slow  # builds a vLLM engine: `make test-fast` leaves it out

PAD, EOS = 0, 2


def test_sampling_params_from_our_sampling():
    s = Sampling(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=33, stop=("\n\n", "###"), seed=5)
    p = sampling_params_from(s, 4)
    assert isinstance(p, vllm.SamplingParams)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (4, 0.7, 0.9, 0, 33)
    assert p.stop == ["\n\n", "###"] and p.include_stop_str_in_output
    assert p.logprobs == 0 and p.seed == 5
    assert sampling_params_from(s, 1, seed=123).seed == 123
    assert sampling_params_from(Sampling(top_k=20), 2).top_k == 20
    assert sampling_params_from(Sampling(), 1).stop == []
    fixed = sampling_params_from(Sampling(stop=("###",), ignore_eos=True), 1)
    assert fixed.ignore_eos and fixed.stop == [], "fixed length: neither EOS nor a stop string ends a row"
    assert not sampling_params_from(s, 1).ignore_eos
    with pytest.raises(ValueError, match="n=0"):
        sampling_params_from(s, 0)


def completion(index, tokens, logps, reason, text="", flat=False):
    """A real CompletionOutput whose logprob containers hold the sampled token plus a distractor."""
    containers = FlatLogprobs() if flat else []
    for tok, lp in zip(tokens, logps):
        entry = {tok: Logprob(logprob=lp, rank=2), 999: Logprob(logprob=-0.01, rank=1)}
        containers.append(entry)
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=list(tokens),
        cumulative_logprob=sum(logps),
        logprobs=containers,
        finish_reason=reason,
    )


def request(i, prompt, completions):
    return RequestOutput(
        request_id=str(i),
        prompt=None,
        prompt_token_ids=prompt,
        prompt_logprobs=None,
        outputs=completions,
        finished=True,
    )


@pytest.mark.parametrize("flat", [False, True])
def test_request_outputs_to_batch(flat):
    prompts = [[11, 12, 13], [21]]
    outputs = [
        # Completions deliberately out of order: the batch follows CompletionOutput.index.
        request(
            0,
            prompts[0],
            [
                completion(1, [7, 8, 9], [-0.5, -0.25, -2.0], "length", "b", flat),
                completion(0, [5, EOS], [-1.0, -0.125], "stop", "a", flat),
            ],
        ),
        request(
            1,
            prompts[1],
            [
                completion(0, [6], [-3.0], "stop", "c", flat),  # a stop string ending the first token
                completion(1, [4, 4, EOS], [-0.1, -0.2, -0.3], "stop", "d", flat),
            ],
        ),
    ]
    b = request_outputs_to_batch(outputs, prompts, 2, PAD)
    assert b.prompt_ids.tolist() == [[11, 12, 13]] * 2 + [[PAD, PAD, 21]] * 2
    assert b.prompt_mask.tolist() == [[True] * 3] * 2 + [[False, False, True]] * 2
    assert b.response_ids.tolist() == [[5, EOS, PAD], [7, 8, 9], [6, PAD, PAD], [4, 4, EOS]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    expected = torch.tensor([[-1.0, -0.125, 0], [-0.5, -0.25, -2.0], [-3.0, 0, 0], [-0.1, -0.2, -0.3]])
    torch.testing.assert_close(b.rollout_logprobs, expected)
    assert b.finish_reasons == ("stop", "length", "stop", "stop")
    assert b.group_index.tolist() == [0, 0, 1, 1] and b.group_size == 2
    assert b.response_texts == ("a", "b", "c", "d")


def test_request_outputs_to_batch_rejects_what_it_cannot_trust():
    prompts = [[1, 2]]
    ok = completion(0, [3], [-1.0], "stop")
    with pytest.raises(ValueError, match="not for prompts"):
        request_outputs_to_batch([request(0, [9, 9], [ok])], prompts, 1, PAD)
    with pytest.raises(ValueError, match="expected n=2"):
        request_outputs_to_batch([request(0, prompts[0], [ok])], prompts, 2, PAD)
    with pytest.raises(ValueError, match="'abort'"):
        request_outputs_to_batch(
            [request(0, prompts[0], [completion(0, [3], [-1.0], "abort")])], prompts, 1, PAD
        )
    no_logprobs = CompletionOutput(
        index=0, text="", token_ids=[3], cumulative_logprob=None, logprobs=None, finish_reason="stop"
    )
    with pytest.raises(ValueError, match="logprobs must be 0"):
        request_outputs_to_batch([request(0, prompts[0], [no_logprobs])], prompts, 1, PAD)
    with pytest.raises(ValueError, match="2 prompts"):
        request_outputs_to_batch([request(0, prompts[0], [ok])], prompts * 2, 1, PAD)


def test_weight_names_are_transformers_names_minus_wrappers():
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert vllm_weight_name(name) == name
    assert vllm_weight_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert (
        vllm_weight_name("model.layers.3._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.3.mlp.up_proj.weight"
    )


def test_importing_rlkit_rollout_does_not_import_vllm():
    code = "import sys, rlkit.rollout, rlkit.rollout.engines.hf; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_request_outputs_to_batch_routes():
    """algo.routing_replay: each completion's routed_experts ([prompt + response - 1, layers, k]: the last
    token is never fed back) land beside its left-padded prompt; the last token and padding get -1."""
    import numpy as np

    prompts = [[11, 12, 13], [21]]
    c0 = completion(0, [5, EOS], [-1.0, -0.5], "stop")
    c1 = completion(0, [6, 7, 8], [-1.0, -0.5, -0.25], "length")
    c0.routed_experts = np.arange(4 * 2 * 2).reshape(4, 2, 2).astype(np.int16)  # 3 prompt + 2 response - 1
    c1.routed_experts = 100 + np.arange(3 * 2 * 2).reshape(3, 2, 2).astype(np.int16)  # 1 + 3 - 1
    b = request_outputs_to_batch(
        [request(0, prompts[0], [c0]), request(1, prompts[1], [c1])], prompts, 1, PAD, routes=True
    )
    want = torch.full((2, 3 + 3, 2, 2), -1, dtype=torch.int16)
    want[0, 0:4] = torch.from_numpy(c0.routed_experts)  # columns: p p p r r (pad)
    want[1, 2:5] = torch.from_numpy(c1.routed_experts)  # columns: pad pad p r r r
    assert b.routed_experts.dtype == torch.int16
    assert torch.equal(b.routed_experts, want)
    c1.routed_experts = None
    with pytest.raises(ValueError, match="no routed_experts"):
        request_outputs_to_batch([request(1, prompts[1], [c1])], prompts[1:], 1, PAD, routes=True)
    c1.routed_experts = np.zeros((9, 2, 2), dtype=np.int16)
    with pytest.raises(ValueError, match="routed_experts of shape"):
        request_outputs_to_batch([request(1, prompts[1], [c1])], prompts[1:], 1, PAD, routes=True)
