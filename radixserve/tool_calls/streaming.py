"""Streaming tool calls: text shown as it grows, held back where it may begin a call marker,
and each call emitted once its closing marker (or the end of the output) arrives."""

from __future__ import annotations

from dataclasses import dataclass

from .formats import TaggedParser, ToolCall


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
    """Index in `text` where a call begins, or -1. A llama3 (pythonic) call may also open the
    output as a bare JSON object (Python list)."""
    at = text.find(parser.start)
    bare = getattr(parser, "bare_start", None)
    if at < 0 and bare and at_output_start and text.lstrip().startswith(bare):
        return len(text) - len(text.lstrip())
    return at


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
