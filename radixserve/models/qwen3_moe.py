"""Qwen3-MoE: Qwen3's attention (q/k norms per head) over sparse expert blocks; layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step`, keep a dense MLP."""

from __future__ import annotations

from torch import nn

from ..attention import LayerAttention
from .decoder import Attention, CausalLM, DecoderLayer, layer_window
from .layers import RMSNorm
from .moe import Experts, Routing, SparseMoE


class Qwen3MoeForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        cfg = self.cfg
        how = LayerAttention(window=layer_window(self.hf, i))
        attention = Attention(cfg, i, self.tp, how, qkv_bias=cfg.qkv_bias, qk_norm=RMSNorm)
        return DecoderLayer(cfg, i, self.tp, attention, self.make_mlp(i))

    def make_mlp(self, i: int) -> nn.Module:
        hf = self.hf
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        sparse = (
            num_experts > 0
            and i not in hf.get("mlp_only_layers", [])
            and (i + 1) % hf.get("decoder_sparse_step", 1) == 0
        )
        if not sparse:
            return super().make_mlp(i)
        routing = Routing(
            "softmax_topk", hf["num_experts_per_tok"], hf.get("norm_topk_prob", False)
        )
        experts = Experts(
            num_experts,
            self.cfg.hidden_size,
            hf["moe_intermediate_size"],
            self.tp,
            hf.get("hidden_act", "silu"),
        )
        return SparseMoE(self.cfg.hidden_size, experts, routing)
