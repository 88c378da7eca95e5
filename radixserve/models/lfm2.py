"""LFM2 (Liquid AI): short-convolution layers beside grouped-query attention layers.

A short-conv layer projects its input to B, C and h, convolves B*h along the sequence (a
depthwise causal convolution of `conv_L_cache` taps) and gates the result by C. Its state per
request is the convolution's last inputs (`recurrent.RecurrentStates`); attention layers keep
KV per token in the pool (their own layer numbering there) and normalize q and k per head.
The token mixer, convolution or attention, sits where a Llama layer has its attention. LFM2-MoE
swaps the MLPs after its first dense layers for routed experts."""

from __future__ import annotations

import re

import torch
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..model_config import ModelConfig, is_attention_layer, layer_types_of
from .decoder import Attention
from .dense_families import layer_window_of
from .hybrid import HybridCausalLM
from .layers import Linear, RMSNorm, SwiGLU
from .mixtral import mixtral_name
from .moe import Experts, Routing, SparseMoE, unstack_experts
from .rank_shards import RankShardedLoading
from .recipe import GatedOutputAttention, LayerRecipe, RecipeAttention, RecipeLayer
from .recurrent_states import RecurrentStates
from .rotary import LAYER_KINDS, RotaryEmbedding, rotaries_by_kind

# checkpoint names of an attention layer -> ours
ATTENTION_NAMES = {"out_proj": "o_proj", "q_layernorm": "q_norm", "k_layernorm": "k_norm"}
LAYER_NAMES = {
    "operator_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "conv": "self_attn",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward": "mlp",  # LFM2-MoE's router (`gate`) and experts
}
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


class ShortConv(nn.Module, RankShardedLoading):
    """in_proj -> (B, C, h); out_proj(C * conv(B * h)), the convolution resumed per request.
    Under tensor parallelism each rank keeps its share of the channels and all-reduces."""

    def __init__(self, cfg: ModelConfig, index: int, states: RecurrentStates, tp: TPGroup):
        super().__init__()
        hidden, bias = cfg.hidden_size, bool(cfg.hf_config.get("conv_bias", False))
        if hidden % tp.size:
            raise ValueError(f"tp_size {tp.size} does not divide the convolution's channels")
        taps, width = cfg.hf_config["conv_L_cache"], hidden // tp.size
        self.index, self.states, self.tp, self.hidden, self.loaded = (
            index,
            states,
            tp,
            hidden,
            set(),
        )
        self.in_proj = Linear(hidden, 3 * width, bias=bias)
        self.conv = nn.Conv1d(width, width, taps, groups=width, bias=bias)
        self.out_proj = Linear(width, hidden, bias=bias)

    def fused_parts(self):
        return {"in_proj": [(self.hidden, False)] * 3, "conv": [(self.hidden, False)]}

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state: the convolution's last inputs."""
        return self.conv.weight.shape[0] * (self.conv.weight.shape[-1] - 1) * dtype.itemsize

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        weight, bias = self.conv.weight[:, 0], self.conv.bias
        mixed = self.states.convolve(self.index, b * h, weight, bias, backend.inputs)
        return self.tp.all_reduce(self.out_proj(c * mixed))


class Lfm2ForCausalLM(HybridCausalLM):
    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        return Attention(self.cfg, kv_index, self.tp, qk_norm=RMSNorm)

    def make_mixer(self, i: int) -> nn.Module:
        return ShortConv(self.cfg, i, self.states, self.tp)

    def make_mlp(self, i: int) -> nn.Module:
        return SwiGLU(self.cfg.hidden_size, feed_forward_size(self.hf) // self.tp.size, "silu")

    def rename(self, name: str) -> str | None:
        if name == "model.embedding_norm.weight":
            return "model.norm.weight"
        match = LAYER_NAME.fullmatch(name)
        if match is None:
            return name
        layer, rest = match.groups()
        if rest == "feed_forward.expert_bias":
            return f"model.layers.{layer}.mlp.e_score_correction_bias"
        module, _, kind = rest.rpartition(".")
        if is_attention_layer(self.hf["layer_types"][int(layer)]):
            head, _, leaf = module.partition(".")
            module = f"{head}.{ATTENTION_NAMES.get(leaf, leaf)}" if leaf else module
        for theirs, ours in LAYER_NAMES.items():
            if module == theirs or module.startswith(theirs + "."):
                module = ours + module[len(theirs) :]
                break
        return f"model.layers.{layer}.{module}.{kind}"


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE: LFM2's layers with sparse MLPs after the first `num_dense_layers`: sigmoid
    scores, experts chosen by score plus `expert_bias`, weights renormalized and scaled."""

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        if i < hf.get("num_dense_layers", 2):
            return SwiGLU(hidden, self.cfg.intermediate_size, "silu")
        routing = Routing(
            "grouped_sigmoid",
            hf["num_experts_per_tok"],
            renormalize=hf.get("norm_topk_prob", True),
            scaling=hf.get("routed_scaling_factor", 1.0),
        )
        experts = Experts(hf["num_experts"], hidden, hf["moe_intermediate_size"], self.tp)
        return SparseMoE(hidden, experts, routing, correction_bias=hf.get("use_expert_bias", True))

    def rename(self, name: str) -> str | None:
        """Experts' `w1`/`w3`/`w2` (as saved per expert) are their gate, up and down."""
        return mixtral_name(super().rename(name))

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """LFM3: LFM2's layers with sliding-window attention layers beside the full ones, a rotary
    table per kind (the full layers' proportional, over part of each head), each head's output
    gated by a sigmoid of its own projection (`use_attention_gate`), the mixer's and the MLP's
    outputs normed before the residual add (`use_sandwich_norm`), an MLP of the configured
    width."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        hf, kind = self.hf, layer_types_of(self.hf)[i]
        sandwich = hf.get("use_sandwich_norm", True)
        bias = hf.get("attention_bias", False)
        return LayerRecipe(
            post_attn="post_operator_norm" if sandwich else None,
            post_mlp="post_ffn_norm" if sandwich else None,
            qk_norm="head",
            qkv_bias=bias,
            o_bias=bias,
            window=layer_window_of(hf, i),
            rope_table=LAYER_KINDS.index(kind) if kind in LAYER_KINDS else 0,
        )

    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        recipe = self.layer_recipe(i)
        if not self.hf.get("use_attention_gate", True):
            return RecipeAttention(self.cfg, kv_index, self.tp, recipe)
        return GatedOutputAttention(self.cfg, kv_index, self.tp, recipe, "sigmoid", per_head=True)

    def make_decoder_layer(self, i: int, mixer: nn.Module) -> nn.Module:
        return RecipeLayer(self.cfg, self.tp, self.layer_recipe(i), mixer, self.make_mlp(i))

    def make_mlp(self, i: int) -> nn.Module:
        return SwiGLU(self.cfg.hidden_size, self.cfg.intermediate_size, "silu")

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return rotaries_by_kind(self.hf, self.cfg.head_dim, max_positions)

    def rename(self, name: str) -> str | None:
        return super().rename(name.replace(".self_attn.gate_proj.", ".self_attn.g_proj."))


def feed_forward_size(hf: dict) -> int:
    """The MLP's width as LFM2 derives it from `intermediate_size` (`block_auto_adjust_ff_dim`:
    two thirds, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`)."""
    size = hf["intermediate_size"]
    if not hf.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    if hf.get("block_ffn_dim_multiplier") is not None:
        size = int(hf["block_ffn_dim_multiplier"] * size)
        multiple = hf.get("block_multiple_of", 256)
        size = multiple * ((size + multiple - 1) // multiple)
    return size
