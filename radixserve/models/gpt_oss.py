"""gpt-oss: attention with biases and a learnt sink logit per head, sliding and full layers in
turn, YaRN rope, and experts (stacked in the checkpoint, gate and up interleaved) whose gate is
a clamped SwiGLU, `(up + 1) * gate * sigmoid(alpha * gate)`, routed by softmax over the top-k
logits."""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch
from torch import nn

from ..attention import LayerAttention
from .decoder import Attention, CausalLM, DecoderLayer, layer_window
from .layers import SwiGLU
from .moe import Experts, Routing, SparseMoE
from .recipe import with_sinks


class ClampedSwiGLU(SwiGLU):
    """`(up + 1) * gate * sigmoid(alpha * gate)`, gate clamped above and up on both sides."""

    def __init__(self, hidden, inter, act, bias, alpha: float = 1.702, limit: float = 7.0):
        super().__init__(hidden, inter, act, bias)
        self.act_name, self.alpha, self.limit = "clamped_swiglu", alpha, limit

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def per_expert(weights: Iterable[tuple[str, torch.Tensor]]):
    """The checkpoint's stacked experts (`gate_up_proj [E, hidden, 2 * inter]`, gate and up
    interleaved, `down_proj [E, inter, hidden]`, their biases) as each expert's tensors in
    nn.Linear's layout, named like a per-expert checkpoint's."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".experts"):
            yield name, tensor
            continue
        bias = leaf.endswith("_bias")
        for e, one in enumerate(tensor):
            at = f"{prefix}.{e}"
            if leaf.startswith("gate_up_proj"):
                gate, up = (one[::2], one[1::2]) if bias else (one[:, ::2].t(), one[:, 1::2].t())
                yield f"{at}.gate_proj.{'bias' if bias else 'weight'}", gate
                yield f"{at}.up_proj.{'bias' if bias else 'weight'}", up
            elif leaf.startswith("down_proj"):
                yield f"{at}.down_proj.{'bias' if bias else 'weight'}", one if bias else one.t()
            else:
                yield name, tensor
                break


class GptOssForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        cfg, hf = self.cfg, self.hf
        how = LayerAttention(window=layer_window(hf, i))
        attention = with_sinks(Attention(cfg, i, self.tp, how, qkv_bias=True, o_bias=True))
        routing = Routing("topk_softmax", hf["num_experts_per_tok"])
        experts = Experts(
            hf["num_local_experts"],
            cfg.hidden_size,
            hf["intermediate_size"],
            self.tp,
            bias=True,
            expert=partial(
                ClampedSwiGLU,
                alpha=hf.get("swiglu_alpha", 1.702),
                limit=hf.get("swiglu_limit", 7.0),
            ),
        )
        mlp = SparseMoE(cfg.hidden_size, experts, routing, router_bias=True)
        return DecoderLayer(cfg, i, self.tp, attention, mlp)

    def rename(self, name: str) -> str | None:
        return name.replace(".mlp.router.", ".mlp.gate.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert(weights))
