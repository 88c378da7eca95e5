"""A vision-language model's images in a step: features from the encoder cache (by content
hash, least recently used out first, within `--mm-encoder-cache-mb`), the vision tower run
once over the step's other images together, and the rows of the step they take."""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass

import torch

from ..messages import ForwardBatch, ImageInput, ImageSlice
from ..models.layers import StepImages
from ..multimodal.cache import BoundedCache


@dataclass
class ImageFeatures:
    embeds: torch.Tensor  # [tokens, hidden]
    deepstack: list[torch.Tensor]  # DeepStack models: [tokens, hidden] per early layer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.embeds, *self.deepstack])


@dataclass
class VisionStats:
    images_encoded: int = 0
    cache_hits: int = 0
    encode_seconds: float = 0.0


class VisionEncoder:
    def __init__(self, model, device: torch.device, cache_bytes: int):
        self.model, self.device = model, device
        self.cache: BoundedCache[int, ImageFeatures] = BoundedCache(cache_bytes)
        self.stats = VisionStats()

    @classmethod
    def of(cls, model, device: torch.device, cache_mb: int) -> VisionEncoder | None:
        if not hasattr(model, "encode_images"):
            return None
        return cls(model, device, cache_mb << 20)

    def figures(self) -> dict:
        st = self.stats
        return {
            "images_encoded_total": st.images_encoded,
            "encoder_cache_hits_total": st.cache_hits,
            "encoder_seconds_total": st.encode_seconds,
            "encoder_cache_bytes": self.cache.bytes,
        }

    def step_images(self, fb: ForwardBatch) -> StepImages:
        slices = fb.images
        features = self._features(slices)
        rows = [torch.arange(s.row, s.row + s.end - s.start) for s in slices]
        parts = [features[s.image.digest] for s in slices]
        depth = len(parts[0].deepstack)
        return StepImages(
            torch.cat(rows).to(self.device),
            torch.cat([f.embeds[s.start : s.end] for f, s in zip(parts, slices)]),
            [
                torch.cat([f.deepstack[k][s.start : s.end] for f, s in zip(parts, slices)])
                for k in range(depth)
            ],
            self._blocks(fb) if getattr(self.model, "whole_images", False) else [],
        )

    @staticmethod
    def _blocks(fb: ForwardBatch) -> list[tuple[int, int, int, int]]:
        """Each image of the step as (table row, first position, end, step row)."""
        starts = list(itertools.accumulate(fb.extend_lens, initial=0))
        blocks = []
        for s in fb.images:
            b = bisect.bisect_right(starts, s.row) - 1
            blocks.append((fb.rows[b], s.image.offset + s.start, s.image.offset + s.end, s.row))
        return blocks

    def _features(self, slices: list[ImageSlice]) -> dict[int, ImageFeatures]:
        """Each image's features: cached, or from one tower run over the missing ones. A hit
        counts where an image's first tokens are computed (its later chunks read it again)."""
        found: dict[int, ImageFeatures] = {}
        missing: dict[int, ImageInput] = {}
        for s in slices:
            digest = s.image.digest
            cached = found.get(digest) or self.cache.get(digest)
            if cached is not None:
                self.stats.cache_hits += s.start == 0 and digest not in found
                found[digest] = cached
            else:
                missing[digest] = s.image
        if missing:
            found.update(self._encode(list(missing.values())))
        return found

    def _encode(self, images: list[ImageInput]) -> dict[int, ImageFeatures]:
        started = time.perf_counter()
        pixels = torch.cat(
            [
                torch.frombuffer(bytearray(im.pixels), dtype=torch.float32).view(-1, im.patch_dim)
                for im in images
            ]
        ).to(self.device)
        grids = [tuple(im.grid) for im in images]
        embeds, deepstack = self.model.encode_images(pixels, grids)
        sizes = [im.tokens for im in images]
        out = {}
        for i, (image, part) in enumerate(zip(images, embeds.split(sizes))):
            layers = [d.split(sizes)[i].clone() for d in deepstack]
            out[image.digest] = ImageFeatures(part.clone(), layers)
            self.cache.put(image.digest, out[image.digest])
        self.stats.images_encoded += len(images)
        self.stats.encode_seconds += time.perf_counter() - started
        return out
