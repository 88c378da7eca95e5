"""Models whose every layer keeps a state per sequence and none keeps KV: Mamba and Falcon Mamba
(`MambaForCausalLM`, `FalconMambaForCausalLM`: the selective scan, `mamba1`) and Mamba2
(`Mamba2ForCausalLM`, Codestral Mamba: `mamba2`). Each layer is x + mixer(norm(x)), with no
MLP; the checkpoint's `backbone.` names are read as the decoder's."""

from __future__ import annotations

import re

from torch import nn

from ..model_config import ModelConfig
from .hybrid import HybridCausalLM
from .layers import RMSNorm
from .mamba1 import Mamba1Mixer, mamba_shape
from .mamba2 import Mamba2Mixer, Mamba2Shape, time_step_limit
from .rotary import RotaryEmbedding

NAMES = {
    "embeddings": "embed_tokens",
    "norm_f": "norm",
    "norm": "input_layernorm",
    "mixer": "self_attn",
}
PARTS = re.compile(r"backbone\.(?:(layers\.\d+)\.)?(\w+)\.(.+)")


class MixerLayer(nn.Module):
    """Pre-norm, the mixer only: x + mixer(norm(x))."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = mixer

    def forward(self, x, normed, ropes, backend, next_norm):
        return next_norm.add_and_norm(x, self.self_attn(normed, ropes, backend))


class StateSpaceLM(HybridCausalLM):
    def make_decoder_layer(self, i: int, mixer: nn.Module) -> nn.Module:
        return MixerLayer(self.cfg, mixer)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return []

    def rename(self, name: str) -> str | None:
        match = PARTS.fullmatch(name)
        if match is None:
            return name
        layer, part, rest = match.groups()
        return ".".join(p for p in ("model", layer, NAMES.get(part, part), rest) if p)


class MambaForCausalLM(StateSpaceLM):
    def make_mixer(self, i: int) -> nn.Module:
        return Mamba1Mixer(mamba_shape(self.hf), i, self.states, self.tp)


def codestral_shape(hf: dict) -> Mamba2Shape:
    """Mamba2's config names: a grouped norm gated before it (`rms_norm`)."""
    inner = int(hf.get("expand", 2) * hf["hidden_size"])
    return Mamba2Shape(
        hidden=hf["hidden_size"],
        heads=hf["num_heads"],
        head_dim=hf.get("head_dim") or inner // hf["num_heads"],
        groups=hf.get("n_groups", 1),
        state_size=hf["state_size"],
        conv_taps=hf.get("conv_kernel", 4),
        conv_bias=hf.get("use_conv_bias", True),
        proj_bias=hf.get("use_bias", False),
        out_bias=hf.get("use_bias", False),
        eps=hf.get("layer_norm_epsilon", 1e-5),
        time_step_limit=time_step_limit(hf),
        gated_norm=hf.get("rms_norm", True),
    )


class Mamba2ForCausalLM(StateSpaceLM):
    def make_mixer(self, i: int) -> nn.Module:
        return Mamba2Mixer(codestral_shape(self.hf), i, self.states, self.tp)
