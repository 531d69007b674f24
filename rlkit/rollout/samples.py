"""What `trainer.log_samples` shows: rows of generated samples (prompt, response, reward and its parts,
correct, finish reason, length, step), from a training batch or from an evaluation's prompts.

rlkit.logging writes them to `<run_dir>/samples.jsonl` and a W&B table; a reward hack shows in them long
before it shows in a curve.
"""

from __future__ import annotations

from rlkit.batch import ScoredBatch
from rlkit.rollout.evaluation import PromptResult


def train_rows(produced: ScoredBatch, tokenizer, limit: int, step: int) -> list[dict]:
    """The first `limit` samples of this rank's training batch of step `step`."""
    rb = produced.rollout
    n = min(limit, rb.num_samples)
    rows = []
    for i in range(n):
        ids = rb.prompt_ids[i][rb.prompt_mask[i].bool()].tolist()
        rows.append(
            {
                "step": step,
                "kind": "train",
                "prompt": tokenizer.decode(ids),
                "response": rb.response_texts[i],
                "reward": float(produced.rewards[i]),
                "parts": {k: float(v[i]) for k, v in produced.per_fn.items()},
                "correct": bool(produced.correct[i] > 0),
                "finish_reason": rb.finish_reasons[i],
                "length": int(rb.response_lengths[i]),
            }  # fmt: skip
        )
        if rb.images is not None and rb.images[i] is not None:  # the picture(s) beside the completion
            rows[-1]["image"] = rb.images[i].digest
    return rows


def eval_rows(results: list[PromptResult], limit: int, step: int) -> list[dict]:
    """The first `limit` samples of an evaluation (prompt by prompt, sample by sample)."""
    rows = []
    for r in results:
        for j in range(r.n):
            if len(rows) >= limit:
                return rows
            rows.append(
                {
                    "step": step,
                    "kind": "eval",
                    "prompt": r.prompt,
                    "response": r.responses[j],
                    "reward": r.rewards[j],
                    "parts": r.parts[j],
                    "correct": r.correct[j],
                    "finish_reason": r.finish_reasons[j],
                    "length": r.lengths[j],
                }  # fmt: skip
            )
            if r.image is not None:
                rows[-1]["image"] = r.image
    return rows
