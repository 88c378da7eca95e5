"""The api process's side of images: each request part fetched or decoded (`multimodal.media`),
preprocessed off the event loop (`multimodal.processing`), and put into the prompt as its
content-hash tokens (`ImageInput`s for the scheduler). Every failure is a 400 naming the part;
a failed image fails its request alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ..messages import ImageInput
from ..multimodal.media import (
    MediaError,
    MediaPolicy,
    decode_image,
    fetch_bytes,
    is_remote,
    load_image_plugins,
    local_bytes,
)
from ..multimodal.processing import ProcessedImage, expand_images, preprocess
from ..multimodal.spec import VisionSpec
from .http import RequestError
from .tokenizing import lower_this_threads_priority


@dataclass(frozen=True)
class ImagePart:
    url: str
    where: str  # the request part it came from, for errors
    detail: str = "auto"


class ImageInputs:
    def __init__(self, spec: VisionSpec | None, policy: MediaPolicy, limit: int, tokenizer: Any):
        if spec is not None:
            spec = with_tokenizer_ids(spec, tokenizer)
        self.spec, self.policy, self.limit = spec, policy, limit
        self.marker = _marker_text(spec, tokenizer)
        if spec is not None:
            load_image_plugins()
        # at the lowest CPU priority, as long tokenizations: decoding a large image must not
        # take a core from the scheduler's threads or the event loop
        self.pool = ThreadPoolExecutor(
            2, thread_name_prefix="images", initializer=lower_this_threads_priority
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, parts: list[ImagePart]) -> list[ProcessedImage]:
        """Each part's image, preprocessed, in order."""
        if not parts:
            return []
        if self.spec is None:
            raise RequestError(
                f"{parts[0].where}: this model takes no images (image_url, input_image and "
                "image parts need a vision-language model)"
            )
        if len(parts) > self.limit:
            raise RequestError(
                f"{parts[self.limit].where}: at most {self.limit} images a prompt "
                "(--limit-mm-per-prompt)"
            )
        for part in parts:
            if part.detail not in ("auto", "low", "high"):
                raise RequestError(f"{part.where}.detail must be 'auto', 'low' or 'high'")
        try:
            fetched = await asyncio.gather(
                *(fetch_bytes(p.url, self.policy, p.where) for p in parts if is_remote(p.url))
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

    def _process(self, data: bytes | None, part: ImagePart) -> ProcessedImage:
        """On a pool thread: the bytes (unless fetched), the picture, its pixels."""
        if data is None:
            data = local_bytes(part.url, self.policy, part.where)
        image = decode_image(data, self.policy, part.where)
        try:
            return preprocess(image, self.spec)
        except (ValueError, OSError) as exc:
            raise MediaError(f"{part.where}: the image cannot be preprocessed ({exc})") from None

    def attach(
        self, ids: list[int], images: list[ProcessedImage]
    ) -> tuple[list[int], list[ImageInput] | None]:
        """The prompt with its image tokens expanded to each image's hash tokens, and the
        scheduler's view of the images."""
        if not images:
            if self.spec is not None and self.spec.placeholder_id in ids:
                raise RequestError(
                    "the prompt holds an image placeholder but the request has no image"
                )
            return ids, None
        try:
            expanded, offsets = expand_images(ids, images, self.spec)
        except ValueError as exc:
            raise RequestError(f"{exc} (each image needs {self.marker!r} in the prompt)") from None
        return expanded, [
            ImageInput(
                im.digest,
                offset,
                im.tokens,
                list(im.grid),
                im.pixels.tobytes(),
                im.pixels.shape[1],
            )
            for im, offset in zip(images, offsets)
        ]


def with_tokenizer_ids(spec: VisionSpec, tokenizer: Any) -> VisionSpec:
    """The spec with the ids only the tokenizer knows: Gemma 3's two newlines around an image,
    Pixtral's row-break and image-end tokens (ValueError, a start-up error, if it lacks them)."""
    if spec.family == "pixtral" and tokenizer is None:
        raise ValueError(
            "Pixtral's images need the checkpoint's tokenizer ([IMG_BREAK], [IMG_END])"
        )
    if tokenizer is None:
        return spec
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


def _marker_text(spec: VisionSpec | None, tokenizer: Any) -> str | None:
    """The text a chat turn holds for one image (the vision start, image and end tokens)."""
    if spec is None or tokenizer is None:
        return None
    return "".join(tokenizer.convert_ids_to_tokens(spec.marker_ids()))
