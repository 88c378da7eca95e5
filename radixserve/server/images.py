"""The api process's side of images and videos: each request part fetched or decoded
(`multimodal.media`, `multimodal.video`), preprocessed off the event loop
(`multimodal.processing`), and put into the prompt as its content-hash tokens (`ImageInput`s
for the scheduler: an image, a whole video, or a video's frame pair). Every failure is a 400
naming the part; a failed image or video fails its request alone."""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ..messages import ImageInput
from ..multimodal.cache import BoundedCache
from ..multimodal.media import (
    MediaError,
    MediaPolicy,
    decode_image,
    fetch_bytes,
    is_remote,
    load_image_plugins,
    local_bytes,
)
from ..multimodal.processing import Media, expand_media, preprocess
from ..multimodal.spec import VisionSpec
from ..multimodal.video import decode_video, preprocess_video
from .http import RequestError
from .tokenizing import lower_this_threads_priority

KINDS = {"image": "image_url, input_image and image parts", "video": "video_url parts"}


@dataclass(frozen=True)
class ImagePart:
    url: str
    where: str  # the request part it came from, for errors
    detail: str = "auto"
    kind: str = "image"  # or "video"


class ImageInputs:
    def __init__(
        self,
        spec: VisionSpec | None,
        policy: MediaPolicy,
        limits: dict[str, int],
        tokenizer: Any,
        max_tokens: int = 0,
        cache_bytes: int = 0,
    ):
        """`max_tokens`: the context length, the most tokens a video may become; `cache_bytes`:
        the preprocessed images and videos kept by the hash of their bytes (a chat that sends
        its picture or video again each turn skips decoding and preprocessing it)."""
        if spec is not None:
            spec = with_tokenizer_ids(spec, tokenizer)
        self.spec, self.policy, self.limits, self.tokenizer = spec, policy, limits, tokenizer
        self.max_tokens = max_tokens
        self.processed: BoundedCache[tuple[str, bytes], Media] = BoundedCache(cache_bytes)
        # the text a chat turn holds for each kind of content part
        self.markers = _marker_texts(spec, tokenizer)
        if spec is not None:
            load_image_plugins()
        # at the lowest CPU priority, as long tokenizations: decoding a large image must not
        # take a core from the scheduler's threads or the event loop
        self.pool = ThreadPoolExecutor(
            2, thread_name_prefix="images", initializer=lower_this_threads_priority
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, parts: list[ImagePart]) -> list[Media]:
        """Each part's image or video, preprocessed, in order."""
        if not parts:
            return []
        self._check(parts)
        try:
            fetched = await asyncio.gather(
                *(
                    fetch_bytes(p.url, self.policy, p.where, p.kind)
                    for p in parts
                    if is_remote(p.url)
                )
            )
            remote = iter(fetched)
            loop = asyncio.get_running_loop()
            return list(
                await asyncio.gather(
                    *(
                        loop.run_in_executor(
                            self.pool, self._process, next(remote) if is_remote(p.url) else None, p
                        )
                        for p in parts
                    )
                )
            )
        except MediaError as exc:
            raise RequestError(str(exc)) from None

    def _check(self, parts: list[ImagePart]) -> None:
        for kind, named in KINDS.items():
            mine = [p for p in parts if p.kind == kind]
            takes = self.spec is not None and (kind == "image" or self.spec.video is not None)
            if mine and not takes:
                raise RequestError(f"{mine[0].where}: this model takes no {kind}s ({named})")
            limit = self.limits.get(kind, 0)
            if len(mine) > limit:
                raise RequestError(
                    f"{mine[limit].where}: at most {limit} {kind}s a prompt (--limit-mm-per-prompt)"
                )
        for part in parts:
            if part.detail not in ("auto", "low", "high"):
                raise RequestError(f"{part.where}.detail must be 'auto', 'low' or 'high'")

    def _process(self, data: bytes | None, part: ImagePart) -> Media:
        """On a pool thread: the bytes (unless fetched), the picture or frames, their pixels
        (or what the same bytes gave before)."""
        if data is None:
            data = local_bytes(part.url, self.policy, part.where, part.kind)
        key = (part.kind, hashlib.sha256(data).digest())
        found = self.processed.get(key)
        if found is None:
            found = self._preprocess(data, part)
            self.processed.put(key, found)
        return found

    def _preprocess(self, data: bytes, part: ImagePart) -> Media:
        try:
            if part.kind == "video":
                video = decode_video(data, self.policy, self.spec, part.where, self.max_tokens)
                return preprocess_video(video, self.spec)
            return preprocess(decode_image(data, self.policy, part.where), self.spec)
        except (ValueError, OSError) as exc:
            if isinstance(exc, MediaError):
                raise
            raise MediaError(
                f"{part.where}: the {part.kind} cannot be preprocessed ({exc})"
            ) from None

    def attach(
        self, ids: list[int], media: list[Media]
    ) -> tuple[list[int], list[ImageInput] | None]:
        """The prompt with its image and video tokens expanded to each one's hash tokens, and
        the scheduler's view of them."""
        if not media:
            spec = self.spec
            if spec is not None and spec.placeholder_id in ids:
                raise RequestError(
                    "the prompt holds an image placeholder but the request has no image"
                )
            if spec is not None and spec.video is not None and spec.video.token_id in ids:
                raise RequestError(
                    "the prompt holds a video placeholder but the request has no video"
                )
            return ids, None
        try:
            expanded, placed = expand_media(ids, media, self.spec, self._words)
        except ValueError as exc:
            shown = " and ".join(f"each {k} needs {m!r}" for k, m in self.markers.items())
            raise RequestError(f"{exc} ({shown} in the prompt)") from None
        return expanded, [
            ImageInput(
                im.digest,
                offset,
                im.tokens,
                list(im.grid),
                im.pixels.tobytes(),
                im.pixels.shape[1],
                im.time_interval,
            )
            for im, offset in placed
        ]

    def _words(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def with_tokenizer_ids(spec: VisionSpec, tokenizer: Any) -> VisionSpec:
    """The spec with the ids only the tokenizer knows: Gemma 3's two newlines around an image,
    Pixtral's row-break and image-end tokens (ValueError, a start-up error, if it lacks them)."""
    if spec.family == "pixtral" and tokenizer is None:
        raise ValueError(
            "Pixtral's images need the checkpoint's tokenizer ([IMG_BREAK], [IMG_END])"
        )
    if tokenizer is None:
        return replace(spec, video=None)  # Qwen3-VL's frame times are words
    if spec.family == "gemma3":
        newlines = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
        return replace(spec, before=newlines + spec.before, after=spec.after + newlines)
    if spec.family == "pixtral":
        names = ("[IMG_BREAK]", "[IMG_END]")
        ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ValueError(f"the tokenizer has no {names[0]} and {names[1]} tokens for images")
        return replace(spec, row_break_id=ids[0], image_end_id=ids[1])
    return spec


def _marker_texts(spec: VisionSpec | None, tokenizer: Any) -> dict[str, str]:
    """The text a chat turn holds for one image (the vision start, image and end tokens) and,
    where the model takes videos, for one video; by content part type."""
    if spec is None or tokenizer is None:
        return {}
    out = {"image_url": "".join(tokenizer.convert_ids_to_tokens(spec.marker_ids()))}
    if spec.video is not None:
        out["video_url"] = "".join(tokenizer.convert_ids_to_tokens(spec.video_marker_ids()))
    return out
