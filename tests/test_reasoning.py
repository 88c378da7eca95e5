"""Reasoning parsers, whole and streamed, and the chat prompt's template options, on the
bundled model's real tokenizer (the server end is in test_tool_calling.py)."""

import pytest
from transformers import AutoTokenizer

from radixserve.models.source import resolve_model
from radixserve.reasoning import (
    PARSERS,
    StreamingReasoningParser,
    detect_reasoning,
    make_reasoning_parser,
)
from radixserve.tokenizer import apply_chat_template, encode_prompt

OUTPUTS = [
    "<think>plan it</think>The answer",
    "plan it</think>The answer",
    "<think>still thinking",
    "No thoughts here",
    "<thinking>is not the tag",
    "  <think>a</think>b</think>c",
    "",
    "<thi",
    "</think>only content",
    "<think></think>",
]


@pytest.mark.parametrize(
    "name,text,expected",
    [
        ("qwen3", "<think>plan it</think>The answer", ("plan it", "The answer")),
        ("qwen3", "No thoughts here", (None, "No thoughts here")),
        ("qwen3", "<think>cut off", ("cut off", "")),
        ("qwen3", "<thinking>is not the tag", (None, "<thinking>is not the tag")),
        ("deepseek-r1", "plan it</think>The answer", ("plan it", "The answer")),
        ("deepseek-r1", "<think>plan it</think>The answer", ("plan it", "The answer")),
        ("deepseek-r1", "no end tag", ("no end tag", "")),
        ("qwen3-thinking", "a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_whole_outputs_split(name, text, expected):
    assert PARSERS[name].split(text) == expected


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_deltas_add_up_to_the_whole_split(name, text, step):
    """Fed a few characters at a time, the deltas concatenate to what the whole output splits
    into, and no piece of a tag is ever sent as reasoning or content."""
    parser = PARSERS[name]
    stream = StreamingReasoningParser(parser)
    reasoning = content = ""
    for end in range(step, len(text) + step, step):
        thought, answer = stream.feed(text[:end], finished=end >= len(text))
        reasoning, content = reasoning + thought, content + answer
    expected_reasoning, expected_content = parser.split(text)
    assert (reasoning, content) == (expected_reasoning or "", expected_content)


def test_a_partial_closing_tag_is_held_back():
    stream = StreamingReasoningParser(PARSERS["qwen3"])
    assert stream.feed("<think>abc</th") == ("abc", "")
    assert stream.feed("<think>abc</thx") == ("</thx", "")
    assert stream.feed("<think>abc</thx</think>ok") == ("", "ok")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_reasoning_parser("nope")


@pytest.fixture(scope="module")
def bos_tokenizer():
    """The bundled tokenizer set to add a BOS token, as Llama's does."""
    return AutoTokenizer.from_pretrained(str(resolve_model(None).tokenizer_dir), add_bos_token=True)


def test_a_rendered_prompt_that_starts_with_bos_gets_no_second_one(bos_tokenizer):
    bos = bos_tokenizer.bos_token_id
    prompt = apply_chat_template(bos_tokenizer, [{"role": "user", "content": "hi"}])
    assert prompt.startswith(bos_tokenizer.bos_token)
    ids = encode_prompt(bos_tokenizer, prompt)
    assert ids[0] == bos and ids[1] != bos
    assert encode_prompt(bos_tokenizer, "plain text")[0] == bos  # plain text still gets its BOS


def test_template_variables_and_a_continued_final_message(bos_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The sky is"}]
    continued = apply_chat_template(
        bos_tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.endswith("<|im_start|>assistant\nThe sky is")
    closed = apply_chat_template(bos_tokenizer, messages, add_generation_prompt=False)
    assert closed.endswith("The sky is<|im_end|>\n")
    template = bos_tokenizer.chat_template
    bos_tokenizer.chat_template = "{% if enable_thinking %}THINK {% endif %}" + template
    try:
        assert apply_chat_template(bos_tokenizer, messages[:1], enable_thinking=True).startswith(
            "THINK "
        )
        assert not apply_chat_template(
            bos_tokenizer, messages[:1], enable_thinking=False
        ).startswith("THINK ")
    finally:
        bos_tokenizer.chat_template = template


@pytest.mark.parametrize(
    "name,template,text,reasoning",
    [
        (
            "seed_oss",
            "{{ '<seed:think>' }}{{ m }}{{ '</seed:think>' }}",
            "<seed:think>First, the city.</seed:think>It is sunny.",
            "First, the city.",
        ),
        (
            "gemma4",
            "{{ '<|channel>thought' }}{{ m }}{{ '<channel|>' }}",
            "<|channel>thought\nFirst, the city.<channel|>It is sunny.",
            "\nFirst, the city.",
        ),
    ],
)
def test_families_reason_between_their_own_tags_whole_and_streamed(name, template, text, reasoning):
    """Seed-OSS's and Gemma 4's tags, detected from their templates; an output that opens no
    tag (or another family's) is all content."""
    assert detect_reasoning(template) == name
    parser = make_reasoning_parser(name)
    assert parser.split(text) == (reasoning, "It is sunny.")
    assert parser.split("No reasoning <think>here</think>.") == (
        None,
        "No reasoning <think>here</think>.",
    )
    for cut in range(1, len(text)):
        stream = StreamingReasoningParser(parser)
        parts = [stream.feed(text[:cut]), stream.feed(text, finished=True)]
        assert "".join(r for r, _ in parts) == reasoning
        assert "".join(c for _, c in parts) == "It is sunny."
