"""Falcon-H1 (TII): every layer runs attention and a Mamba2 mixer side by side on the same
normed input and adds their outputs, then a gated MLP. So every layer keeps KV per token and a
state per request.

Its µP multipliers (on the embedding, the SSM's input and each part of its projection, keys,
attention's input and output, the MLP's gate and down projection, the logits) are folded into
the weights they scale as the checkpoint loads, but the logits' which is applied to them."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import Attention
from .hybrid import HybridCausalLM
from .mamba2 import Mamba2Mixer, Mamba2Shape, time_step_limit

RENAMES = [
    (re.compile(r"\.layers\.(\d+)\.self_attn\."), r".layers.\1.self_attn.attention."),
    (re.compile(r"\.layers\.(\d+)\.mamba\."), r".layers.\1.self_attn.mamba."),
    (re.compile(r"\.feed_forward\."), ".mlp."),
    (re.compile(r"\.pre_ff_layernorm\."), ".post_attention_layernorm."),
    (re.compile(r"^model\.final_layernorm\."), "model.norm."),
]


def mamba2_shape(hf: dict) -> Mamba2Shape:
    inner = hf.get("mamba_d_ssm") or int(hf.get("mamba_expand", 2) * hf["hidden_size"])
    head_dim = hf.get("mamba_d_head", "auto")
    return Mamba2Shape(
        hidden=hf["hidden_size"],
        heads=hf["mamba_n_heads"],
        head_dim=inner // hf["mamba_n_heads"] if head_dim == "auto" else head_dim,
        groups=hf.get("mamba_n_groups", 1),
        state_size=hf["mamba_d_state"],
        conv_taps=hf.get("mamba_d_conv", 4),
        conv_bias=hf.get("mamba_conv_bias", True),
        proj_bias=hf.get("mamba_proj_bias", False),
        out_bias=hf.get("projectors_bias", False),
        eps=hf.get("rms_norm_eps", 1e-5),
        time_step_limit=time_step_limit(hf),
        gated_norm=hf.get("mamba_rms_norm", False),
        norm_before_gate=hf.get("mamba_norm_before_gate", True),
    )


class ParallelMixers(nn.Module):
    """attention(x) + mamba(x), each already scaled by its folded multipliers."""

    def __init__(self, attention: nn.Module, mamba: nn.Module):
        super().__init__()
        self.attention, self.mamba = attention, mamba

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        return self.attention(x, ropes, backend) + self.mamba(x, ropes, backend)


class FalconH1ForCausalLM(HybridCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        self.embed_scale = cfg.hf_config.get("embedding_multiplier", 1.0)
        self.logit_scale = cfg.hf_config.get("lm_head_multiplier", 1.0)
        super().__init__(cfg, max_positions, tp)

    def make_layer(self, i: int) -> nn.Module:
        mixers = ParallelMixers(
            Attention(self.cfg, i, self.tp, qkv_bias=self.cfg.qkv_bias, o_bias=self.cfg.qkv_bias),
            Mamba2Mixer(mamba2_shape(self.hf), i, self.states, self.tp),
        )
        return self.make_decoder_layer(i, mixers)

    def rename(self, name: str) -> str | None:
        for pattern, ours in RENAMES:
            name = pattern.sub(ours, name)
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(fold_multipliers(self.hf, weights))


def fold_multipliers(hf: dict, weights: Iterable[tuple[str, torch.Tensor]]):
    """The checkpoint's tensors with the µP multipliers that scale their outputs (or, for a
    weight, their inputs) multiplied in."""
    shape = mamba2_shape(hf)
    groups_state = shape.groups * shape.state_size
    parts = [shape.inner, shape.inner, groups_state, groups_state, shape.heads]
    ssm = hf.get("ssm_multipliers") or [1.0] * 5
    mup = torch.cat([torch.full((n,), float(m)) for n, m in zip(parts, ssm)])
    gate, down = hf.get("mlp_multipliers") or (1.0, 1.0)
    attention_in = hf.get("attention_in_multiplier", 1.0)
    outputs = {  # leaf module -> multiplier of its output (weight and bias)
        "mamba.out_proj": hf.get("ssm_out_multiplier", 1.0),
        "self_attn.o_proj": hf.get("attention_out_multiplier", 1.0),
        "self_attn.k_proj": hf.get("key_multiplier", 1.0),
        "feed_forward.gate_proj": gate,
        "feed_forward.down_proj": down,
    }
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        leaf = ".".join(module.split(".")[-2:])
        scale = outputs.get(leaf, 1.0)
        if (
            leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            and kind == "weight"
        ):
            scale *= attention_in
        if leaf == "mamba.in_proj":
            rows = mup.to(tensor.dtype)
            ssm_in = hf.get("ssm_in_multiplier", 1.0) if kind == "weight" else 1.0
            tensor = tensor * (rows[:, None] if kind == "weight" else rows) * ssm_in
        elif scale != 1.0:
            tensor = tensor * scale
        yield name, tensor
