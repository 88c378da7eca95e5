"""Request bodies of the OpenAI routes (completions, chat completions), strict as in
`protocol`: OpenAI fields that radixserve does not implement are refused by name."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..multimodal.inputs import MediaPart
from .content_parts import check_parts, image_parts, parts_text
from .http import RequestError
from .protocol import BootstrapFields, refuse_unsupported

# OpenAI request fields with no implementation here: refused when set to anything but these
# values (a client that sends the default loses nothing).
UNSUPPORTED_OPENAI_FIELDS: dict[str, tuple] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "store": (None, False),
}
TOOL_FIELDS: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
}
# apply_chat_template's own arguments, not template variables
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)

    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI `response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self

    def grammar(self) -> dict[str, Any]:
        if self.type == "json_object":
            return {"json_schema": {"type": "object"}}
        if self.type == "json_schema":
            return {"json_schema": self.json_schema.schema_}
        return {}


class _OpenAIBase(BootstrapFields):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return refuse_unsupported(data, cls.unsupported_fields())

    @classmethod
    def unsupported_fields(cls) -> dict[str, tuple]:
        return {**UNSUPPORTED_OPENAI_FIELDS, **TOOL_FIELDS}

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    priority: int | None = None  # with --enable-priority-scheduling: higher runs first
    cache_salt: str | None = None  # requests of different salts never share cached KV
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None

    def sampling_params(self, default_max_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": default_max_tokens if self.max_tokens is None else self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "regex": self.regex,
            "ebnf": self.ebnf,
            "logit_bias": self.logit_bias,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.response_format is not None:
            params.update(self.response_format.grammar())
        return params


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_legacy_function_call(cls, data: Any) -> Any:
        return refuse_unsupported(data, {"function_call": (None,)})

    @field_validator("content")
    @classmethod
    def _text_and_image_parts(cls, content: Any) -> Any:
        if isinstance(content, list):
            check_parts(content)
        return content

    def text(self, markers: dict[str, str] | None = None) -> str:
        if isinstance(self.content, list):
            return parts_text(self.content, markers or {})
        return self.content or ""

    def images(self, where: str) -> list[MediaPart]:
        return image_parts(self.content, where) if isinstance(self.content, list) else []

    def template_dict(self, markers: dict[str, str] | None = None) -> dict[str, Any]:
        """The message as chat templates take it (tool calls with their arguments as objects,
        each image or video as the model's marker for it)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text(markers)}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _json_object(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = (
        True  # with --reasoning-parser: reasoning in message.reasoning_content
    )
    chat_template_kwargs: dict[str, Any] | None = (
        None  # more variables for the template (enable_thinking)
    )
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    add_generation_prompt: bool | None = None  # default: True, unless continue_final_message

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(
                f"chat_template_kwargs cannot set {taken}; they are request fields or "
                f"radixserve's own"
            )
        return kwargs

    @classmethod
    def unsupported_fields(cls) -> dict[str, tuple]:
        return UNSUPPORTED_OPENAI_FIELDS

    @model_validator(mode="after")
    def _continued_message_is_the_assistants(self) -> "ChatCompletionRequest":
        if self.continue_final_message:
            if self.messages[-1].role != "assistant":
                raise ValueError(
                    "continue_final_message needs the last message to be the assistant's"
                )
            if self.add_generation_prompt:
                raise ValueError(
                    "continue_final_message and add_generation_prompt cannot both be true"
                )
        return self

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of the chat template for this request."""
        opening = (
            not self.continue_final_message
            if self.add_generation_prompt is None
            else self.add_generation_prompt
        )
        return {
            **(self.chat_template_kwargs or {}),
            "add_generation_prompt": opening,
            "continue_final_message": self.continue_final_message,
        }

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tools: the function name {repeated[0]!r} is given more than once")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if (
            isinstance(self.tool_choice, NamedToolChoice)
            and self.tool_choice.function.name not in names
        ):
            raise ValueError(
                f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
            )
        return self

    def image_parts(self) -> list[MediaPart]:
        """Every image and video of the conversation, in order."""
        return [
            part
            for i, message in enumerate(self.messages)
            for part in message.images(f"messages[{i}].content")
        ]

    def template_functions(self) -> list[dict[str, Any]]:
        """The functions the prompt shows, as OpenAI dicts: every tool, with tool_choice 'none'
        too, so that an agent loop's prompts keep one prefix (and hit the radix cache)."""
        return [
            t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools or []
        ]

    def offered_functions(self) -> list[dict[str, Any]]:
        """The functions the model may call (none with tool_choice 'none')."""
        return [] if self.tool_choice == "none" else self.template_functions()

    def forced_functions(self) -> list[dict[str, Any]]:
        """The functions decoding must call, constrained to their schemas: all of them with
        'required', the named one, or none (then the model chooses and output is parsed)."""
        offered = self.offered_functions()
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in offered if f["name"] == self.tool_choice.function.name]
        return offered if self.tool_choice == "required" else []


def chat_request_of(data: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's body converts to (Responses, Anthropic): fields left
    None are left out; one the conversion made badly is a 400 naming it; a stream reports its
    usage at the end."""
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in data.items() if v is not None}
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise RequestError(f"invalid request: {where}: {err.get('msg')}") from exc
    if chat.stream:
        chat.stream_options = StreamOptions(include_usage=True)
    return chat
