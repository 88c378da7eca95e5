"""Routing keys: the part of a request body that predicts which cached prefix it will hit."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from pydantic import ValidationError

from ..multimodal.inputs import data_fields
from ..server.openai_protocol import ChatCompletionRequest
from ..tokenizer import apply_chat_template, encode_prompt

MAX_CODE_POINT = 0x10FFFF


def ids_key(ids: list[Any]) -> str:
    """Token ids as a string, one character per token, so ids share the text tree's code."""
    if not all(isinstance(i, int) and 0 <= i <= MAX_CODE_POINT for i in ids):
        return ""
    return "".join(map(chr, ids))


def _first(value: Any) -> Any:
    """The first prompt of a batch (a batch goes to one worker, so its first prompt decides)."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return value[0]
    return value


def _prompt_key(value: Any, images: Any = None) -> str:
    """A prompt's key; /generate's `image_data` and `video_data` follow it as hashes."""
    if images is not None:
        urls = [images] if isinstance(images, str) else images
        tail = "".join(_part_key({"image_url": u}) for u in urls if isinstance(u, str))
        return _prompt_key(value) + tail
    value = _first(value)
    if isinstance(value, str):
        return value
    return ids_key(value) if isinstance(value, list) else ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_key(p) for p in content if isinstance(p, dict))
    return ""


def _part_key(part: dict) -> str:
    """A text part's text; an image part (chat `image_url`, Responses `input_image`, Anthropic
    `image`) as a short hash of its URL or data, never the data itself."""
    if isinstance(part.get("text"), str):
        return part["text"]
    image = part.get("image_url") or part.get("video_url") or part.get("source")
    if isinstance(image, dict):
        image = image.get("url") or image.get("data")
    if not isinstance(image, str):
        return ""
    return f"{IMAGE_MARK}{hashlib.sha256(image.encode()).hexdigest()[:16]}{IMAGE_MARK}"


def _has_images(data: dict) -> bool:
    if data.get("image_data") is not None or data.get("video_data") is not None:
        return True
    messages = data.get("messages")
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") != "text" for p in m["content"])
        for m in (messages if isinstance(messages, list) else [])
    )


def _chat_key(body: dict) -> str:
    """Tools first (templates render them into the system prompt), then each message."""
    parts = [orjson.dumps(body["tools"]).decode()] if body.get("tools") else []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict):
            parts.append(f"<{message.get('role')}>{_content_text(message.get('content'))}")
    return "".join(parts)


IMAGE_MARK = "\x00image\x00"  # around an image's hash in a key
SALT_MARK = "\x00salt\x00"  # a salted key starts here: it never shares a prefix with others
LORA_MARK = "\x00lora\x00"  # as does the key of a request on a LoRA adapter
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


def routing_key(path: str, body: bytes) -> str:
    """The key the cache-aware policy matches; empty when the body has none (malformed
    bodies are forwarded anyway: the worker names what is wrong with them). A `cache_salt`
    leads the key, as it leads the worker's radix tree, and so does the adapter: `lora_path` on
    /generate, the `model` field on OpenAI's and Anthropic's routes (where an adapter is named)."""
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return ""
    if not isinstance(data, dict):
        return ""
    key = _unsalted_key(path, data)
    if not key:
        return key
    adapter = _adapter(path, data)
    if adapter is not None:
        key = f"{LORA_MARK}{adapter}{LORA_MARK}{key}"
    salt = data.get("cache_salt")
    return f"{SALT_MARK}{salt}{SALT_MARK}{key}" if isinstance(salt, str) else key


def _adapter(path: str, data: dict) -> str | None:
    if path == "/generate":
        named = data.get("lora_path")
        named = named[0] if isinstance(named, list) and named else named
        return named if isinstance(named, str) else None
    model = data.get("model")
    return model if path in OPENAI_PATHS and isinstance(model, str) else None


def _unsalted_key(path: str, data: dict) -> str:
    if path == "/generate":
        prompt = data["text"] if data.get("text") is not None else data.get("input_ids")
        media = [url for _, _, url in data_fields(data.get("image_data"), data.get("video_data"))]
        return _prompt_key(prompt, media or None)
    if path == "/v1/completions":
        return _prompt_key(data.get("prompt"))
    if path == "/v1/chat/completions":
        return _chat_key(data)
    if path == "/v1/messages":
        return _content_text(data.get("system")) + _chat_key(data)
    if path == "/v1/responses":
        given = data.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given
        return str(data.get("instructions") or "") + _chat_key({**data, "messages": items})
    if path in ("/v1/embeddings", "/v1/rerank", "/v1/score"):
        return _prompt_key(data.get("input", data.get("query", data.get("text_1"))))
    return ""


def token_key(
    path: str, body: bytes, tokenizer: Any, adapters: frozenset[str] | set[str] = frozenset()
) -> str:
    """The prompt's token ids as the worker will compute them (`ids_key`), for the KV-event
    index; chat requests are rendered through the same request model and template code as
    the worker's. Empty when the body is not a valid request (or a route this does not
    render: those are keyed by `routing_key`, and so are requests on one of the workers'
    LoRA `adapters`, named by `lora_path` or by `model`)."""
    if path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
        return routing_key(path, body)
    try:
        data = orjson.loads(body) if body else None
        if (
            not isinstance(data, dict)
            or any(
                isinstance(data.get(field), (str, list)) for field in ("cache_salt", "lora_path")
            )
            or (path != "/generate" and data.get("model") in adapters)
            or _has_images(data)
        ):  # a salted prefix, or an adapter's, matches no base model's KV event; an image's
            # tokens are its content hash, known once the worker has its pixels
            return routing_key(path, body)
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(data)
            text = apply_chat_template(
                tokenizer,
                [m.template_dict() for m in chat.messages],
                tools=chat.template_functions() or None,
                **chat.template_options(),
            )
            return ids_key(encode_prompt(tokenizer, text))
        prompt = _first(
            data.get("prompt")
            if path == "/v1/completions"
            else (data["text"] if data.get("text") is not None else data.get("input_ids"))
        )
        return ids_key(
            encode_prompt(tokenizer, prompt) if isinstance(prompt, str) else prompt or []
        )
    except (orjson.JSONDecodeError, ValidationError, ValueError, TypeError):
        return ""
    except Exception:  # noqa: BLE001 - a template that fails on this input: the worker names the error
        return ""
