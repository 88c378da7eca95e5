"""An image's (or a video's) bytes from a `data:` URL, an allowed http(s) host or an allowed
local folder, and the decoded picture, with every refusal a `MediaError` naming the request
part."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote_to_bytes, urlsplit

import aiohttp
from PIL import Image
from yarl import URL

MODES = ("RGB", "RGBA", "L", "LA", "P", "1")  # 8-bit colour, grey or palette
MIN_SIDE = 4  # pixels; a thinner image carries nothing a vision tower can read
MAX_ASPECT = 200  # the longer side over the shorter (Qwen-VL's own limit)
MAX_REDIRECTS = 3


def load_image_plugins() -> None:
    """Import Pillow's format plugins now (at start-up), not in the first request's thread,
    where the imports would hold the interpreter for ~0.5 s."""
    Image.init()


class MediaError(ValueError):
    """A request's image that cannot be used; the message names the part (a 400)."""


@dataclass(frozen=True)
class MediaPolicy:
    """What the operator allows: http(s) hosts (none by default), one local folder (none by
    default), the largest download or data URL, the fetch time and the largest image."""

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_bytes: int = 20 << 20
    fetch_timeout_s: float = 10.0
    max_pixels: int = 40_000_000  # an image's, or a video frame's
    max_video_frames: int = 7200


MEDIA_LIMITS = {"image": 8, "video": 1}  # each kind's count a prompt may carry, unless set


def media_limits(limit_mm_per_prompt: str) -> dict[str, int]:
    """The images and videos a prompt may carry, from `--limit-mm-per-prompt '{"image": N,
    "video": M}'` (a kind left out keeps its default)."""
    try:
        limits = json.loads(limit_mm_per_prompt)
    except json.JSONDecodeError:
        limits = None
    if not isinstance(limits, dict):
        raise ValueError(
            'limit_mm_per_prompt must be a JSON object like \'{"image": 8, "video": 1}\''
        )
    for kind, count in limits.items():
        if kind not in MEDIA_LIMITS or not isinstance(count, int) or count < 0:
            raise ValueError(
                "limit_mm_per_prompt takes the keys 'image' and 'video', each a count >= 0; "
                f"got {kind!r}: {count!r}"
            )
    return {**MEDIA_LIMITS, **limits}


def is_remote(url: str) -> bool:
    """An http(s) URL: fetched on the event loop; anything else is read by `local_bytes`."""
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


def local_bytes(url: str, policy: MediaPolicy, where: str, kind: str = "image") -> bytes:
    """The encoded image (or video) of a data URL (or bare base64) or an allowed file: URL."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"{where}: an {kind} URL must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url[:12] else ""
    if scheme == "data":
        return _data_url(url, policy, where, kind)
    if scheme == "file":
        return _local_file(url, policy, where, kind)
    if scheme == "":
        return _base64(url, policy, where, kind)
    raise MediaError(f"{where}: URL scheme {scheme!r} is not allowed (data, http, https, file)")


def decode_image(data: bytes, policy: MediaPolicy, where: str) -> Image.Image:
    """The picture, RGB, checked before its pixels are decoded: a size within `max_pixels`,
    sides of at least MIN_SIDE, an aspect ratio within MAX_ASPECT, one frame, 8-bit colour."""
    try:
        image = Image.open(io.BytesIO(data))
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"{where}: not an image Pillow can read ({brief(exc)})") from None
    check_size(*image.size, policy, where, "image")
    if getattr(image, "n_frames", 1) > 1:
        raise MediaError(f"{where}: animated images are not accepted; send one frame")
    if image.mode not in MODES:
        raise MediaError(
            f"{where}: images of mode {image.mode!r} are not accepted; send 8-bit RGB, RGBA or grey"
        )
    try:
        image.load()
        return _on_white(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise MediaError(
            f"{where}: the image data is truncated or corrupt ({brief(exc)})"
        ) from None


def check_size(width: int, height: int, policy: MediaPolicy, where: str, kind: str) -> None:
    """An image's (or a video frame's) size, from its header: within `max_pixels`, sides of at
    least MIN_SIDE, an aspect ratio within MAX_ASPECT."""
    if width * height > policy.max_pixels:
        raise MediaError(
            f"{where}: the {kind} is {width}x{height} pixels; at most {policy.max_pixels} are "
            "accepted"
        )
    if min(width, height) < MIN_SIDE:
        raise MediaError(f"{where}: the {kind} is {width}x{height}; each side needs {MIN_SIDE}+")
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise MediaError(
            f"{where}: the {kind} is {width}x{height}; its aspect ratio must be within "
            f"{MAX_ASPECT}:1"
        )


def _on_white(image: Image.Image) -> Image.Image:
    """RGB, transparent parts over white (as HF's `convert_to_rgb` does)."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def _data_url(url: str, policy: MediaPolicy, where: str, kind: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep:
        raise MediaError(f"{where}: a data URL needs a ',' before its data")
    if not head.lower().startswith(f"data:{kind}/"):
        raise MediaError(f"{where}: a data URL must have an {kind}/* media type")
    if head.lower().endswith(";base64"):
        return _base64(body, policy, where, kind)
    return _limited(unquote_to_bytes(body), policy, where, kind)


def _base64(text: str, policy: MediaPolicy, where: str, kind: str) -> bytes:
    if len(text) > policy.max_bytes * 4 // 3 + 4:
        raise MediaError(f"{where}: the {kind} is over {policy.max_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{where}: the {kind} data is not valid base64") from None


def _local_file(url: str, policy: MediaPolicy, where: str, kind: str) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError(f"{where}: file URLs need --allowed-local-media-path")
    root = Path(policy.allowed_local_path).resolve()
    path = Path(unquote_to_bytes(urlsplit(url).path).decode("utf-8", "replace")).resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"{where}: the file is outside --allowed-local-media-path")
    if not path.is_file():
        raise MediaError(f"{where}: no such file under --allowed-local-media-path")
    if path.stat().st_size > policy.max_bytes:
        raise MediaError(f"{where}: the {kind} is over {policy.max_bytes} bytes")
    return path.read_bytes()


async def fetch_bytes(url: str, policy: MediaPolicy, where: str, kind: str = "image") -> bytes:
    """GET an allowed URL; redirects are followed only to allowed hosts, at most MAX_REDIRECTS."""
    timeout = aiohttp.ClientTimeout(total=policy.fetch_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for _ in range(MAX_REDIRECTS + 1):
                await _check_host(url, policy, where)
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                        url = str(resp.url.join(URL(resp.headers["Location"])))
                        continue
                    if resp.status != 200:
                        raise MediaError(f"{where}: fetching the {kind} gave HTTP {resp.status}")
                    return await _read_limited(resp, policy, where, kind)
    except MediaError:
        raise
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise MediaError(f"{where}: the {kind} could not be fetched ({brief(exc)})") from None
    raise MediaError(f"{where}: more than {MAX_REDIRECTS} redirects")


async def _read_limited(resp, policy: MediaPolicy, where: str, kind: str) -> bytes:
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > policy.max_bytes:
            raise MediaError(f"{where}: the {kind} is over {policy.max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _check_host(url: str, policy: MediaPolicy, where: str) -> None:
    """The host must be allowed by name; a name (not an address the operator listed) must not
    resolve to a private, loopback or link-local address."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise MediaError(f"{where}: a redirect to scheme {parts.scheme!r} is not followed")
    host = (parts.hostname or "").lower()
    if not any(host == d or host.endswith("." + d) for d in policy.allowed_domains):
        raise MediaError(f"{where}: the host {host!r} is not in --allowed-media-domains")
    if host in policy.allowed_domains and _is_address(host):
        return
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 443)
        addresses = {info[4][0] for info in found}
    except OSError:
        raise MediaError(f"{where}: the host {host!r} does not resolve") from None
    if any(not ipaddress.ip_address(a.split("%")[0]).is_global for a in addresses):
        raise MediaError(f"{where}: the host {host!r} resolves to a private address")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _limited(data: bytes, policy: MediaPolicy, where: str, kind: str) -> bytes:
    if len(data) > policy.max_bytes:
        raise MediaError(f"{where}: the {kind} is over {policy.max_bytes} bytes")
    return data


def brief(exc: BaseException) -> str:
    """An exception's message, at most 200 characters, for an error naming a request part."""
    return (str(exc) or type(exc).__name__)[:200]
