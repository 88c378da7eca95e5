"""A video as the Qwen-VL and Gemma 4 towers take it: decoded with PyAV, its frames sampled as
HF's video processors sample them, sized, normalized and cut into patches (of frame pairs for
Qwen-VL).

Qwen2-VL and Qwen2.5-VL take a video as one span of `t x h x w / merge^2` tokens (its time
positions `tokens_per_second x temporal_patch / sampled fps` apart on Qwen2.5-VL); Qwen3-VL
takes each frame pair as its own span after the text of its time (`<1.5 seconds>`), Gemma 4
each frame, cut as an image, after its time (`00:01`). The towers read each frame pair (or
frame) on its own, so a Qwen3-VL or Gemma 4 video is a list of parts, each named by its own
content hash: a video's frames share cached KV with the same frames of another request."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace

import av
import numpy as np
from PIL import Image

from .media import MediaError, MediaPolicy, brief, check_size
from .processing import (
    ProcessedImage,
    ProcessedVideo,
    content_digest,
    fitted_size,
    frames_size,
    gemma4_size,
    normalized,
    pooled_patches,
)
from .spec import CLOCK, SECONDS, VisionSpec


@dataclass(frozen=True)
class DecodedVideo:
    frames: list[np.ndarray]  # the sampled frames at the family's size, RGB uint8 [H, W, 3]
    indices: list[int]  # their places among the video's frames
    total: int  # the video's frames
    fps: float  # the video's frame rate


def decode_video(
    data: bytes, policy: MediaPolicy, spec: VisionSpec, where: str, max_tokens: int
) -> DecodedVideo:
    """The sampled frames, resized as each is decoded, checked from the stream's header before
    a frame is decoded: a frame size within `max_pixels`, at most `max_video_frames` frames, a
    frame rate, at most `max_tokens` prompt tokens (a long video at a large size would fill
    memory with frames before its prompt was found too long)."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return _sampled(container, policy, spec, where, max_tokens)
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError, IndexError) as exc:
        raise MediaError(f"{where}: not a video PyAV can read ({brief(exc)})") from None


def _sampled(
    container, policy: MediaPolicy, spec: VisionSpec, where: str, max_tokens: int
) -> DecodedVideo:
    if not container.streams.video:
        raise MediaError(f"{where}: the file has no video stream")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    check_size(width, height, policy, where, "video's frame")
    fps = float(stream.average_rate or 0)
    if not fps > 0:
        raise MediaError(f"{where}: the video has no frame rate")
    total = stream.frames or _count_frames(container, stream, policy, where)
    if total > policy.max_video_frames:
        raise MediaError(
            f"{where}: the video has {total} frames; at most {policy.max_video_frames} are "
            "accepted (--max-video-frames)"
        )
    indices = sample_frames(total, fps, spec)
    if not indices:
        raise MediaError(f"{where}: the video has {total} frames, too few to sample")
    size_h, size_w = frame_size(len(indices), height, width, spec)
    tokens = video_tokens(len(indices), size_h, size_w, spec)
    if tokens > max_tokens:
        raise MediaError(
            f"{where}: the video would be {tokens} prompt tokens ({len(indices)} frames of "
            f"{size_w}x{size_h}); the context holds {max_tokens}"
        )
    wanted, frames = set(indices), []
    for i, frame in enumerate(container.decode(stream)):
        if i in wanted:
            image = Image.fromarray(frame.to_ndarray(format="rgb24"))
            frames.append(np.asarray(image.resize((size_w, size_h), spec.resample)))
        if i >= indices[-1]:
            break
    if len(frames) < len(indices):
        raise MediaError(
            f"{where}: the video ends after {len(frames)} of the frames its header lists"
        )
    return DecodedVideo(frames, indices, total, fps)


def _count_frames(container, stream, policy: MediaPolicy, where: str) -> int:
    """Frames of a stream whose header does not say: its packets, counted without decoding."""
    count = 0
    for packet in container.demux(stream):
        count += packet.size > 0
        if count > policy.max_video_frames:
            break
    container.seek(0)
    return count


def sample_frames(total: int, fps: float, spec: VisionSpec) -> list[int]:
    """The frames HF's video processor samples: Gemma 4's `num_frames` evenly over the video
    (all of a shorter one; HF refuses it); at `spec.video.fps` frames a second, Qwen2-VL's and
    Qwen2.5-VL's (a multiple of the temporal patch, evenly strided), Qwen3-VL's (evenly spaced
    from the first frame to the last)."""
    video, pair = spec.video, spec.temporal_patch_size
    assert video is not None
    if video.num_frames:
        count = min(video.num_frames, total)
        return (np.arange(count) * total // count).tolist()
    wanted = total / fps * video.fps
    if video.timestamps == SECONDS:
        count = min(max(int(wanted), video.min_frames), video.max_frames, total)
        return np.linspace(0, total - 1, count).round().astype(int).tolist()
    most = math.floor(min(video.max_frames, total) / pair) * pair
    count = math.floor(min(max(wanted, video.min_frames), most, total) / pair) * pair
    if count == 0:
        return []
    step = total / count  # torch.arange's: float32 values of double steps, truncated
    values = (np.arange(math.ceil(total / step), dtype=np.float64) * step).astype(np.float32)
    return values.astype(np.int64).tolist()


def video_tokens(frames: int, height: int, width: int, spec: VisionSpec) -> int:
    """The prompt tokens of `frames` frames of this size (Qwen3-VL's frame times aside)."""
    pairs = -(-frames // spec.temporal_patch_size)
    return pairs * (height // spec.factor) * (width // spec.factor)


def preprocess_video(video: DecodedVideo, spec: VisionSpec) -> ProcessedVideo:
    """The frames (resized as decoded, as an image is, PIL) normalized; Gemma 4's each cut as
    an image; Qwen-VL's, the last repeated to fill the last frame pair, cut into patches of
    frame pairs (HF's video patch order: frame pair, merge block, patch, then channel, frame,
    pixel)."""
    vs = spec.video
    assert vs is not None
    height, width = video.frames[0].shape[:2]
    frames = [normalized(frame, vs.mean, vs.std) for frame in video.frames]
    if vs.timestamps == CLOCK:  # Gemma 4: each frame as an image, after its time
        parts = [_part(*pooled_patches(frame, spec)) for frame in frames]
        return ProcessedVideo(parts, [i / video.fps for i in video.indices])
    pair = spec.temporal_patch_size
    frames += frames[-1:] * (-len(frames) % pair)
    pixels = cut_frame_pairs(np.stack(frames), spec)
    t, gh, gw = len(frames) // pair, height // spec.patch_size, width // spec.patch_size
    per_pair = gh * gw // spec.merge_size**2
    if not vs.timestamps:
        sampled_fps = len(video.indices) / video.total * video.fps
        interval = vs.tokens_per_second * pair / sampled_fps if vs.tokens_per_second else 1.0
        return ProcessedVideo([_part(pixels, (t, gh, gw), t * per_pair, interval)], [])
    rows = gh * gw
    parts = [_part(pixels[i * rows : (i + 1) * rows], (1, gh, gw), per_pair) for i in range(t)]
    return ProcessedVideo(parts, pair_times(video.indices, video.fps, pair))


def frame_size(frames: int, height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """HF's `smart_resize` for videos: Qwen2-VL's and Qwen2.5-VL's bound each frame; Qwen3-VL's
    bound all frames together (and first scale a side under one merged patch up to it); Gemma 4
    sizes each frame as an image within the video's `max_soft_tokens`."""
    vs = spec.video
    assert vs is not None
    if vs.timestamps == CLOCK:
        return gemma4_size(height, width, replace(spec, max_soft_tokens=vs.max_soft_tokens))
    if not vs.timestamps:
        bounds = replace(spec, min_pixels=vs.min_pixels, max_pixels=vs.max_pixels)
        return fitted_size(height, width, bounds)
    return frames_size(frames, height, width, spec, vs.min_pixels, vs.max_pixels)


def cut_frame_pairs(frames: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """[F, C, H, W] -> [pairs x patches, C x T x P x P], merge blocks together in each pair."""
    count, channels, height, width = frames.shape
    p, m, pair = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = height // p, width // p
    cut = frames.reshape(count // pair, pair, channels, gh // m, m, p, gw // m, m, p)
    cut = cut.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(cut.reshape(count // pair * gh * gw, channels * pair * p * p))


def pair_times(indices: list[int], fps: float, pair: int) -> list[float]:
    """Each frame pair's time: the mean of its first and last frames' (HF's Qwen3-VL)."""
    padded = indices + indices[-1:] * (-len(indices) % pair)
    seconds = [i / fps for i in padded]
    return [(seconds[i] + seconds[i + pair - 1]) / 2 for i in range(0, len(seconds), pair)]


def _part(pixels: np.ndarray, grid: tuple[int, int, int], tokens: int, interval: float = 1.0):
    """A video's part; its hash covers its time spacing too (it sets the tokens' positions)."""
    pixels = np.ascontiguousarray(pixels)
    return ProcessedImage(pixels, grid, tokens, content_digest(pixels, grid, interval), interval)
