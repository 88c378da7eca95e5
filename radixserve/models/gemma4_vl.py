"""Gemma 4 with images: its vision tower (patches embedded with a learnt 2-D position table,
bidirectional layers with q, k and unweighted v norms and an axial rotary over the patch's
column and row, linears that may clip their inputs and outputs to the checkpoint's bounds),
each k x k patches averaged into one token, scaled by sqrt(width), optionally standardized,
normed and projected to the language model's width.

An image's tokens take the per-layer inputs (PLE) of the pad token, mixed with a projection of
the image's features. With `use_bidirectional_attention: vision` an image's tokens attend to
each other both ways on the sliding layers (the global layers stay causal): a step computes an
image whole and its rows are attended again over the image (`gemma.attend_whole_images`); the
KV-sharing layers skip that, since their image rows feed no KV and no sampled token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from .decoder import swap_prefix
from .gemma4 import Gemma4ForCausalLM
from .layers import RMSNorm, StepImages, activation
from .recipe import UnweightedNorm
from .rotary import apply_rotary

# the checkpoint's names for its parts -> ours (its audio tower's: Gemma4ForCausalLM.rename)
PREFIXES = (
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision."),
    ("model.embed_vision.", "vision.embed."),
)


class ClippedLinear(nn.Module):
    """A linear without bias; `clipped`: its input and output clamped to the checkpoint's
    bounds (`input_min` ... `output_max`)."""

    def __init__(self, inputs: int, outputs: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs, bias=False)
        self.clipped = clipped
        if clipped:
            low, high = torch.tensor(float("-inf")), torch.tensor(float("inf"))
            self.input_min, self.input_max = nn.Parameter(low), nn.Parameter(high)
            self.output_min, self.output_max = nn.Parameter(low.clone()), nn.Parameter(high.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


def axial_rotary(positions: torch.Tensor, head_dim: int, theta: float):
    """cos and sin `[patches, 1, head_dim / 2]`: a quarter-width table for each half of a head,
    the first turned by the patch's column, the second by its row (`rotate_halves`)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter))
    angles = torch.cat([positions[:, axis, None].float() * inv_freq for axis in (0, 1)], dim=-1)
    return angles.unsqueeze(1).cos(), angles.unsqueeze(1).sin()


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each half of each head rotated (`rotary.apply_rotary`) by its own half of the tables."""
    parts = zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1))
    return torch.cat([apply_rotary(part, c, s) for part, c, s in parts], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        dim, clipped = vc["hidden_size"], bool(vc.get("use_clipped_linears"))
        self.heads, self.kv_heads = vc["num_attention_heads"], vc["num_key_value_heads"]
        self.head_dim, eps = vc.get("head_dim", dim // self.heads), vc.get("rms_norm_eps", 1e-6)
        self.q_proj = ClippedLinear(dim, self.heads * self.head_dim, clipped)
        self.k_proj = ClippedLinear(dim, self.kv_heads * self.head_dim, clipped)
        self.v_proj = ClippedLinear(dim, self.kv_heads * self.head_dim, clipped)
        self.o_proj = ClippedLinear(self.heads * self.head_dim, dim, clipped)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        self.v_norm = UnweightedNorm(self.head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[patches, dim]` of one image, every patch seeing every other; scores unscaled."""
        n, d = len(x), self.head_dim
        q = self.q_norm(self.q_proj(x).view(-1, d)).view(n, -1, d)
        k = self.k_norm(self.k_proj(x).view(-1, d)).view(n, -1, d)
        v = self.v_norm(self.v_proj(x).view(n, -1, d))
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0
        )
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class VisionLayer(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        dim, eps, clipped = (
            vc["hidden_size"],
            vc.get("rms_norm_eps", 1e-6),
            vc.get("use_clipped_linears"),
        )
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            self.add_module(f"{name}_layernorm", RMSNorm(dim, eps))
        self.self_attn = VisionAttention(vc)
        self.mlp = nn.Module()
        hidden = vc["intermediate_size"]
        self.mlp.gate_proj = ClippedLinear(dim, hidden, bool(clipped))
        self.mlp.up_proj = ClippedLinear(dim, hidden, bool(clipped))
        self.mlp.down_proj = ClippedLinear(hidden, dim, bool(clipped))
        self.act = activation(vc.get("hidden_activation", "gelu_pytorch_tanh"))

    def forward(self, x, cos, sin):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        mlp, h = self.mlp, self.pre_feedforward_layernorm(x)
        h = mlp.down_proj(self.act(mlp.gate_proj(h)) * mlp.up_proj(h))
        return x + self.post_feedforward_layernorm(h)


class Gemma4VisionTower(nn.Module):
    """`vision_tower.*` and `embed_vision.*` (as `embed.*`) of the checkpoint."""

    def __init__(self, vc: dict, text_hidden: int):
        super().__init__()
        dim, patch = vc["hidden_size"], vc.get("patch_size", 16)
        self.pool, self.dim = vc.get("pooling_kernel_size", 3), dim
        self.head_dim = vc.get("head_dim", dim // vc["num_attention_heads"])
        self.theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 100.0))
        self.patch_embedder = nn.Module()
        self.patch_embedder.input_proj = nn.Linear(3 * patch * patch, dim, bias=False)
        table = torch.zeros(2, vc.get("position_embedding_size", 10240), dim)
        self.patch_embedder.position_embedding_table = nn.Parameter(table)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(vc) for _ in range(vc["num_hidden_layers"]))
        self.standardize = bool(vc.get("standardize"))
        if self.standardize:
            self.std_bias = nn.Parameter(torch.zeros(dim))
            self.std_scale = nn.Parameter(torch.ones(dim))
        self.embed = nn.Module()
        self.embed.embedding_pre_projection_norm = UnweightedNorm(dim, vc.get("rms_norm_eps", 1e-6))
        self.embed.embedding_projection = nn.Linear(dim, text_hidden, bias=False)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches `[rows x columns, P x P x 3]` (pixels in [0, 1]) -> its tokens
        `[rows / k x columns / k, text_hidden]`."""
        _, rows, columns = grid
        embedder, k = self.patch_embedder, self.pool
        x = embedder.input_proj((2 * (pixels - 0.5)).to(embedder.input_proj.weight.dtype))
        positions = (
            torch.stack(
                torch.meshgrid(torch.arange(columns), torch.arange(rows), indexing="xy"), dim=-1
            )
            .reshape(-1, 2)
            .to(x.device)
        )
        table = embedder.position_embedding_table
        x = x + table[0][positions[:, 0]] + table[1][positions[:, 1]]
        cos, sin = (t.to(x.dtype) for t in axial_rotary(positions, self.head_dim, self.theta))
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        pooled = x.float().view(rows // k, k, columns // k, k, self.dim).mean(dim=(1, 3))
        pooled = pooled.reshape(-1, self.dim) * self.dim**0.5
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        embed = self.embed
        return embed.embedding_projection(embed.embedding_pre_projection_norm(pooled.to(x.dtype)))


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    def __init__(self, cfg, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.vision = Gemma4VisionTower(self.hf["vision_config"], cfg.hidden_size)
        # a step's images as (table row, first position, end, step row), read by the sliding
        # layers when images attend both ways there
        self.blocks: list[tuple[int, int, int, int]] = []
        self.whole_images = self.hf.get("use_bidirectional_attention") == "vision"
        if self.whole_images:  # the sliding layers that store KV: a shared layer's image rows
            # feed no KV and no sampled token, so how they attend changes nothing
            for i in range(self.first_shared):
                if self.types[i] == "sliding_attention":
                    self.model.layers[i].self_attn.image_blocks = self.blocks

    def rename(self, name: str) -> str | None:
        renamed = swap_prefix(name, PREFIXES)
        return renamed if renamed != name else super().rename(name)

    def forward(self, input_ids, positions, backend, images: StepImages | None = None):
        self.blocks[:] = images.blocks if images is not None else []
        return super().forward(input_ids, positions, backend, images)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids):
        sizes = [rows * columns for _, rows, columns in grids]
        dtype = self.vision.embed.embedding_projection.weight.dtype
        parts = pixels.to(dtype).split(sizes)
        return torch.cat([self.vision(part, grid) for part, grid in zip(parts, grids)]), []
