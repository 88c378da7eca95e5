"""Anthropic's Messages API request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`)
and how one becomes a chat request: the system prompt, text, `tool_use` and `tool_result`
blocks become chat messages; tools and `tool_choice` map onto chat's. Fields outside these
models are refused by name (`extra="forbid"`). `cache_control` is accepted everywhere and
changes nothing: every prompt prefix is cached."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .content_parts import image_url_part
from .http import RequestError
from .openai_protocol import ChatCompletionRequest, chat_request_of

SKIPPED_BLOCKS = ("thinking", "redacted_thinking")  # earlier turns' reasoning: templates drop it


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CustomTool(_Strict):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Strict):
    """Thinking is split out (as `thinking` blocks) when the server has a reasoning parser;
    a budget is not something radixserve can hold a model to."""

    type: Literal["disabled"]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        system = _system_text(self.system)
        messages = [{"role": "system", "content": system}] if system else []
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{i}]")
        return messages

    def chat_fields(self) -> dict[str, Any]:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools or []
        ]
        choice, parallel = self._tool_choice()
        return {
            "messages": self.chat_messages(),
            "tools": tools or None,
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
        }

    def _tool_choice(self) -> tuple[Any, bool]:
        tc = self.tool_choice
        if tc is None:
            return None, True
        if tc.type == "tool":
            if tc.name is None:
                raise RequestError("tool_choice of type 'tool' needs a name")
            return {"type": "function", "function": {"name": tc.name}}, True
        chosen = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
        return chosen, not tc.disable_parallel_tool_use


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # radixserve's (and SGLang's) own
    seed: int | None = None
    priority: int | None = None
    cache_salt: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        data = {
            **self.chat_fields(),
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "priority": self.priority,
            "cache_salt": self.cache_salt,
            "stream": self.stream,
            "model": self.model,  # a LoRA adapter's name picks the adapter
        }
        return chat_request_of(data)


def _system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "".join(_block_text(block, f"system[{i}]") for i, block in enumerate(system))


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else None
        raise RequestError(f"{where}: blocks of type {kind!r} are not supported here")
    if not isinstance(block.get("text"), str):
        raise RequestError(f"{where}.text must be a string")
    return block["text"]


def _chat_messages(message: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results become tool
    messages (before its text), an assistant turn's tool uses its tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(message.content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append({"type": "text", "text": _block_text(block, at)})
        elif kind == "image" and message.role == "user":
            texts.append(_image_part(block, at))
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and message.role == "user":
            results.append(_tool_result(block, at))
        elif kind not in SKIPPED_BLOCKS:
            raise RequestError(f"{at}: {message.role} blocks of type {kind!r} are not supported")
    out = list(results)
    if texts or calls or not results:
        images = any(part["type"] != "text" for part in texts)
        content = texts if images else "".join(part["text"] for part in texts)
        turn: dict[str, Any] = {"role": message.role, "content": content}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _image_part(block: dict, where: str) -> dict[str, Any]:
    """An image block (a base64 or url source) as a chat image part."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise RequestError(f"{where}.source needs a string media_type and data")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        url = source.get("url")
    else:
        raise RequestError(
            f"{where}.source.type of an image block must be 'base64' or 'url', not {kind!r}"
        )
    try:
        return image_url_part(url, f"{where}.source")
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _tool_call(block: dict, where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise RequestError(f"{where}: a tool_use block needs a string id and name")
    if not isinstance(block.get("input"), dict):
        raise RequestError(f"{where}.input must be an object")
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
    }


def _tool_result(block: dict, where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise RequestError(f"{where}.tool_use_id must be a string")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_block_text(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
