"""Anthropic's Messages API over the chat route: `POST /v1/messages` (whole, or as Anthropic's
stream events) and `POST /v1/messages/count_tokens`. Usage counts as Anthropic's does:
`input_tokens` are the prompt tokens not read from the cache, `cache_read_input_tokens` the
ones that were."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .http import json_response, parse_body, sse_events
from .openai_api import ChatSetup, chat_prompt_ids, start_chat
from .openai_protocol import chat_request_of
from .tokenizer_manager import TokenizerManager

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_routes(app: FastAPI, tm: TokenizerManager, setup: ChatSetup) -> None:
    @app.post("/v1/messages")
    async def create_message(request: Request):
        body = await parse_body(request, MessagesRequest)
        reqs, adapter = await start_chat(tm, setup, body.chat_request())
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            events = message_events(adapter.stream(reqs), message_id, setup.model, reqs[0])
            return sse_events(events, stream_error)
        state = await tm.run_to_end(reqs[0], request.is_disconnected)
        reply = adapter.response([state])
        choice = reply["choices"][0]
        stop_reason, stop_sequence = stop_of(choice["finish_reason"], choice["matched_stop"])
        return json_response(
            {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": setup.model,
                "content": content_blocks(choice["message"]),
                "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": usage_of(reply["usage"]),
            }
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await parse_body(request, CountTokensRequest)
        chat = chat_request_of(body.chat_fields())
        return {"input_tokens": len((await chat_prompt_ids(tm, chat))[0])}


def stop_of(finish_reason: str | None, matched: Any) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish reason."""
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def usage_of(chat_usage: dict) -> dict:
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": chat_usage["completion_tokens"],
    }


def content_blocks(message: dict) -> list[dict]:
    blocks = []
    if message.get("reasoning_content"):
        blocks.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append(
            tool_use_block(call["id"], call["function"]["name"], call["function"]["arguments"])
        )
    return blocks


def tool_use_block(call_id: str, name: str, arguments: str | None) -> dict:
    return {
        "type": "tool_use",
        "id": call_id,
        "name": name,
        "input": json.loads(arguments) if arguments else {},
    }


async def message_events(chunks: AsyncIterator[dict], message_id: str, model: str, req):
    """Anthropic stream events from the chat route's chunks: one content block open at a
    time (thinking, text or a tool use), then the stop reason and usage."""
    yield {
        "type": "message_start",
        "message": {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(req.input_ids), "output_tokens": 0},
        },
    }
    blocks = BlockEvents()
    stop_reason, stop_sequence, usage = "end_turn", None, None
    async for chunk in chunks:
        if not chunk["choices"]:
            usage = chunk.get("usage")
            continue
        choice = chunk["choices"][0]
        for event in blocks.feed(choice["delta"]):
            yield event
        if choice["finish_reason"] is not None:
            stop_reason, stop_sequence = stop_of(
                choice["finish_reason"], choice.get("matched_stop")
            )
    for event in blocks.close():
        yield event
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": usage_of(usage),
    }
    yield {"type": "message_stop"}


class BlockEvents:
    def __init__(self):
        self.index = -1
        self.open: str | None = None  # the open block's type

    def feed(self, delta: dict) -> list[dict]:
        out = []
        if delta.get("reasoning_content"):
            out += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(
                self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            )
        if delta.get("content"):
            out += self._into("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                out += self.close()
                out += self._into(
                    "tool_use", tool_use_block(call["id"], call["function"]["name"], None)
                )
            if call["function"].get("arguments"):
                out.append(
                    self._delta(
                        {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
                    )
                )
        return out

    def _into(self, kind: str, block: dict) -> list[dict]:
        if self.open == kind and kind != "tool_use":
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]


def stream_error(message: str, status: int) -> dict:
    kind = "overloaded_error" if status == 503 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": message}}
