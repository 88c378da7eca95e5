"""What every tool-call format returns (`ToolCall`, `Parsed`) and the parser of calls between
a start and an end marker that the tagged formats share."""

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
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    """The JSON value of `text`; None where it is not one (or nests past Python's stack)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class TaggedParser:
    """Calls between a start and an end marker (hermes: a JSON call); the end may be missing at
    the end of output. Other tagged formats say how a block's body reads (`calls_of`)."""

    json_body = True  # the body is a JSON call (the auto grammar can constrain it)

    def __init__(self, start: str, end: str, arguments_key: str = "arguments"):
        self.start, self.end, self.arguments_key = start, end, arguments_key

    def calls_of(self, body: str) -> list[ToolCall] | None:
        call = _call_from(_loads(body.strip()), self.arguments_key)
        return None if call is None else [call]

    def parse(self, text: str) -> Parsed:
        content, calls, rest = [], [], text
        while (at := rest.find(self.start)) >= 0:
            content.append(rest[:at])
            body_start = at + len(self.start)
            stop = rest.find(self.end, body_start)
            body = rest[body_start:] if stop < 0 else rest[body_start:stop]
            found = self.calls_of(body)
            if not found:  # not a call after all: keep the text
                content.append(rest[at:] if stop < 0 else rest[at : stop + len(self.end)])
            else:
                calls += found
            rest = "" if stop < 0 else rest[stop + len(self.end) :]
        content.append(rest)
        return Parsed("".join(content).strip() if calls else "".join(content), calls)
