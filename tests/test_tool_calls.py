"""Tool-call parsers on model-shaped output, whole and streamed in every possible split."""

import json

import pytest

from radixserve.tool_calls import (
    Parsed,
    StreamingToolParser,
    ToolCall,
    calls_structural_tag,
    detect_parser,
    make_parser,
)

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "C"}))
TIME = ToolCall("get_time", json.dumps({"zone": "CET"}))

CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "C"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
        Parsed("Let me check.", [WEATHER, TIME]),
    ),
    (
        "hermes",
        "No tools needed: 2 < 3 and <b>bold</b>.",
        Parsed("No tools needed: 2 < 3 and <b>bold</b>."),
    ),
    (
        "hermes",
        # cut at EOS
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}',
        Parsed("", [WEATHER]),
    ),
    (
        "hermes",
        "<tool_call>not json</tool_call> done",
        Parsed("<tool_call>not json</tool_call> done"),
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
        Parsed("", [TIME]),
    ),  # arguments sent as a JSON string
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        Parsed("Sure.", [WEATHER, TIME]),
    ),
    ("mistral", "[TOOL_CALLS] oops", Parsed("[TOOL_CALLS] oops")),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
        Parsed("", [WEATHER]),
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        Parsed("", [WEATHER, TIME]),
    ),
    ("llama3", "The answer is {not a call}.", Parsed("The answer is {not a call}.")),
    (
        "glm45",
        "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>C</arg_value>\n</tool_call>"
        "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>",
        Parsed("Checking.", [WEATHER, TIME]),
    ),
    (
        "glm45",
        "<tool_call>get_count\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        Parsed("", [ToolCall("get_count", json.dumps({"n": 3}))]),
    ),  # a value that reads as JSON is JSON
    ("glm45", "<tool_call>not a name!</tool_call>", Parsed("<tool_call>not a name!</tool_call>")),
    (
        "seed_oss",
        "Sure.<seed:tool_call><function=get_weather><parameter=city>Paris</parameter>"
        "<parameter=unit>C</parameter></function></seed:tool_call>",
        Parsed("Sure.", [WEATHER]),
    ),
    (
        "command_a",
        'I will check.<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
        '"parameters": {"city": "Paris", "unit": "C"}}, {"tool_call_id": "1", "tool_name": '
        '"get_time", "parameters": {"zone": "CET"}}]<|END_ACTION|>',
        Parsed("I will check.", [WEATHER, TIME]),
    ),
    (
        "pythonic",
        '[get_weather(city="Paris", unit="C"), get_time(zone="CET")]',
        Parsed("", [WEATHER, TIME]),
    ),
    (
        "pythonic",
        '<|python_start|>[get_time(zone="CET")]<|python_end|>',
        Parsed("", [TIME]),
    ),
    ("pythonic", "[1, 2, 3] are numbers.", Parsed("[1, 2, 3] are numbers.")),
    (
        "gemma4",
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>C<|"|>}<tool_call|>'
        '<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>',
        Parsed("Checking.", [WEATHER, TIME]),
    ),
    (
        "gemma4",
        '<|tool_call>call:plan{n:3,ok:true,steps:[1,<|"|>a, b}<|"|>],at:{<|"|>x y<|"|>:null},'
        "t:-1.5e3}<tool_call|>",
        Parsed(
            "",
            [
                ToolCall(
                    "plan",
                    json.dumps(
                        {
                            "n": 3,
                            "ok": True,
                            "steps": [1, "a, b}"],
                            "at": {"x y": None},
                            "t": -1500.0,
                        }
                    ),
                )
            ],
        ),
    ),  # numbers, booleans, lists, objects, a quoted key, brackets inside a string
    (
        "gemma4",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>C<|"|>}',
        Parsed("", [WEATHER]),
    ),  # cut at EOS
    (
        "gemma4",
        "<|tool_call>call:get_time{zone:CET}<tool_call|> left as text",
        Parsed("<|tool_call>call:get_time{zone:CET}<tool_call|> left as text"),
    ),  # an unquoted string is not a value
]


@pytest.mark.parametrize("name,text,expected", CASES)
def test_whole_output(name, text, expected):
    assert make_parser(name).parse(text) == expected


@pytest.mark.parametrize("name,text,expected", CASES)
def test_streamed_in_every_split_gives_the_same_and_never_leaks_a_partial_marker(
    name, text, expected
):
    marker = make_parser(name).start
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text], [text[:cut], text[: cut + 1], text]):
            stream = StreamingToolParser(make_parser(name))
            events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
            content = "".join(e.content for e in events)
            calls = [e.call for e in events if e.call is not None]
            assert calls == expected.calls
            assert [e.call_index for e in events if e.call is not None] == list(range(len(calls)))
            if expected.calls:
                assert content.strip() == expected.content
                assert marker not in content and not any(
                    e.content.endswith(marker[:k])
                    for e in events
                    for k in range(2, len(marker))
                    if e.content
                )
            else:
                assert content == text


@pytest.mark.parametrize(
    "name,opening,closing",
    [
        ("gemma4", "<|tool_call>call:f{a:", "}<tool_call|>"),
        ("hermes", '<tool_call>{"name": "f", "arguments": ', "}</tool_call>"),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": ', "}]"),
    ],
)
def test_values_nested_past_any_reason_stay_text(name, opening, closing):
    """Values are read recursively (by json or Gemma 4's reader): 100,000 nested lists in a
    call are text, not a crash."""
    text = opening + "[" * 100_000 + "]" * 100_000 + closing
    assert make_parser(name).parse(text) == Parsed(text)


def test_parser_names_and_detection():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_parser("nope")
    assert detect_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser("<|python_tag|>") == "llama3"
    assert detect_parser(None) == "hermes"
    assert detect_parser("{{ '<tool_call>' + name }}<arg_key>{{ k }}</arg_key>") == "glm45"
    assert detect_parser("{{ '<seed:tool_call>' }}") == "seed_oss"
    assert detect_parser("<|START_ACTION|>{{ calls }}<|END_ACTION|>") == "command_a"
    assert detect_parser("{{ '<|python_start|>' }}[func_name(params)]") == "pythonic"
    assert detect_parser("{{- '<|tool_call>call:' + function['name'] + '{' -}}") == "gemma4"


FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["CET", "UTC"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
]


@pytest.fixture(scope="module")
def grammars():
    from radixserve.constrained import GrammarBackend
    from radixserve.models.source import resolve_model
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None).tokenizer_dir)
    return GrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def accepts(grammars, tag: dict, text: str) -> bool:
    from radixserve.constrained import GrammarSpec

    return grammars.matcher(GrammarSpec("structural_tag", json.dumps(tag))).accept_string(text)


@pytest.mark.parametrize(
    "name,valid,invalid",
    [
        (
            "hermes",
            'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
            '<tool_call>{"name": "get_time", "arguments": {"zone": "EST"}}</tool_call>',
        ),
        (
            "mistral",
            'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": '
            '"C"}}]',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        ),
        (
            "llama3",
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}',
            '{"name": "get_weather", "parameters": {"town": "Oslo"}}',
        ),
    ],
)
def test_auto_grammar_leaves_text_free_and_makes_every_call_valid(grammars, name, valid, invalid):
    """`tool_choice: auto` in every format: free text until the format's trigger, then only a
    call that validates against its function's schema."""
    parser = make_parser(name)
    tag = calls_structural_tag(parser, FUNCTIONS, parallel=False)
    assert accepts(grammars, tag, "Just text, no call.")
    assert accepts(grammars, tag, valid)
    assert not accepts(grammars, tag, invalid)
    assert parser.parse(valid).calls


def test_mistral_auto_grammar_takes_one_call_unless_parallel(grammars):
    two = (
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]'
    )
    parser = make_parser("mistral")
    assert not accepts(grammars, calls_structural_tag(parser, FUNCTIONS, parallel=False), two)
    assert accepts(grammars, calls_structural_tag(parser, FUNCTIONS, parallel=True), two)


def test_json_calls_cut_short_keep_their_complete_calls():
    from radixserve.tool_calls import JsonCallsParser

    parser = JsonCallsParser()
    whole = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a"'
    parsed = parser.parse(whole)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("add", {"a": 1, "b": 2})]
    assert parser.parse('[{"name": "add", "argu').calls == []
    assert parser.parse('{"name": "add", "arguments": {}}').calls[0].name == "add"


QWEN3_TEMPLATE = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is "
    "false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}<tool_call>"
)
R1_TEMPLATE = (
    "{{ content.split('</think>')[-1] }}{% if add_generation_prompt %}"
    "{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)


def test_formats_are_chosen_from_the_chat_template():
    from radixserve.reasoning import detect_reasoning

    assert detect_parser(QWEN3_TEMPLATE) == "hermes"
    assert detect_reasoning(QWEN3_TEMPLATE) == "qwen3"
    assert detect_reasoning(R1_TEMPLATE) == "deepseek-r1"
    assert detect_reasoning("{{ messages }}") is None
    with pytest.raises(ValueError, match="harmony format"):
        detect_parser("{{ '<|start|>assistant<|channel|>commentary<|call|>' }}")
