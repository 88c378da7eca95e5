"""An image as the vision tower takes it, and the ids that name it in a prompt.

Each family's preprocessing is its HF image processor's (PIL backend) step by step: the size it
picks (`LAYOUTS`: Qwen-VL's and GLM-4.xV's sides rounded to multiples of patch x merge within
the pixel budget, Gemma 3's square, Gemma 4's token budget, Pixtral's longest edge), a PIL
resize, x 1/255 in float64 then float32, normalized, cut into patches in the order its tower
reads them. Its content hash (over the processed pixels and their grid) names the image
everywhere: in the radix tree its tokens are `IMAGE_ID_BASE + hash % IMAGE_ID_SPAN`, so equal
images share a cached prefix and different ones part at their first token."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .spec import SECONDS, VisionSpec

IMAGE_ID_BASE = 1 << 30  # above every vocabulary; below 2**31
IMAGE_ID_SPAN = (1 << 31) - 1 - IMAGE_ID_BASE


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # float32 [patches, channels x temporal x patch x patch]
    grid: tuple[int, int, int]  # (t, h, w) in patches
    tokens: int  # prompt tokens it becomes
    digest: int  # content hash
    time_interval: float = 1.0  # a video's: time positions from one frame pair to the next

    @property
    def token_id(self) -> int:
        return image_token_id(self.digest)

    @property
    def nbytes(self) -> int:
        return self.pixels.nbytes


def image_token_id(digest: int) -> int:
    return IMAGE_ID_BASE + digest % IMAGE_ID_SPAN


def is_image_token(token: int) -> bool:
    return token >= IMAGE_ID_BASE


def preprocess(image: Image.Image, spec: VisionSpec) -> ProcessedImage:
    """The image resized as its family does (`LAYOUTS`), scaled to [0, 1] (x 1/255 in float64,
    then float32), normalized, and cut into what the tower takes."""
    layout = LAYOUTS[spec.family]
    height, width = layout.size(image.height, image.width, spec)
    resized = np.asarray(image.resize((width, height), resample=spec.resample))
    pixels, grid, tokens = layout.cut(normalized(resized, spec.mean, spec.std), spec)
    if layout.thumbnail and grid[0] > 1:  # InternVL: the whole image as one more tile
        side = spec.image_size
        small = np.asarray(image.resize((side, side), resample=spec.resample))
        pixels = np.concatenate([pixels, normalized(small, spec.mean, spec.std).reshape(1, -1)])
        grid, tokens = (grid[0] + 1, *grid[1:]), tokens + spec.tokens_per_image
    pixels = np.ascontiguousarray(pixels)
    return ProcessedImage(pixels, grid, tokens, content_digest(pixels, grid))


def normalized(rgb: np.ndarray, mean, std) -> np.ndarray:
    """uint8 [H, W, C] -> float32 [C, H, W]: x 1/255 in float64, then float32, minus the mean,
    over the std (HF's PIL image processors' steps)."""
    scaled = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return ((scaled - mean) / std).transpose(2, 0, 1)


def content_digest(pixels: np.ndarray, grid: tuple[int, int, int], interval: float = 1.0) -> int:
    """The hash that names an image (or a video's part) everywhere: over its grid, pixels and,
    for a video's time spacing other than one, that spacing."""
    spacing = b"" if interval == 1.0 else np.float64(interval).tobytes()
    data = np.asarray(grid).tobytes() + spacing + pixels.tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


Cut = tuple[np.ndarray, tuple[int, int, int], int]  # pixels, grid, prompt tokens


@dataclass(frozen=True)
class Layout:
    """How a family resizes an image (`size(height, width, spec)` -> the new height, width)
    and cuts the normalized `[C, H, W]` pixels for its tower (`cut(pixels, spec)`)."""

    size: Callable[[int, int, VisionSpec], tuple[int, int]]
    cut: Callable[[np.ndarray, VisionSpec], Cut]
    thumbnail: bool = False  # after several tiles, the whole image at one tile's size


def merged_patches(image: np.ndarray, spec: VisionSpec) -> Cut:
    """Qwen-VL: patches of each merge x merge block together, a token a block."""
    pixels, grid = patchify(image, spec)
    return pixels, grid, grid[1] * grid[2] // spec.merge_size**2


def whole_image(image: np.ndarray, spec: VisionSpec) -> Cut:
    """Gemma 3: the image kept whole (`[1, C x H x W]`, grid (1, H, W)), a fixed token count."""
    return image.reshape(1, -1), (1, *image.shape[1:]), spec.tokens_per_image


def pooled_patches(image: np.ndarray, spec: VisionSpec) -> Cut:
    """Gemma 4: patches row by row, a token each merge x merge of them."""
    pixels, grid = patch_rows(image, spec.patch_size)
    return pixels, grid, grid[1] * grid[2] // spec.merge_size**2


def patch_rows_with_breaks(image: np.ndarray, spec: VisionSpec) -> Cut:
    """Pixtral: patches row by row in a convolution's order; a token each merge x merge of
    them, and one more a row (its row break, or the image's end)."""
    pixels, grid = patch_rows(image, spec.patch_size, channels_first=True)
    rows, columns = grid[1] // spec.merge_size, grid[2] // spec.merge_size
    return pixels, grid, rows * (columns + 1)


def square_tiles(image: np.ndarray, spec: VisionSpec) -> Cut:
    """InternVL: square tiles row by row, each `[C x size x size]`; grid (tiles, side, side) in
    patches."""
    channels, height, width = image.shape
    side = spec.image_size
    cut = image.reshape(channels, height // side, side, width // side, side)
    cut = cut.transpose(1, 3, 0, 2, 4)
    tiles = cut.shape[0] * cut.shape[1]
    patches = side // spec.patch_size
    return cut.reshape(tiles, -1), (tiles, patches, patches), tiles * spec.tokens_per_image


def tiled_size(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """InternVL's canvas (transformers' `get_optimal_tiled_canvas`): the grid of columns x rows
    within `min_tiles`..`max_tiles` whose aspect ratio is nearest the image's; on a tie the
    later grid (more tiles) where the image's area passes half the grid's."""
    tile, grids = spec.image_size, []
    for columns in range(1, spec.max_tiles + 1):
        for rows in range(1, spec.max_tiles + 1):
            if spec.min_tiles <= columns * rows <= spec.max_tiles:
                grids.append((columns, rows))
    aspect, area = width / height, width * height
    best, best_gap = (1, 1), float("inf")
    for columns, rows in sorted(grids, key=lambda g: g[0] * g[1]):
        gap = abs(aspect - columns / rows)
        if gap < best_gap:
            best, best_gap = (columns, rows), gap
        elif gap == best_gap and area > 0.5 * tile * tile * columns * rows:
            best = (columns, rows)
    return best[1] * tile, best[0] * tile


def square_size(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    return spec.image_size, spec.image_size


def fitted_size(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """Qwen-VL's `smart_resize`: sides that are multiples of `spec.factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as nearly as that allows."""
    factor = spec.factor
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > spec.max_pixels:
        beta = math.sqrt(height * width / spec.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def glm4v_size(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """GLM-4.xV's `smart_resize`: an image as the frames of one temporal patch, an aspect
    ratio past 200 a ValueError."""
    frames = spec.temporal_patch_size
    return frames_size(frames, height, width, spec, spec.min_pixels, spec.max_pixels, 200)


def frames_size(
    frames: int, height: int, width: int, spec: VisionSpec, low: int, high: int, ratio=None
) -> tuple[int, int]:
    """`smart_resize` over `frames` frames (GLM-4.xV's images, Qwen3-VL's videos): a side
    shorter than `spec.factor` scaled up first (the aspect ratio kept, truncated; past `ratio`
    a ValueError), sides rounded to multiples of it, all frames' pixels within [low, high]."""
    factor = spec.factor
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if ratio is not None and max(height, width) / min(height, width) > ratio:
        raise ValueError(f"a {width}x{height} image has an aspect ratio past {ratio}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / spec.temporal_patch_size) * spec.temporal_patch_size
    if t * h * w > high:
        beta = math.sqrt(frames * height * width / high)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < low:
        beta = math.sqrt(low / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def gemma4_size(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """Gemma 4's aspect-ratio-preserving size: the largest sides, multiples of patch x pooling,
    within `max_soft_tokens` pooled patches (a side that rounds to nothing gets one multiple,
    the other stretched by the aspect ratio up to the budget's side). ValueError past it."""
    budget = spec.max_soft_tokens * spec.merge_size**2 * spec.patch_size**2  # pixels
    factor = math.sqrt(budget / (height * width))
    side = spec.factor
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ValueError(f"a {width}x{height} image resizes to nothing")
    longest = spec.max_soft_tokens * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > budget:
        raise ValueError(
            f"a {width}x{height} image has no size within {spec.max_soft_tokens} tokens"
        )
    return h, w


def pixtral_size(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """Pixtral's size: scaled down (floored) to fit `longest_edge`, each side then rounded up
    to whole merged patches."""
    ratio = max(height / spec.longest_edge, width / spec.longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    if min(height, width) == 0:
        raise ValueError(f"a side scales to nothing within {spec.longest_edge} pixels")
    side = spec.factor
    return ((height - 1) // side + 1) * side, ((width - 1) // side + 1) * side


def patch_rows(
    image: np.ndarray, patch: int, channels_first: bool = False
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[C, H, W] -> [patches, P x P x C], patches row by row, each patch's pixels row by row
    with their channels together (Gemma 4's order); `channels_first`: [patches, C x P x P]
    (a convolution's order, Pixtral's)."""
    channels, height, width = image.shape
    gh, gw = height // patch, width // patch
    order = (1, 3, 0, 2, 4) if channels_first else (1, 3, 2, 4, 0)
    cut = image.reshape(channels, gh, patch, gw, patch).transpose(*order)
    return np.ascontiguousarray(cut.reshape(gh * gw, -1)), (1, gh, gw)


def patchify(image: np.ndarray, spec: VisionSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[C, H, W] -> [patches, C x T x P x P], the patches of each merge x merge block together
    (the frame repeated over the temporal patch)."""
    channels, height, width = image.shape
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = height // p, width // p
    blocks = image.reshape(channels, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(frames.reshape(gh * gw, channels * t * p * p)), (1, gh, gw)


@dataclass(frozen=True)
class ProcessedVideo:
    # one (Qwen2-VL, Qwen2.5-VL), or one a frame pair (Qwen3-VL) or a frame (Gemma 4)
    parts: list[ProcessedImage]
    timestamps: list[float]  # each part's time in seconds (Qwen3-VL, Gemma 4), else empty

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


Media = ProcessedImage | ProcessedVideo


def expand_media(
    ids: list[int], media: list[Media], spec: VisionSpec, words: Callable[[str], list[int]]
) -> tuple[list[int], list[tuple[ProcessedImage, int]]]:
    """The prompt with each image placeholder replaced by `spec.before`, the image's tokens and
    `spec.after`, each video placeholder by its parts' tokens (Qwen3-VL: each part after the
    tokens of its time, `words(text)`, between its own start and end tokens); and where each
    image or part starts. ValueError when the prompt holds another number of placeholders."""
    images = [m for m in media if isinstance(m, ProcessedImage)]
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


# each family's Layout (multimodal.spec.FAMILIES names the families)
LAYOUTS = {
    "qwen2_5_vl": Layout(fitted_size, merged_patches),
    "qwen3_vl": Layout(fitted_size, merged_patches),
    "gemma3": Layout(square_size, whole_image),
    "gemma4": Layout(gemma4_size, pooled_patches),
    "pixtral": Layout(pixtral_size, patch_rows_with_breaks),
    "glm4v": Layout(glm4v_size, merged_patches),
    "internvl": Layout(tiled_size, square_tiles, thumbnail=True),
}


def image_span(image: ProcessedImage, spec: VisionSpec) -> list[int]:
    """The prompt tokens an image becomes: its hash token `image.tokens` times, or (Pixtral)
    rows of them each ended by the row-break token, the last row by the image-end token."""
    if spec.row_break_id is None:
        return [image.token_id] * image.tokens
    columns = image.grid[2] // spec.merge_size
    rows = image.tokens // (columns + 1)
    span = ([image.token_id] * columns + [spec.row_break_id]) * rows
    return span[:-1] + [spec.image_end_id]
