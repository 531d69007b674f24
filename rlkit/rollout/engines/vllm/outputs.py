"""vLLM's request outputs as a RolloutBatch: the sampled tokens, their log-probs and the policy version of each
token (from vLLM 0.32's `weight_versions` spans). Plain Python over the outputs' attributes: no vllm import
(rlkit/rollout/engines/vllm/engine.py builds and drives the engine)."""

from __future__ import annotations

from rlkit.batch import RolloutBatch
from rlkit.rollout.engines.base import rows_to_batch


def span_versions(completion, fallback: int | None, where: str) -> list[int]:
    """The policy version of each token of a vLLM completion, from its `weight_versions` spans (vLLM 0.32:
    output tokens `[start, end)` were sampled by the weights labelled `version`, the label the engine set
    with `set_weight_version`; rlkit's labels are the versions' integers). A completion without spans gets
    `fallback` on every token; with `fallback=None` (weights updated in flight, so a row may span several
    versions) it is refused, as are spans that do not cover the tokens exactly once, in order."""
    count = len(completion.token_ids)
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        if fallback is None:
            raise ValueError(
                f"{where} carries no weight_versions spans: with weights updated in flight the version of "
                f"each token must come from vLLM (0.32 or later)"
            )
        return [fallback] * count
    versions: list[int] = []
    for span in spans:
        if span.start != len(versions) or span.end < span.start:
            raise ValueError(f"{where}: weight_versions spans {spans} do not tile its {count} tokens")
        try:
            label = int(span.version)
        except ValueError:
            raise ValueError(f"{where}: weight version {span.version!r} is not one rlkit set") from None
        versions += [label] * (span.end - span.start)
    if len(versions) != count:
        raise ValueError(f"{where}: weight_versions spans {spans} do not tile its {count} tokens")
    return versions


def completion_routes(completion, prompt_len: int, where: str):
    """A completion's routed experts (vLLM's `routed_experts`, [tokens, MoE layers, k], from prompt token 0: every
    token the engine ran) as an int16 tensor; refused when missing or longer than prompt + response."""
    import torch

    routes = getattr(completion, "routed_experts", None)
    if routes is None:
        raise ValueError(
            f"{where} carries no routed_experts: algo.routing_replay needs vLLM's "
            "enable_return_routed_experts (Model Runner V2)"
        )
    routes = torch.as_tensor(routes)
    if routes.dim() != 3 or routes.shape[0] > prompt_len + len(completion.token_ids):
        raise ValueError(
            f"{where}: routed_experts of shape {tuple(routes.shape)} for {prompt_len} prompt and "
            f"{len(completion.token_ids)} response tokens (expected [at most their sum, layers, k])"
        )
    return routes.to(torch.int16)


def request_outputs_to_batch(
    outputs, prompts: list[list[int]], n: int, pad_id: int, *, version: int | None = 0, routes: bool = False
) -> RolloutBatch:
    """Convert vLLM `RequestOutput`s (one per prompt, in prompt order) into a RolloutBatch.

    Each output must carry `n` completions with per-token logprobs (`SamplingParams.logprobs=0`);
    the log-prob of the token vLLM sampled at each position is read from its logprob dict (or
    `FlatLogprobs`). Token versions come from the completions' `weight_versions` spans (`span_versions`;
    `version` labels a completion without them, None refuses it). With `routes`, each completion's
    `routed_experts` become the batch's `routed_experts` (`completion_routes`). Raises `ValueError` when outputs and
    prompts do not line up, logprobs are missing, or a completion finished for another reason than
    "stop"/"length" (aborted, error).
    """
    if len(outputs) != len(prompts):
        raise ValueError(f"got {len(outputs)} request outputs for {len(prompts)} prompts")
    rows, texts, row_prompts, versions, row_routes = [], [], [], [], []
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        if list(out.prompt_token_ids) != list(prompt):
            raise ValueError(f"request output {i} (id {out.request_id!r}) is not for prompts[{i}]")
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise ValueError(f"request output {i} has {len(completions)} completions, expected n={n}")
        for c in completions:
            if c.finish_reason not in ("stop", "length"):
                raise ValueError(f"prompts[{i}] sample {c.index} finished with {c.finish_reason!r}")
            tokens = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(tokens):
                raise ValueError(
                    f"prompts[{i}] sample {c.index} has no per-token logprobs: "
                    f"SamplingParams.logprobs must be 0 (see sampling_params_from)"
                )
            logps = [position[token].logprob for token, position in zip(tokens, c.logprobs)]
            rows.append((tokens, logps, c.finish_reason))
            texts.append(c.text)
            row_prompts.append(list(prompt))
            versions.append(span_versions(c, version, f"prompts[{i}] sample {c.index}"))
            if routes:
                row_routes.append(completion_routes(c, len(prompt), f"prompts[{i}] sample {c.index}"))
    return rows_to_batch(row_prompts, rows, texts, n, pad_id, versions, routes=row_routes if routes else None)
