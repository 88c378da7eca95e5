"""Request bodies of the HTTP API, as pydantic models in strict mode: wrong types (`"1"` or
`1.0` for an integer, `"yes"` for a boolean) are 400s naming the field, never coerced. OpenAI
fields that radixserve does not implement are refused by name, not dropped."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI request fields with no implementation here: refused when set to anything but these
# values (a client that sends the default loses nothing).
UNSUPPORTED_OPENAI_FIELDS: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "best_of": (None, 1), "suffix": (None, ""), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,), "store": (None, False),
}
TEXT_PART = "text"


def refuse_unsupported(data: Any, fields: dict[str, tuple]) -> Any:
    if isinstance(data, dict):
        for name, allowed in fields.items():
            if name in data and not any(data[name] == value and type(data[name]) is type(value) for value in allowed):
                raise ValueError(f"{name!r} is not supported by radixserve")
    return data


class GenerateRequest(BaseModel):
    """SGLang's native /generate body."""

    model_config = ConfigDict(extra="ignore", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = -1
    top_logprobs_num: int | list[int] | None = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class AbortRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    rid: str


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


class _OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return refuse_unsupported(data, UNSUPPORTED_OPENAI_FIELDS)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
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
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
        }
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": self.min_p, "seed": self.seed, "stop": self.stop,
                    "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                    "repetition_penalty": self.repetition_penalty, "min_new_tokens": self.min_tokens,
                    "stop_token_ids": self.stop_token_ids, "regex": self.regex, "ebnf": self.ebnf,
                    "logit_bias": self.logit_bias}
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.response_format is not None:
            params.update(self.response_format.grammar())
        return params


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_tool_messages(cls, data: Any) -> Any:
        return refuse_unsupported(data, {"tool_calls": (None, []), "tool_call_id": (None,), "function_call": (None,)})

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else []:
            kind = part.get("type")
            if kind != TEXT_PART or not isinstance(part.get("text"), str):
                raise ValueError(f"content parts must be {{'type': 'text', 'text': str}}; "
                                 f"parts of type {kind!r} are not supported")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=0)
