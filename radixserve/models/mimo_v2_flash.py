"""MiMo-V2-Flash (Xiaomi): sliding-window layers (twice the KV heads, a learnt sink logit per
head) between full-attention layers, each kind with its own rotary base over part of each head;
values narrower than keys (`v_head_dim`) and scaled by `attention_value_scale`; DeepSeek-V3's
routed experts (no shared one) where `mlp_layer_types` says "sparse".

The KV pool keeps each layer's own KV heads (`ModelConfig.kv_layer_dims`) at the key width: a
value is stored zero-padded to it, and the padding is cut from the attention's output before
o_proj (softmax-weighted zeros stay zero)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import CausalLM, DecoderLayer
from .layers import Linear, SwiGLU
from .moe import deepseek_moe, unstack_experts
from .recipe import with_sinks
from .rotary import RotaryEmbedding, apply_rotary, rotaries_by_kind


class NarrowValueAttention(nn.Module):
    """GQA whose values are `v_dim` wide (padded to the key width in the pool) and scaled."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, how, rope: int, hf: dict):
        super().__init__()
        self.cfg, self.layer, self.tp, self.how, self.rope = cfg, layer, tp, how, rope
        self.v_dim, self.v_scale = hf["v_head_dim"], hf.get("attention_value_scale") or 1.0
        v_size = cfg.num_kv_heads * self.v_dim
        self.qkv_proj = Linear(
            cfg.hidden_size,
            cfg.q_size + cfg.kv_size + v_size,
            bias=hf.get("attention_bias", False),
            parts=(cfg.q_size, cfg.kv_size, v_size),
        )
        self.o_proj = Linear(cfg.num_heads * self.v_dim, cfg.hidden_size)
        self.cpu_ops = None

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        cfg = self.cfg
        v_size = cfg.num_kv_heads * self.v_dim
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, v_size], dim=-1)
        cos, sin = ropes[self.rope]
        q = apply_rotary(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin, self.cpu_ops)
        k = apply_rotary(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin, self.cpu_ops)
        v = v.view(-1, cfg.num_kv_heads, self.v_dim) * self.v_scale
        v = F.pad(v, (0, cfg.head_dim - self.v_dim))
        out = backend.forward(self.layer, q, k, v, self.how)
        out = out.reshape(-1, cfg.num_heads, cfg.head_dim)[..., : self.v_dim]
        return self.tp.all_reduce(self.o_proj(out.reshape(x.shape[0], -1)))


class MiMoV2FlashForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        hf, cfg = self.hf, self.cfg
        sliding = hf["layer_types"][i] == "sliding_attention"
        if cfg.kv_layer_dims is not None:
            heads, dim = cfg.kv_layer_dims[i]
            cfg = replace(cfg, num_kv_heads=heads, head_dim=dim)
        how = LayerAttention(window=hf.get("sliding_window") if sliding else None)
        attention = NarrowValueAttention(cfg, i, self.tp, how, int(sliding), hf)
        if sliding:
            with_sinks(attention)
        return DecoderLayer(cfg, i, self.tp, attention, self.make_mlp(i))

    def make_mlp(self, i: int) -> nn.Module:
        hf, cfg = self.hf, self.cfg
        if hf["mlp_layer_types"][i] != "sparse":
            return SwiGLU(cfg.hidden_size, cfg.intermediate_size, hf.get("hidden_act", "silu"))
        return deepseek_moe({**hf, "n_shared_experts": 0}, cfg.hidden_size, self.tp)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return rotaries_by_kind(self.hf, self.cfg.head_dim, max_positions, 0.334)

    def rename(self, name: str) -> str | None:
        name = name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))
