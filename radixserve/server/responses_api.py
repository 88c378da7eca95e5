"""OpenAI's Responses API over the chat route: `POST /v1/responses` (whole or as a stream of
Responses events), `GET` and `DELETE /v1/responses/{id}`. A stored response keeps its whole
conversation, so a follow-up that names it in `previous_response_id` renders the same prompt
prefix and hits the radix cache."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from .http import RequestError, json_response, parse_body, sse_events
from .openai_api import ChatSetup, start_chat
from .responses_protocol import ResponsesRequest
from .tokenizer_manager import TokenizerManager

MAX_STORED_RESPONSES = 1024  # the oldest are forgotten first


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    conversation: list[dict[str, Any]]  # every message up to and including its output


class ResponseStore:
    """Responses created with `store: true`, in memory, the last `capacity` of them."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()

    def keep(self, stored: StoredResponse) -> None:
        self.items[stored.body["id"]] = stored
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        if response_id not in self.items:
            raise RequestError(f"no stored response has id {response_id!r}", 404)
        return self.items[response_id]

    def forget(self, response_id: str) -> None:
        self.get(response_id)  # a 404 for an unknown id
        del self.items[response_id]

    def history(self, previous_id: str | None) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        if previous_id not in self.items:
            raise RequestError(
                f"previous_response_id: no stored response has id {previous_id!r} "
                f"(the server keeps the last {self.capacity} created with store: true)"
            )
        return self.items[previous_id].conversation


def responses_routes(app: FastAPI, tm: TokenizerManager, setup: ChatSetup) -> None:
    store = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await parse_body(request, ResponsesRequest)
        history = store.history(body.previous_response_id)
        chat = body.chat_request(history)
        reqs, adapter = await start_chat(tm, setup, chat)
        draft = ResponseDraft(tm, body, setup.model, chat_messages(chat))
        if len(reqs) != 1:
            raise RequestError("a response has one output")
        if body.stream:
            return sse_events(draft.stream(adapter.stream(reqs), store), stream_error)
        state = await tm.run_to_end(reqs[0], request.is_disconnected)
        reply = adapter.response([state])
        message, finish = reply["choices"][0]["message"], reply["choices"][0]["finish_reason"]
        return json_response(
            await draft.finish(output_items(message), finish, reply["usage"], store)
        )

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return json_response(store.get(response_id).body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        store.forget(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def chat_messages(chat) -> list[dict[str, Any]]:
    """The chat request's messages as stored history (the instructions' system message left
    out: a follow-up brings its own)."""
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    return messages[1:] if messages and messages[0]["role"] == "system" else messages


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "type": "reasoning",
        "id": item_id or _new_id("rs"),
        "summary": [],
        "content": content,
        "status": status,
    }


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id or _new_id("msg"),
        "role": "assistant",
        "status": status,
        "content": content if status == "completed" else [],
    }


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict:
    return {
        "type": "function_call",
        "id": item_id or _new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def output_items(message: dict) -> list[dict]:
    """A chat message as Responses output items: reasoning, text, then each call."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def assistant_message(items: list[dict]) -> dict[str, Any]:
    """Output items as the assistant message a later turn's prompt shows."""
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


@dataclass
class ResponseDraft:
    """One response being made: its id and echoed settings, and the conversation so far."""

    tm: TokenizerManager
    body: ResponsesRequest
    model: str
    conversation: list[dict[str, Any]]
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, status: str, items: list[dict], usage: dict | None) -> dict:
        body = self.body
        tool_choice = body.tool_choice or "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": items,
            "instructions": body.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": body.store,
            "metadata": body.metadata or {},
            "user": body.user,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "error": None,
            "usage": usage,
        }

    async def finish(
        self, items: list[dict], finish_reason: str | None, chat_usage: dict, store: ResponseStore
    ) -> dict:
        """The final response object; kept in `store` when the body asked to store it."""
        status = "incomplete" if finish_reason == "length" else "completed"
        if status == "incomplete" and items and items[-1]["type"] == "message":
            items[-1]["status"] = "incomplete"  # the text the cut ended
        thought = "".join(
            part["text"]
            for item in items
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        reasoning_tokens = len(await self.tm.inputs.encode(thought)) if thought else 0
        usage = {
            "input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": chat_usage["prompt_tokens_details"],
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"],
        }
        response = self.envelope(status, items, usage)
        if self.body.store:
            conversation = self.conversation + [assistant_message(items)]
            store.keep(StoredResponse(response, conversation))
        return response

    async def stream(self, chunks: AsyncIterator[dict], store: ResponseStore):
        """Responses events from the chat route's chunks."""
        events = ResponseEvents()
        yield events.event("response.created", response=self.envelope("in_progress", [], None))
        yield events.event("response.in_progress", response=self.envelope("in_progress", [], None))
        finish, usage = None, None
        async for chunk in chunks:
            if not chunk["choices"]:
                usage = chunk.get("usage")
                continue
            choice = chunk["choices"][0]
            for event in events.feed(choice["delta"]):
                yield event
            finish = choice["finish_reason"] or finish
        for event in events.close():
            yield event
        response = await self.finish(events.items, finish, usage, store)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield events.event(kind, response=response)


class ResponseEvents:
    """Turns chat deltas into Responses stream events, one output item open at a time."""

    def __init__(self):
        self.sequence = 0
        self.items: list[dict] = []  # the finished output items
        self.open: dict | None = None  # the item being streamed
        self.text = ""  # its text (or a call's arguments) so far

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def feed(self, delta: dict) -> list[dict]:
        out = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                out += self.close()
                item = call_item(call["id"], call["function"]["name"], "")
                item["status"] = "in_progress"
                out += self._open(item)
            if call["function"].get("arguments"):
                self.text += call["function"]["arguments"]
                out.append(
                    self._on_open(
                        "response.function_call_arguments.delta",
                        delta=call["function"]["arguments"],
                    )
                )
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            make = reasoning_item if kind == "reasoning" else message_item
            out += self._open(make("", status="in_progress"))
            if kind == "message":
                out.append(
                    self._on_open(
                        "response.content_part.added", content_index=0, part=_text_part("")
                    )
                )
        self.text += text
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self._on_open(name, content_index=0, delta=text, **extra))
        return out

    def _open(self, item: dict) -> list[dict]:
        self.open, self.text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.items), item=item)]

    def _on_open(self, kind: str, **fields) -> dict:
        return self.event(kind, item_id=self.open["id"], output_index=len(self.items), **fields)

    def close(self) -> list[dict]:
        """End the open item: its `.done` events, then `output_item.done`."""
        item, text = self.open, self.text
        if item is None:
            return []
        out = []
        if item["type"] == "reasoning":
            out.append(self._on_open("response.reasoning_text.done", content_index=0, text=text))
            done = reasoning_item(text, item["id"])
        elif item["type"] == "message":
            out.append(
                self._on_open("response.output_text.done", content_index=0, text=text, logprobs=[])
            )
            out.append(
                self._on_open("response.content_part.done", content_index=0, part=_text_part(text))
            )
            done = message_item(text, item["id"])
        else:
            out.append(
                self._on_open(
                    "response.function_call_arguments.done", name=item["name"], arguments=text
                )
            )
            done = call_item(item["call_id"], item["name"], text, item["id"])
        out.append(self.event("response.output_item.done", output_index=len(self.items), item=done))
        self.items.append(done)
        self.open, self.text = None, ""
        return out


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def stream_error(message: str, status: int) -> dict:
    return {"type": "error", "code": str(status), "message": message, "param": None}
