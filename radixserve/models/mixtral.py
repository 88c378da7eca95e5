"""Mixtral: Mistral's attention over sparse expert blocks (`block_sparse_moe`, experts named
w1/w3/w2), top-k of the softmax, renormalised."""

from __future__ import annotations

from torch import nn

from .decoder import CausalLM
from .moe import Experts, Routing, SparseMoE

EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(CausalLM):
    def make_mlp(self, i: int) -> nn.Module:
        hf, cfg = self.hf, self.cfg
        routing = Routing("softmax_topk", hf["num_experts_per_tok"], renormalize=True)
        experts = Experts(
            hf["num_local_experts"],
            cfg.hidden_size,
            hf["intermediate_size"],
            self.tp,
            hf.get("hidden_act", "silu"),
        )
        return SparseMoE(cfg.hidden_size, experts, routing)

    def rename(self, name: str) -> str | None:
        return mixtral_name(name)


def mixtral_name(name: str) -> str:
    """`block_sparse_moe.experts.{e}.w1` is our `mlp.experts.{e}.gate_proj` (w3: up, w2:
    down)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if ".experts." not in name:
        return name
    prefix, part, leaf = name.rsplit(".", 2)
    return f"{prefix}.{EXPERT_NAMES.get(part, part)}.{leaf}"
