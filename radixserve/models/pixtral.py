"""Mistral 3 (Mistral Small 3.1 and later) with images: the Pixtral tower (each image at its own
size, patches embedded by a convolution, RMS-normed, bidirectional layers over one image with a
2-D rotary over the patch's row and column) and the projector (normed, each merge x merge patch
block concatenated and merged, two linears around an activation) over a Mistral, Ministral 3 or
Mistral 4 language model.

An image spans rows of tokens, each row its features then a row-break token, the last break an
image-end token (`multimodal.expansion.image_span`). The break and end tokens stay text: a
step's image rows that hold a vocabulary token keep that token's embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from .decoder import swap_prefix
from .deepseek_v3 import Mistral4ForCausalLM
from .layers import RMSNorm, StepImages
from .llama import Ministral3ForCausalLM
from .qwen_vision import activation
from .rotary import apply_rotary

PREFIXES = (
    ("model.vision_tower.", "vision."),
    ("vision_tower.", "vision."),
    ("model.multi_modal_projector.", "vision.projector."),
    ("multi_modal_projector.", "vision.projector."),
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def axial_rotary(rows: int, columns: int, head_dim: int, theta: float):
    """cos and sin `[patches, 1, head_dim / 2]` (`rotary.apply_rotary`'s tables) of Pixtral's
    2-D rotary: alternate frequencies turn by the patch's row and by its column, the two sets
    side by side."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    row, column = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
    angles = torch.cat(
        [row.reshape(-1, 1) * inv_freq[0::2], column.reshape(-1, 1) * inv_freq[1::2]], dim=-1
    ).unsqueeze(1)
    return angles.cos(), angles.sin()


class PixtralLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = RMSNorm(dim, 1e-5), RMSNorm(dim, 1e-5)
        self.attention = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.attention, name, nn.Linear(dim, dim, bias=False))
        self.feed_forward = nn.Module()
        ff = self.feed_forward
        ff.gate_proj, ff.up_proj = (
            nn.Linear(dim, hidden, bias=False),
            nn.Linear(dim, hidden, bias=False),
        )
        ff.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, n = self.attention, len(x)
        h = self.attention_norm(x)
        q, k, v = (p(h).view(n, self.heads, -1) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        )
        x = x + a.o_proj(out.transpose(0, 1).reshape(n, -1))
        ff, h = self.feed_forward, self.ffn_norm(x)
        return x + ff.down_proj(self.act(ff.gate_proj(h)) * ff.up_proj(h))


class PixtralTower(nn.Module):
    """`vision_tower.*` and `multi_modal_projector.*` (as `projector.*`) of the checkpoint."""

    def __init__(self, hf: dict, text_hidden: int):
        super().__init__()
        vc = hf["vision_config"]
        dim, heads, patch = vc["hidden_size"], vc["num_attention_heads"], vc.get("patch_size", 16)
        self.dim, self.head_dim = dim, vc.get("head_dim") or dim // heads
        self.theta = float(
            (vc.get("rope_parameters") or {}).get("rope_theta", vc.get("rope_theta", 1e4))
        )
        self.patch_conv = nn.Conv2d(vc.get("num_channels", 3), dim, patch, patch, bias=False)
        self.ln_pre = RMSNorm(dim, 1e-5)
        self.transformer = nn.Module()
        act = vc.get("hidden_act", "gelu")
        layers = [
            PixtralLayer(dim, heads, vc["intermediate_size"], act)
            for _ in range(vc["num_hidden_layers"])
        ]
        self.transformer.layers = nn.ModuleList(layers)
        self.feature_layer = int(hf.get("vision_feature_layer", -1))
        self.merge = int(hf.get("spatial_merge_size", 2))
        bias = bool(hf.get("multimodal_projector_bias", False))
        self.projector = nn.Module()
        pr = self.projector
        pr.norm = RMSNorm(dim, hf.get("rms_norm_eps", 1e-5))
        pr.patch_merger = nn.Module()
        pr.patch_merger.merging_layer = nn.Linear(dim * self.merge**2, dim, bias=False)
        pr.linear_1 = nn.Linear(dim, text_hidden, bias=bias)
        pr.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(hf.get("projector_hidden_act", "gelu"))

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches `[rows x columns, C x P x P]` -> its merged features
        `[rows / merge x columns / merge, text_hidden]`, row by row."""
        _, rows, columns = grid
        x = self.ln_pre(
            patches.to(self.patch_conv.weight.dtype) @ self.patch_conv.weight.flatten(1).T
        )
        cos, sin = (t.to(x.dtype) for t in axial_rotary(rows, columns, self.head_dim, self.theta))
        states = [x]
        for layer in self.transformer.layers:
            states.append(layer(states[-1], cos, sin))
        pr, m = self.projector, self.merge
        x = pr.norm(states[self.feature_layer])
        blocks = x.view(rows // m, m, columns // m, m, self.dim).permute(0, 2, 4, 1, 3)
        x = pr.patch_merger.merging_layer(blocks.reshape(-1, self.dim * m * m))
        return pr.linear_2(self.act(pr.linear_1(x)))


class PixtralImages:
    """The Pixtral tower and projector in front of the language model class it is mixed into."""

    def __init__(self, cfg, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.vision = PixtralTower(self.hf, cfg.hidden_size)

    def rename(self, name: str) -> str | None:
        return super().rename(swap_prefix(name, PREFIXES))

    def embed(self, input_ids: torch.Tensor, images: StepImages | None = None) -> torch.Tensor:
        """Image rows that hold a vocabulary token (row breaks, the image's end) keep its
        embedding; the others take the image's features."""
        if images is not None:
            keep = input_ids[images.rows] >= self.cfg.vocab_size
            images = StepImages(images.rows[keep], images.embeds[keep], images.deepstack)
        return super().embed(input_ids, images)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids):
        """Each image's span: its merged features row by row, a zero row after each row where
        the prompt holds the row-break (or image-end) token."""
        sizes = [rows * columns for _, rows, columns in grids]
        spans = []
        for part, grid in zip(pixels.split(sizes), grids):
            features = self.vision(part, grid)
            per_row = grid[2] // self.vision.merge
            rows = features.view(-1, per_row, features.shape[-1])
            spans.append(F.pad(rows, (0, 0, 0, 1)).reshape(-1, features.shape[-1]))
        return torch.cat(spans), []


class Mistral3ForConditionalGeneration(PixtralImages, Ministral3ForCausalLM):
    """Mistral 3 and Ministral 3 with images: a Mistral or Ministral 3 language model."""


class Mistral4VisionForConditionalGeneration(PixtralImages, Mistral4ForCausalLM):
    """Mistral Small 4 with images (`Mistral3ForConditionalGeneration` over a `mistral4` text
    config): Mistral 4's latent attention and experts."""
