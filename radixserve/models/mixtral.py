"""Mixtral: Mistral's attention over sparse expert blocks (`block_sparse_moe`, experts named
w1/w3/w2), top-k of the softmax, renormalised."""

from __future__ import annotations

from torch import nn

from .decoder import CausalLM
from .moe import MIXTRAL_PARTS, Experts, Routing, SparseMoE


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
            parts=MIXTRAL_PARTS,
        )
        return SparseMoE(cfg.hidden_size, experts, routing)

    def rename(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")
