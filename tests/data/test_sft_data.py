"""SFT rows (rlkit/data/sft.py): the assistant-only loss mask against masks written out by hand from the SmolLM2
template's text, prompt/completion rows templated as RL prompts are, the length budget, and bad input named."""

import copy
import dataclasses

import pytest

from rlkit.config.schema import ConfigError, DataConfig, SFTConfig
from rlkit.data.loading import DataError
from rlkit.data.sft import build_sft_set, chat_tokens, check_tokenizer, train_batch
from rlkit.models import load_tokenizer

DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def expected(tok, segments):
    """(ids, mask) from (text, trains) pieces written by hand; each piece is tokenised alone (they all end at a
    special token or a newline after one, where SmolLM2's BPE never merges across)."""
    ids, mask = [], []
    for text, trains in segments:
        piece = tok(text, add_special_tokens=False).input_ids
        ids += piece
        mask += [trains] * len(piece)
    return ids, mask


def test_multi_turn_mask_covers_every_assistant_turn_only(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "Bye"},
    ]
    want = expected(
        tok,
        [
            (
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            ("Hello there<|im_end|>\n", True),
            (
                "<|im_start|>tool\n42<|im_end|>\n<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            ("Bye<|im_end|>\n", True),
        ],
    )
    assert chat_tokens(messages, tok) == want
    assert sum(want[1]) > 4 and not all(want[1])


def test_prompt_completion_row_is_the_rl_prompt_then_the_answer(tok):
    data = DataConfig(system_prompt="Answer with a number.", instruction="Give only the number.")
    rows = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}]
    got = build_sft_set(rows, tok, data, SFTConfig())
    want = expected(
        tok,
        [
            (
                "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?\n"
                "Give only the number.<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            ("2 + 3 = 5\n#### 5<|im_end|>\n", True),
        ],
    )
    assert (got.token_ids[0], got.loss_masks[0]) == want
    # the prompt part is exactly what RL's prompt rendering gives (rlkit/data/prompts.py)
    from rlkit.data.prompts import render_prompt

    _, prompt_ids = render_prompt("What is 2 + 3?", tok, data)
    assert got.token_ids[0][: len(prompt_ids)] == prompt_ids and not any(got.loss_masks[0][: len(prompt_ids)])


def test_completion_key_and_default_system_prompt(tok):
    rows = [{"q": "x?", "sol": "y", "answer": "unused"}]
    got = build_sft_set(
        rows, tok, DataConfig(prompt_key="q", instruction=""), SFTConfig(completion_key="sol")
    )
    want = expected(
        tok,
        [
            (DEFAULT_SYSTEM + "<|im_start|>user\nx?<|im_end|>\n<|im_start|>assistant\n", False),
            ("y<|im_end|>\n", True),
        ],
    )
    assert (got.token_ids[0], got.loss_masks[0]) == want


def _chat(n_words):
    return {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": " ".join(["a"] * n_words)},
        ]
    }


def test_overlong_rows_truncated_or_dropped_and_counted(tok):
    short, long = _chat(2), _chat(40)
    n_short = len(chat_tokens(short["messages"], tok)[0])
    n_long = len(chat_tokens(long["messages"], tok)[0])
    budget = n_short + 3
    assert n_long > budget
    cut = build_sft_set([short, long, long], tok, DataConfig(), SFTConfig(max_length=budget))
    assert (len(cut), cut.truncated, cut.dropped) == (3, 2, 0)
    assert [len(t) for t in cut.token_ids] == [n_short, budget, budget]
    full_ids, full_mask = chat_tokens(long["messages"], tok)
    assert (cut.token_ids[1], cut.loss_masks[1]) == (full_ids[:budget], full_mask[:budget])
    dropped = build_sft_set(
        [short, long, long], tok, DataConfig(), SFTConfig(max_length=budget, overlong="drop")
    )
    assert (len(dropped), dropped.truncated, dropped.dropped) == (1, 0, 2)


def test_empty_after_filtering_is_named(tok):
    with pytest.raises(DataError, match=r"no row is left.*sft.overlong='drop'.*sft.max_length=4"):
        build_sft_set([_chat(3)], tok, DataConfig(), SFTConfig(max_length=4, overlong="drop"))
    # truncated to the prompt alone: no assistant token left, dropped, and then none is left
    with pytest.raises(DataError, match="no row is left"):
        build_sft_set([_chat(3)], tok, DataConfig(), SFTConfig(max_length=5))


@pytest.mark.parametrize(
    "row, words",
    [
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            ["row 2 of split 'train'", "sft.messages_key='messages'", "no assistant turn", "'hi'"],
        ),
        ({"messages": [{"role": "bot", "content": "hi"}]}, ["row 2", "'bot'", "'role': one of"]),
        ({"messages": []}, ["row 2", "holds []"]),
        (
            {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
            ["row 2", "begins with an assistant turn"],
        ),
        ({"question": "q"}, ["row 2", "sft.completion_key='answer'", "holds None", "columns: ['question']"]),
        ({"question": "q", "answer": "  "}, ["row 2", "completion ('answer') is empty"]),
    ],
    ids=["no-assistant", "bad-role", "empty", "assistant-first", "no-completion", "empty-completion"],
)
def test_bad_rows_name_key_row_and_value(tok, row, words):
    with pytest.raises(DataError) as err:
        build_sft_set([_chat(1), row], tok, DataConfig(), SFTConfig())
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_tokenizer_without_chat_template_is_refused(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(ConfigError, match=r"model.path='m'.*no chat template"):
        check_tokenizer(plain, "m")
    check_tokenizer(tok, "m")


def test_template_that_rewrites_earlier_turns_is_refused(tok):
    odd = copy.deepcopy(tok)
    # renders only the last assistant turn's content: earlier turns' tokens change once a later one exists
    odd.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat += [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(DataError, match="renders the chat up to assistant turn 1 differently"):
        chat_tokens(chat, odd)


def test_train_batch_layout():
    batch = train_batch([[5, 6, 7, 8], [9, 10]], [[False, False, True, True], [False, True]], pad_id=0)
    assert batch.prompt_ids.tolist() == [[5], [9]] and batch.prompt_mask.all()
    assert batch.response_ids.tolist() == [[6, 7, 8], [10, 0, 0]]
    assert batch.response_mask.tolist() == [[False, True, True], [True, False, False]]
    assert batch.advantages.shape == (2, 3)


@pytest.fixture(scope="module")
def vl_processor(tmp_path_factory):
    """The tiny Idefics3 / SmolVLM processor of tests/vl_families.py (4 image tokens per 32-pixel picture)."""
    from vl_families import build_vl_family

    from rlkit.vision import load_processor

    return load_processor(build_vl_family("smolvlm", tmp_path_factory.mktemp("smolvlm") / "ckpt"))


def test_an_image_row_has_the_processors_expanded_ids_and_its_answer_masked(vl_processor, tmp_path):
    from vl_families import picture

    path = tmp_path / "red.png"
    picture((255, 0, 0), size=(32, 32)).save(path)
    data = DataConfig(
        path=str(tmp_path), prompt_key="q", answer_key="a", image_key="image", system_prompt="Be brief.",
        instruction="",
    )  # fmt: skip
    rows = [{"q": "What colour?", "a": "red", "image": str(path)}]
    got = build_sft_set(rows, vl_processor.tokenizer, data, SFTConfig(), processor=vl_processor)
    text = (  # the chat written by hand: the picture before the question
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<image>What colour?<|im_end|>\n"
        "<|im_start|>assistant\nred<|im_end|>\n"
    )
    from PIL import Image

    want = vl_processor(text=[text], images=[Image.open(path).convert("RGB")], add_special_tokens=False)
    assert got.token_ids[0] == want["input_ids"][0]
    answer = len(vl_processor.tokenizer("red<|im_end|>\n", add_special_tokens=False).input_ids)
    assert got.loss_masks[0] == [False] * (len(want["input_ids"][0]) - answer) + [True] * answer
    images = got.images[0]
    assert images.pictures[0].size == (32, 32) and "pixel_values" in images.tensors
    batch = train_batch(got.token_ids, got.loss_masks, 0, got.images)
    assert batch.images == (images,)
    with pytest.raises(DataError, match="data.image_key='picture' is not a column"):
        build_sft_set(rows, vl_processor.tokenizer, dataclasses.replace(data, image_key="picture"), SFTConfig(),
                      processor=vl_processor)  # fmt: skip
