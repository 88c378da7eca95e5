"""Lara Mini (`LaraMiniForCausalLM`): Qwen3.5's Gated DeltaNet layers beside attention layers
with per-head q/k norms, the window layers turned by the rotary and the full ones without a
position (NoPE); softmax top-k experts beside an ungated shared expert in every layer. The
release fuses each Gated DeltaNet's input projections into one `in_proj` (rows q, k, v, z, b,
a) and names its gated norm `out_norm`."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from ..attention import LayerAttention
from .decoder import Attention, layer_window
from .hybrid import HybridCausalLM
from .layers import RMSNorm, SwiGLU
from .moe import Experts, Routing, SparseMoE, unstack_experts
from .qwen3_5 import GatedDeltaNet, delta_net_shard

FUSED_INPUT = re.compile(r"(.*\.linear_attn)\.in_proj\.weight")


class LaraMiniForCausalLM(HybridCausalLM):
    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        window = layer_window(self.hf, i)
        how = LayerAttention(window=window)
        rope = 0 if window is not None else None
        return Attention(self.cfg, kv_index, self.tp, how, qk_norm=RMSNorm, rope=rope)

    def make_mixer(self, i: int) -> nn.Module:
        return GatedDeltaNet(self.cfg, i, self.states, self.tp)

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        routing = Routing("softmax_topk", hf["num_experts_per_tok"], hf.get("norm_topk_prob", True))
        experts = Experts(hf["num_experts"], hidden, hf["moe_intermediate_size"], self.tp)
        shared = SwiGLU(hidden, hf["shared_expert_intermediate_size"] // self.tp.size)
        return SparseMoE(hidden, experts, routing, shared=shared)

    def rename(self, name: str) -> str | None:
        """A Gated DeltaNet sits at `self_attn`, its gated norm at `norm`; the shared expert
        at `shared_experts`."""
        name = name.replace(".linear_attn.out_norm.", ".linear_attn.norm.")
        name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        return name.replace(".linear_attn.", ".self_attn.")

    def load_weights(self, weights) -> None:
        split = self.split_inputs(unstack_experts(weights))
        super().load_weights(delta_net_shard(split, self.hf, self.tp))

    def split_inputs(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Each fused `in_proj` as the Gated DeltaNet's q/k/v, z, b and a projections."""
        hf = self.hf
        keys = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
        values = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
        heads = hf["linear_num_value_heads"]
        for name, tensor in weights:
            fused = FUSED_INPUT.fullmatch(name)
            if fused is None:
                yield name, tensor
                continue
            parts = tensor.split([2 * keys + values, values, heads, heads])
            for leaf, part in zip(("qkv", "z", "b", "a"), parts):
                yield f"{fused[1]}.in_proj_{leaf}.weight", part
