"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`):
each image as square tiles and the whole image at one tile's size (`multimodal.processing`
cuts them; each is its own part of the prompt between text tokens), each tile through SigLIP
(positions bucketed into the tower's table), its patches
pixel-shuffled `scale_factor` x `scale_factor` into one token and projected by one matrix to
the Llama language model's width. Plain positions: an image's tokens are text tokens to the
language model."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import TPGroup
from .decoder import swap_prefix
from .llama import LlamaForCausalLM
from .siglip import SiglipTower, pixel_shuffle

# the checkpoint's names for its parts -> ours
PREFIXES = (
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision."),
    ("model.connector.modality_projection.proj.", "vision.projection."),
)
VISION_DEFAULTS = {"image_size": 224, "patch_size": 32}  # transformers' Idefics3VisionConfig


class Idefics3Vision(SiglipTower):
    def __init__(self, hf: dict, text_hidden: int):
        vc = {**VISION_DEFAULTS, **hf["vision_config"]}
        super().__init__(vc)
        self.scale = int(hf.get("scale_factor", 2))
        self.projection = nn.Linear(vc["hidden_size"] * self.scale**2, text_hidden, bias=False)

    def bucketed_positions(self, patches: int) -> torch.Tensor:
        """Each patch's row of the position table for a tile `patches` x `patches` patches: its
        fractional place bucketed into the table's `side` steps, in float32 as transformers
        computes it (at the tower's own size too, where rounding moves some rows)."""
        bounds = torch.arange(1 / self.side, 1.0, 1 / self.side)
        steps = torch.arange(patches, dtype=torch.float32) * (1.0 / torch.tensor(patches))
        buckets = torch.bucketize(steps.clamp(max=1.0 - 1e-6), bounds, right=True)
        return (buckets[:, None] * self.side + buckets[None, :]).flatten()

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        """`[tiles, 3, size, size]` -> the tiles' tokens in turn `[tiles x tokens, hidden]`."""
        positions = self.bucketed_positions(tiles.shape[-1] // self.patch)
        return self.projection(pixel_shuffle(self.encode(tiles, positions), self.scale))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """Idefics3 and SmolVLM: a Llama language model behind the tiles' tower."""

    def __init__(self, cfg, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.vision = Idefics3Vision(self.hf, cfg.hidden_size)

    def rename(self, name: str) -> str | None:
        return super().rename(swap_prefix(name, PREFIXES))

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids):
        """Each tile (a row of `3 x size x size` pixels, `size` its grid's patches a side) ->
        its tokens, tile after tile."""
        size = grids[0][1] * self.vision.patch
        return self.vision(pixels.view(-1, 3, size, size)), []
