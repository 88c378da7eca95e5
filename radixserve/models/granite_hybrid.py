"""Granite 4.0 (`GraniteMoeHybridForCausalLM`, IBM; and Granite 3's MoE models, attention only,
with or without a shared MLP): Mamba2 layers (a grouped gated norm)
beside attention layers (a rotary only where `position_embedding_type` is "rope"), Granite's
µP multipliers (the embedding, attention scores, each residual branch, the logits divided by
`logits_scaling`), and in every layer a shared gated MLP plus, where `num_local_experts` > 0,
experts routed by a softmax over each token's top-k logits. Mamba2 layers keep their states
per request, attention layers KV per token (`hybrid.HybridCausalLM`)."""

from __future__ import annotations

import re

import torch
from torch import nn

from ..attention import LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig, layer_types_of
from .decoder import Attention, DecoderLayer
from .falcon_h1 import mamba2_shape
from .hybrid import HybridCausalLM
from .layers import SwiGLU
from .llama import split_gate_up
from .mamba2 import Mamba2Mixer
from .moe import Experts, Routing, SparseMoE, unstack_experts
from .rotary import RotaryEmbedding

# checkpoint name -> ours, applied in order
RENAMES = [
    (re.compile(r"\.layers\.(\d+)\.mamba\."), r".layers.\1.self_attn."),
    (re.compile(r"\.shared_mlp\.input_linear\."), ".mlp.shared.gate_up_proj."),
    (re.compile(r"\.shared_mlp\.output_linear\."), ".mlp.shared.down_proj."),
    (re.compile(r"\.block_sparse_moe\.router\.layer\."), ".mlp.moe.gate."),
    (re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".mlp.moe.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".mlp.moe.experts.down_proj"),
    # transformers' own names, as saved where it has no conversion for the family (Granite SWA)
    (re.compile(r"\.block_sparse_moe\.router\.weight$"), ".mlp.moe.gate.weight"),
    (re.compile(r"\.block_sparse_moe\.experts\.(\w+_proj)$"), r".mlp.moe.experts.\1"),
]


class SharedAndRoutedMLP(nn.Module):
    """The shared MLP every token runs and the routed experts, where the model has each."""

    def __init__(self, shared: SwiGLU | None, moe: SparseMoE | None):
        super().__init__()
        self.shared, self.moe = shared, moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [part(x) for part in (self.shared, self.moe) if part is not None]
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]


class ScaledResidualLayer(DecoderLayer):
    """Pre-norm, each sublayer's output times `residual_multiplier` before its residual add."""

    def __init__(self, cfg: ModelConfig, i: int, tp: TPGroup, mixer, mlp, scale: float):
        super().__init__(cfg, i, tp, mixer, mlp)
        self.scale = scale

    def forward(self, x, normed, ropes, backend, next_norm):
        mixed = self.self_attn(normed, ropes, backend) * self.scale
        x, normed = self.post_attention_layernorm.add_and_norm(x, mixed)
        return next_norm.add_and_norm(x, self.tp.all_reduce(self.mlp(normed)) * self.scale)


class GraniteMoeHybridForCausalLM(HybridCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        hf = cfg.hf_config
        self.embed_scale = hf.get("embedding_multiplier", 1.0)
        hybrid = hf.get("model_type") == "granitemoehybrid"  # Granite 3's MoE always rotates
        self.rope = hf.get("position_embedding_type", None if hybrid else "rope") == "rope"
        super().__init__(cfg, max_positions, tp)

    def make_layer(self, i: int) -> nn.Module:
        if layer_types_of(self.hf) is None:  # Granite 3's MoE models: attention everywhere
            return self.make_decoder_layer(i, self.make_attention(i, i))
        return super().make_layer(i)

    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        how = LayerAttention(scale=self.hf.get("attention_multiplier", 1.0))
        bias = self.hf.get("attention_bias", False)
        rope = 0 if self.rope else None
        return Attention(self.cfg, kv_index, self.tp, how, bias, bias, rope=rope)

    def make_mixer(self, i: int) -> nn.Module:
        hf = self.hf  # Falcon-H1's names, but a gated norm after the gate and one bias switch
        options = dict(mamba_rms_norm=True, mamba_norm_before_gate=False)
        shape = mamba2_shape({**hf, **options, "projectors_bias": hf.get("mamba_proj_bias")})
        return Mamba2Mixer(shape, i, self.states, self.tp)

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        act = hf.get("hidden_act", "silu")
        width = hf.get("shared_intermediate_size") or 0
        shared = SwiGLU(hidden, width // self.tp.size, act) if width else None
        if not hf.get("num_local_experts"):
            return SharedAndRoutedMLP(shared, None)
        routing = Routing("topk_softmax", hf["num_experts_per_tok"])
        experts = Experts(hf["num_local_experts"], hidden, hf["intermediate_size"], self.tp, act)
        return SharedAndRoutedMLP(shared, SparseMoE(hidden, experts, routing))

    def make_decoder_layer(self, i: int, mixer: nn.Module) -> nn.Module:
        scale = self.hf.get("residual_multiplier", 1.0)
        return ScaledResidualLayer(self.cfg, i, self.tp, mixer, self.make_mlp(i), scale)

    def make_rotaries(self, max_positions: int) -> list:
        return super().make_rotaries(max_positions) if self.rope else []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.hf.get("logits_scaling", 1.0)

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(split_gate_up(self._our_names(weights))))

    @staticmethod
    def _our_names(weights):
        for name, tensor in weights:
            for pattern, replacement in RENAMES:
                name = pattern.sub(replacement, name)
            yield name, tensor


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """Bamba (IBM): Granite 4.0-H's Mamba2 layers beside attention layers with a rotary over half
    of each head and the usual score scale, one plain MLP per layer, no multipliers."""

    NAMES = (
        (".feed_forward.", ".mlp."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
    )

    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        bias = self.hf.get("attention_bias", False)
        return Attention(self.cfg, kv_index, self.tp, LayerAttention(), bias, bias, rope=0)

    def make_mlp(self, i: int) -> nn.Module:
        return SwiGLU(
            self.cfg.hidden_size, self.cfg.intermediate_size, self.hf.get("hidden_act", "silu")
        )

    def make_rotaries(self, max_positions: int) -> list:
        cfg = self.cfg
        width = int(cfg.head_dim * self.hf.get("partial_rotary_factor", 0.5))
        return [RotaryEmbedding(width, max_positions, cfg.rope_theta, cfg.rope_scaling_dict)]

    def rename(self, name: str) -> str | None:
        if name == "model.final_layernorm.weight":
            return "model.norm.weight"
        for theirs, ours in self.NAMES:
            name = name.replace(theirs, ours)
        return name
