"""Images from environments, end to end (rlkit/envs/images.py, rlkit/rollout/observations.py): a picture an
environment shows enters the next turn as the processor renders the whole conversation with all its pictures;
its image tokens count in the token budget; a malformed one fails its episode with the reason; the learner's
log-probs of such episodes equal the HF engine's. A tiny random SmolVLM (Idefics3, tests/vl_families.py)."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from cfg_helpers import learner_cfg
from PIL import Image
from rlkit_test_image_envs import png
from vl_families import build_vl_family, picture

from rlkit.envs.images import PictureRule
from rlkit.rollout.engines.base import Sampling, rows_to_batch
from rlkit.rollout.episodes import run_episodes
from rlkit.vision import load_processor

pytestmark = pytest.mark.slow  # environment worker processes, a model's generation and a learner

EOS = 2  # SmolLM2's <|im_end|>
RULE = PictureRule(max_pixels=10_000, resize=False)
QUESTION = "What is in the plot?"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = build_vl_family("smolvlm", tmp_path_factory.mktemp("smolvlm"))
    return path, load_processor(path)


class Scripted:
    """The k-th call returns the ids of script[k] for every row (log-prob -0.5); records prompts and images."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def __call__(self, prompts, n, sampling, turn, positions, images=None):
        self.calls.append((prompts, n, images))
        ids = self.script[turn]
        rows = [(ids, [-0.5] * len(ids), "stop") for _ in range(len(prompts) * n)]
        return rows_to_batch([p for p in prompts for _ in range(n)], rows, ["t"] * len(rows), n, EOS)


def _prompt(processor, pictures):
    """The first prompt's ids and Images, as the processor renders a user turn (pictures first)."""
    from rlkit.data.images import expand

    content = [{"type": "image"}] * len(pictures) + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    if not pictures:
        return processor.tokenizer(text, add_special_tokens=False).input_ids, None
    return expand(processor, text, pictures)


def _run(processor, script, env, *, n=2, first=(), budget=400, max_turns=3, pictures=RULE, env_kwargs=None):
    prompt, images = _prompt(processor, list(first))
    engine = Scripted(script)
    out = run_episodes(
        engine, processor.tokenizer, [prompt], [[{"role": "user", "content": QUESTION}]], [{}], n,
        Sampling(max_new_tokens=50), env_name=f"rlkit_test_image_envs:{env}", env_kwargs=env_kwargs or {},
        max_turns=max_turns, max_total_tokens=budget, timeout_s=10.0, eos_ids={EOS}, pad_id=EOS,
        images=[images] if images is not None else None, processor=processor, pictures=pictures,
    )  # fmt: skip
    return prompt, engine, out


def _sequence(rb, row):
    end = int(torch.nonzero(rb.response_mask[row]).max()) + 1
    return rb.prompt_ids[row][rb.prompt_mask[row]].tolist() + rb.response_ids[row, :end].tolist()


def _turn(tok, text):
    return tok(text, add_special_tokens=False).input_ids + [EOS]


def test_a_picture_shown_at_turn_two_equals_the_whole_conversation_rendered_at_once(vlm):
    """Ids and Images equal the processor's rendering of the whole conversation with both pictures (the data's
    and the environment's); observation tokens, image tokens included, are out of the loss."""
    _, processor = vlm
    tok = processor.tokenizer
    texts = ["Let me see.", "Show me.", "It is blue."]
    script = [_turn(tok, t) for t in texts]
    data_picture = picture(seed=3, size=(40, 40))
    prompt, engine, out = _run(processor, script, "ShowAtTurnTwo", first=[data_picture])
    shown = Image.open(io.BytesIO(png((0, 0, 255)))).convert("RGB")
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": texts[0]},
        {"role": "user", "content": "<result>1</result>"},
        {"role": "assistant", "content": texts[1]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "The plot."}]},
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    whole = processor(
        text=[text], images=[data_picture, shown], return_tensors="pt", add_special_tokens=False
    )
    expected = whole["input_ids"][0].tolist() + script[2]
    rb = out.rollout
    assert not out.failed.any() and out.stats["turns"].tolist() == [3.0, 3.0]
    image_token = tok.convert_tokens_to_ids("<image>")
    for row in range(2):
        seq = _sequence(rb, row)
        assert seq == expected
        assert seq.count(image_token) == 8  # 4 image tokens a picture (this family's image_seq_len)
        images = rb.images[row]
        assert len(images.pictures) == 2 and images.pictures[1].tobytes() == shown.tobytes()
        assert set(images.tensors) == {"pixel_values", "pixel_attention_mask"}
        for key in images.tensors:
            torch.testing.assert_close(images.tensors[key], whole[key], rtol=0, atol=0)
        # Model tokens are the scripted turns; the observations (the picture's tokens too) are context.
        resp = rb.response_ids[row].tolist()[: len(seq) - len(prompt)]
        model = rb.response_mask[row, : len(resp)].tolist()
        assert sum(model) == sum(map(len, script))
        assert all(not m for t, m in zip(resp, model) if t == image_token)
    # The engine's third turn got the whole sequence and both pictures; its second, the data's picture alone.
    (_, _, second), (prompts, _, third) = engine.calls[1], engine.calls[2]
    assert [len(x.pictures) for x in second] == [1, 1] and [len(x.pictures) for x in third] == [2, 2]
    assert prompts[0] == expected[: -len(script[2])]
    assert out.env_rewards.tolist() == [0.5, 0.5]


def test_image_tokens_count_in_the_token_budget(vlm):
    """A budget one token short of the observation with its picture ends the episode (finish `length`, no
    failure, no picture), as a text observation's would; one token more lets the next turn take that token."""
    _, processor = vlm
    tok = processor.tokenizer
    t1 = _turn(tok, "Look.")
    script = [t1, _turn(tok, "Green.")]
    prompt, _ = _prompt(processor, [])
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Look."},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    green = Image.new("RGB", (40, 24), "green")
    whole = processor(text=[text], images=[green], add_special_tokens=False)["input_ids"][0]
    observation = len(whole) - len(prompt) - len(t1)  # the observation's tokens, its picture's included
    assert whole.count(tok.convert_tokens_to_ids("<image>")) == 4 and observation > 4

    _, _, short = _run(processor, script, "ShowEveryTurn", n=1, budget=len(t1) + observation, max_turns=2)
    assert short.rollout.finish_reasons == ("length",) and not short.failed.any()
    assert short.stats["turns"].tolist() == [1.0] and short.rollout.images is None
    assert _sequence(short.rollout, 0) == prompt + t1

    _, _, fits = _run(processor, script, "ShowEveryTurn", n=1, budget=len(t1) + observation + 1, max_turns=2)
    assert fits.stats["turns"].tolist() == [2.0] and fits.rollout.finish_reasons == ("length",)
    assert _sequence(fits.rollout, 0) == whole + script[1][:1]
    assert len(fits.rollout.images[0].pictures) == 1


@pytest.mark.parametrize(
    "env, kwargs, pictures, reason",
    [
        ("BadImage", {}, RULE, "turn 1: step returned a bad result: observation[0]['content'][0]: cannot decode the "
                               "image (UnidentifiedImageError"),
        ("BadImage", {"how": "big"}, RULE, "the image is 400x300 = 120000 pixels, over data.max_image_pixels=10000"),
        ("Undeclared", {}, None, "is an image, but this run takes none from its environment"),
    ],
)  # fmt: skip
def test_a_malformed_picture_fails_its_episode_naming_env_and_turn(
    vlm, env, kwargs, pictures, reason, caplog
):
    _, processor = vlm
    tok = processor.tokenizer
    _, _, out = _run(processor, [_turn(tok, "Look.")] * 2, env, pictures=pictures, env_kwargs=kwargs)
    assert out.failed.tolist() == [True, True] and out.errors == 2
    assert out.stats["turns"].tolist() == [1.0, 1.0] and out.rollout.images is None
    assert reason in out.first_failure and out.first_failure.startswith("turn 1: ")
    (warning,) = [r.getMessage() for r in caplog.records if "end with reward 0" in r.getMessage()]
    assert f"environment rlkit_test_image_envs:{env}: 2 episode(s)" in warning and reason in warning


def test_hf_engine_multi_turn_with_pictures_logprobs_equal_the_learner(vlm):
    """Real sampled episodes on the HF engine, a picture shown at turn 2 (the first prompt with its own picture, the
    second without): the learner's fp32 log-probs of the rows, all their pictures given, equal the engine's."""
    from rlkit.learner import Learner
    from rlkit.rollout.engines.hf import HFEngine

    path, processor = vlm
    engine = HFEngine(path, seed=0, vision=True)
    firsts = [_prompt(processor, [picture(seed=5, size=(40, 40))]), _prompt(processor, [])]
    temperature = 0.9

    def generate(ps, n, sampling, turn, positions, images=None):
        return engine.generate(ps, n, dataclasses.replace(sampling, seed=11 + turn), images=images)

    out = run_episodes(
        generate, processor.tokenizer, [p for p, _ in firsts], [[{"role": "user", "content": QUESTION}]] * 2,
        [{}, {}], 2, Sampling(temperature=temperature, max_new_tokens=12), env_name="rlkit_test_image_envs:Stoppy",
        env_kwargs={}, max_turns=3, max_total_tokens=200, timeout_s=10.0, eos_ids=set(engine.eos_ids),
        pad_id=engine.pad_id, context=engine.context, images=[firsts[0][1], None], processor=processor,
        pictures=RULE,
    )  # fmt: skip
    rb = out.rollout
    assert not out.failed.any()
    shown = [0 if x is None else len(x.pictures) for x in rb.images]
    assert any(k == 2 for k in shown[:2]) and any(k == 1 for k in shown[2:]), shown  # pictures shown
    cfg = learner_cfg(model_path=path, dtype="float32", temperature=temperature, seed=0)
    cfg.env.name, cfg.env.max_turns = "rlkit_test_image_envs:Stoppy", 3
    learner = Learner(cfg)
    assert learner.vision
    logp = learner.forward(rb).logprobs
    m = rb.response_mask
    assert (rb.rollout_logprobs[m] < 0).all()
    torch.testing.assert_close(logp[m], rb.rollout_logprobs[m], rtol=0, atol=1e-4)
    # The reusing update (the trainer's "log-probs from the update's forward") scores the rows that hold no loss
    # token (here the first group's, as a zero-std group's) in a forward of their own: with their pictures too.
    from rlkit.batch import TrainBatch
    from rlkit.learner.reuse import ForwardScores

    trained = m.clone()
    trained[:2] = False
    scores = ForwardScores(m)
    batch = TrainBatch(
        rb.prompt_ids, rb.prompt_mask, rb.response_ids, trained, torch.zeros(m.shape), images=rb.images
    )
    learner.update(batch, scores=scores)
    torch.testing.assert_close(scores.logprobs[m], rb.rollout_logprobs[m], rtol=0, atol=1e-4)


def test_start_up_checks_of_an_environment_that_shows_images(vlm, tmp_path):
    """An environment that shows images makes the run a vision-language one; a text-only model, FSDP2, or a
    processor whose template drops an image part are refused at start-up, naming the keys."""
    import copy

    from rlkit.envs import check_env_images, picture_rule, takes_images
    from rlkit.models import make_tiny_checkpoint
    from rlkit.rollout.observations import check_picture_template

    path, processor = vlm
    cfg = learner_cfg(model_path=path)
    assert not takes_images(cfg) and picture_rule(cfg) is None
    cfg.env.name, cfg.env.max_turns = "rlkit_test_image_envs:ShowAtTurnTwo", 3
    cfg.data.max_image_pixels, cfg.data.resize_images = 5000, True
    assert takes_images(cfg) and picture_rule(cfg) == PictureRule(max_pixels=5000, resize=True)
    check_env_images(cfg)
    cfg.env.max_turns = 1  # one turn: no observation is ever shown
    assert not takes_images(cfg)
    cfg.env.max_turns = 3
    cfg.trainer.strategy = "fsdp2"
    with pytest.raises(ValueError, match="shows images in its observations: with trainer.strategy=fsdp2"):
        check_env_images(cfg)
    cfg.trainer.strategy = "auto"
    cfg.model.path = make_tiny_checkpoint(tmp_path / "text", hidden_size=16, num_layers=1)
    with pytest.raises(ValueError, match="is a text-only model"):
        check_env_images(cfg)
    question = [{"role": "user", "content": QUESTION}]
    check_picture_template(processor, question, "env.name='x'")
    plain = copy.deepcopy(processor)
    plain.chat_template = (
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="env.name='x': the model's processor"):
        check_picture_template(plain, question, "env.name='x'")
