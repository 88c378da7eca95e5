"""Gemma 3 with images: a SigLIP tower (one fixed size, patches embedded with learned
positions, bidirectional blocks, a final layer norm), its output pooled to `mm_tokens_per_image`
tokens, normed and projected to the language model's width. In the language model an image's
tokens attend to each other both ways (each image a block; text stays causal), so a step
computes an image whole: chunks and cached prefixes end outside images (`whole_images`), and
after each layer's causal attention the rows of the step's image tokens are attended again
over the request's keys up to their image's end (`BlockAttention`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from .decoder import Attention, swap_prefix
from .gemma import Gemma3ForCausalLM, GemmaNorm, attend_whole_images
from .layers import StepImages
from .siglip import SiglipTower

# the checkpoint's names for its parts (newer and older transformers) -> ours
PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("model.vision_tower.vision_model.", "vision."),
    ("vision_tower.vision_model.", "vision."),
    ("model.vision_tower.", "vision."),
    ("vision_tower.", "vision."),
    ("model.multi_modal_projector.", "vision."),
    ("multi_modal_projector.", "vision."),
)


class Gemma3VisionTower(SiglipTower):
    """`vision_tower.*` and `multi_modal_projector.*` of the checkpoint; SigLIP's pooling head
    is not used."""

    def __init__(self, vc: dict, text_hidden: int, tokens_per_image: int):
        super().__init__({"image_size": 896, **vc})
        dim = vc["hidden_size"]
        self.pool = self.side // int(tokens_per_image**0.5)
        self.norm = GemmaNorm(dim, vc.get("layer_norm_eps", 1e-6))
        self.projection = nn.Parameter(torch.zeros(dim, text_hidden))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """`[images, C x H x W]` -> `[images x tokens_per_image, text_hidden]`."""
        channels = self.embeddings.patch_embedding.in_channels
        x = self.encode(pixels.view(-1, channels, self.size, self.size))
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2).reshape(-1, d)
        return self.norm(pooled.contiguous()) @ self.projection


class BlockAttention(Attention):
    """Gemma 3's attention where the image tokens of a step see their whole image."""

    def __init__(self, *args, blocks: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocks = blocks  # the model's: this step's image blocks, shared by its layers

    def forward(self, x, ropes, backend):
        q, out = self.attend(x, ropes, backend)
        out = attend_whole_images(q, out, backend, self.layer, self.cfg, self.how, self.blocks)
        return self.tp.all_reduce(self.o_proj(out))


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    whole_images = True

    def __init__(self, cfg, max_positions: int, tp: TPGroup = TPGroup()):
        self.blocks: list[tuple[int, int, int, int]] = []
        super().__init__(cfg, max_positions, tp)
        self.vision = Gemma3VisionTower(
            self.hf["vision_config"], cfg.hidden_size, int(self.hf.get("mm_tokens_per_image", 256))
        )

    def make_attention(self, *args, **kwargs) -> Attention:
        return BlockAttention(*args, blocks=self.blocks, **kwargs)

    def rename(self, name: str) -> str | None:
        name = swap_prefix(name, PREFIXES)
        if name.startswith("vision.head."):
            return None
        return {
            "vision.mm_input_projection_weight": "vision.projection",
            "vision.mm_soft_emb_norm.weight": "vision.norm.weight",
        }.get(name, name)

    def forward(self, input_ids, positions, backend, images: StepImages | None = None):
        self.blocks[:] = images.blocks if images is not None else []
        return super().forward(input_ids, positions, backend, images)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids):
        return self.vision(pixels), []
