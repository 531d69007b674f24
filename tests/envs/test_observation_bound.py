"""An observation far longer than the episode's token budget is refused in the worker by its length in
characters, before the trainer tokenizes it (rlkit/envs/workers.py `Oversized`, rlkit/rollout/episodes.py)."""

import pytest

from rlkit.models import load_tokenizer
from rlkit.rollout.engines.base import Sampling, rows_to_batch
from rlkit.rollout.episodes import run_episodes

EOS = 2  # SmolLM2's <|im_end|>


class Measured:
    """The tokenizer, recording the longest text it was asked to tokenize or render."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def apply_chat_template(self, messages, **kw):
        self.longest = max(self.longest, sum(len(m["content"]) for m in messages))
        return self.tok.apply_chat_template(messages, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")  # the embedded SmolLM2's tokenizer and chat template


def _turn(tok):
    ids = tok("Let me look it up", add_special_tokens=False).input_ids

    def generate(prompts, n, sampling, turn, positions):
        rows = [(ids, [-0.5] * len(ids), "stop") for _ in range(len(prompts) * n)]
        return rows_to_batch(
            [p for p in prompts for _ in range(n)], rows, ["Let me look it up"] * len(rows), n, EOS
        )

    return generate


@pytest.mark.parametrize("chars, budget", [(3_000_000, 64), (100_000, 256)])
def test_an_observation_the_budget_could_never_hold_is_refused_before_tokenizing(tok, chars, budget):
    question = [{"role": "user", "content": "Look it up."}]
    text = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False).input_ids
    measured = Measured(tok)
    out = run_episodes(
        _turn(tok), measured, [prompt], [question], [{"question": "q"}], 2, Sampling(max_new_tokens=16),
        env_name="rlkit_test_doors:LongObservation", env_kwargs={"chars": chars}, max_turns=3,
        max_total_tokens=budget, timeout_s=60, eos_ids={EOS}, pad_id=EOS,
    )  # fmt: skip
    assert out.failed.tolist() == [True, True] and out.errors == 2
    longest_entry = max(len(t) for t in tok.get_vocab())
    assert measured.longest <= 2 * budget * longest_entry  # never the observation itself
