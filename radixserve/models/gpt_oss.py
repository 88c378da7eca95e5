"""gpt-oss: attention with biases and a learnt sink logit per head, sliding and full layers in
turn, YaRN rope, and experts (stacked in the checkpoint, gate and up interleaved) whose gate is
a clamped SwiGLU, `(up + 1) * gate * sigmoid(alpha * gate)`, routed by softmax over the top-k
logits."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..attention import LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import Attention, CausalLM, DecoderLayer, layer_window
from .moe import Experts, Routing, SparseMoE


class SinkAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, how: LayerAttention):
        super().__init__(cfg, layer, tp, how, qkv_bias=True, o_bias=True)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))
        self.how = replace(how, sinks=self.sinks)


def clamped_swiglu(alpha: float, limit: float):
    def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    return gated


class StackedExperts(Experts):
    """Loads `gate_up_proj [E, hidden, 2 * inter]` (gate and up interleaved), `down_proj
    [E, inter, hidden]` and their biases."""

    def load_checkpoint(self, name: str, tensor: torch.Tensor, tp: TPGroup) -> None:
        if name not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            raise ValueError("it has no place in the experts")
        if tensor.shape[0] != self.num_experts:
            raise ValueError(f"expected {self.num_experts} experts")
        suffix = "_bias" if name.endswith("_bias") else ""
        for e in range(self.num_experts):
            if name.startswith("gate_up"):
                self.load_part(e, "gate" + suffix, tensor[e][..., ::2], tp)
                self.load_part(e, "up" + suffix, tensor[e][..., 1::2], tp)
            else:
                self.load_part(e, "down" + suffix, tensor[e], tp)


class GptOssForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        cfg, hf = self.cfg, self.hf
        attention = SinkAttention(cfg, i, self.tp, LayerAttention(window=layer_window(hf, i)))
        routing = Routing("topk_softmax", hf["num_experts_per_tok"])
        experts = StackedExperts(
            hf["num_local_experts"],
            cfg.hidden_size,
            hf["intermediate_size"],
            self.tp,
            bias=True,
            gated=clamped_swiglu(hf.get("swiglu_alpha", 1.702), hf.get("swiglu_limit", 7.0)),
        )
        mlp = SparseMoE(cfg.hidden_size, experts, routing, router_bias=True)
        return DecoderLayer(cfg, i, self.tp, attention, mlp)

    def rename(self, name: str) -> str | None:
        return name.replace(".mlp.router.", ".mlp.gate.")
