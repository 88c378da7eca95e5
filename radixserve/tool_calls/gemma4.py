"""Gemma 4's tool calls: `<|tool_call>call:name{key:value,...}<tool_call|>`."""

from __future__ import annotations

import json
import re

from .tagged import TaggedParser, ToolCall


class Gemma4Parser(TaggedParser):
    """Gemma 4: `<|tool_call>call:name{key:value,...}<tool_call|>`, one or more calls a block;
    a string value (or a quoted key) sits between `<|"|>` marks, other values are JSON-like
    (numbers, `true`, `false`, `null`, `{...}`, `[...]`)."""

    json_body = False
    QUOTE = '<|"|>'
    NAME = re.compile(r"call:([\w.\-]+)")
    KEY = re.compile(r"[\w.\-]+")
    BARE = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?|true|false|null")

    def __init__(self):
        super().__init__("<|tool_call>", "<tool_call|>")

    def calls_of(self, body: str) -> list[ToolCall] | None:
        calls, at = [], 0
        while (found := self.NAME.match(body, at)) is not None:
            try:
                args, at = self._value(body, found.end())
            except (ValueError, IndexError, RecursionError):  # not a call (or nested past reason)
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(found[1], json.dumps(args, ensure_ascii=False)))
            while at < len(body) and body[at] in " \n,;":
                at += 1
        return calls if calls and not body[at:].strip() else None

    def _value(self, text: str, at: int):
        """(the value that starts at `at`, where it ends); ValueError where none does."""
        if text.startswith(self.QUOTE, at):
            end = text.index(self.QUOTE, at + len(self.QUOTE))
            return text[at + len(self.QUOTE) : end], end + len(self.QUOTE)
        if text[at] in "{[":
            return self._collection(text, at)
        bare = self.BARE.match(text, at)
        if bare is None:
            raise ValueError(f"no value at {at}")
        return json.loads(bare[0]), bare.end()

    def _collection(self, text: str, at: int):
        closing, is_object = ("}", True) if text[at] == "{" else ("]", False)
        items: dict | list = {} if is_object else []
        at += 1
        while text[at] != closing:
            if is_object:
                key, at = self._key(text, at)
                value, at = self._value(text, at)
                items[key] = value
            else:
                value, at = self._value(text, at)
                items.append(value)
            if text[at] == ",":
                at += 1
            elif text[at] != closing:
                raise ValueError(f"unexpected {text[at]!r} at {at}")
        return items, at + 1

    def _key(self, text: str, at: int) -> tuple[str, int]:
        """A key and the position after its `:`."""
        if text.startswith(self.QUOTE, at):
            key, at = self._value(text, at)
        else:
            found = self.KEY.match(text, at)
            if found is None:
                raise ValueError(f"no key at {at}")
            key, at = found[0], found.end()
        if text[at] != ":":
            raise ValueError(f"no ':' after the key at {at}")
        return key, at + 1
