"""Tool-call parsers on model-shaped output, whole and streamed in every possible split."""
import json

import pytest

from radixserve.tool_calls import Parsed, StreamingToolParser, ToolCall, detect_parser, make_parser

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "C"}))
TIME = ToolCall("get_time", json.dumps({"zone": "CET"}))

CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
     Parsed("Let me check.", [WEATHER, TIME])),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", Parsed("No tools needed: 2 < 3 and <b>bold</b>.")),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}',  # cut at EOS
     Parsed("", [WEATHER])),
    ("hermes", "<tool_call>not json</tool_call> done", Parsed("<tool_call>not json</tool_call> done")),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
     Parsed("", [TIME])),  # arguments sent as a JSON string
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', Parsed("Sure.", [WEATHER, TIME])),
    ("mistral", "[TOOL_CALLS] oops", Parsed("[TOOL_CALLS] oops")),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', Parsed("", [WEATHER])),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
               '{"name": "get_time", "parameters": {"zone": "CET"}}', Parsed("", [WEATHER, TIME])),
    ("llama3", "The answer is {not a call}.", Parsed("The answer is {not a call}.")),
]


@pytest.mark.parametrize("name,text,expected", CASES)
def test_whole_output(name, text, expected):
    assert make_parser(name).parse(text) == expected


@pytest.mark.parametrize("name,text,expected", CASES)
def test_streamed_in_every_split_gives_the_same_and_never_leaks_a_partial_marker(name, text, expected):
    marker = make_parser(name).start
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text], [text[:cut], text[:cut + 1], text]):
            stream = StreamingToolParser(make_parser(name))
            events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
            content = "".join(e.content for e in events)
            calls = [e.call for e in events if e.call is not None]
            assert calls == expected.calls
            assert [e.call_index for e in events if e.call is not None] == list(range(len(calls)))
            if expected.calls:
                assert content.strip() == expected.content
                assert marker not in content and not any(
                    e.content.endswith(marker[:k]) for e in events for k in range(2, len(marker)) if e.content)
            else:
                assert content == text


def test_parser_names_and_detection():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_parser("nope")
    assert detect_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser("<|python_tag|>") == "llama3"
    assert detect_parser(None) == "hermes"
