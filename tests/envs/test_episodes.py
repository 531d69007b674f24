"""Multi-turn episodes, token in / token out (rlkit/rollout/episodes.py) and the calculator tool.

Token-exactness is checked against the chat template applied to the whole conversation, with turns we
script as token ids (a scripted engine lets a test choose ids that re-encoding would change); log-probs
of real multi-turn episodes are checked against the learner's fp32 recomputation."""

import dataclasses
import multiprocessing
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from cfg_helpers import learner_cfg
from rlkit_test_envs import Chatty

from rlkit.batch import RolloutBatch
from rlkit.envs import make_env, resolve_env
from rlkit.envs.calculator import CalcError, evaluate, format_number
from rlkit.models import load_tokenizer, make_tiny_checkpoint
from rlkit.rollout.engines.base import Sampling, rows_to_batch
from rlkit.rollout.episodes import run_episodes

pytestmark = (
    pytest.mark.slow
)  # environment worker processes and a model's generation: `make test-fast` leaves it out

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


def _run(tok, script, env="calculator", n=2, max_turns=4, budget=200, env_kwargs=None, rows=None, **kw):
    question = [{"role": "user", "content": "What is 12*7+3?"}]
    prompt = encode(tok, tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True))
    engine = Scripted(tok, script)
    rows = rows or [{"question": "q"}]
    out = run_episodes(
        engine, tok, [prompt] * len(rows), [question] * len(rows), rows, n, Sampling(max_new_tokens=50),
        env_name=env, env_kwargs=env_kwargs or {}, max_turns=max_turns, max_total_tokens=budget,
        eos_ids={EOS}, pad_id=EOS, **{"timeout_s": 5.0, **kw},
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
    # A budget that fits the call and, alone, the observation (18 tokens) but not both: finish reason
    # "length", no observation appended, not an error.
    _, _, engine, out = _run(tok, [call, call], budget=len(call) + 17)
    assert out.rollout.finish_reasons == ("length", "length") and len(engine.calls) == 1
    assert out.errors == 0 and not out.failed.any()
    assert out.rollout.response_ids.shape[1] == len(call)


def test_failing_and_hanging_steps_are_counted():
    from rlkit.envs.workers import EnvWorkers

    workers = EnvWorkers("rlkit_test_envs:Misbehaving", {}, 4, timeout_s=0.5)
    try:
        assert all(v[0] == "ok" for v in workers.call("make", {k: () for k in range(4)}).values())
        hows = ["raise", "sleep", "ok", "exit"]
        resets = workers.call(
            "reset", {k: ({"how": how}, [{"role": "user", "content": "q"}]) for k, how in enumerate(hows)}
        )
        assert all(v[0] == "ok" for v in resets.values())
        results = workers.call("step", {k: ("a",) for k in range(4)})
    finally:
        workers.close()
    assert results[0][0] == "error" and "step boom" in results[0][1]
    assert results[1][0] == "timeout" and "env.timeout_s=0.5" in results[1][1]
    assert results[2] == ("ok", ([{"role": "user", "content": "Go on."}], 0.25, False))
    assert results[3][0] == "error" and "exit code 3" in results[3][1]
    assert multiprocessing.active_children() == []


def _descendants() -> set[int]:
    """Live descendant processes of this one (children, and the fork server's children), from /proc."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(stat.parent.name)] = int(fields[1])
    out, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - out
        out |= frontier
    return out


def test_single_turn_starts_no_process_or_thread(tok, monkeypatch):
    """The default environment never steps: its episodes (also when a response is cut to its room, which
    takes the general path) run in this process, with no worker process and no thread."""
    import rlkit.rollout.episodes as episodes

    def refuse(*args, **kwargs):
        raise AssertionError("single_turn started a process or a thread")

    monkeypatch.setattr(episodes, "EnvWorkers", refuse, raising=False)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    turn = encode(tok, TURN)
    _, _, _, out = _run(tok, [turn], env="single_turn")
    assert out.stats["turns"].tolist() == [1.0, 1.0] and out.errors == 0
    _, _, _, cut = _run(tok, [turn], env="single_turn", budget=3)  # cut: the general path
    assert cut.rollout.finish_reasons == ("length", "length") and cut.rollout.response_mask.sum() == 6


def test_sigterm_to_the_process_group_spares_the_environment_workers():
    """SIGTERM to the whole process group is the trainer's to handle: the fork server and the workers ignore
    it, so the step being finished keeps its environments (a dead fork server would take them along)."""
    import signal

    from rlkit.envs.workers import EnvWorkers

    workers = EnvWorkers("rlkit_test_envs:Misbehaving", {}, 2, timeout_s=5.0)
    try:
        assert all(v[0] == "ok" for v in workers.call("make", {0: (), 1: ()}).values())
        server = [
            p
            for p in _descendants()
            if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()
            and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())
        ]
        assert len(server) == 1
        for pid in [*server, *(w.proc.pid for w in workers._workers)]:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        results = workers.call("step", {0: ("a",), 1: ("b",)})
    finally:
        workers.close()
    assert all(v == ("ok", ([{"role": "user", "content": "Go on."}], 0.25, False)) for v in results.values())
    assert Path(f"/proc/{server[0]}").exists()


TURN = "Let me think about it step by step"

# Each failure and the reason its warning gives.
MALFORMED = {
    "raise": "step raised RuntimeError: step boom",
    "content_none": "step returned a bad result: observation[0]['content'] must be a string or a list of text and "
    "image parts, got NoneType",
    "content_int": "observation[0]['content'] must be a string or a list of text and image parts, got int",
    "element_not_dict": "observation[0] must be a dict with role and content, got str",
    "not_a_list": "observation must be a list of messages, got str",
    "reset_none": "reset returned a bad result: reset's first messages must be a list of messages, got NoneType",
    "reset_raise": "reset raised RuntimeError: reset boom",
    "huge_first": "characters, more than the model's context of 1024 tokens could hold (refused before tokenizing)",
    "long_first": "tokens, the model's context 1024",
    "huge_observation": "characters is longer than the episode's budget of 400 tokens could hold (refused before",
    "exit": "its worker died (exit code 3)",
}


@pytest.mark.parametrize("how", MALFORMED)
def test_a_misbehaving_environment_fails_only_its_episode(tok, how, caplog):
    """Each failure ends the bad row's episodes with reward 0, counted in env/errors (never a raise), its
    reason logged once; the good row's episodes run on with their per-step rewards."""
    script = [encode(tok, TURN)] * 3
    rows = [{"question": "q", "how": how}, {"question": "q", "how": "ok"}]
    _, _, engine, out = _run(tok, script, env="rlkit_test_envs:Misbehaving", rows=rows, max_turns=3,
                             context=1024, budget=400)  # fmt: skip
    assert out.failed.tolist() == [True, True, False, False], how
    assert out.errors == 2 and out.timeouts == 0
    assert out.env_rewards.tolist() == [0.0, 0.0, 0.75, 0.75]
    assert out.stats["turns"].tolist()[2:] == [3.0, 3.0]
    (warning,) = [r.getMessage() for r in caplog.records if "end with reward 0" in r.getMessage()]
    assert "2 episode(s) (0, 1)" in warning and MALFORMED[how] in warning
    # No model turn; the prompt stays the dataset's.
    if how in ("reset_none", "reset_raise", "huge_first", "long_first"):
        assert out.stats["turns"].tolist()[:2] == [0.0, 0.0] and len(engine.calls[0][0]) == 1
        assert out.rollout.prompt_ids.shape[1] < 100
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["spin", "sleep"])
def test_a_hung_step_is_killed_with_nothing_left_behind(tok, how):
    """A step over env.timeout_s is stopped for real: its worker process is killed, no thread or process
    is left, and the next batches take no longer (a leaked CPU-spinning thread would hold the GIL)."""
    script = [encode(tok, TURN)] * 3
    _run(tok, script, env="rlkit_test_envs:Chatty", max_turns=1)  # starts the fork server (it stays)
    threads, processes = threading.active_count(), _descendants()
    seconds = []
    for _ in range(3):
        t0 = time.monotonic()
        _, _, _, out = _run(tok, script, env="rlkit_test_envs:Misbehaving", env_kwargs={"how": how},
                            max_turns=3, timeout_s=0.5)  # fmt: skip
        seconds.append(time.monotonic() - t0)
        assert out.failed.all() and out.errors == 2 and out.timeouts >= 1
        assert out.env_rewards.eq(0).all() and out.stats["turns"].tolist() == [1.0, 1.0]
        assert threading.active_count() == threads
        assert _descendants() == processes and multiprocessing.active_children() == []
    assert max(seconds) < 10 and seconds[-1] < 2 * seconds[0] + 1, seconds


def test_calculator_scan_is_linear_in_the_turn():
    env = make_env("calculator")
    for text in (
        "<calc>" * 170_000,
        "<calc>1" + "</calc>" * 145_000,
        "<calc>1+1</calc> x" * 56_000 + "<calc>2*3</calc>",
    ):
        assert len(text) >= 1_000_000
        t0 = time.monotonic()
        obs, _, done = env.step(text)
        assert time.monotonic() - t0 < 1.0
    assert obs == [{"role": "user", "content": "<result>6</result>"}] and not done
    assert (make_env("calculator").step("<calc>" * 170_000)) == (None, 0.0, True)
    from rlkit.envs.calculator import last_call

    # The scan finds what the lazy pattern `<calc>(.*?)</calc>` found (its last match), on every split.
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(
            rng.choice(["<calc>", "</calc>", "1+2", "x", "\n", "<calc"]) for _ in range(rng.randint(0, 9))
        )
        found = re.findall(r"<calc>(.*?)</calc>", text, re.DOTALL)
        assert last_call(text) == (found[-1] if found else None), text


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


class ScriptedWithImages(Scripted):
    """Scripted, recording the images it is given with each call."""

    def __call__(self, prompts, n, sampling, turn, positions, images=None):
        self.seen = getattr(self, "seen", []) + [images]
        return super().__call__(prompts, n, sampling, turn, positions)


def test_the_first_prompts_images_stay_with_the_episode(tok):
    """Multi-turn (calculator): every turn's call gets each live episode's first-prompt Images, and the finished
    batch's rows carry them; a prompt without images has None beside it."""
    from rlkit.batch import Images

    question = [{"role": "user", "content": "What is 12*7+3?"}]
    prompt = encode(tok, tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True))
    pics = Images((), {"pixel_values": torch.zeros(4, 3)}, "abc")
    script = [tok.encode("<calc>12*7</calc>"), tok.encode("#### 87")]
    engine = ScriptedWithImages(tok, script)
    out = run_episodes(
        engine, tok, [prompt, prompt], [question, question], [{"question": "q"}] * 2, 2,
        Sampling(max_new_tokens=50), env_name="calculator", env_kwargs={}, max_turns=4, max_total_tokens=200,
        eos_ids={EOS}, pad_id=EOS, timeout_s=5.0, images=[pics, None],
    )  # fmt: skip
    assert engine.seen[0] == (pics, None)  # turn 0: one entry per prompt (n=2 each)
    assert engine.seen[1] == (pics, pics, None, None)  # turn 1: one per live episode
    assert out.rollout.images == (pics, pics, None, None)
