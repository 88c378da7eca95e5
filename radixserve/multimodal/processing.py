"""An image as the vision tower takes it, and the ids that name it in a prompt.

Each family's preprocessing is its HF image processor's (PIL backend) step by step: the size it
picks (`LAYOUTS`: Qwen-VL's and GLM-4.xV's sides rounded to multiples of patch x merge within
the pixel budget, Gemma 3's square, Gemma 4's token budget, Pixtral's longest edge, InternVL's
tiles, LLaVA's shorter side and centre crop; Idefics3's resizes and tiles: `split_tiles`), a
PIL resize, x 1/255 in float64 then float32, normalized, cut into patches in the order its
tower reads them. Its content hash (over the processed pixels and their grid) names the image
everywhere: in the radix tree its tokens are `IMAGE_ID_BASE + hash % IMAGE_ID_SPAN`, so equal
images share a cached prefix and different ones part at their first token."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .spec import VisionSpec

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


def preprocess(image: Image.Image, spec: VisionSpec) -> ProcessedImage | ProcessedTiles:
    """The image resized as its family does (`LAYOUTS`), scaled to [0, 1] (x 1/255 in float64,
    then float32), normalized, and cut into what the tower takes (Idefics3: `split_tiles`)."""
    if spec.family == "idefics3":
        return split_tiles(image, spec)
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


def shortest_edge_size(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """LLaVA: the shorter side scaled to `shortest_edge`, the longer by the aspect ratio
    (truncated), as HF's `get_resize_output_image_size`; without one, `image_size` square."""
    side = spec.shortest_edge
    if not side:
        return square_size(height, width, spec)
    if width <= height:
        return int(side * height / width), side
    return side, int(side * width / height)


def center_crop(image: np.ndarray, spec: VisionSpec) -> Cut:
    """LLaVA: the centre `image_size` square (HF's `center_crop`, its top-left offsets
    floored), whole."""
    _, height, width = image.shape
    side = spec.image_size
    top, left = (height - side) // 2, (width - side) // 2
    crop = image[:, top : top + side, left : left + side]
    patches = side // spec.patch_size
    return crop.reshape(1, -1), (1, patches, patches), spec.tokens_per_image


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


@dataclass(frozen=True)
class ProcessedTiles:
    """Idefics3: an image's tiles row by row, then the whole image at one tile's size; each its
    own part of the prompt (where the image is not cut, the whole image alone: no rows)."""

    parts: list[ProcessedImage]
    rows: int
    columns: int

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


Media = ProcessedImage | ProcessedVideo | ProcessedTiles
MAX_SIDE = 4096  # Idefics3's processor scales a longer side down to this first


def split_tiles(image: Image.Image, spec: VisionSpec) -> ProcessedTiles:
    """Idefics3's processor step by step: scaled (Lanczos by default) to `longest_edge`, then
    (`split_tiles`) up to whole tiles and cut into them, the whole image scaled to one tile
    after them; without splitting the image is scaled straight to one tile."""
    height, width = longest_edge_size(image.height, image.width, spec.longest_edge)
    image = image.resize((width, height), resample=spec.resample)
    side = spec.image_size
    if spec.split_tiles:
        height, width = whole_tiles_size(image.height, image.width, side)
        image = image.resize((width, height), resample=spec.resample)
    rows, columns = (height // side, width // side) if spec.split_tiles else (1, 1)
    pictures = [image]
    if rows * columns > 1:
        boxes = [(c * side, r * side, (c + 1) * side, (r + 1) * side)
                 for r in range(rows) for c in range(columns)]  # fmt: skip
        pictures = [image.crop(box) for box in boxes] + [image]
    pictures[-1] = pictures[-1].resize((side, side), resample=spec.resample)
    grid, parts = (1, side // spec.patch_size, side // spec.patch_size), []
    for picture in pictures:
        pixels = normalized(np.asarray(picture), spec.mean, spec.std).reshape(1, -1)
        digest = content_digest(pixels, grid)
        parts.append(ProcessedImage(pixels, grid, spec.tokens_per_image, digest))
    return ProcessedTiles(parts, *((rows, columns) if len(parts) > 1 else (0, 0)))


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longer side scaled to `longest` (the other truncated, then made even), then both
    within `MAX_SIDE`, as Idefics3's processor computes them."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / aspect)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def whole_tiles_size(height: int, width: int, side: int) -> tuple[int, int]:
    """Both sides up to whole tiles: the longer first, the other from the aspect ratio."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect) / side) * side
    return height, width


# each family's Layout (multimodal.spec.FAMILIES names the families)
LAYOUTS = {
    "qwen2_5_vl": Layout(fitted_size, merged_patches),
    "qwen3_vl": Layout(fitted_size, merged_patches),
    "gemma3": Layout(square_size, whole_image),
    "gemma4": Layout(gemma4_size, pooled_patches),
    "pixtral": Layout(pixtral_size, patch_rows_with_breaks),
    "glm4v": Layout(glm4v_size, merged_patches),
    "internvl": Layout(tiled_size, square_tiles, thumbnail=True),
    "llava": Layout(shortest_edge_size, center_crop),
}
