"""Hunyuan v4 (`HYV4ForCausalLM`): DeepSeek-V3.2's sparse MLA (a lightning indexer, layers
sharing the previous indexer's choice by `indexer_types`) with a learnt sink logit per head and
each head's output gated by a sigmoid of the layer's input; its indexer turns the last dims of
each head, as pairs. The residual is `hc_mult` streams under hyper-connections that do not mix
the streams (`post` up to `hc_magnitude`); dense MLPs by `mlp_layer_types`, else DeepSeek-V3's
experts, theirs with gate and up clamped to `swiglu_limit`."""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from ..distributed import TPGroup
from ..model_config import ModelConfig
from .deepseek_v4 import LimitedSwiGLU
from .deepseek_v32 import DeepseekV32ForCausalLM, SparseLatentAttention
from .hyper_connections import HyperConnection, HyperHead, HyperLayer, run_streams
from .layers import Linear, StepImages, SwiGLU
from .moe import Experts, SparseMoE, deepseek_routing

# the release's tensor names (transformers saves them too) -> ours, in this order
NAMES = tuple(
    (re.compile(pattern), new)
    for pattern, new in (
        (r"\.hc_pre\.hc_", ".hc_"),
        (r"\.learnable_sink_param$", ".sinks"),
        (r"\.linear_gate\.", ".gate_proj."),
        (r"\.hc_attn_layer\.hc_(fn|base|scale)$", r".attn_hc.\1"),
        (r"\.hc_mlp_layer\.hc_(fn|base|scale)$", r".ffn_hc.\1"),
        (r"\.hc_head_(fn|base|scale)$", r".hc_\1"),
    )
)


class GatedSparseLatentAttention(SparseLatentAttention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, selections: dict, own: bool):
        eps = cfg.hf_config["rms_norm_eps"]
        super().__init__(
            cfg, layer, tp, selections, own, eps, indexer_rope_last=True, indexer_interleaved=True
        )
        self.gate_proj = Linear(cfg.hidden_size, self.heads * self.v_dim)
        self.sinks = nn.Parameter(torch.zeros(self.heads))

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate_proj(x)).view(-1, self.heads, self.v_dim)


def hy_mlp(cfg: ModelConfig, i: int, tp: TPGroup) -> nn.Module:
    hf = cfg.hf_config
    if hf["mlp_layer_types"][i] != "sparse":
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size)
    inter, hidden = hf["moe_intermediate_size"], cfg.hidden_size
    expert = partial(LimitedSwiGLU, limit=hf["swiglu_limit"])
    experts = Experts(hf["n_routed_experts"], hidden, inter, tp, expert=expert)
    shared = SwiGLU(hidden, inter * hf["n_shared_experts"] // tp.size)
    return SparseMoE(hidden, experts, deepseek_routing(hf), correction_bias=True, shared=shared)


class HYV4ForCausalLM(DeepseekV32ForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.model.hc_head = HyperHead(self.hf)

    def make_layer(self, i: int) -> nn.Module:
        hf, cfg = self.hf, self.cfg
        own = hf["indexer_types"][i] != "shared"
        attention = GatedSparseLatentAttention(cfg, i, self.tp, self.selections, own)
        connect = partial(
            HyperConnection,
            hf,
            mix_streams=False,
            post_scale=hf["hc_magnitude"],
            post_eps=hf["hc_eps"],
        )
        return HyperLayer(hf, attention, hy_mlp(cfg, i, self.tp), (connect(), connect()), self.tp)

    def rename(self, name: str) -> str | None:
        """The release's names (`NAMES`) or transformers'."""
        for pattern, new in NAMES:
            name = pattern.sub(new, name)
        return super().rename(name)

    def forward(self, input_ids, positions, backend, images: StepImages | None = None):
        self.selections.clear()
        dtype = self.model.embed_tokens.weight.dtype
        ropes = [rotary.cos_sin(positions, dtype) for rotary in self.rotaries]
        return run_streams(self, input_ids, ropes, backend)
