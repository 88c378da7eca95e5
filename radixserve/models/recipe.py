"""Dense decoder families that are Llama but for where their norms sit, a norm over q and k
(per head, or over all heads at once), no-rope layers, windows, biases, multipliers or an
interleaved rotary: each family declares a `LayerRecipe` per layer and a `ModelRecipe`, and the
shared `RecipeLayer` / `RecipeCausalLM` run them.

Norm slots by checkpoint name: `pre_attn` (Llama's `input_layernorm`), `post_attn` (applied to
the attention's output before the residual add: OLMo 2, GLM-4), `pre_mlp` (Llama's
`post_attention_layernorm`), `post_mlp`. An interleaved rotary (pairs of neighbouring dims,
GLM and ERNIE) is Llama's rotate-half after the rows of q and k are permuted at load, each
head's rotated dims ordered evens first: q.k is unchanged by a permutation of both."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import Attention, CausalLM
from .layers import Linear, RMSNorm, SwiGLU
from .rotary import RotaryEmbedding

NORM_SLOTS = ("pre_attn", "post_attn", "pre_mlp", "post_mlp")


@dataclass(frozen=True)
class LayerRecipe:
    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None
    # "head": each head's q and k; "all": all heads' at once; "head_unweighted": each head's,
    # without a weight (Llama 4)
    qk_norm: str | None = None
    qk_norm_after_rope: bool = False  # q and k normed after the rotary (HunYuan), not before
    query_temperature: bool = False  # queries scaled by the model's second table (Llama 4)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope: bool = True  # False: a no-rope layer
    rope_table: int = 0  # which of the model's rotary tables (one per layer kind: Laguna)
    window: int | None = None
    chunk: int | None = None  # attention within chunks of this many tokens (Llama 4)
    attention_scale: float | None = None  # None: 1/sqrt(head_dim)
    residual_scale: float = 1.0  # each sublayer's output is scaled before the residual add
    # attention and MLP side by side, both reading the pre-attention norm (Cohere), or the MLP
    # its own `pre_mlp` norm of the same input where one is named (GPT-NeoX)
    parallel: bool = False
    clip_qkv: float | None = None  # q, k (after their norms) and v clamped to +-this (OLMo)


@dataclass(frozen=True)
class ModelRecipe:
    embed_scale: float | None = None
    logit_scale: float = 1.0
    interleaved_rope: bool = False
    rotary_fraction: float = 1.0  # of each head's dims
    # "layer": mean-subtracting, weight only (Cohere); "layer_bias": PhiMoE's; "layer_1p": with a
    # bias and `(1 + w)` weights (Nemotron); "layer_unweighted": neither (OLMo); "gemma": RMS
    # with `(1 + w)` weights
    norm: str = "rms"


def llama_biases(hf: dict) -> dict:
    """Llama's bias switches as recipe fields: `attention_bias` for q, k, v and o,
    `mlp_bias` for the MLP."""
    bias = hf.get("attention_bias", False)
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=hf.get("mlp_bias", False))


def rotary_fraction(hf: dict, default: float = 1.0) -> float:
    """The share of each head's dims a partial rotary turns: `partial_rotary_factor` (in
    `rope_parameters` or at the top level), or MiniMax-M2's legacy `rotary_dim`."""
    if "rotary_dim" in hf:
        return hf["rotary_dim"] / hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or {}
    return rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", default))


class AllHeadsNorm(RMSNorm):
    """RMSNorm over all heads' q (or k) of a token; under TP each rank holds its heads'
    share of the weight, and the mean square is summed over ranks."""

    def __init__(self, size: int, eps: float, tp: TPGroup):
        super().__init__(size, eps)
        self.tp, self.full = tp, size * tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = self.tp.all_reduce(x.float().square().sum(-1, keepdim=True))
        return (x.float() * torch.rsqrt(squares / self.full + self.eps) * self.weight).to(x.dtype)


class UnweightedNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm in float32, with a bias or (Cohere) without; `offset` is added to the weight
    (Nemotron's `1 + w`)."""

    def __init__(self, size: int, eps: float, bias: bool = False, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        weight = self.weight.float() + self.offset
        return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, self.eps).to(x.dtype)


class UnweightedLayerNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def norm_class(recipe: ModelRecipe):
    """The norm a model's recipe names, as `cls(size, eps)`."""
    if recipe.norm == "gemma":
        return partial(RMSNorm, weight_offset=1.0)
    if recipe.norm == "layer_1p":
        return partial(LayerNorm, bias=True, offset=1.0)
    if recipe.norm == "layer_unweighted":
        return UnweightedLayerNorm
    return RMSNorm if recipe.norm == "rms" else partial(LayerNorm, bias=recipe.norm == "layer_bias")


def with_sinks(attention: nn.Module) -> nn.Module:
    """The attention with a learnt sink logit per head (this rank's heads): an extra logit in
    each softmax's denominator, as gpt-oss's."""
    attention.sinks = nn.Parameter(torch.zeros(attention.cfg.num_heads))
    attention.how = replace(attention.how, sinks=attention.sinks)
    return attention


class RecipeAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, recipe: LayerRecipe):
        how = LayerAttention(scale=recipe.attention_scale, window=recipe.window, chunk=recipe.chunk)
        per_head = {"head": RMSNorm, "head_unweighted": UnweightedNorm}
        super().__init__(
            cfg,
            layer,
            tp,
            how,
            qkv_bias=recipe.qkv_bias,
            o_bias=recipe.o_bias,
            qk_norm=per_head.get(recipe.qk_norm),
            rope=recipe.rope_table if recipe.rope else None,
            norm_after_rope=recipe.qk_norm_after_rope,
            temperature=1 if recipe.query_temperature else None,
        )
        self.all_heads = recipe.qk_norm == "all"
        if self.all_heads:
            self.q_norm = AllHeadsNorm(cfg.q_size, cfg.rms_norm_eps, tp)
            self.k_norm = AllHeadsNorm(cfg.kv_size, cfg.rms_norm_eps, tp)
        self.clip = recipe.clip_qkv
        if self.clip is not None:  # values clamped here, q and k after their norms
            self.qkv_proj.register_forward_hook(self._clamp_values)

    def _clamp_values(self, _, __, qkv: torch.Tensor) -> torch.Tensor:
        values = qkv[..., self.cfg.q_size + self.cfg.kv_size :]
        values.clamp_(-self.clip, self.clip)
        return qkv

    def norm_qk(self, q, k):
        cfg = self.cfg
        if not self.all_heads:
            q, k = super().norm_qk(q, k)
        else:
            q = self.q_norm(q).view(-1, cfg.num_heads, cfg.head_dim)
            k = self.k_norm(k).view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.clip is None:
            return q, k
        return q.clamp(-self.clip, self.clip), k.clamp(-self.clip, self.clip)


class GatedOutputAttention(RecipeAttention):
    """Attention whose output is scaled, before o_proj, by `activation` ("sigmoid" or
    "softplus") of the layer input's own projection (`g_proj`): one gate per channel (AFMoE,
    Laguna's "per-element") or per head, broadcast over its dims (Laguna, LFM3)."""

    def __init__(
        self, cfg: ModelConfig, layer: int, tp: TPGroup, recipe: LayerRecipe, activation: str,
        per_head: bool,
    ):  # fmt: skip
        super().__init__(cfg, layer, tp, recipe)
        self.activation = {"sigmoid": torch.sigmoid, "softplus": F.softplus}[activation]
        self.per_head = per_head
        self.g_proj = Linear(cfg.hidden_size, cfg.num_heads if per_head else cfg.q_size)

    def forward(self, x, ropes, backend):
        out = self.attend(x, ropes, backend)[1]
        gate = self.activation(self.g_proj(x).float()).to(out.dtype)
        if self.per_head:
            heads = out.view(-1, self.cfg.num_heads, self.cfg.head_dim)
            out = (heads * gate.unsqueeze(-1)).view(out.shape)
        else:
            out = out * gate.view(out.shape)
        return self.tp.all_reduce(self.o_proj(out))


class RecipeLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, recipe: LayerRecipe, attention, mlp, norm=RMSNorm
    ):
        super().__init__()
        self.tp, self.scale, self.parallel = tp, recipe.residual_scale, recipe.parallel
        self.mlp_normed_apart = recipe.parallel and recipe.pre_mlp is not None  # GPT-NeoX
        self.slots: dict[str, nn.Module] = {}
        for slot in NORM_SLOTS:
            name = getattr(recipe, slot)
            norm_module = norm(cfg.hidden_size, cfg.rms_norm_eps) if name else nn.Identity()
            if name:
                self.add_module(name, norm_module)
            self.slots[slot] = norm_module
        if recipe.pre_attn != "input_layernorm":
            self.input_layernorm = self.slots["pre_attn"]
        self.self_attn, self.mlp = attention, mlp

    def forward(self, x, normed, ropes, backend, next_norm):
        """`normed` is `input_layernorm(x)` (x itself where the layer has no norm before its
        attention); returns the residual stream and `next_norm` of it."""
        norms = self.slots
        if self.parallel:
            mlp_in = norms["pre_mlp"](x) if self.mlp_normed_apart else normed
            h = self.self_attn(normed, ropes, backend) + self.tp.all_reduce(self.mlp(mlp_in))
            x = x + h
            return x, next_norm(x)
        x = x + norms["post_attn"](self.self_attn(normed, ropes, backend)) * self.scale
        h = self.tp.all_reduce(self.mlp(norms["pre_mlp"](x)))
        x = x + norms["post_mlp"](h) * self.scale
        return x, next_norm(x)


class RecipeCausalLM(CausalLM):
    """A family says `layer_recipe(i)` and, where it differs, `model_recipe()`."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        self.recipe = self.model_recipe_of(cfg.hf_config)
        self.embed_scale = self.recipe.embed_scale
        self.norm_class = norm_class(self.recipe)
        super().__init__(cfg, max_positions, tp)

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe()

    def layer_recipe(self, i: int) -> LayerRecipe:
        raise NotImplementedError

    def make_layer(self, i: int) -> nn.Module:
        cfg, recipe = self.cfg, self.layer_recipe(i)
        attention = self.make_attention(i, recipe)
        return RecipeLayer(cfg, self.tp, recipe, attention, self.make_mlp(i), self.norm_class)

    def make_attention(self, i: int, recipe: LayerRecipe) -> nn.Module:
        return RecipeAttention(self.cfg, i, self.tp, recipe)

    def make_mlp(self, i: int) -> nn.Module:
        cfg, act = self.cfg, self.hf.get("hidden_act", "silu")
        bias = self.layer_recipe(i).mlp_bias
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, act, bias=bias)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        cfg = self.cfg
        width = int(cfg.head_dim * self.recipe.rotary_fraction)
        return [RotaryEmbedding(width, max_positions, cfg.rope_theta, cfg.rope_scaling_dict)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits if self.recipe.logit_scale == 1.0 else logits * self.recipe.logit_scale

    def tp_slice(self, module_name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        shared = all_heads_norm_share(module_name, tensor, self.cfg.head_dim, self.tp)
        return super().tp_slice(module_name, kind, tensor) if shared is None else shared

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.recipe.interleaved_rope:
            weights = self._rotate_half_order(weights)
        super().load_weights(weights)

    def _rotate_half_order(self, weights):
        """q and k rows (and per-head norms) of each head: the rotated dims' evens, then their
        odds, then the rest."""
        head, width = self.cfg.head_dim, int(self.cfg.head_dim * self.recipe.rotary_fraction)
        order = torch.cat(
            [torch.arange(0, width, 2), torch.arange(1, width, 2), torch.arange(width, head)]
        )
        for name, tensor in weights:
            leaf = name.rpartition(".")[0].rpartition(".")[2]  # "...self_attn.q_proj.weight"
            if leaf in ("q_proj", "k_proj"):
                rows = tensor.reshape(-1, head, *tensor.shape[1:])
                tensor = rows[:, order].reshape(tensor.shape)
            elif leaf in ("q_norm", "k_norm"):  # one weight for all heads, or a row per head
                tensor = tensor.reshape(-1, head)[:, order].reshape(tensor.shape)
            yield name, tensor


def all_heads_norm_share(module_name: str, tensor: torch.Tensor, head_dim: int, tp: TPGroup):
    """A q or k norm over all heads (`qk_norm` "all"): this rank's heads' rows; None for any
    other tensor."""
    leaf = module_name.rpartition(".")[2]
    if leaf in ("q_norm", "k_norm") and tensor.shape[0] != head_dim:
        return tp.shard(tensor, 0)
    return None
