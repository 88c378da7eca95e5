"""A served model's images and videos, whoever asks (the api process's `server.images`, the
offline `Engine`): each part's bytes decoded and preprocessed (or found in the processor cache
by the hash of its bytes), and a prompt's markers expanded to their content-hash tokens with the
scheduler's `ImageInput`s. Every refusal is a `MediaError` naming the part."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from ..messages import ImageInput
from .cache import BoundedCache
from .expansion import FAKE_TOKEN, GLOBAL_TOKEN, expand_media
from .media import MediaError, MediaPolicy, decode_image, load_image_plugins
from .processing import Media, preprocess
from .spec import VisionSpec
from .video import decode_video, preprocess_video

KINDS = {"image": "image_url, input_image and image parts", "video": "video_url parts"}


def data_fields(image_data: Any, video_data: Any) -> list[tuple[str, str, Any]]:
    """/generate's (and the offline Engine's) `image_data` and `video_data`, each one item or
    a list: (kind, the field it came from, the item) for each, images first."""
    out = []
    for kind, value in (("image", image_data), ("video", video_data)):
        items = value if isinstance(value, list) else [] if value is None else [value]
        out += [(kind, f"{kind}_data[{i}]", item) for i, item in enumerate(items)]
    return out


@dataclass(frozen=True)
class MediaPart:
    url: str
    where: str  # the request part it came from, for errors
    detail: str = "auto"
    kind: str = "image"  # or "video"


class MediaInputs:
    def __init__(
        self,
        spec: VisionSpec | None,
        policy: MediaPolicy,
        limits: dict[str, int],
        tokenizer: Any,
        max_tokens: int = 0,
        cache_bytes: int = 0,
    ):
        """`limits`: each kind's count a prompt may carry (none for a kind left out);
        `max_tokens`: the context length, the most tokens a video may become; `cache_bytes`: the
        preprocessed images and videos kept by the hash of their bytes (a chat that sends its
        picture or video again each turn skips decoding and preprocessing it)."""
        if spec is not None:
            spec = with_tokenizer_ids(spec, tokenizer)
            load_image_plugins()
        self.spec, self.policy, self.limits, self.tokenizer = spec, policy, limits, tokenizer
        self.max_tokens = max_tokens
        self.processed: BoundedCache[tuple[str, bytes], Media] = BoundedCache(cache_bytes)
        # the text a chat turn holds for each kind of content part
        self.markers = _marker_texts(spec, tokenizer)

    def check(self, parts: list[MediaPart]) -> None:
        """The parts' kinds, counts and details, before any is fetched or decoded."""
        for kind, named in KINDS.items():
            mine = [p for p in parts if p.kind == kind]
            takes = self.spec is not None and (kind == "image" or self.spec.video is not None)
            if mine and not takes:
                raise MediaError(f"{mine[0].where}: this model takes no {kind}s ({named})")
            limit = self.limits.get(kind)
            if limit is not None and len(mine) > limit:
                raise MediaError(
                    f"{mine[limit].where}: at most {limit} {kind}s a prompt (--limit-mm-per-prompt)"
                )
        for part in parts:
            if part.detail not in ("auto", "low", "high"):
                raise MediaError(f"{part.where}.detail must be 'auto', 'low' or 'high'")

    def process(self, data: bytes, part: MediaPart) -> Media:
        """The part's picture or frames, their pixels (or what the same bytes gave before)."""
        key = (part.kind, hashlib.sha256(data).digest())
        found = self.processed.get(key)
        if found is None:
            found = self._preprocess(data, part)
            self.processed.put(key, found)
        return found

    def _preprocess(self, data: bytes, part: MediaPart) -> Media:
        try:
            if part.kind == "video":
                video = decode_video(data, self.policy, self.spec, part.where, self.max_tokens)
                return preprocess_video(video, self.spec)
            return preprocess(decode_image(data, self.policy, part.where), self.spec)
        except MediaError:
            raise
        except (ValueError, OSError) as exc:
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
                raise MediaError(
                    "the prompt holds an image placeholder but the request has no image"
                )
            if spec is not None and spec.video is not None and spec.video.token_id in ids:
                raise MediaError(
                    "the prompt holds a video placeholder but the request has no video"
                )
            return ids, None
        try:
            expanded, placed = expand_media(ids, media, self.spec, self._words)
        except ValueError as exc:
            shown = " and ".join(f"each {k} needs {m!r}" for k, m in self.markers.items())
            raise MediaError(f"{exc} ({shown} in the prompt)") from None
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


# the tokens a family's images need of the tokenizer: Pixtral's row break and image end,
# InternVL's start and end around an image, Idefics3's around each tile and the whole image
TOKENIZER_MARKERS = {
    "pixtral": ("[IMG_BREAK]", "[IMG_END]"),
    "internvl": ("<img>", "</img>"),
    "idefics3": (FAKE_TOKEN, GLOBAL_TOKEN),
}


def with_tokenizer_ids(spec: VisionSpec, tokenizer: Any) -> VisionSpec:
    """The spec with the ids only the tokenizer knows: Gemma 3's two newlines around an image,
    `TOKENIZER_MARKERS` (ValueError, a start-up error, if it lacks them)."""
    if spec.family in TOKENIZER_MARKERS and tokenizer is None:
        names = " and ".join(TOKENIZER_MARKERS[spec.family])
        raise ValueError(f"{spec.family}'s images need the checkpoint's tokenizer ({names})")
    if tokenizer is None:
        return replace(spec, video=None)  # Qwen3-VL's frame times are words
    if spec.family == "gemma3":
        newlines = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
        return replace(spec, before=newlines + spec.before, after=spec.after + newlines)
    if spec.family not in TOKENIZER_MARKERS:
        return spec
    names = TOKENIZER_MARKERS[spec.family]
    ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"the tokenizer has no {names[0]} and {names[1]} tokens for images")
    if spec.family == "internvl":
        return replace(spec, before=(ids[0],), after=(ids[1],))
    if spec.family == "idefics3":
        text = tokenizer.convert_ids_to_tokens(spec.image_token_id)
        if tokenizer.encode(text, add_special_tokens=False) != [spec.image_token_id]:
            raise ValueError(f"the tokenizer has no token of its own for image_token_id {text!r}")
        return replace(spec, image_text=text)
    return replace(spec, row_break_id=ids[0], image_end_id=ids[1])


def _marker_texts(spec: VisionSpec | None, tokenizer: Any) -> dict[str, str]:
    """The text a chat turn holds for one image (the vision start, image and end tokens) and,
    where the model takes videos, for one video; by content part type."""
    if spec is None or tokenizer is None:
        return {}
    out = {"image_url": "".join(tokenizer.convert_ids_to_tokens(spec.marker_ids()))}
    if spec.video is not None:
        out["video_url"] = "".join(tokenizer.convert_ids_to_tokens(spec.video_marker_ids()))
    return out
