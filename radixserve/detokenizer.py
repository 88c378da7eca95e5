"""Incremental detokenization with stop-string trimming, one state per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .messages import BatchOut, FinishReason, ReqOutput
from .tokenizer import decode_ids


@dataclass
class DecodeState:
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    prefix_offset: int = 0
    read_offset: int = 0


class Detokenizer:
    """Turns streams of token ids into text deltas.

    Text that might be the start of a stop string is held back until the request
    finishes; a request that stopped on a stop string never shows it.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return decode_ids(self.tokenizer, ids, skip_special_tokens)

    def text_for(self, out: ReqOutput) -> str:
        """Append this output's tokens to its request; return the newly visible text."""
        state = self.states.get(out.rid)
        if state is None:
            state = self.states[out.rid] = DecodeState(
                out.skip_special_tokens, list(out.stop or [])
            )
        state.ids += out.new_token_ids
        state.text += self._new_text(state, flush=out.finished)
        visible = self._visible(state, out.finished, out.finish_reason)
        delta = visible[state.sent :]
        state.sent = max(state.sent, len(visible))
        if out.finished:
            del self.states[out.rid]
        return delta

    def _new_text(self, s: DecodeState, flush: bool) -> str:
        """Text the new ids add; an incomplete UTF-8 sequence waits for more ids unless flushing."""
        before = self.decode(s.ids[s.prefix_offset : s.read_offset], s.skip_special_tokens)
        after = self.decode(s.ids[s.prefix_offset :], s.skip_special_tokens)
        if not flush and (after.endswith("\ufffd") or len(after) <= len(before)):
            return ""
        s.prefix_offset, s.read_offset = s.read_offset, len(s.ids)
        return after[len(before) :]

    def _visible(self, s: DecodeState, finished: bool, reason: FinishReason | None) -> str:
        if finished:
            matched = None if reason is None else reason.matched
            if isinstance(matched, str) and matched in s.text:
                return s.text[: s.text.index(matched)]
            return s.text
        if not s.stop:
            return s.text
        hold = max(len(x) for x in s.stop) - 1
        return s.text[: max(len(s.text) - hold, s.sent)]


def run_detokenizer(tokenizer_dir, endpoints, log_level: str = "info") -> None:
    """Detokenizer process: scheduler outputs in, the same outputs with text out to the api.

    Any other message (readiness, control replies) passes through unchanged.
    """
    import logging

    import zmq

    from .ipc import decode, encode, exit_with_parent, pull_socket, push_socket
    from .tokenizer import load_decoder

    exit_with_parent()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s detokenizer: %(message)s")
    tokenizer = load_decoder(tokenizer_dir)
    detok = Detokenizer(tokenizer) if tokenizer is not None else None
    ctx = zmq.Context()
    inbox = pull_socket(ctx, endpoints.detokenizer_in, bind=True)
    outbox = push_socket(ctx, endpoints.api_in, bind=False)
    while True:
        if not inbox.poll(1000):
            continue
        msg = decode(inbox.recv())
        if isinstance(msg, BatchOut) and detok is not None:
            for out in msg.outputs:
                out.text = detok.text_for(out)
        outbox.send(encode(msg))
