"""InternVL 3 and 3.5 in transformers' layout (`InternVLForConditionalGeneration`): each image as
square tiles (and a thumbnail of the whole), each tile through InternViT (a class token and
learned positions, pre-norm blocks whose outputs are scaled per channel, `lambda_1` and
`lambda_2`), its patch features (class token dropped) pixel-shuffled 2x2 into one and projected
by a LayerNorm and a two-layer MLP to the language model's width: Qwen2 (InternVL 3), Qwen3 or
Qwen3-MoE (InternVL 3.5), picked by the text config's type (`registry.BY_TEXT_MODEL`). Plain
positions: an image's tokens are text tokens to the language model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from .decoder import swap_prefix
from .llama import LlamaForCausalLM, Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM
from .qwen_vision import activation
from .siglip import pixel_shuffle

# the checkpoint's names for its parts (as transformers loads them, and as it saves them) -> ours
PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision.tower."),
    ("vision_tower.", "vision.tower."),
    ("model.multi_modal_projector.", "vision.projector."),
    ("multi_modal_projector.", "vision.projector."),
)


def pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class InternViTLayer(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        dim, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-6)
        self.heads = vc["num_attention_heads"]
        norm = nn.RMSNorm if vc.get("norm_type", "layer_norm") == "rms_norm" else nn.LayerNorm
        self.layernorm_before, self.layernorm_after = norm(dim, eps=eps), norm(dim, eps=eps)
        self.attention = nn.Module()
        bias = vc.get("attention_bias", False)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self.attention, name, nn.Linear(dim, dim, bias=bias))
        self.attention.projection_layer = nn.Linear(dim, dim)
        self.qk_norm = vc.get("use_qk_norm", False)
        if self.qk_norm:
            self.attention.q_norm = nn.RMSNorm(dim, eps=1e-6)
            self.attention.k_norm = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, vc["intermediate_size"])
        self.mlp.fc2 = nn.Linear(vc["intermediate_size"], dim)
        self.act = activation(vc.get("hidden_act", "gelu"))
        self.lambda_1 = nn.Parameter(torch.ones(dim))
        self.lambda_2 = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [tiles, tokens, dim]: each tile attends within itself."""
        at, h = self.attention, self.layernorm_before(x)
        q, k, v = at.q_proj(h), at.k_proj(h), at.v_proj(h)
        if self.qk_norm:
            q, k = at.q_norm(q), at.k_norm(k)
        heads = [t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*heads).transpose(1, 2).flatten(2)
        x = x + self.lambda_1 * at.projection_layer(out)
        return x + self.lambda_2 * self.mlp.fc2(self.act(self.mlp.fc1(self.layernorm_after(x))))


class InternViT(nn.Module):
    """Tiles `[tiles, 3, size, size]` -> the features of the chosen layer `[tiles, 1 + patches,
    dim]` (the last layer's after the final norm, unless the config pools by mean)."""

    def __init__(self, vc: dict, feature_layer: int):
        super().__init__()
        dim, self.patch = vc["hidden_size"], pair(vc.get("patch_size", 14))
        rows, columns = (s // p for s, p in zip(pair(vc.get("image_size", 448)), self.patch))
        self.grid = (rows, columns)
        self.embeddings = nn.Module()
        self.embeddings.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.embeddings.patch_embeddings = nn.Module()
        self.embeddings.patch_embeddings.projection = nn.Conv2d(
            vc.get("num_channels", 3), dim, self.patch, self.patch
        )
        self.with_positions = vc.get("use_absolute_position_embeddings", True)
        if self.with_positions:
            table = torch.zeros(1, rows * columns + 1, dim)
            self.embeddings.position_embeddings = nn.Parameter(table)
        self.encoder = nn.Module()
        layers = (InternViTLayer(vc) for _ in range(vc["num_hidden_layers"]))
        self.encoder.layer = nn.ModuleList(layers)
        self.final_norm = not vc.get("use_mean_pooling", True)
        if self.final_norm:
            self.layernorm = nn.LayerNorm(dim, eps=vc.get("layer_norm_eps", 1e-6))
        depth = len(self.encoder.layer)
        self.feature_layer = feature_layer % (depth + 1)  # hidden states 0..depth

    def positions(self, rows: int, columns: int) -> torch.Tensor:
        table = self.embeddings.position_embeddings
        if (rows, columns) == self.grid:
            return table
        side = self.grid[0]
        grid = table[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, columns), mode="bicubic", align_corners=False)
        return torch.cat([table[:, :1], grid.permute(0, 2, 3, 1).flatten(1, 2)], dim=1)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        proj = self.embeddings.patch_embeddings.projection
        x = proj(tiles.to(proj.weight.dtype)).flatten(2).transpose(1, 2)
        rows, columns = (s // p for s, p in zip(tiles.shape[2:], self.patch))
        x = torch.cat([self.embeddings.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.with_positions:
            x = x + self.positions(rows, columns)
        for layer in self.encoder.layer[: self.feature_layer]:
            x = layer(x)
        last = self.feature_layer == len(self.encoder.layer)
        return self.layernorm(x) if last and self.final_norm else x


class InternVLVision(nn.Module):
    """The tower and the projector: each tile's patch features (its class token dropped, the
    `default` feature select strategy) pixel-shuffled (`shuffle` x `shuffle` neighbours into
    one token, as transformers' `pixel_shuffle` orders them) and projected."""

    def __init__(self, hf: dict, text_hidden: int):
        super().__init__()
        vc = hf["vision_config"]
        self.tower = InternViT(vc, int(hf.get("vision_feature_layer", -1)))
        self.shuffle = round(1 / hf.get("downsample_ratio", 0.5))
        width = vc["hidden_size"] * self.shuffle**2
        self.projector = nn.Module()
        self.projector.layer_norm = nn.LayerNorm(width)
        self.projector.linear_1 = nn.Linear(width, text_hidden)
        self.projector.linear_2 = nn.Linear(text_hidden, text_hidden)
        self.act = activation(hf.get("projector_hidden_act", "gelu"))

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        """`[tiles, 3, size, size]` -> the tiles' tokens in turn `[tiles x tokens, hidden]`."""
        x = self.tower(tiles)[:, 1:]  # the class token dropped (`config_checks.check_supported`)
        x = pixel_shuffle(x, self.shuffle)
        pr = self.projector
        return pr.linear_2(self.act(pr.linear_1(pr.layer_norm(x))))


class InternVLImages:
    """InternVL's tower and projector in front of the language model class it is mixed into."""

    def __init__(self, cfg, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.vision = InternVLVision(self.hf, cfg.hidden_size)

    def rename(self, name: str) -> str | None:
        return super().rename(swap_prefix(name, PREFIXES))

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids):
        """Each image's tiles (rows of `3 x size x size` pixels, `size` the grid's patches a
        side: the processor's tile, the tower's positions resampled where it differs) -> their
        tokens, image after image, tile after tile."""
        size = grids[0][1] * self.vision.tower.patch[0]
        return self.vision(pixels.view(-1, 3, size, size)), []


class InternVLForConditionalGeneration(InternVLImages, LlamaForCausalLM):
    """InternVL 3: a Qwen2 (or Llama) language model."""


class InternVLQwen3ForConditionalGeneration(InternVLImages, Qwen3ForCausalLM):
    """InternVL 3.5 over Qwen3."""


class InternVLQwen3MoeForConditionalGeneration(InternVLImages, Qwen3MoeForCausalLM):
    """InternVL 3.5 over Qwen3-MoE."""
