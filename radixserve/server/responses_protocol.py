"""The OpenAI Responses API's request body (`POST /v1/responses`) and how it becomes a chat
request: instructions, the stored history of `previous_response_id` and the input items become
messages; function tools and `tool_choice` map onto chat's. Fields outside this model are refused
by name (`extra="forbid"`), never dropped."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .content_parts import image_url_part
from .http import RequestError
from .openai_protocol import ChatCompletionRequest, chat_request_of

TEXT_PARTS = ("input_text", "output_text", "text")
SKIPPED_ITEMS = ("reasoning",)  # the chat template drops earlier reasoning; so do we


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None


class ReasoningOptions(_Strict):
    """Reasoning comes back as `reasoning` items when the server splits it out
    (`--reasoning-parser`); an effort level is not something radixserve can set."""

    effort: None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    truncation: Literal["disabled"] | None = None
    # radixserve's (and SGLang's) own
    top_k: int | None = None
    seed: int | None = None
    priority: int | None = None
    cache_salt: str | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}]: tools of type {kind!r} are not supported")
        return tools

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, include: list[str] | None) -> list[str] | None:
        if include:
            raise ValueError(f"include {include[0]!r} is not supported")
        return include

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (the shape `ChatMessage` takes)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            _add_item(messages, item, f"input[{i}]")
        return messages

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this body stands for after `history` (earlier turns' messages)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tool_choice: Any = self.tool_choice
        if isinstance(tool_choice, FunctionChoice):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        data: dict[str, Any] = {
            "messages": system + history + self.input_messages(),
            "tools": [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools or []
            ]
            or None,
            "tool_choice": tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "priority": self.priority,
            "cache_salt": self.cache_salt,
            "stream": self.stream,
            "response_format": self._response_format(),
            "model": self.model,  # a LoRA adapter's name picks the adapter
        }
        return chat_request_of(data)

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise RequestError("text.format of type json_schema needs a schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """Append one input item: a message, a function call (joined to the assistant message
    before it) or a function call's output."""
    if not isinstance(item, dict):
        raise RequestError(f"{where}: an input item must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise RequestError(f"{where}.role: {role!r} is not a message role")
        messages.append({"role": role, "content": _content_of(item.get("content"), where)})
    elif kind == "function_call":
        call = {
            "id": _string(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _string(item, "name", where),
                "arguments": _string(item, "arguments", where),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append(
            {
                "role": "tool",
                "tool_call_id": _string(item, "call_id", where),
                "content": _text_of(item.get("output"), where, "output"),
            }
        )
    elif kind not in SKIPPED_ITEMS:
        raise RequestError(f"{where}: input items of type {kind!r} are not supported")


def _text_of(content: Any, where: str, name: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.{name} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.{name}[{j}]: parts of type {kind!r} are not supported")
        texts.append(part["text"])
    return "".join(texts)


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or chat parts where it holds images (`input_image`)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text_of(content, where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            if part.get("file_id") is not None or part.get("image_url") is None:
                raise RequestError(
                    f"{at}: an input_image needs an image_url (file_id is not supported)"
                )
            try:
                parts.append(image_url_part(part["image_url"], at, part.get("detail", "auto")))
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        else:
            parts.append({"type": "text", "text": _text_of([part], f"{where}.content[{j}]")})
    return parts


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string")
    return value
