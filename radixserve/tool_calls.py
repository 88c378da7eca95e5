"""Tool calls in model output: the formats models are trained to emit, parsed whole or as a stream.

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


MAX_PARALLEL_CALLS = 4  # the grammar closes a list of required calls after this many


def calls_schema(functions: list[dict], parallel: bool) -> dict:
    """JSON schema of a call to one of `functions` (OpenAI function dicts), or of a list of 1 to
    MAX_PARALLEL_CALLS calls: decoding constrained by it can only produce calls that validate,
    and a model that repeats a call cannot keep the list open until max_tokens."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    if not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}


def calls_structural_tag(parser, functions: list[dict], parallel: bool) -> dict | None:
    """For `tool_choice: auto`: an xgrammar structural tag that leaves text free but makes
    whatever follows the format's trigger a call that validates (only one call, or one list of
    calls, without `parallel`). None for a format with no trigger (constrained calls only)."""
    if isinstance(parser, TaggedParser):  # hermes: <tool_call>{call}</tool_call>
        tags = [_tag(parser.start, calls_schema(functions, False), parser.end)]
        triggers = [parser.start]
    elif isinstance(parser, MistralParser):  # [TOOL_CALLS] [calls]
        listed = calls_schema(functions, True) | ({} if parallel else {"maxItems": 1})
        tags, triggers = [_tag(parser.marker, listed, "")], [parser.marker]
        parallel = False  # one list holds every call
    elif isinstance(
        parser, Llama3Parser
    ):  # {"name": "f", "parameters": {args}}, one tag per function
        opening = '{"name": '
        tags = [
            _tag(
                f'{opening}"{f["name"]}", "parameters": ',
                f.get("parameters") or {"type": "object"},
                "}",
            )
            for f in functions
        ]
        triggers = [opening]
    else:
        return None
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        },
    }


def _tag(begin: str, schema: dict, end: str) -> dict:
    return {"begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}


def default_tool_prompt(functions: list[dict]) -> str:
    """The system text that offers `functions` to a model whose chat template has no tool
    support, asking for the hermes format."""
    listed = "\n".join(
        json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions
    )
    return (
        "You can call functions. Their signatures, one JSON object per line:\n"
        + listed
        + "\nTo call one, answer with a JSON object in tags, one block per call:\n"
        '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>'
    )


def with_tool_prompt(messages: list[dict], functions: list[dict]) -> list[dict]:
    """Messages for a chat template without tool support: the default tool prompt joins the
    system message, and earlier calls become hermes blocks in the assistant's text."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")} | (
            {
                "content": message.get("content", "")
                + "".join(
                    "<tool_call>"
                    + json.dumps(
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                        ensure_ascii=False,
                    )
                    + "</tool_call>"
                    for c in message["tool_calls"]
                )
            }
            if message.get("tool_calls")
            else {}
        )
        out.append(message)
    prompt = default_tool_prompt(functions)
    if out and out[0]["role"] == "system":
        return [dict(out[0], content=out[0]["content"] + "\n\n" + prompt)] + out[1:]
    return [{"role": "system", "content": prompt}] + out


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


@dataclass
class Event:
    """One piece of a streamed answer: content text, or a call (its index, name and arguments)."""

    content: str = ""
    call_index: int | None = None
    call: ToolCall | None = None


class StreamingToolParser:
    """Feeds the output text as it grows and returns what can be shown: content up to any text
    that may begin a call, and each call once it is complete. `finish()` flushes the rest."""

    def __init__(self, parser):
        self.parser = parser
        self.text = ""
        self.shown = 0  # characters of `text` already emitted as content or calls
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        self.text = text
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            pending = self.text[self.shown :]
            if not pending:
                return events
            at = call_start(
                self.parser, pending, at_output_start=not self.text[: self.shown].strip()
            )
            if at < 0:
                keep = 0 if final else partial_suffix(pending, self.parser.start)
                return events + self._content(pending[: len(pending) - keep])
            events += self._content(pending[:at])
            block_end = self._block_end(pending, at, final)
            if block_end is None:  # the call is still being written
                return events
            parsed = self.parser.parse(pending[at:block_end])
            if parsed.calls:
                for call in parsed.calls:
                    events.append(Event(call_index=self.calls, call=call))
                    self.calls += 1
                self.shown += block_end - at
            else:
                events += self._content(pending[at:block_end])

    def _block_end(self, pending: str, at: int, final: bool) -> int | None:
        """Where the call starting at `at` ends, or None while it may still grow."""
        if isinstance(self.parser, TaggedParser):
            stop = pending.find(self.parser.end, at + len(self.parser.start))
            if stop >= 0:
                return stop + len(self.parser.end)
        return len(pending) if final else None  # the others run to the end of the output

    def _content(self, text: str) -> list[Event]:
        self.shown += len(text)
        return [Event(content=text)] if text else []


def call_start(parser, text: str, at_output_start: bool) -> int:
    """Index in `text` where a call begins, or -1. A llama3 call may also be a bare JSON object,
    but only as the whole output."""
    at = text.find(parser.start)
    if (
        at < 0
        and isinstance(parser, Llama3Parser)
        and at_output_start
        and text.lstrip().startswith("{")
    ):
        return len(text) - len(text.lstrip())
    return at


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
