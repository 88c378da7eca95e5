"""Tool calls in model output, by family: the formats models are trained to emit, parsed whole.

Formats (`--tool-call-parser`, names as in SGLang where one exists):
- `hermes` (Qwen 2.5+, Hermes, SmolLM3 and many fine-tunes):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
- `llama3`: a JSON object `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
  several separated by `;`; the whole output must be calls.
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}`.

Text outside calls is content. A call whose JSON does not parse stays content (the caller can
constrain decoding so that this cannot happen). Streaming holds back any text that may be the
start of a call marker, so a partial tag never leaks out as content; each call is emitted once
its closing marker (or the end of the output) arrives: first its name, then its arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def _call_from(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class TaggedParser:
    """Calls between a start and an end marker (hermes); the end may be missing at the end of
    output."""

    def __init__(self, start: str, end: str, arguments_key: str = "arguments"):
        self.start, self.end, self.arguments_key = start, end, arguments_key

    def parse(self, text: str) -> Parsed:
        content, calls, rest = [], [], text
        while (at := rest.find(self.start)) >= 0:
            content.append(rest[:at])
            body_start = at + len(self.start)
            stop = rest.find(self.end, body_start)
            body = rest[body_start:] if stop < 0 else rest[body_start:stop]
            call = _call_from(_loads(body.strip()), self.arguments_key)
            if call is None:  # not a call after all: keep the text
                content.append(rest[at:] if stop < 0 else rest[at : stop + len(self.end)])
            else:
                calls.append(call)
            rest = "" if stop < 0 else rest[stop + len(self.end) :]
        content.append(rest)
        return Parsed("".join(content).strip() if calls else "".join(content), calls)


class MistralParser:
    """`[TOOL_CALLS]` then a JSON list of calls, to the end of the output."""

    marker = "[TOOL_CALLS]"
    start = marker

    def parse(self, text: str) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            return Parsed(text)
        listed = _loads(text[at + len(self.marker) :].strip())
        objs = listed if isinstance(listed, list) else [listed]
        calls = [_call_from(obj, "arguments") for obj in objs]
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        return Parsed(text[:at].strip(), calls)


class Llama3Parser:
    """The whole output is one or more JSON calls (`;`-separated), maybe after `<|python_tag|>`."""

    start = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self.start).strip()
        if not body.startswith("{"):
            return Parsed(text)
        calls = [
            _call_from(_loads(part.strip()), "parameters") for part in _split_top_level(body, ";")
        ]
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        return Parsed("", calls)


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside JSON strings and brackets."""
    parts, depth, in_string, escaped, begin = [], 0, False, False, 0
    for i, char in enumerate(text):
        if in_string:
            escaped = not escaped and char == "\\"
            in_string = escaped or char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    parts.append(text[begin:])
    return [p for p in parts if p.strip()]


class JsonCallsParser:
    """The output of decoding constrained to the tools' schema (`tool_choice` required or named):
    one call object, or a list of them, as JSON. Complete only at the end of the output; a list
    cut short (by max_tokens) still yields the calls completed before the cut."""

    start = ""

    def parse(self, text: str) -> Parsed:
        value = _loads(text.strip())
        if value is None and text.lstrip().startswith("["):
            value = _complete_items(text.lstrip()[1:])
        calls = [
            _call_from(obj, "arguments") for obj in (value if isinstance(value, list) else [value])
        ]
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        return Parsed("", calls)


def _complete_items(text: str) -> list:
    """The JSON values that are complete at the start of a list's body, in order."""
    decoder, items, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


PARSERS = {
    "hermes": lambda: TaggedParser("<tool_call>", "</tool_call>"),
    "qwen25": lambda: TaggedParser("<tool_call>", "</tool_call>"),
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}


def make_parser(name: str):
    if name not in PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name]()


# markers of tool formats a chat template may show that no parser here reads
UNPARSED_FORMATS = {
    "<｜tool▁calls▁begin｜>": "DeepSeek's",
    "<|call|>": "gpt-oss's harmony",
    "<start_function_call>": "Gemma's",
}


def detect_parser(chat_template: str | None) -> str:
    """The parser a chat template's own tool format implies (Qwen's `<tool_call>` is hermes);
    `hermes` when it has none (the default tool prompt asks for that format). A format no
    parser reads is a ValueError naming it."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    for marker, name in UNPARSED_FORMATS.items():
        if marker in template and "<tool_call>" not in template:
            raise ValueError(
                f"this model's chat template writes tool calls in {name} format, which no "
                f"tool-call parser here reads; choose one with --tool-call-parser "
                f"({', '.join(sorted(PARSERS))}) or use tool_choice 'required' or a named function"
            )
    return "hermes"
