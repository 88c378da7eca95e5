"""Request bodies of the native HTTP routes (/generate, /tokenize, /detokenize, /abort_request)
and what every API's bodies share, as pydantic models in strict mode: wrong types (`"1"` or
`1.0` for an integer, `"yes"` for a boolean) are 400s naming the field, never coerced. Fields
that radixserve does not implement are refused by name, not dropped (`refuse_unsupported`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from ..messages import Bootstrap
from .http import RequestError


def refuse_unsupported(data: Any, fields: dict[str, tuple]) -> Any:
    if isinstance(data, dict):
        for name, allowed in fields.items():
            if name in data and not any(
                data[name] == value and type(data[name]) is type(value) for value in allowed
            ):
                raise ValueError(f"{name!r} is not supported by radixserve")
    return data


class BootstrapFields(BaseModel):
    """SGLang's fields of a disaggregated request, set by `radixserve router --pd-disaggregation`:
    the prefill server's host and bootstrap port, and the room both servers know it by."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    def bootstrap(self) -> Bootstrap | None:
        given = (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)
        if all(v is None for v in given):
            return None
        if any(v is None for v in given):
            raise RequestError("bootstrap_host, bootstrap_port and bootstrap_room go together")
        return Bootstrap(*given)


class GenerateRequest(BootstrapFields):
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
    priority: int | None = None  # with --enable-priority-scheduling: higher runs first
    cache_salt: str | None = None  # requests of different salts never share cached KV
    lora_path: str | list[str | None] | None = None  # a served adapter's name, or one a prompt
    image_data: str | list[str] | None = None  # images (URLs, data URLs, base64) of one prompt
    video_data: str | list[str] | None = None  # its videos, alike


class TokenizeRequest(BaseModel):
    """vLLM's (and SGLang's) /tokenize body."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    model: str | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tokens: list[int]
    model: str | None = None


class AbortRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    rid: str
