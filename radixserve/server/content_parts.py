"""A chat message's content parts, as every chat-shaped API hands them on: `text` parts,
`image_url` parts (`{"url": ..., "detail": ...}`; the Responses and Anthropic adapters turn
their image parts into these, with `where` naming the part of their own body) and `video_url`
parts (`{"url": ...}`, OpenAI chat only, as vLLM and SGLang take them)."""

from __future__ import annotations

from typing import Any

from ..multimodal.inputs import MediaPart

TEXT_PART = "text"
IMAGE_PART = "image_url"
VIDEO_PART = "video_url"
MEDIA_KINDS = {IMAGE_PART: "image", VIDEO_PART: "video"}


def check_parts(content: list[Any]) -> None:
    """ValueError naming the first part that is neither text nor an image or video URL."""
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == TEXT_PART and isinstance(part.get("text"), str):
            continue
        if kind in MEDIA_KINDS and _url_of(part) is not None:
            continue
        raise ValueError(
            f"content[{j}]: parts must be {{'type': 'text', 'text': str}}, {{'type': "
            f"'image_url', 'image_url': {{'url': str}}}} or {{'type': 'video_url', "
            f"'video_url': {{'url': str}}}}; parts of type {kind!r} are not supported"
        )


def parts_text(content: list[dict[str, Any]], markers: dict[str, str]) -> str:
    """The text of the parts, each image or video as the model's marker for it."""
    return "".join(
        part["text"] if part["type"] == TEXT_PART else markers.get(part["type"], "")
        for part in content
    )


def image_parts(content: list[dict[str, Any]], where: str) -> list[MediaPart]:
    """The image and video parts, in order."""
    out = []
    for j, part in enumerate(content):
        kind = part["type"]
        if kind in MEDIA_KINDS:
            value = part[kind]
            detail = value.get("detail", "auto") if isinstance(value, dict) else "auto"
            at = part.get("where") or f"{where}[{j}]"
            out.append(MediaPart(_url_of(part), at, detail, MEDIA_KINDS[kind]))
    return out


def image_url_part(url: Any, where: str, detail: Any = "auto") -> dict[str, Any]:
    """An image part of another API, in the chat form."""
    if not isinstance(url, str):
        raise ValueError(f"{where}: an image needs a string URL")
    return {"type": IMAGE_PART, IMAGE_PART: {"url": url, "detail": detail}, "where": where}


def _url_of(part: dict) -> str | None:
    value = part.get(part.get("type"))
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) else None
