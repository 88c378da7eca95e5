"""Kimi Linear (`KimiLinearForCausalLM`, Moonshot): Kimi Delta Attention (KDA) layers beside
DeepSeek's latent attention without rotary, over DeepSeek-V3's MoE block.

KDA is the gated delta rule with a decay per key channel rather than per head: q, k and v (each
projected on its own, one causal convolution over the three, SiLU after), a decay
`-exp(A_log) softplus(f_b(f_a(x)) + dt_bias)` for every channel of every head, a write
strength `sigmoid(b)` per head; its output is normed per head, gated by `sigmoid(g_b(g_a(x)))`
and projected. Its state per request is the convolution's last inputs and a [key dim, value
dim] matrix per head (`recurrent.RecurrentStates`). The attention layers are MLA whose rotary
part of each key stays unrotated (`mla_use_nope`), one latent per token in the KV pool."""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .deepseek_v3 import LatentAttention, deepseek_mlp, latent_rotary
from .hybrid import HybridCausalLM, joined_convolutions
from .layers import Linear, RMSNorm, fused
from .mixtral import mixtral_name
from .rank_shards import RankShardedLoading
from .recurrent_states import RecurrentStates
from .rotary import RotaryEmbedding

FORGET_GATE = re.compile(r"\.forget_gate\.")  # transformers' module for the decay's tensors


class KimiDeltaAttention(nn.Module, RankShardedLoading):
    """Under tensor parallelism each rank keeps a block of the heads (their projections,
    convolution channels, decays and states) and all-reduces its output."""

    by_columns = ("o_proj",)
    kept_whole = ("f_a_proj", "g_a_proj", "o_norm")
    shard_dims = {"A_log": 2}
    fused_names = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(self, cfg: ModelConfig, index: int, states: RecurrentStates, tp: TPGroup):
        super().__init__()
        hf = cfg.hf_config
        if hf["linear_num_heads"] % tp.size:
            raise ValueError(f"tp_size {tp.size} does not divide the linear attention's heads")
        self.index, self.states, self.tp, self.loaded = index, states, tp, set()
        self.full_width = hf["linear_num_heads"] * hf["linear_head_dim"]
        self.heads, self.head_dim = hf["linear_num_heads"] // tp.size, hf["linear_head_dim"]
        width, hidden = self.heads * self.head_dim, cfg.hidden_size
        taps = hf["linear_conv_kernel_dim"]
        self.qkv_proj = Linear(hidden, 3 * width, parts=(width, width, width))
        self.conv1d = nn.Conv1d(3 * width, 3 * width, taps, groups=3 * width, bias=False)
        self.f_a_proj = Linear(hidden, self.head_dim)
        self.f_b_proj = Linear(self.head_dim, width)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.heads, 1))
        self.b_proj = Linear(hidden, self.heads)
        self.g_a_proj = Linear(hidden, self.head_dim)
        self.g_b_proj = Linear(self.head_dim, width)
        self.o_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(width, hidden)
        self.cpu_ops = None

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state: the convolution's last inputs, the delta rule's matrices."""
        conv = self.conv1d.weight.shape[0] * (self.conv1d.weight.shape[-1] - 1)
        delta = self.heads * self.head_dim * self.head_dim
        return conv * dtype.itemsize + delta * self.states.ssm_dtype.itemsize

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        inputs, tokens, shape = backend.inputs, x.shape[0], (x.shape[0], self.heads, self.head_dim)
        mixed = self.states.convolve(
            self.index, self.qkv_proj(x), self.conv1d.weight[:, 0], None, inputs
        )
        q, k, v = (part.reshape(shape) for part in F.silu(mixed).chunk(3, dim=-1))
        forget = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        decay = -self.A_log.float().exp()[0] * F.softplus(forget.view(shape))
        beta = self.b_proj(x).sigmoid()
        out = self.states.delta_rule(self.index, q, k, v, decay, beta, inputs, fused(self.cpu_ops))
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(-1, self.head_dim)
        out = self.o_norm(out.reshape(-1, self.head_dim)) * torch.sigmoid(gate.float())
        return self.tp.all_reduce(self.o_proj(out.to(x.dtype).reshape(tokens, -1)))

    def fused_parts(self):
        return {"conv1d": [(self.full_width, False)] * 3}


class KimiLinearForCausalLM(HybridCausalLM):
    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        rotate = not self.hf.get("mla_use_nope", True)
        return LatentAttention(self.cfg, kv_index, self.tp, rotate=rotate)

    def make_mixer(self, i: int) -> nn.Module:
        return KimiDeltaAttention(self.cfg, i, self.states, self.tp)

    def make_mlp(self, i: int) -> nn.Module:
        return deepseek_mlp(self.cfg, i, self.tp)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return [] if self.hf.get("mla_use_nope", True) else [latent_rotary(self.cfg, max_positions)]

    def rename(self, name: str) -> str | None:
        """Mixtral's expert names; the decay's tensors sit on the layer, as the release keeps
        them; the router's correction bias beside its experts."""
        name = FORGET_GATE.sub(".", mixtral_name(name))
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(joined_convolutions(weights))
