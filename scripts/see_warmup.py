"""Can SmolLM2-135M learn to see in minutes on a CPU? A plain torch / transformers check, before any recipe.

The model is `smollm2-135m-vl` (rlkit/vlmodels.py): the embedded SmolLM2-135M-Instruct with a small random
vision encoder and the Idefics3 connector. The vision encoder and the connector train with the supervised
next-token loss on the answers of rlkit's generated pictures (rlkit/data/pictures.py); the language model stays
frozen. Held-out accuracy of greedy answers, scored by the task's reward, is measured before and after (and
every --eval-every steps), and the warmed-up checkpoint is written with --save.

    python scripts/see_warmup.py --kinds count --minutes 5 --save /tmp/see-warm

Prints one JSON line per evaluation: {"step", "seconds", "loss", "accuracy"}.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time

import torch
from PIL import Image

from rlkit.data.pictures import KINDS, picture_rows
from rlkit.models import resolve_model
from rlkit.rewards.functions import resolve as resolve_reward

SYSTEM = {"count": "Answer with a number.", "colour": "Answer with a colour."}


def messages(row: dict) -> list[dict]:
    """The chat of one picture row: a short system prompt, the picture then the question."""
    return [
        {"role": "system", "content": SYSTEM[row["kind"]]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["question"]}]},
    ]


def encode(processor, rows: list[dict], *, with_answers: bool) -> dict:
    """The processor's tensors for `rows` (left-padded); with answers, `labels` mark the answer's tokens and the
    end of the turn."""
    prompts = [processor.apply_chat_template(messages(r), add_generation_prompt=True) for r in rows]
    images = [[Image.open(io.BytesIO(r["image"])).convert("RGB")] for r in rows]
    if not with_answers:
        return processor(text=prompts, images=images, return_tensors="pt", padding=True)
    eot = "<|im_end|>"
    texts = [p + r["answer"] + eot for p, r in zip(prompts, rows)]
    enc = processor(text=texts, images=images, return_tensors="pt", padding=True)
    tok = processor.tokenizer
    labels = torch.full_like(enc["input_ids"], -100)
    for i, r in enumerate(rows):
        n = len(tok(r["answer"] + eot, add_special_tokens=False)["input_ids"])
        labels[i, -n:] = enc["input_ids"][i, -n:]
    enc["labels"] = labels
    return enc


@torch.no_grad()
def accuracy(
    model, processor, rows: list[dict], batch: int = 32, bf16: bool = False
) -> tuple[float, list[str]]:
    """Fraction of `rows` whose greedy answer the row's reward accepts, and the answers."""
    model.eval()
    correct, answers = 0, []
    for i in range(0, len(rows), batch):
        part = rows[i : i + batch]
        enc = encode(processor, part, with_answers=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model.generate(**enc, max_new_tokens=4, do_sample=False)
        texts = processor.tokenizer.batch_decode(
            out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
        )
        for r, t in zip(part, texts):
            correct += resolve_reward(KINDS[r["kind"]].reward)("", t, r["answer"]) >= 1.0
            answers.append(t)
    model.train()
    return correct / len(rows), answers


def trainable(model) -> list[torch.nn.Parameter]:
    """The vision encoder and the connector train; the language model is frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = [*model.model.vision_model.parameters(), *model.model.connector.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-vl")
    ap.add_argument("--kinds", nargs="+", default=["count"])
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-eval", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights and Adam state)")
    ap.add_argument("--save", default=None, help="write the warmed-up checkpoint and processor here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    torch.manual_seed(args.seed)
    path, _ = resolve_model(args.model)
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    rows = picture_rows(args.num_train + args.num_eval, seed=0, kinds=tuple(args.kinds))
    held, train = rows[: args.num_eval], rows[args.num_eval :]
    params = trainable(model)
    optim = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    start = time.perf_counter()
    acc, answers = accuracy(model, processor, held, bf16=args.bf16)
    log = [{"step": 0, "seconds": 0.0, "loss": None, "accuracy": acc, "sample": answers[:4]}]
    print(json.dumps(log[-1]), flush=True)
    step, losses = 0, []
    start = time.perf_counter()
    while step < args.max_steps and time.perf_counter() - start < 60 * args.minutes:
        enc = encode(processor, rng.sample(train, args.batch), with_answers=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(**enc).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        if step % args.eval_every == 0:
            acc, answers = accuracy(model, processor, held, bf16=args.bf16)
            entry = {"step": step, "seconds": round(time.perf_counter() - start, 1)}
            entry |= {"loss": round(sum(losses) / len(losses), 4), "accuracy": acc, "sample": answers[:4]}
            log.append(entry)
            losses = []
            print(json.dumps(entry), flush=True)
    if step % args.eval_every:
        acc, answers = accuracy(model, processor, held, bf16=args.bf16)
        entry = {
            "step": step,
            "seconds": round(time.perf_counter() - start, 1),
            "loss": None,
            "accuracy": acc,
        }
        log.append(entry | {"sample": answers[:4]})
        print(json.dumps(log[-1]), flush=True)
    if args.save:
        model.save_pretrained(args.save)
        processor.save_pretrained(args.save)
    return {"before": log[0]["accuracy"], "after": log[-1]["accuracy"], "steps": step, "log": log}


if __name__ == "__main__":
    main()
