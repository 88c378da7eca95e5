"""What a vision-language checkpoint expects of an image: its family, the token that stands for
image features in a prompt, the text that stands for one image in a chat turn, and how pixels
are resized, normalized and cut into patches (from `preprocessor_config.json`); and of a video,
for the families that take them (`VideoSpec`, from `video_preprocessor_config.json`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

# vision-language architectures -> family
FAMILIES = {
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen2VLForConditionalGeneration": "qwen2_5_vl",  # the same preprocessing and positions
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",
    "Qwen3_5ForConditionalGeneration": "qwen3_vl",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_vl",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Mistral3ForConditionalGeneration": "pixtral",
    "Glm4vForConditionalGeneration": "glm4v",
    "Glm4vMoeForConditionalGeneration": "glm4v",
    "Glm46VForConditionalGeneration": "glm4v",
    "InternVLForConditionalGeneration": "internvl",
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "idefics3",
    "LlavaForConditionalGeneration": "llava",
}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
LANCZOS, BICUBIC, BILINEAR = 1, 3, 2  # PIL's resampling filter numbers
VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma4")
# HF's image processors' pixel budgets (min, max) where the config names none (GLM-4.xV's
# counts each image twice: as two frames of one temporal patch)
PIXEL_BUDGETS = {"glm4v": (112 * 112, 28 * 28 * 15000)}
SECONDS, CLOCK = "seconds", "clock"  # how a video's parts are timed in the prompt


@dataclass(frozen=True)
class VideoSpec:
    """How a family samples and sizes a video's frames (HF's video processor defaults where the
    checkpoint's video preprocessor config is silent)."""

    token_id: int  # the prompt token that stands for a video
    min_pixels: int  # Qwen2-VL and Qwen2.5-VL: a frame's; Qwen3-VL: all frames' together
    max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    fps: float = 2.0  # frames sampled a second of video
    min_frames: int = 4
    max_frames: int = 768
    # Qwen2.5-VL: time positions a second of video (0: a time position a frame pair, Qwen2-VL)
    tokens_per_second: float = 0.0
    # each part (frame pair, or frame) its own span after the text of its time: "" (none: one
    # span, Qwen2-VL and Qwen2.5-VL), SECONDS (Qwen3-VL: `<1.5 seconds>`), CLOCK (Gemma 4:
    # `00:01`, the frames apart by a space)
    timestamps: str = ""
    num_frames: int = 0  # frames sampled evenly from the whole video (Gemma 4), else at `fps`
    max_soft_tokens: int = 0  # Gemma 4: a frame's most tokens

    @classmethod
    def of(cls, family: str, hf: dict, video: dict) -> VideoSpec | None:
        """From the video preprocessor config (or the image's, as HF falls back to it): Qwen2-VL's
        video processor reads `min_pixels`/`max_pixels` or `size`, CLIP's mean and std by
        default; Qwen3-VL's reads `size` only, a mean and std of 0.5 by default."""
        if family not in VIDEO_FAMILIES or "video_token_id" not in hf:
            return None
        if family == "gemma4":
            return cls._gemma4(hf, video)
        qwen3 = family == "qwen3_vl"
        side = 32 if qwen3 else 28
        size = video.get("size") or {}
        low = size.get("shortest_edge", 128 * side * side)
        high = size.get("longest_edge", 768 * side * side)
        if not qwen3:
            low, high = video.get("min_pixels", low), video.get("max_pixels", high)
        mean, std = ((0.5,) * 3, (0.5,) * 3) if qwen3 else (CLIP_MEAN, CLIP_STD)
        return cls(
            token_id=int(hf["video_token_id"]),
            min_pixels=int(low),
            max_pixels=int(high),
            mean=tuple(video.get("image_mean", mean)),
            std=tuple(video.get("image_std", std)),
            fps=float(video.get("fps", 2.0)),
            min_frames=int(video.get("min_frames", 4)),
            max_frames=int(video.get("max_frames", 768)),
            tokens_per_second=float(hf["vision_config"].get("tokens_per_second", 0)),
            timestamps=SECONDS if qwen3 else "",
        )

    @classmethod
    def _gemma4(cls, hf: dict, video: dict) -> VideoSpec:
        """Gemma 4's video processor: `num_frames` (32) frames evenly, each resized as an image
        within `max_soft_tokens` (70), pixels in [0, 1] unless a mean and std are given."""
        normalize = video.get("do_normalize", True)
        return cls(
            token_id=int(hf["video_token_id"]),
            min_pixels=0,
            max_pixels=0,
            mean=tuple(video.get("image_mean", (0.0,) * 3)) if normalize else (0.0,) * 3,
            std=tuple(video.get("image_std", (1.0,) * 3)) if normalize else (1.0,) * 3,
            timestamps=CLOCK,
            num_frames=int(video.get("num_frames", 32)),
            max_soft_tokens=int(video.get("max_soft_tokens", 70)),
        )


@dataclass(frozen=True)
class VisionSpec:
    family: str
    image_token_id: int  # the prompt token each image feature replaces
    patch_size: int
    merge_size: int  # merge_size x merge_size patches make one prompt token
    mean: tuple[float, ...]
    std: tuple[float, ...]
    start_token_id: int | None = None  # tokens the chat turn puts around an image
    end_token_id: int | None = None
    temporal_patch_size: int = 1
    min_pixels: int = 0  # the pixel budget (Qwen-VL, GLM-4.xV)
    max_pixels: int = 0
    resample: int = BICUBIC
    mrope: bool = True  # 3-D rotary positions (time, height, width) for image tokens
    image_size: int = 0  # a fixed square size every image (Gemma 3) or tile (InternVL) takes
    tokens_per_image: int = 0  # a fixed number of tokens an image (a tile) becomes
    max_tiles: int = 0  # InternVL: the most tiles an image is cut into (a thumbnail after them)
    min_tiles: int = 0
    # Idefics3's `do_image_splitting`: cut into tiles with the whole image after them (else
    # the whole image alone at one tile's size)
    split_tiles: bool = False
    max_soft_tokens: int = 0  # the most tokens an image becomes (Gemma 4; merge_size pools)
    longest_edge: int = 0  # the longest side an image is scaled to (Pixtral: down; Idefics3)
    # LLaVA: the shorter side an image is scaled to before its centre is cropped to
    # `image_size` (0: scaled straight to `image_size` square)
    shortest_edge: int = 0
    # the tokens ending each row of an image's tokens and the image (Pixtral's row break and
    # image end; the api process fills in their ids)
    row_break_id: int | None = None
    image_end_id: int | None = None
    # the prompt token that stands for one image, and the tokens put in its place around the
    # image's own (Gemma 3: two newlines and its start token before, its end token and two
    # newlines after; the api process fills in the newlines' ids)
    placeholder_id: int = 0
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    video: VideoSpec | None = None  # None: the family takes no videos
    # Idefics3: the image token's text, for the prompt of an image's tiles that is written out
    # and tokenized (the api process fills it in)
    image_text: str = ""

    @classmethod
    def of(cls, hf: dict, folder: Path | None) -> VisionSpec | None:
        """The spec of a served vision-language config (None for a text model)."""
        family = FAMILIES.get((hf.get("architectures") or [None])[0])
        if family is None:
            return None
        vision = hf["vision_config"]
        pre = _preprocessor_config(folder)
        if family == "gemma3":
            return _gemma3_spec(hf, vision, pre)
        if family == "gemma4":
            video = _json_file(folder, "video_preprocessor_config.json") or pre
            return replace(_gemma4_spec(hf, vision, pre), video=VideoSpec.of(family, hf, video))
        if family == "pixtral":
            return _pixtral_spec(hf, vision, pre)
        if family == "internvl":
            return _internvl_spec(hf, vision, pre)
        if family == "idefics3":
            return _idefics3_spec(hf, vision, pre)
        if family == "llava":
            return _llava_spec(hf, vision, pre)
        size = pre.get("size") or {}
        default_patch = 16 if family == "qwen3_vl" else 14
        low, high = PIXEL_BUDGETS.get(family, (56 * 56, 28 * 28 * 1280))
        # HF reads a video's settings from the image's config where there is no video one
        video = _json_file(folder, "video_preprocessor_config.json") or pre
        return cls(
            family=family,
            image_token_id=int(hf["image_token_id"]),
            start_token_id=hf.get("vision_start_token_id", hf.get("image_start_token_id")),
            end_token_id=hf.get("vision_end_token_id", hf.get("image_end_token_id")),
            patch_size=int(pre.get("patch_size", vision.get("patch_size", default_patch))),
            temporal_patch_size=int(
                pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2))
            ),
            merge_size=int(pre.get("merge_size", vision.get("spatial_merge_size", 2))),
            min_pixels=int(pre.get("min_pixels", size.get("shortest_edge", low))),
            max_pixels=int(pre.get("max_pixels", size.get("longest_edge", high))),
            mean=tuple(pre.get("image_mean", CLIP_MEAN)),
            std=tuple(pre.get("image_std", CLIP_STD)),
            resample=int(pre.get("resample", BICUBIC)),
            placeholder_id=int(hf["image_token_id"]),
            video=VideoSpec.of(family, hf, video),
        )

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    def marker_ids(self) -> list[int]:
        """The token ids a chat turn holds for one image before it is expanded."""
        if self.family in ("gemma3", "gemma4", "pixtral", "internvl", "idefics3", "llava"):
            return [self.placeholder_id]
        ids = (self.start_token_id, self.image_token_id, self.end_token_id)
        return [t for t in ids if t is not None]

    def video_marker_ids(self) -> list[int]:
        """The token ids a chat turn holds for one video (Qwen-VL: start, video, end; Gemma 4:
        the video token)."""
        assert self.video is not None
        if self.video.timestamps == CLOCK:
            return [self.video.token_id]
        return [self.start_token_id, self.video.token_id, self.end_token_id]


def _gemma3_spec(hf: dict, vision: dict, pre: dict) -> VisionSpec:
    """SigLIP at one fixed size (pan-and-scan is not applied), pooled to a fixed number of
    tokens; a prompt marks each image with its start token."""
    size = int(vision.get("image_size", 896))
    return VisionSpec(
        family="gemma3",
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id"))),
        start_token_id=int(hf["boi_token_index"]),
        end_token_id=int(hf["eoi_token_index"]),
        patch_size=int(vision.get("patch_size", 14)),
        merge_size=1,
        max_pixels=size * size,
        mean=tuple(pre.get("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(pre.get("image_std", (0.5, 0.5, 0.5))),
        resample=int(pre.get("resample", BILINEAR)),
        mrope=False,
        image_size=size,
        tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
        placeholder_id=int(hf["boi_token_index"]),
        before=(int(hf["boi_token_index"]),),
        after=(int(hf["eoi_token_index"]),),
    )


def _gemma4_spec(hf: dict, vision: dict, pre: dict) -> VisionSpec:
    """Resized within `max_soft_tokens` pooled patches keeping the aspect ratio, pixels in
    [0, 1] (no normalization), cut into patches that `pooling_kernel_size`^2 at a time
    become one token; a prompt's image token becomes its start token, its tokens and its
    end token."""
    defaults = {"image_token_id": 258_880, "boi_token_id": 255_999, "eoi_token_id": 258_882}
    image, boi, eoi = (int(hf.get(k, v)) for k, v in defaults.items())  # transformers'

    normalize = pre.get("do_normalize", False)
    return VisionSpec(
        family="gemma4",
        image_token_id=image,
        start_token_id=boi,
        end_token_id=eoi,
        patch_size=int(pre.get("patch_size", vision.get("patch_size", 16))),
        merge_size=int(pre.get("pooling_kernel_size", vision.get("pooling_kernel_size", 3))),
        mean=tuple(pre.get("image_mean", (0.0,) * 3)) if normalize else (0.0,) * 3,
        std=tuple(pre.get("image_std", (1.0,) * 3)) if normalize else (1.0,) * 3,
        resample=int(pre.get("resample", BICUBIC)),
        mrope=False,
        max_soft_tokens=int(pre.get("max_soft_tokens", 280)),
        placeholder_id=image,
        before=(boi,),
        after=(eoi,),
    )


def _pixtral_spec(hf: dict, vision: dict, pre: dict) -> VisionSpec:
    """Scaled down to fit `longest_edge`, sides rounded up to whole merged patches; a
    prompt's image token becomes rows of its tokens, each ended by a row break, the last by
    the image end."""
    image = int(hf.get("image_token_index", hf.get("image_token_id", 10)))
    return VisionSpec(
        family="pixtral",
        image_token_id=image,
        patch_size=int(vision.get("patch_size", 16)),
        merge_size=int(hf.get("spatial_merge_size", 2)),
        mean=tuple(pre.get("image_mean", CLIP_MEAN)),
        std=tuple(pre.get("image_std", CLIP_STD)),
        resample=int(pre.get("resample", BICUBIC)),
        mrope=False,
        longest_edge=int((pre.get("size") or {}).get("longest_edge", 1024)),
        placeholder_id=image,
    )


def _internvl_spec(hf: dict, vision: dict, pre: dict) -> VisionSpec:
    """Square tiles of `size` in the grid whose aspect ratio is nearest the image's within
    `min_patches`..`max_patches` tiles, a thumbnail of the whole image after several; each
    tile's patches pixel-shuffled into `tokens_per_image` tokens; a prompt's image token
    becomes `<img>`, the tokens and `</img>` (the api process fills in their ids)."""
    tile = int((pre.get("size") or {}).get("height", 448))
    patch = vision.get("patch_size", 14)
    patch = int(patch if isinstance(patch, int) else patch[0])
    shuffle = round(1 / hf.get("downsample_ratio", 0.5))
    tiled = pre.get("crop_to_patches", False)
    image = int(hf["image_token_id"])
    return VisionSpec(
        family="internvl",
        image_token_id=image,
        patch_size=patch,
        merge_size=shuffle,
        mean=tuple(pre.get("image_mean", CLIP_MEAN)),
        std=tuple(pre.get("image_std", CLIP_STD)),
        resample=int(pre.get("resample", BICUBIC)),
        mrope=False,
        image_size=tile,
        tokens_per_image=(tile // patch // shuffle) ** 2,
        max_tiles=int(pre.get("max_patches", 12)) if tiled else 1,
        min_tiles=int(pre.get("min_patches", 1)) if tiled else 1,
        placeholder_id=image,
    )


def _idefics3_spec(hf: dict, vision: dict, pre: dict) -> VisionSpec:
    """Scaled to `size.longest_edge`, then up to whole tiles of `max_image_size`; cut into
    them (`do_image_splitting`) and the whole image at one tile's size after them; each
    tile's patches pixel-shuffled `scale_factor` x `scale_factor` into one token."""
    tile = int((pre.get("max_image_size") or {}).get("longest_edge", 364))
    longest = int((pre.get("size") or {}).get("longest_edge", 4 * 364))
    patch, shuffle = int(vision.get("patch_size", 32)), int(hf.get("scale_factor", 2))
    image = int(hf.get("image_token_id", 128257))
    return VisionSpec(
        family="idefics3",
        image_token_id=image,
        patch_size=patch,
        merge_size=shuffle,
        mean=tuple(pre.get("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(pre.get("image_std", (0.5, 0.5, 0.5))),
        resample=int(pre.get("resample", LANCZOS)),
        mrope=False,
        image_size=tile,
        tokens_per_image=(tile // patch // shuffle) ** 2,
        split_tiles=bool(pre.get("do_image_splitting", True)),
        longest_edge=longest,
        placeholder_id=image,
    )


def _llava_spec(hf: dict, vision: dict, pre: dict) -> VisionSpec:
    """Scaled so its shorter side is `size.shortest_edge` and its centre cropped to
    `crop_size` (or scaled to `size` square), the tower's patches a token each (and its
    class token under the `full` strategy). ValueError for `do_pad`, which is not
    implemented."""
    name = "preprocessor_config.json"
    if pre.get("do_pad"):
        raise ValueError(f"{name}: do_pad (LLaVA's pad to square) is not implemented")
    clip = vision.get("model_type", "clip_vision_model") == "clip_vision_model"
    size, crop = pre.get("size") or {"shortest_edge": 224}, pre.get("crop_size") or {}
    side = int(crop.get("height", size.get("shortest_edge", size.get("height", 224))))
    patch = int(vision.get("patch_size", 32 if clip else 16))
    tower = int(vision.get("image_size", 224))
    full = hf.get("vision_feature_select_strategy", "default") == "full"
    image = int(hf.get("image_token_index", hf.get("image_token_id", 32000)))
    shortest = int(size.get("shortest_edge", 0))
    if side != tower or 0 < shortest < side:
        raise ValueError(
            f"{name}: images cropped to {side} (scaled to {shortest or side}) do not fit "
            f"the tower's image_size {tower}"
        )
    return VisionSpec(
        family="llava",
        image_token_id=image,
        patch_size=patch,
        merge_size=1,
        mean=tuple(pre.get("image_mean", CLIP_MEAN)),
        std=tuple(pre.get("image_std", CLIP_STD)),
        resample=int(pre.get("resample", BICUBIC)),
        mrope=False,
        image_size=side,
        tokens_per_image=(tower // patch) ** 2 + (clip and full),
        shortest_edge=shortest,
        placeholder_id=image,
    )


def _preprocessor_config(folder: Path | None) -> dict:
    return _json_file(folder, "preprocessor_config.json")


def _json_file(folder: Path | None, name: str) -> dict:
    path = folder / name if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
