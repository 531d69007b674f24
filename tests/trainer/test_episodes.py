"""Multi-turn episodes, token in / token out (rlkit/rollout/episodes.py) and the calculator tool.

Token-exactness is checked against the chat template applied to the whole conversation, with turns we
script as token ids (a scripted engine lets a test choose ids that re-encoding would change); log-probs
of real multi-turn episodes are checked against the learner's fp32 recomputation."""

import dataclasses
import time

import pytest
import torch
from cfg_helpers import learner_cfg
from rlkit_test_envs import Chatty

from rlkit.batch import RolloutBatch
from rlkit.envs import make_env, resolve_env
from rlkit.envs.calculator import CalcError, evaluate, format_number
from rlkit.models import load_tokenizer, make_tiny_checkpoint
from rlkit.rollout.engines.base import Sampling, rows_to_batch
from rlkit.rollout.episodes import run_episodes, step_all

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mt"), hidden_size=32, num_layers=2, seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)  # SmolLM2's real tokenizer and chat template


def encode(tok, text):
    return tok(text, add_special_tokens=False).input_ids


# -- the calculator ---------------------------------------------------------------------------------


def test_calculator_parser_by_hand_and_rejects_code():
    assert format_number(evaluate("12*7+3")) == "87"
    assert format_number(evaluate("123 * 456")) == str(123 * 456)
    assert format_number(evaluate("-(2+3)*4")) == "-20"
    assert format_number(evaluate("7/2")) == "3.5"
    assert format_number(evaluate("1/3")) == "0.333333"
    assert format_number(evaluate("2 - -3")) == "5"
    assert format_number(evaluate("1,000 + 1")) == "1001"
    for bad in ["", "2**3", "7/0", "(1+2", "1+", "__import__('os')", "abs(1)", "9" * 40 + "*" + "9" * 40]:
        with pytest.raises(CalcError):
            evaluate(bad)


def test_calculator_env_answers_a_call_and_ends_without_one():
    env = make_env("calculator")
    obs, reward, done = env.step("I need <calc>12*7+3</calc>")
    assert obs == [{"role": "user", "content": "<result>87</result>"}] and reward == 0 and not done
    obs, _, done = env.step("<calc>1/0</calc>")
    assert "division by zero" in obs[0]["content"] and not done
    assert env.step("#### 87") == (None, 0.0, True)
    assert env.tool_calls == 2
    assert resolve_env("rlkit_test_envs:Chatty") is Chatty
    with pytest.raises(ValueError, match="env.name='nope'"):
        resolve_env("nope")


def test_calculator_examples_are_worked_turns_before_the_question():
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 3 * 5?"}]
    assert make_env("calculator").reset({}, prompt) == prompt
    shown = make_env("calculator", {"examples": 2}).reset({}, prompt)
    assert shown == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": "<calc>12 * 34</calc>"},
        {"role": "user", "content": "<result>408</result>"},
        {"role": "assistant", "content": "#### 408"},
        {"role": "user", "content": "What is 250 * 19?"},
        {"role": "assistant", "content": "<calc>250 * 19</calc>"},
        {"role": "user", "content": "<result>4750</result>"},
        {"role": "assistant", "content": "#### 4750"},
        {"role": "user", "content": "What is 3 * 5?"},
    ]
    assert make_env("calculator", {"examples": 1}).reset({}, prompt)[1:5] == shown[1:5]
    with pytest.raises(ValueError, match="examples=3 must be between 0 and 2"):
        make_env("calculator", {"examples": 3})


# -- token exactness with scripted turns ------------------------------------------------------------


class Scripted:
    """Returns, for the k-th call, the token ids of script[k] for every row, with log-prob -0.5 - 0.01 t;
    records the prompts it was given."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def __call__(self, prompts, n, sampling, turn, positions):
        self.calls.append((prompts, n, sampling))
        ids = self.script[turn]
        rows = [(ids, [-0.5 - 0.01 * t for t in range(len(ids))], "stop") for _ in range(len(prompts) * n)]
        texts = [self.tok.decode(ids, skip_special_tokens=True)] * len(rows)
        return rows_to_batch([p for p in prompts for _ in range(n)], rows, texts, n, EOS)


def _run(tok, script, env="calculator", n=2, max_turns=4, budget=200, **kw):
    question = [{"role": "user", "content": "What is 12*7+3?"}]
    prompt = encode(tok, tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True))
    engine = Scripted(tok, script)
    out = run_episodes(
        engine, tok, [prompt], [question], [{"question": "q"}], n, Sampling(max_new_tokens=50),
        env_name=env, env_kwargs={}, max_turns=max_turns, max_total_tokens=budget, timeout_s=5.0,
        eos_ids={EOS}, pad_id=EOS, **kw,
    )  # fmt: skip
    return question, prompt, engine, out


def _sequence(rb: RolloutBatch, row: int) -> list[int]:
    return (
        rb.prompt_ids[row][rb.prompt_mask[row]].tolist() + rb.response_ids[row, : _extent(rb, row)].tolist()
    )


def _extent(rb, row):
    return int(torch.nonzero(rb.response_mask[row]).max()) + 1


def test_ids_equal_the_template_of_the_whole_conversation(tok):
    turn1, turn2 = "Let me compute. <calc>12*7+3</calc>", "#### 87"
    script = [encode(tok, turn1), encode(tok, turn2) + [EOS]]
    question, prompt, engine, out = _run(tok, script)
    rb = out.rollout
    conversation = [
        *question,
        {"role": "assistant", "content": turn1},
        {"role": "user", "content": "<result>87</result>"},
        {"role": "assistant", "content": turn2},
    ]
    whole = encode(tok, tok.apply_chat_template(conversation, tokenize=False))
    for row in range(2):
        seq = _sequence(rb, row)
        # The sequence ends at the sampled EOS; the template adds only the newline after it.
        assert seq == whole[: len(seq)] and tok.decode(whole[len(seq) :]) == "\n"
        # Model tokens are exactly the scripted turns, trained with their log-probs; the rest is context.
        resp = rb.response_ids[row, : _extent(rb, row)].tolist()
        mask = rb.response_mask[row, : len(resp)].tolist()
        n1, n2 = len(script[0]), len(script[1])
        obs = len(resp) - n1 - n2
        assert mask == [True] * n1 + [False] * obs + [True] * n2
        assert resp[:n1] == script[0] and resp[n1 + obs :] == script[1]
        assert (
            tok.decode(resp[n1 : n1 + obs])
            == "<|im_end|>\n<|im_start|>user\n<result>87</result><|im_end|>\n<|im_start|>assistant\n"
        )
        lp = rb.rollout_logprobs[row, : len(resp)]
        expected = [-0.5 - 0.01 * t for t in range(n1)] + [0.0] * obs + [-0.5 - 0.01 * t for t in range(n2)]
        torch.testing.assert_close(lp, torch.tensor(expected), rtol=0, atol=1e-6)
    assert rb.response_texts == (turn2, turn2) and rb.finish_reasons == ("stop", "stop")
    assert out.stats["turns"].tolist() == [2.0, 2.0] and out.stats["tool_calls"].tolist() == [1.0, 1.0]
    # Two engine calls: the first with n=2 for the row, the second with both live episodes, n=1 each,
    # given the whole sequence so far.
    assert len(engine.calls) == 2 and engine.calls[0][1] == 2 and engine.calls[1][1] == 1
    assert (
        engine.calls[1][0] == [_sequence(rb, 0)[: len(prompt) + len(rb.response_ids[0]) - len(script[1])]] * 2
    )
    assert engine.calls[0][2].stop == ("</calc>",)


def test_stored_ids_are_the_sampled_ones_when_re_encoding_would_change_them(tok):
    turn1 = "<calc>12*7+3</calc>"
    odd = [i for ch in turn1 for i in encode(tok, ch)]  # one token per character: a legal, unusual split
    assert odd != encode(tok, turn1) and tok.decode(odd) == turn1
    script = [odd, encode(tok, "#### 87") + [EOS]]
    question, prompt, _, out = _run(tok, script, n=1)
    rb = out.rollout
    resp = rb.response_ids[0, : _extent(rb, 0)].tolist()
    assert resp[: len(odd)] == odd  # never re-encoded
    assert rb.response_mask[0, : len(odd)].all()
    assert "<result>87</result>" in tok.decode(resp)  # the tool saw the decoded text
    conversation = [*question, {"role": "assistant", "content": turn1}]
    reencoded = encode(tok, tok.apply_chat_template(conversation, tokenize=False))
    assert reencoded[len(prompt) : len(prompt) + len(odd)] != odd  # what re-tokenising would have trained on


def test_token_budget_and_max_turns_end_episodes(tok):
    call = encode(tok, "<calc>1+1</calc>")
    # max_turns=1: the call is answered by nobody, the episode ends after the first turn.
    _, _, engine, out = _run(tok, [call], max_turns=1)
    assert len(engine.calls) == 1 and out.stats["turns"].tolist() == [1.0, 1.0]
    assert out.rollout.response_mask.sum(-1).tolist() == [len(call)] * 2
    # A budget that fits the call but not the observation: finish reason "length", no observation appended.
    _, _, engine, out = _run(tok, [call, call], budget=len(call) + 5)
    assert out.rollout.finish_reasons == ("length", "length") and len(engine.calls) == 1
    assert out.rollout.response_ids.shape[1] == len(call)


def test_failing_and_hanging_steps_are_counted():
    class Boom(Chatty):
        def step(self, text):
            raise RuntimeError("boom")

    class Slow(Chatty):
        def step(self, text):
            time.sleep(2)
            return super().step(text)

    results = step_all([Boom(), Slow(), Chatty()], ["a", "b", "c"], timeout_s=0.3)
    assert results[0][0] == "error" and "boom" in results[0][1]
    assert results[1] == ("timeout", None)
    assert results[2] == ("ok", ([{"role": "user", "content": "Go on."}], 0.25, False))


# -- real multi-turn episodes: log-probs equal the learner's recomputation -----------------------------


def test_multi_turn_logprobs_equal_learner_recomputation_and_observations_are_masked(tiny_dir, tok):
    from rlkit.learner import Learner
    from rlkit.rollout.engines.hf import HFEngine

    engine = HFEngine(tiny_dir, seed=0)
    questions = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What is 2 + 2? Think."}]]
    prompts = [
        encode(tok, tok.apply_chat_template(q, tokenize=False, add_generation_prompt=True)) for q in questions
    ]
    temperature = 0.9
    calls = []

    def generate(ps, n, sampling, turn, positions):
        calls.append(len(ps) * n)
        return engine.generate(ps, n, dataclasses.replace(sampling, seed=11 + turn))

    out = run_episodes(
        generate, tok, prompts, questions, [{}, {}], 2, Sampling(temperature=temperature, max_new_tokens=8),
        env_name="rlkit_test_envs:Chatty", env_kwargs={}, max_turns=3, max_total_tokens=120, timeout_s=5.0,
        eos_ids=set(engine.eos_ids), pad_id=engine.pad_id, context=engine.context,
    )  # fmt: skip
    rb = out.rollout
    assert out.stats["turns"].max() == 3 and out.stats["turns"].mean() > 2  # really multi-turn
    assert calls[0] == 4 and len(calls) == out.stats["turns"].max()  # one engine call per turn
    torch.testing.assert_close(out.env_rewards, 0.25 * out.stats["turns"])  # episodes ended by max_turns
    # Observation tokens: every run of masked positions inside a response is the observation, as text.
    obs = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    holes = 0
    for row in range(rb.num_samples):
        resp, mask = rb.response_ids[row, : _extent(rb, row)].tolist(), rb.response_mask[row].tolist()
        t = 0
        while t < len(resp):
            if mask[t]:
                t += 1
                continue
            end = t
            while not mask[end]:
                end += 1
            after_eos = resp[t - 1] == EOS
            assert tok.decode(resp[t:end]) == (obs[len("<|im_end|>") :] if after_eos else obs)
            holes += 1
            t = end
        assert rb.rollout_logprobs[row][~rb.response_mask[row]].eq(0).all()
    assert holes == int((out.stats["turns"] - 1).sum())
    learner = Learner(learner_cfg(model_path=tiny_dir, dtype="float32", temperature=temperature, seed=0))
    logp = learner.forward(rb).logprobs
    m = rb.response_mask
    assert (rb.rollout_logprobs[m] < 0).all()
    torch.testing.assert_close(logp[m], rb.rollout_logprobs[m], rtol=0, atol=1e-4)


def test_multiturn_start_up_check_of_the_chat_template(tok):
    import copy

    from rlkit.config.rules import parse
    from rlkit.config.schema import ConfigError
    from rlkit.rollout.episodes import check_multiturn_template
    from rlkit.train import compose

    cfg = parse(compose(["+recipe=calculator", "model.path=tiny-test"]))  # the schema's rules only: no model
    question = [{"role": "user", "content": "What is 2 * 3?"}]
    check_multiturn_template(tok, cfg, question)  # SmolLM2's template only appends
    # A template that re-renders earlier messages when one is added (here: it counts them up front).
    restless = copy.copy(tok)
    restless.chat_template = (
        "{{ messages|length }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(ConfigError, match=r"env.max_turns=3.*model.path='tiny-test'.*not prefix-stable"):
        check_multiturn_template(restless, cfg, question)
    cfg.data.template = "plain"
    with pytest.raises(
        ConfigError, match=r"env.name='calculator' with env.max_turns=3 .*data.template='chat'"
    ):
        check_multiturn_template(tok, cfg, question)
