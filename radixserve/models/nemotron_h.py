"""Nemotron-H (NVIDIA; Nemotron 3): each layer is one block, Mamba2, attention (no rotary
embedding), a squared-ReLU MLP or routed squared-ReLU experts beside a shared one, as
`layers_block_type` (or `hybrid_override_pattern`: M, *, -, E) lists them,
each a pre-norm residual `x + block(norm(x))`. Mamba2 layers keep their convolution's and
scan's state per request (`mamba2.Mamba2Mixer`); attention layers keep KV per token in the pool
(their own numbering there). Checkpoints name the model `backbone` (HF's own save: `model`),
the embedding `embeddings`, the final norm `norm_f` and every block `mixer`."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..model_config import ModelConfig, is_attention_layer, layer_types_of
from .decoder import Attention
from .hybrid import HybridCausalLM
from .layers import Linear, PlainMLP, RMSNorm
from .mamba2 import Mamba2Mixer, Mamba2Shape, time_step_limit
from .moe import Experts, SparseMoE, deepseek_routing, route, unstack_experts

LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(norm|mixer)\.(.+)")
MODEL_NAMES = {"model.embeddings.weight": "model.embed_tokens.weight"}


def mamba2_shape(hf: dict) -> Mamba2Shape:
    return Mamba2Shape(
        hidden=hf["hidden_size"],
        heads=hf["mamba_num_heads"],
        head_dim=hf["mamba_head_dim"],
        groups=hf["n_groups"],
        state_size=hf["ssm_state_size"],
        conv_taps=hf["conv_kernel"],
        conv_bias=hf.get("use_conv_bias", True),
        proj_bias=hf.get("use_bias", False),
        out_bias=hf.get("use_bias", False),
        eps=hf.get("layer_norm_epsilon", 1e-5),
        time_step_limit=time_step_limit(hf),
    )


class FeedForward(nn.Module):
    """An MLP block in the place of a token mixer."""

    def __init__(self, mlp: nn.Module, tp: TPGroup):
        super().__init__()
        self.mlp, self.tp = mlp, tp

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        return self.tp.all_reduce(self.mlp(x))


class Block(nn.Module):
    """`x + mixer(norm(x))`; the norm is `input_layernorm` so the model fuses each residual
    add with the next block's norm."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = mixer

    def forward(self, x, normed, ropes, backend, next_norm: RMSNorm):
        return next_norm.add_and_norm(x, self.self_attn(normed, ropes, backend))


class LatentSparseMoE(SparseMoE):
    """Routed experts (in `latent` dims between `fc1_latent_proj` and `fc2_latent_proj` where
    set) plus the shared expert, both read the full hidden state's router choice."""

    def __init__(self, hidden: int, experts, routing, shared, latent: int | None, bias: bool):
        super().__init__(hidden, experts, routing, correction_bias=True, shared=shared)
        self.fc1_latent_proj = Linear(hidden, latent, bias=bias) if latent else nn.Identity()
        self.fc2_latent_proj = Linear(latent, hidden, bias=bias) if latent else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)
        weights, chosen = route(logits, self.routing, self.e_score_correction_bias)
        routed = self.experts(self.fc1_latent_proj(x), weights, chosen)
        return self.fc2_latent_proj(routed) + self.shared_experts(x)


class NemotronHForCausalLM(HybridCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        self.types = layer_types_of(cfg.hf_config)
        super().__init__(cfg, max_positions, tp)

    def make_layer(self, i: int) -> nn.Module:
        kind = self.types[i]
        if is_attention_layer(kind):
            kv_index = sum(map(is_attention_layer, self.types[:i]))
            mixer = Attention(self.cfg, kv_index, self.tp, rope=None)
        elif kind in ("mamba", "linear_attention"):
            mixer = Mamba2Mixer(mamba2_shape(self.hf), i, self.states, self.tp)
        elif kind == "moe":
            mixer = FeedForward(self.make_moe(), self.tp)
        else:
            mlp = PlainMLP(
                self.cfg.hidden_size,
                self.cfg.intermediate_size,
                self.hf.get("mlp_hidden_act", "relu2"),
                self.hf.get("mlp_bias", False),
            )
            mixer = FeedForward(mlp, self.tp)
        return Block(self.cfg, mixer)

    def make_moe(self) -> nn.Module:
        """DeepSeek-V3's routing over gateless squared-ReLU experts, beside a shared expert;
        the experts run in a latent space where `moe_latent_size` is set."""
        hf, hidden = self.hf, self.cfg.hidden_size
        act, bias = hf.get("mlp_hidden_act", "relu2"), hf.get("mlp_bias", False)
        routing = deepseek_routing(hf)
        latent = hf.get("moe_latent_size")
        experts = Experts(
            hf["n_routed_experts"], latent or hidden, hf["moe_intermediate_size"], self.tp, act,
            bias, expert=PlainMLP,
        )  # fmt: skip
        shared_width = hf["moe_shared_expert_intermediate_size"] // self.tp.size
        shared = PlainMLP(hidden, shared_width, act, bias)
        return LatentSparseMoE(hidden, experts, routing, shared, latent, bias)

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))

    def make_rotaries(self, max_positions: int) -> list:
        return []

    def rename(self, name: str) -> str | None:
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        if name == "model.norm_f.weight":
            return "model.norm.weight"
        name = MODEL_NAMES.get(name, name)
        match = LAYER_NAME.fullmatch(name)
        if match is None:
            return name
        layer, part, rest = match.groups()
        if part == "norm":
            return f"model.layers.{layer}.input_layernorm.{rest}"
        if self.types[int(layer)] == "moe":
            rest = rest.replace("gate.e_score_correction_bias", "e_score_correction_bias")
            return f"model.layers.{layer}.self_attn.mlp.{rest}"
        if not is_attention_layer(self.types[int(layer)]) and rest.startswith(("up_", "down_")):
            return f"model.layers.{layer}.self_attn.mlp.{rest}"
        return f"model.layers.{layer}.self_attn.{rest}"
