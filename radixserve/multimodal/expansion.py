"""A prompt's image and video placeholders expanded to the content-hash tokens of what they
stand for (`processing.ProcessedImage.token_id`), with the text some families put around and
between them, and where each image (or a video's or a tiled image's part) starts."""

from __future__ import annotations

from collections.abc import Callable

from .processing import Media, ProcessedImage, ProcessedTiles, ProcessedVideo
from .spec import SECONDS, VisionSpec

# Idefics3's text around each tile and the whole image (its processor's)
FAKE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<global-img>"


def expand_media(
    ids: list[int], media: list[Media], spec: VisionSpec, words: Callable[[str], list[int]]
) -> tuple[list[int], list[tuple[ProcessedImage, int]]]:
    """The prompt with each image placeholder replaced by `spec.before`, the image's tokens and
    `spec.after` (Idefics3: its tiles' prompt, `tiles_tokens`), each video placeholder by its
    parts' tokens (Qwen3-VL: each part after the tokens of its time, `words(text)`, between its
    own start and end tokens); and where each image or part starts. ValueError when the prompt
    holds another number of placeholders."""
    images = [m for m in media if not isinstance(m, ProcessedVideo)]
    videos = [m for m in media if isinstance(m, ProcessedVideo)]
    video_id = spec.video.token_id if spec.video is not None else None
    for kind, items, token in (("image", images, spec.placeholder_id), ("video", videos, video_id)):
        found = sum(t == token for t in ids) if token is not None else 0
        if found != len(items):
            raise ValueError(f"the prompt has {found} {kind} placeholders for {len(items)} {kind}s")
    out: list[int] = []
    placed: list[tuple[ProcessedImage, int]] = []
    next_image, next_video, skip = iter(images), iter(videos), -1
    for i, t in enumerate(ids):
        if i == skip:
            continue
        if t == spec.placeholder_id:
            image = next(next_image)
            if isinstance(image, ProcessedTiles):
                out += tiles_tokens(image, spec, words, len(out), placed)
                continue
            out += spec.before
            placed.append((image, len(out)))
            out += image_span(image, spec) + list(spec.after)
        elif t == video_id and spec.video.timestamps:
            after = ids[i + 1 : i + 2] == [spec.end_token_id]
            if spec.video.timestamps == SECONDS and out[-1:] == [spec.start_token_id] and after:
                out.pop()  # the chat's start and end around the video: each part has its own
                skip = i + 1
            video = next(next_video)
            for k, (part, seconds) in enumerate(zip(video.parts, video.timestamps)):
                out += words(part_time(k, seconds, spec.video.timestamps))
                out.append(spec.start_token_id)
                placed.append((part, len(out)))
                out += [part.token_id] * part.tokens + [spec.end_token_id]
        elif t == video_id:
            (part,) = next(next_video).parts
            placed.append((part, len(out)))
            out += [part.token_id] * part.tokens
        else:
            out.append(t)
    return out, placed


def part_time(index: int, seconds: float, style: str) -> str:
    """The text before a video's part: Qwen3-VL's `<1.5 seconds>`; Gemma 4's `00:01 ` (minutes
    and seconds, after a space from the frame before)."""
    if style == SECONDS:
        return f"<{seconds:.1f} seconds>"
    clock = f"{int(seconds // 60):02d}:{int(seconds % 60):02d} "
    return clock if index == 0 else " " + clock


def image_span(image: ProcessedImage, spec: VisionSpec) -> list[int]:
    """The prompt tokens an image becomes: its hash token `image.tokens` times, or (Pixtral)
    rows of them each ended by the row-break token, the last row by the image-end token."""
    if spec.row_break_id is None:
        return [image.token_id] * image.tokens
    columns = image.grid[2] // spec.merge_size
    rows = image.tokens // (columns + 1)
    span = ([image.token_id] * columns + [spec.row_break_id]) * rows
    return span[:-1] + [spec.image_end_id]


def tiles_text(tiles: ProcessedTiles, image_text: str, per_tile: int) -> str:
    """Idefics3's prompt for an image, as its processor writes it: each tile after
    `<fake_token_around_image><row_r_col_c>`, a newline after each row, then (a newline on)
    the whole image between `<fake_token_around_image><global-img>` and
    `<fake_token_around_image>`."""
    tile = image_text * per_tile
    text = ""
    for row in range(tiles.rows):
        for column in range(tiles.columns):
            text += f"{FAKE_TOKEN}<row_{row + 1}_col_{column + 1}>{tile}"
        text += "\n"
    if tiles.rows:
        text += "\n"
    return text + FAKE_TOKEN + GLOBAL_TOKEN + tile + FAKE_TOKEN


def tiles_tokens(
    tiles: ProcessedTiles,
    spec: VisionSpec,
    words: Callable[[str], list[int]],
    at: int,
    placed: list[tuple[ProcessedImage, int]],
) -> list[int]:
    """The tokens of `tiles_text` (tokenized whole, as HF's processor does, so the text
    between tiles takes the tokens it takes there), each tile's image tokens its hash tokens;
    each part's start (from `at`, where the span begins) appended to `placed`."""
    ids = words(tiles_text(tiles, spec.image_text, spec.tokens_per_image))
    out: list[int] = []
    parts, i = iter(tiles.parts), 0
    while i < len(ids):
        if ids[i] != spec.image_token_id:
            out.append(ids[i])
            i += 1
            continue
        part = next(parts)
        placed.append((part, at + len(out)))
        out += [part.token_id] * part.tokens
        i += part.tokens
    return out
