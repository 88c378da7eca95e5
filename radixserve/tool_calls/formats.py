"""Tool calls in model output, by family: the formats models are trained to emit, parsed whole.

Formats (`--tool-call-parser`, names as in SGLang where one exists):
- `hermes` (Qwen 2.5+, Hermes, SmolLM3 and many fine-tunes):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
- `llama3`: a JSON object `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
  several separated by `;`; the whole output must be calls.
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}`.
- `glm45` (GLM-4.5 to 4.7): `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>`.
- `seed_oss`: `<seed:tool_call><function=name><parameter=k>v</parameter></function>`.
- `command_a` (Command A): `<|START_ACTION|>` a JSON list of `{"tool_name", "parameters"}`.
- `pythonic` (Llama 4): the whole output a Python list of calls, `[f(a=1), g(b="x")]`.
- `gemma4` (Gemma 4): `<|tool_call>call:name{key:<|"|>text<|"|>,n:3}<tool_call|>`, keys bare,
  strings between `<|"|>` marks, other values (numbers, booleans, objects, lists) written out.

Text outside calls is content. A call whose JSON does not parse stays content (the caller can
constrain decoding so that this cannot happen). Streaming holds back any text that may be the
start of a call marker, so a partial tag never leaks out as content; each call is emitted once
its closing marker (or the end of the output) arrives: first its name, then its arguments.
"""

from __future__ import annotations

import ast
import json
import re

from .gemma4 import Gemma4Parser
from .tagged import Parsed, TaggedParser, ToolCall, _call_from, _loads

__all__ = ["Parsed", "ToolCall", "TaggedParser", "Gemma4Parser"]


def _value(text: str):
    """An XML-style argument's value: JSON where it reads as JSON, else the text itself."""
    value = _loads(text)
    return text if value is None else value


class Glm45Parser(TaggedParser):
    """GLM-4.5 to 4.7: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...
    </tool_call>`, values JSON where they parse as JSON."""

    json_body = False
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def __init__(self):
        super().__init__("<tool_call>", "</tool_call>")

    def calls_of(self, body: str) -> list[ToolCall] | None:
        name, _, rest = body.partition("<arg_key>")
        name = name.strip()
        if not name or not re.fullmatch(r"[\w.\-]+", name):
            return None
        args = {k.strip(): _value(v.strip()) for k, v in self.PAIR.findall("<arg_key>" + rest)}
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


class SeedOssParser(TaggedParser):
    """Seed-OSS: `<seed:tool_call><function=name><parameter=k>v</parameter>...</function>
    </seed:tool_call>`."""

    json_body = False
    FUNCTION = re.compile(r"<function=([\w.\-]+)>(.*?)(?:</function>|$)", re.S)
    PARAMETER = re.compile(r"<parameter=([\w.\-]+)>(.*?)</parameter>", re.S)

    def __init__(self):
        super().__init__("<seed:tool_call>", "</seed:tool_call>")

    def calls_of(self, body: str) -> list[ToolCall] | None:
        calls = []
        for name, inner in self.FUNCTION.findall(body):
            args = {k: _value(v.strip()) for k, v in self.PARAMETER.findall(inner)}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls or None


class CommandAParser(TaggedParser):
    """Command A: `<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ..., "parameters":
    {...}}, ...]<|END_ACTION|>`."""

    json_body = False

    def __init__(self):
        super().__init__("<|START_ACTION|>", "<|END_ACTION|>")

    def calls_of(self, body: str) -> list[ToolCall] | None:
        listed = _loads(body.strip())
        objs = listed if isinstance(listed, list) else [listed]
        calls = [
            _call_from({"name": o.get("tool_name"), **o}, "parameters")
            if isinstance(o, dict)
            else None
            for o in objs
        ]
        return None if not calls or None in calls else calls


class PythonicParser:
    """Llama 4 (and SGLang's `pythonic`): the whole output a Python list of calls with literal
    keyword arguments, `[get_weather(city="Paris"), get_time(zone="CET")]`, maybe between
    `<|python_start|>` and `<|python_end|>`."""

    start = "<|python_start|>"
    bare_start = "["

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self.start).removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return Parsed(text)
        if not isinstance(tree, ast.List) or not tree.elts:
            return Parsed(text)
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return Parsed(text)
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return Parsed(text)
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return Parsed("", calls)


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
    bare_start = "{"  # a call may also open the output without the tag

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
        except (json.JSONDecodeError, RecursionError):
            return items
        items.append(item)


PARSERS = {
    "hermes": lambda: TaggedParser("<tool_call>", "</tool_call>"),
    "qwen25": lambda: TaggedParser("<tool_call>", "</tool_call>"),
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "glm45": Glm45Parser,
    "seed_oss": SeedOssParser,
    "command_a": CommandAParser,
    "pythonic": PythonicParser,
    "gemma4": Gemma4Parser,
}


def make_parser(name: str):
    if name not in PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name]()


# markers of the tool formats a chat template may show, and the parser that reads them
TEMPLATE_MARKERS = {
    "<arg_key>": "glm45",
    "<seed:tool_call>": "seed_oss",
    "<|START_ACTION|>": "command_a",
    "<|python_start|>": "pythonic",
    "<|tool_call>": "gemma4",
}
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
    for marker, name in TEMPLATE_MARKERS.items():
        if marker in template:
            return name
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
