"""Qwen3-MoE: Qwen3's attention (q/k norms per head) over sparse expert blocks; layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step`, keep a dense MLP. Qwen2-MoE: the same
blocks with a gated shared expert, under Qwen2's attention."""

from __future__ import annotations

from torch import nn

from ..attention import LayerAttention
from .decoder import Attention, CausalLM, DecoderLayer, layer_window
from .layers import RMSNorm
from .moe import Experts, GatedSharedExpert, Routing, SparseMoE, shared_expert_name


class Qwen3MoeForCausalLM(CausalLM):
    qk_norm: type[RMSNorm] | None = RMSNorm

    def make_layer(self, i: int) -> nn.Module:
        cfg = self.cfg
        how = LayerAttention(window=layer_window(self.hf, i))
        qk_norm = self.qk_norm
        attention = Attention(cfg, i, self.tp, how, qkv_bias=cfg.qkv_bias, qk_norm=qk_norm)
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


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (a q/k/v bias, no norms) over the same
    sparse blocks, each beside a shared expert scaled by its own sigmoid gate."""

    qk_norm = None

    def make_mlp(self, i: int) -> nn.Module:
        mlp, hf = super().make_mlp(i), self.hf
        if isinstance(mlp, SparseMoE) and hf.get("shared_expert_intermediate_size"):
            inter, act = hf["shared_expert_intermediate_size"], hf.get("hidden_act", "silu")
            shared = GatedSharedExpert(self.cfg.hidden_size, inter // self.tp.size, act)
            mlp.shared_experts = shared
        return mlp

    def rename(self, name: str) -> str | None:
        return shared_expert_name(name)
