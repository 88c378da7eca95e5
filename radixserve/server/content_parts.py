"""A chat message's content parts, as every chat-shaped API hands them on: `text` parts and
`image_url` parts (`{"url": ..., "detail": ...}`; the Responses and Anthropic adapters turn
their image parts into these, with `where` naming the part of their own body)."""

from __future__ import annotations

from typing import Any

from .images import ImagePart

TEXT_PART = "text"
IMAGE_PART = "image_url"


def check_parts(content: list[Any]) -> None:
    """ValueError naming the first part that is neither text nor an image URL."""
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == TEXT_PART and isinstance(part.get("text"), str):
            continue
        if kind == IMAGE_PART and _url_of(part) is not None:
            continue
        raise ValueError(
            f"content[{j}]: parts must be {{'type': 'text', 'text': str}} or {{'type': "
            f"'image_url', 'image_url': {{'url': str}}}}; parts of type {kind!r} are not "
            "supported"
        )


def parts_text(content: list[dict[str, Any]], image_marker: str | None) -> str:
    """The text of the parts, each image as the model's image marker."""
    return "".join(
        part["text"] if part["type"] == TEXT_PART else (image_marker or "") for part in content
    )


def image_parts(content: list[dict[str, Any]], where: str) -> list[ImagePart]:
    out = []
    for j, part in enumerate(content):
        if part["type"] == IMAGE_PART:
            detail = (
                part[IMAGE_PART].get("detail", "auto")
                if isinstance(part[IMAGE_PART], dict)
                else "auto"
            )
            out.append(ImagePart(_url_of(part), part.get("where") or f"{where}[{j}]", detail))
    return out


def image_url_part(url: Any, where: str, detail: Any = "auto") -> dict[str, Any]:
    """An image part of another API, in the chat form."""
    if not isinstance(url, str):
        raise ValueError(f"{where}: an image needs a string URL")
    return {"type": IMAGE_PART, IMAGE_PART: {"url": url, "detail": detail}, "where": where}


def _url_of(part: dict) -> str | None:
    value = part.get(IMAGE_PART)
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) else None
