"""Qwen-VL vision towers, loaded by HF's names under `visual.`: patches embedded (the Conv3d as
one matrix product), blocks of bidirectional attention with a 2-D rotary embedding over each
image (Qwen2.5-VL: most blocks within 112-pixel windows, `fullatt_block_indexes` over the whole
image), then merge x merge patches merged into one token of the language model's width.
Qwen3-VL adds learned positions (resampled to the image's grid) and DeepStack: features of
some blocks, merged alike, that the language model adds to its first layers' hidden states.
A step's images run as one batch, each attending within itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionRotary(nn.Module):
    """Each patch's (row, column) rotates half of each head's pairs by row, half by column."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        quarter = head_dim // 2
        inv = 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, rows_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = (rows_cols[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim/2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x32.shape[-1] // 2
    turned = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int, qkv_bias: bool = True, proj_bias: bool = True):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def forward(self, x: torch.Tensor, bounds: list[int], cos, sin) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = torch.empty_like(q)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            seg = [t[lo:hi].transpose(0, 1) for t in (q, k, v)]
            out[lo:hi] = F.scaled_dot_product_attention(*seg).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, bias: bool = True):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"vision hidden_act {name!r} is not implemented")


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: nn.Module, norm, attention_biases=(True, True)):
        super().__init__()
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn = VisionAttention(dim, heads, *attention_biases)
        self.mlp = mlp

    def forward(self, x, bounds, cos, sin):
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen25Merger(nn.Module):
    """Qwen2.5-VL's (Qwen2-VL's: `norm` a LayerNorm)."""

    def __init__(self, dim: int, context: int, merge: int, norm=nn.RMSNorm):
        super().__init__()
        self.width = context * merge * merge
        self.ln_q = norm(context, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, dim)
        )

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen3Merger(nn.Module):
    def __init__(self, dim: int, context: int, merge: int, after_shuffle: bool):
        super().__init__()
        self.width, self.after_shuffle = context * merge * merge, after_shuffle
        self.norm = nn.LayerNorm(self.width if after_shuffle else context, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, dim)

    def forward(self, x):
        x = self.norm(x.view(-1, self.width) if self.after_shuffle else x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class QwenVisionTower(nn.Module):
    """The shared frame of both towers; `forward(pixels, grids)` gives each image's merged
    tokens in prompt order, `[tokens, out_hidden]`, and the DeepStack features alike."""

    def __init__(self, vc: dict):
        super().__init__()
        self.merge = vc.get("spatial_merge_size", 2)
        self.dim, heads = vc["hidden_size"], vc["num_heads"]
        patch, temporal = vc.get("patch_size", 14), vc.get("temporal_patch_size", 2)
        kernel = (temporal, patch, patch)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            vc.get("in_channels", 3), self.dim, kernel, kernel, bias=self.patch_bias
        )
        self.rotary = VisionRotary(self.dim // heads, self.rotary_theta(vc))
        self.blocks = nn.ModuleList(self.make_block(vc, heads) for _ in range(vc["depth"]))

    patch_bias = False

    @staticmethod
    def rotary_theta(vc: dict) -> float:
        return 10000.0  # what transformers' Qwen-VL towers use, whatever the config says

    def embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        proj = self.patch_embed.proj
        return F.linear(pixels.to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)

    def rows_cols(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each patch's (row, column), patches of one merge block together."""
        m, out = self.merge, []
        for t, h, w in grids:
            rows = torch.arange(h)[:, None].expand(h, w)
            cols = torch.arange(w)[None, :].expand(h, w)
            both = torch.stack([rows, cols], -1).view(h // m, m, w // m, m, 2)
            out.append(both.transpose(1, 2).reshape(-1, 2).repeat(t, 1))
        return torch.cat(out)

    @staticmethod
    def image_bounds(grids: list[tuple[int, int, int]]) -> list[int]:
        bounds = [0]
        for t, h, w in grids:
            bounds += [bounds[-1] + h * w * (i + 1) for i in range(t)]
        return bounds


class Qwen25VisionTower(QwenVisionTower):
    def __init__(self, vc: dict):
        super().__init__(vc)
        self.full_blocks = set(vc.get("fullatt_block_indexes", []))
        self.window = vc.get("window_size", 112) // self.merge // vc.get("patch_size", 14)
        self.merger = Qwen25Merger(vc["out_hidden_size"], self.dim, self.merge)

    def make_block(self, vc: dict, heads: int) -> nn.Module:
        mlp = GatedMLP(vc["hidden_size"], vc["intermediate_size"], vc.get("hidden_act", "silu"))
        return VisionBlock(vc["hidden_size"], heads, mlp, lambda d: nn.RMSNorm(d, eps=1e-6))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        order, window_bounds = self.window_order(grids)
        unit = self.merge * self.merge
        x = self.embed_patches(pixels)
        x = x.view(-1, unit, self.dim)[order].reshape(-1, self.dim)
        cos, sin = self.rotary(self.rows_cols(grids))
        cos = cos.view(-1, unit, cos.shape[-1])[order].flatten(0, 1)
        sin = sin.view(-1, unit, sin.shape[-1])[order].flatten(0, 1)
        images = self.image_bounds(grids)
        for i, block in enumerate(self.blocks):
            x = block(x, images if i in self.full_blocks else window_bounds, cos, sin)
        return self.merger(x)[torch.argsort(order)], []

    def window_order(self, grids) -> tuple[torch.Tensor, list[int]]:
        """The merged tokens ordered window by window (windows of `self.window` tokens a side,
        row-major within each image), and the windows' bounds in patches."""
        order, bounds, base, unit = [], [0], 0, self.merge * self.merge
        size = self.window
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = torch.arange(t * gh * gw).view(t, gh, gw)
            for frame in range(t):
                for r in range(0, gh, size):
                    for c in range(0, gw, size):
                        cell = index[frame, r : r + size, c : c + size].reshape(-1)
                        order.append(cell + base)
                        bounds.append(bounds[-1] + cell.numel() * unit)
            base += t * gh * gw
        return torch.cat(order), bounds


class Qwen2VisionTower(QwenVisionTower):
    """Qwen2-VL's: every block attends over its whole image, LayerNorms, a two-layer MLP
    (`fc1`, `fc2`; QuickGELU by default), the merger's norm a LayerNorm. Its config names the
    tower's width `embed_dim` and the language model's `hidden_size`."""

    def __init__(self, vc: dict):
        width = vc["embed_dim"]
        vc = dict(vc, hidden_size=width, out_hidden_size=vc["hidden_size"])
        super().__init__(dict(vc, intermediate_size=width * vc.get("mlp_ratio", 4)))
        self.merger = Qwen25Merger(vc["out_hidden_size"], width, self.merge, nn.LayerNorm)

    def make_block(self, vc: dict, heads: int) -> nn.Module:
        mlp = PlainMLP(
            vc["hidden_size"], vc["intermediate_size"], vc.get("hidden_act", "quick_gelu")
        )
        return VisionBlock(vc["hidden_size"], heads, mlp, lambda d: nn.LayerNorm(d, eps=1e-6))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        x = self.embed_patches(pixels)
        cos, sin = self.rotary(self.rows_cols(grids))
        bounds = self.image_bounds(grids)
        for block in self.blocks:
            x = block(x, bounds, cos, sin)
        return self.merger(x), []


class Qwen3VisionTower(QwenVisionTower):
    patch_bias = True

    def __init__(self, vc: dict):
        super().__init__(vc)
        self.pos_embed = nn.Embedding(vc["num_position_embeddings"], self.dim)
        self.side = int(vc["num_position_embeddings"] ** 0.5)
        out = vc["out_hidden_size"]
        self.merger = Qwen3Merger(out, self.dim, self.merge, after_shuffle=False)
        self.deepstack_indexes = list(vc.get("deepstack_visual_indexes", []))
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3Merger(out, self.dim, self.merge, after_shuffle=True)
            for _ in self.deepstack_indexes
        )

    def make_block(self, vc: dict, heads: int) -> nn.Module:
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        mlp = PlainMLP(vc["hidden_size"], vc["intermediate_size"], act)
        return VisionBlock(vc["hidden_size"], heads, mlp, lambda d: nn.LayerNorm(d, eps=1e-6))

    def positions(self, grids) -> torch.Tensor:
        """The learned position table resampled (bilinear, corners aligned) to each grid."""
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]
        m, out = self.merge, []
        for t, h, w in grids:
            grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)
            grid = grid[0].permute(1, 2, 0).view(h // m, m, w // m, m, -1).transpose(1, 2)
            out.append(grid.reshape(h * w, -1).repeat(t, 1))
        return torch.cat(out)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        x = self.embed_patches(pixels)
        x = x + self.positions(grids).to(x.dtype)
        cos, sin = self.rotary(self.rows_cols(grids))
        bounds, deepstack = self.image_bounds(grids), []
        for i, block in enumerate(self.blocks):
            x = block(x, bounds, cos, sin)
            if i in self.deepstack_indexes:
                merger = self.deepstack_merger_list[self.deepstack_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
