"""Row operations on rollout batches of whole groups: stack, take groups, merge and split scored shares."""

from __future__ import annotations

import dataclasses

import torch

from rlkit.batch import NO_VERSION, SUMMED_STATS, RolloutBatch, ScoredBatch


def concat_rollouts(parts: list[RolloutBatch]) -> RolloutBatch:
    """Stack RolloutBatches of the same group size: prompts re-padded on the left, responses on the right."""
    P = max(b.prompt_ids.shape[1] for b in parts)
    T = max(b.response_ids.shape[1] for b in parts)
    # The pad id never matters (it is masked); reuse one from the padding when there is any.
    pads = [b.prompt_ids[~b.prompt_mask] for b in parts]
    pad_id = next((int(p[0]) for p in pads if p.numel()), 0)

    def left(x, width, value):
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    def right(x, width, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    offsets = torch.tensor([0] + [b.num_samples // b.group_size for b in parts]).cumsum(0)
    return RolloutBatch(
        prompt_ids=torch.cat([left(b.prompt_ids, P, pad_id) for b in parts]),
        prompt_mask=torch.cat([left(b.prompt_mask, P, False) for b in parts]),
        response_ids=torch.cat([right(b.response_ids, T, pad_id) for b in parts]),
        response_mask=torch.cat([right(b.response_mask, T, False) for b in parts]),
        rollout_logprobs=torch.cat([right(b.rollout_logprobs, T, 0.0) for b in parts]),
        finish_reasons=tuple(f for b in parts for f in b.finish_reasons),
        group_index=torch.cat([b.group_index + off for b, off in zip(parts, offsets.tolist())]),
        group_size=parts[0].group_size,
        response_texts=tuple(t for b in parts for t in b.response_texts),
        stats={k: sum(b.stats.get(k, 0.0) for b in parts) for k in SUMMED_STATS},
        token_versions=(
            torch.cat([right(b.token_versions, T, NO_VERSION) for b in parts])
            if all(b.token_versions is not None for b in parts)
            else None
        ),
        images=(
            tuple(x for b in parts for x in (b.images or (None,) * b.num_samples))
            if any(b.images is not None for b in parts)
            else None
        ),
    )


def take_groups(rb: RolloutBatch, groups: list[int]) -> RolloutBatch:
    """The rows of groups `groups` (in that order), renumbered 0..len(groups)-1."""
    G = rb.group_size
    rows = [g * G + j for g in groups for j in range(G)]
    idx = torch.tensor(rows, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=rb.prompt_ids[idx],
        prompt_mask=rb.prompt_mask[idx],
        response_ids=rb.response_ids[idx],
        response_mask=rb.response_mask[idx],
        rollout_logprobs=rb.rollout_logprobs[idx],
        finish_reasons=tuple(rb.finish_reasons[i] for i in rows),
        group_index=torch.arange(len(rows)) // G,
        group_size=G,
        response_texts=tuple(rb.response_texts[i] for i in rows) if rb.response_texts else (),
        stats={},
        token_versions=rb.token_versions[idx] if rb.token_versions is not None else None,
        images=tuple(rb.images[i] for i in rows) if rb.images is not None else None,
    )


def merge_scored(parts: list[ScoredBatch]) -> ScoredBatch:
    """One ScoredBatch of several producers' shares (in rank order: the global prompt order).

    Counters add up; `stats` (global already) come from the first share; `policy_version` is the oldest share's.
    """
    first = parts[0]
    rb = concat_rollouts([p.rollout for p in parts])  # sums the SUMMED_STATS
    return dataclasses.replace(
        first,
        rollout=rb,
        rewards=torch.cat([p.rewards for p in parts]),
        correct=torch.cat([p.correct for p in parts]),
        per_fn={k: torch.cat([p.per_fn[k] for p in parts]) for k in first.per_fn},
        errors=sum(p.errors for p in parts),
        timeouts=sum(p.timeouts for p in parts),
        env_stats={k: torch.cat([p.env_stats[k] for p in parts]) for k in first.env_stats},
        tasks={k: torch.cat([p.tasks[k] for p in parts]) for k in first.tasks},
        env_errors=sum(p.env_errors for p in parts),
        env_timeouts=sum(p.env_timeouts for p in parts),
        policy_version=min(p.policy_version for p in parts),
    )


def split_scored(sb: ScoredBatch, n: int) -> list[ScoredBatch]:
    """`n` equal shares of whole groups, in order (share r for training rank r).

    The counters and throughput stay with share 0, so summing them over ranks counts each once.
    """
    G = sb.rollout.group_size
    groups = sb.rollout.num_samples // G
    if groups % n:
        raise ValueError(f"{groups} groups do not split evenly over {n} ranks")
    per = groups // n
    out = []
    for r in range(n):
        rows = slice(r * per * G, (r + 1) * per * G)
        rb = take_groups(sb.rollout, list(range(r * per, (r + 1) * per)))
        if r == 0:
            rb = dataclasses.replace(rb, stats=dict(sb.rollout.stats))
        out.append(
            dataclasses.replace(
                sb,
                rollout=rb,
                rewards=sb.rewards[rows],
                correct=sb.correct[rows],
                per_fn={k: v[rows] for k, v in sb.per_fn.items()},
                env_stats={k: v[rows] for k, v in sb.env_stats.items()},
                tasks={k: v[rows] for k, v in sb.tasks.items()},
                **({} if r == 0 else dict(errors=0, timeouts=0, env_errors=0, env_timeouts=0)),
            )
        )
    return out
