"""GLM-4.1V and GLM-4.6V-Flash (`Glm4vForConditionalGeneration`), GLM-4.5V and GLM-4.6V
(`Glm4vMoeForConditionalGeneration`): the GLM-4 (or GLM-4.5 MoE) language model with M-RoPE in
consecutive sections over half of each head, and their vision tower: Qwen-VL's frame (patches
of each merge block together, a 2-D rotary over each image, bidirectional blocks within an
image) with RMSNorms, no biases, learned positions resampled bicubically to each image's grid,
then a convolution that merges merge x merge patches and a gated MLP to the language model's
width."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .dense_families import Glm4ForCausalLM
from .moe_families import Glm4MoeForCausalLM
from .qwen_vision import GatedMLP, QwenVisionTower, VisionBlock
from .qwen_vl import MRotaryEmbedding, VisionLanguage
from .recipe import LayerRecipe, ModelRecipe, rotary_fraction

DEFAULT_MROPE_SECTION = [8, 12, 12]  # transformers' when the config names none


class Glm4vMerger(GatedMLP):
    """A square projection, a LayerNorm and GELU, then the gated MLP (`gate_proj`, `up_proj`,
    `down_proj` under `merger.`)."""

    def __init__(self, dim: int, context: int, act: str):
        super().__init__(dim, context, act, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)

    def forward(self, x):
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class Glm4vVisionTower(QwenVisionTower):
    patch_bias = True

    def __init__(self, vc: dict):
        super().__init__(vc)
        eps, out = vc.get("rms_norm_eps", 1e-5), vc["out_hidden_size"]
        self.post_conv_layernorm = nn.RMSNorm(self.dim, eps=eps)
        side = vc.get("image_size", 336) // vc.get("patch_size", 14)
        self.embeddings = nn.Module()
        self.embeddings.position_embedding = nn.Embedding(side * side, self.dim)
        self.post_layernorm = nn.RMSNorm(self.dim, eps=eps)
        self.downsample = nn.Conv2d(self.dim, out, self.merge, self.merge)
        self.merger = Glm4vMerger(out, vc["intermediate_size"], vc.get("hidden_act", "silu"))

    @staticmethod
    def rotary_theta(vc: dict) -> float:
        return (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)

    def make_block(self, vc: dict, heads: int) -> nn.Module:
        dim, eps = vc["hidden_size"], vc.get("rms_norm_eps", 1e-5)
        mlp = GatedMLP(dim, vc["out_hidden_size"], vc.get("hidden_act", "silu"), bias=False)
        biases = (vc.get("attention_bias", False), False)
        return VisionBlock(dim, heads, mlp, lambda d: nn.RMSNorm(d, eps=eps), biases)

    def positions(self, grids, rows_cols: torch.Tensor) -> torch.Tensor:
        """The learned square table sampled bicubically (corners not aligned, borders
        repeated) at each patch's centre, scaled to its image's grid."""
        weight = self.embeddings.position_embedding.weight
        side = int(weight.shape[0] ** 0.5)
        table = weight.view(side, side, -1).permute(2, 0, 1)[None].float()
        sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids])
        centres = ((rows_cols + 0.5) / sizes.float()) * 2 - 1  # (row, column) in [-1, 1]
        at = centres.flip(-1)[None, :, None, :]  # grid_sample reads (x, y)
        sampled = F.grid_sample(
            table, at, mode="bicubic", align_corners=False, padding_mode="border"
        )
        return sampled[0, :, :, 0].T.to(weight.dtype)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        x = self.post_conv_layernorm(self.embed_patches(pixels))
        rows_cols = self.rows_cols(grids)
        cos, sin = self.rotary(rows_cols)
        x = x + self.positions(grids, rows_cols).to(x.dtype)
        bounds = self.image_bounds(grids)
        for block in self.blocks:
            x = block(x, bounds, cos, sin)
        m = self.merge
        x = self.post_layernorm(x).view(-1, m, m, self.dim).permute(0, 3, 1, 2)
        x = self.downsample(x).view(-1, self.downsample.out_channels)
        return self.merger(x), []


class Glm4vLanguage(VisionLanguage):
    """What both GLM-4.xV classes add to their language model: the tower, and M-RoPE over the
    share of each head the language model's recipe turns (transformers' sections where the
    config names none)."""

    tower_class = Glm4vVisionTower

    def make_rotaries(self, max_positions: int):
        cfg = self.cfg
        rope = self.hf.get("rope_parameters") or self.hf.get("rope_scaling") or {}
        section = {"mrope_section": rope.get("mrope_section", DEFAULT_MROPE_SECTION)}
        width = int(cfg.head_dim * self.recipe.rotary_fraction)
        return [
            MRotaryEmbedding(width, max_positions, cfg.rope_theta, cfg.rope_scaling_dict, section)
        ]


class Glm4vForConditionalGeneration(Glm4vLanguage, Glm4ForCausalLM):
    """Also GLM-4.6V's checkpoints (`Glm46VForConditionalGeneration`) over GLM-4.1V's language
    model; over GLM-4.5's MoE they are `Glm4vMoeForConditionalGeneration`'s
    (`registry.BY_TEXT_MODEL`)."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        """transformers turns the whole head where the config names no partial rotary."""
        return ModelRecipe(interleaved_rope=True, rotary_fraction=rotary_fraction(hf, 1.0))

    def layer_recipe(self, i: int) -> LayerRecipe:
        return replace(super().layer_recipe(i), qkv_bias=True)  # whatever the config says


class Glm4vMoeForConditionalGeneration(Glm4vLanguage, Glm4MoeForCausalLM):
    """GLM-4.5V and GLM-4.6V: the same tower over GLM-4.5's MoE language model (a rotate-half
    rotary over half of each head by default, a q/k/v bias unless the config says none)."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(rotary_fraction=rotary_fraction(hf, 0.5))

    def layer_recipe(self, i: int) -> LayerRecipe:
        return replace(super().layer_recipe(i), qkv_bias=self.hf.get("attention_bias", True))
