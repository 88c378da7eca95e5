"""Jamba (AI21): Mamba layers (`mamba1`, dt, B and C RMS-normed) with an attention layer every
`attn_layer_period` layers from `attn_layer_offset` (no positional encoding at all), and
experts routed by a softmax over all logits (top-k kept, not renormalized) every
`expert_layer_period` layers from `expert_layer_offset`, a plain MLP elsewhere."""

from __future__ import annotations

from torch import nn

from ..attention import LayerAttention
from .decoder import Attention
from .hybrid import HybridCausalLM
from .layers import SwiGLU
from .mamba1 import Mamba1Mixer, jamba_shape
from .moe import Experts, Routing, SparseMoE, unstack_experts
from .rotary import RotaryEmbedding

# checkpoint name part -> ours
NAMES = (
    (".mamba.", ".self_attn."),
    (".feed_forward.router.", ".mlp.gate."),
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


class JambaForCausalLM(HybridCausalLM):
    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        return Attention(self.cfg, kv_index, self.tp, LayerAttention(), rope=None)

    def make_mixer(self, i: int) -> nn.Module:
        return Mamba1Mixer(jamba_shape(self.hf), i, self.states, self.tp)

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        experts = hf.get("num_experts", 16)
        period, offset = hf.get("expert_layer_period", 2), hf.get("expert_layer_offset", 1)
        act = hf.get("hidden_act", "silu")
        if experts <= 1 or i % period != offset:
            return SwiGLU(hidden, self.cfg.intermediate_size, act)
        routing = Routing("softmax_topk", hf.get("num_experts_per_tok", 2))
        return SparseMoE(
            hidden, Experts(experts, hidden, hf["intermediate_size"], self.tp, act), routing
        )

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return []

    def rename(self, name: str) -> str | None:
        for theirs, ours in NAMES:
            name = name.replace(theirs, ours)
        return name

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))
