"""LongCat-Flash (`LongcatFlashForCausalLM`): each layer is two MLA attentions, each followed by
a dense MLP, and beside them a shortcut MoE that reads the first MLP's input and is added at the
layer's end. Its router scores the experts and `zero_expert_num` identity experts by softmax
(chosen with a correction bias, not renormalized, times `routed_scaling_factor`); an identity
expert passes the token through times its weight. The MLA scales its queries and latents up by
sqrt(hidden / rank). The KV pool holds two layers per layer (`ModelConfig.kv_layers`)."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import TPGroup
from ..model_config import ModelConfig
from .deepseek_v3 import DeepseekV3ForCausalLM, LatentAttention
from .layers import RMSNorm, StepImages, SwiGLU
from .moe import Experts, Routing, route


class ZeroExpertRouter(nn.Module):
    def __init__(self, hf: dict, hidden: int):
        super().__init__()
        choices = hf["n_routed_experts"] + (hf.get("zero_expert_num") or 0)
        self.classifier = nn.Linear(hidden, choices, bias=hf.get("router_bias", False))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(choices))


class ZeroExpertMoE(nn.Module):
    """(the routed experts' output, this rank's part; the identity experts' output, whole)."""

    def __init__(self, hf: dict, hidden: int, tp: TPGroup):
        super().__init__()
        self.num_experts = hf["n_routed_experts"]
        self.routing = Routing(
            "grouped_softmax", hf["num_experts_per_tok"], scaling=hf["routed_scaling_factor"]
        )
        self.router = ZeroExpertRouter(hf, hidden)
        self.experts = Experts(self.num_experts, hidden, hf["moe_intermediate_size"], tp)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router.classifier(x.float())
        weights, chosen = route(logits, self.routing, self.router.e_score_correction_bias)
        identity = chosen >= self.num_experts  # run expert 0 at weight 0 in their place, as HF
        routed = self.experts(
            x, weights.masked_fill(identity, 0.0), chosen.masked_fill(identity, 0)
        )
        return routed, x * (weights * identity).sum(dim=-1, keepdim=True).to(x.dtype)


class ShortcutLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, tp: TPGroup):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.tp = tp
        self.self_attn = nn.ModuleList(
            LatentAttention(cfg, 2 * i + j, tp, lora_scaled=True) for j in (0, 1)
        )
        self.mlps = nn.ModuleList(SwiGLU(hidden, cfg.intermediate_size) for _ in (0, 1))
        self.input_layernorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in (0, 1))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in (0, 1))
        self.mlp = ZeroExpertMoE(cfg.hf_config, hidden, tp)

    def forward(self, x: torch.Tensor, ropes, backend) -> torch.Tensor:
        x = x + self.self_attn[0](self.input_layernorm[0](x), ropes, backend)
        normed = self.post_attention_layernorm[0](x)
        routed, identity = self.mlp(normed)
        x = x + self.tp.all_reduce(self.mlps[0](normed))
        x = x + self.self_attn[1](self.input_layernorm[1](x), ropes, backend)
        x = x + self.tp.all_reduce(self.mlps[1](self.post_attention_layernorm[1](x)))
        return x + self.tp.all_reduce(routed) + identity


class LongcatFlashForCausalLM(DeepseekV3ForCausalLM):
    def make_layer(self, i: int) -> nn.Module:
        return ShortcutLayer(self.cfg, i, self.tp)

    def rename(self, name: str) -> str | None:
        return name

    def forward(self, input_ids, positions, backend, images: StepImages | None = None):
        x = self.embed(input_ids)
        ropes = [rotary.cos_sin(positions, x.dtype) for rotary in self.rotaries]
        for layer in self.model.layers:
            x = layer(x, ropes, backend)
        return self.model.norm(x)
