"""SigLIP's tower as the vision-language families load it (`embeddings.patch_embedding`,
`embeddings.position_embedding`, `encoder.layers`, `post_layernorm`): patches embedded by a
convolution with learned positions, pre-norm bidirectional blocks, a final layer norm; CLIP's,
the same with a class token (LLaVA); and the pixel shuffle that folds s x s neighbouring
patches into one token (Idefics3, InternVL)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .qwen_vision import activation


class SiglipLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str, eps: float):
        super().__init__()
        self.heads = heads
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(dim, dim))
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, (n, t, d) = self.self_attn, x.shape
        h = self.layer_norm1(x)
        q, k, v = (
            p(h).view(n, t, self.heads, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj)
        )
        x = x + a.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class SiglipTower(nn.Module):
    """`[images, C, H, W]` -> `[images, patches, dim]`: each image attends within itself; the
    position table is `side` x `side` (the config's `image_size` over `patch_size`). With
    `class_token` it is CLIP's: a class embedding before the patches (its own row of the
    position table first), a patch convolution without a bias and a layer norm before the
    blocks (`pre_layrnorm`)."""

    def __init__(self, vc: dict, class_token: bool = False):
        super().__init__()
        dim, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-6)
        self.size, self.patch = vc.get("image_size", 224), vc.get("patch_size", 14)
        self.side = self.size // self.patch
        self.class_token = class_token
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(
            vc.get("num_channels", 3), dim, self.patch, self.patch, bias=not class_token
        )
        self.embeddings.position_embedding = nn.Embedding(self.side**2 + class_token, dim)
        if class_token:
            self.embeddings.class_embedding = nn.Parameter(torch.zeros(dim))
            self.pre_layrnorm = nn.LayerNorm(dim, eps=eps)
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipLayer(dim, vc["num_attention_heads"], vc["intermediate_size"], act, eps)
            for _ in range(vc["num_hidden_layers"])
        )
        self.post_layernorm = nn.LayerNorm(dim, eps=eps)

    def encode(self, pixels: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The last block's output, normed. `positions`: each patch's row of the position table
        (None: the table in order, the images at the tower's own size)."""
        return self.post_layernorm(self.hidden_states(pixels, positions))

    def hidden_states(
        self, pixels: torch.Tensor, positions: torch.Tensor | None = None, depth: int | None = None
    ) -> torch.Tensor:
        """The output of the first `depth` blocks (all by default; 0: the embeddings), not
        normed: `[images, (class token and) patches, dim]`."""
        conv = self.embeddings.patch_embedding
        x = conv(pixels.to(conv.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_token:
            x = torch.cat([self.embeddings.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        table = self.embeddings.position_embedding.weight
        x = x + (table if positions is None else table[positions])
        if self.class_token:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers[:depth]:
            x = layer(x)
        return x


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """`[images, side x side, d]` -> `[images x (side/s)^2, d x s^2]`: token (a, b) holds the
    patches (a*s + i, b*s + j), i outer, j inner (transformers' order for Idefics3 and
    InternVL)."""
    n, side = x.shape[0], int(x.shape[1] ** 0.5)
    x = x.reshape(n, side // s, s, side // s, s, -1).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n * (side // s) ** 2, -1)
