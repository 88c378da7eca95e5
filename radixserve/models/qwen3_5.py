"""Qwen3.5 (text, dense): Gated DeltaNet linear-attention layers, three of every four, beside
gated full-attention layers.

A Gated DeltaNet layer projects q, k and v (one causal convolution over the three, SiLU after),
a decay and a write strength per value head, and a gate; its state per request is the
convolution's last inputs and the delta rule's [key dim, value dim] matrix per value head
(`recurrent.RecurrentStates`); its output is normed per head, gated by SiLU(gate) and
projected. The attention layers rotate only the first `partial_rotary_factor` of each head,
normalize q and k per head and gate their output by a sigmoid of a second half of q_proj. Every
norm of the residual stream and of q and k stores its weight minus one."""

from __future__ import annotations

import re
from functools import partial
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import Attention, DecoderLayer
from .hybrid import HybridCausalLM
from .layers import Linear, RMSNorm, fused
from .moe import (
    Experts,
    GatedSharedExpert,
    Routing,
    SparseMoE,
    shared_expert_name,
    unstack_experts,
)
from .recurrent_states import RecurrentStates
from .rotary import RotaryEmbedding, apply_rotary

ZeroCentredNorm = partial(RMSNorm, weight_offset=1.0)
LINEAR_ATTENTION = re.compile(r"(model\.layers\.\d+)\.linear_attn\.")
NOT_TEXT = ("mtp.",)  # the multi-token prediction head


class GatedDeltaNet(nn.Module):
    """`write_scale` multiplies each write strength sigmoid(b) (OLMo Hybrid's 2: negative
    eigenvalues allowed). Under tensor parallelism each rank keeps its share of the key and
    value heads (`delta_net_shard` slices the checkpoint) and all-reduces its output."""

    write_scale = 1.0

    def __init__(
        self, cfg: ModelConfig, index: int, states: RecurrentStates, tp: TPGroup = TPGroup()
    ):
        super().__init__()
        hf = cfg.hf_config
        self.index, self.states, self.tp = index, states, tp
        heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
        if any(h % tp.size for h in heads):
            raise ValueError(f"tp_size {tp.size} does not divide the linear attention's heads")
        self.key_heads, self.value_heads = (h // tp.size for h in heads)
        self.key_dim, self.value_dim = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.widths = [keys, keys, values]
        mixed = 2 * keys + values
        hidden, taps = cfg.hidden_size, hf["linear_conv_kernel_dim"]
        self.in_proj_qkv = Linear(hidden, mixed)
        self.in_proj_z = Linear(hidden, values)
        self.in_proj_b = Linear(hidden, self.value_heads)
        self.in_proj_a = Linear(hidden, self.value_heads)
        self.conv1d = nn.Conv1d(mixed, mixed, taps, groups=mixed, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = RMSNorm(self.value_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(values, hidden)
        self.cpu_ops = None

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state: the convolution's last inputs, the delta rule's matrices."""
        conv = self.conv1d.weight.shape[0] * (self.conv1d.weight.shape[-1] - 1)
        delta = self.value_heads * self.key_dim * self.value_dim
        return conv * dtype.itemsize + delta * self.states.ssm_dtype.itemsize

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        inputs, tokens = backend.inputs, x.shape[0]
        mixed = self.states.convolve(
            self.index, self.project_qkv(x), self.conv1d.weight[:, 0], None, inputs
        )
        q, k, v = F.silu(mixed).split(self.widths, dim=-1)
        q = q.reshape(tokens, self.key_heads, self.key_dim)
        k = k.reshape(tokens, self.key_heads, self.key_dim)
        v = v.reshape(tokens, self.value_heads, self.value_dim)
        beta = self.in_proj_b(x).sigmoid()
        if self.write_scale != 1.0:
            beta = beta * self.write_scale
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        kernels = fused(self.cpu_ops)
        out = self.states.delta_rule(self.index, q, k, v, decay, beta, inputs, kernels)
        gate = self.in_proj_z(x).reshape(-1, self.value_dim)
        out = self.norm(out.reshape(-1, self.value_dim)) * F.silu(gate.float())
        return self.tp.all_reduce(self.out_proj(out.to(x.dtype).reshape(tokens, -1)))

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj_qkv(x)


# a Gated DeltaNet's tensors -> how a rank takes its share: by rows in the parts q, k, v
# (their widths: key, key, value), by rows, by columns
DELTA_NET_TENSOR = re.compile(
    r".*\.(?:linear_attn|self_attn)\.(in_proj_qkv\.weight|conv1d\.weight|in_proj_[zab]\.weight"
    r"|dt_bias|A_log|out_proj\.weight)"
)


def delta_net_shard(weights: Iterable[tuple[str, torch.Tensor]], hf: dict, tp: TPGroup):
    """The checkpoint's Gated DeltaNet tensors as this rank keeps them (its heads); the rest
    pass through to the loader's own slicing."""
    keys = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    values = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    for name, tensor in weights:
        match = DELTA_NET_TENSOR.fullmatch(name) if tp.size > 1 else None
        if match is None:
            yield name, tensor
        elif match[1].startswith(("in_proj_qkv", "conv1d")):
            parts = tensor.split([keys, keys, values])
            yield name, torch.cat([tp.shard(part, 0) for part in parts])
        else:
            yield name, tp.shard(tensor, 1 if match[1].startswith("out_proj") else 0)


class GatedAttention(Attention):
    """q_proj gives each head its query and a gate; the output is gated by sigmoid(gate)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup):
        super().__init__(cfg, layer, tp, qk_norm=ZeroCentredNorm)
        self.qkv_proj = Linear(
            cfg.hidden_size,
            2 * cfg.q_size + 2 * cfg.kv_size,
            parts=(2 * cfg.q_size, cfg.kv_size, cfg.kv_size),
        )

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        cfg = self.cfg
        qg, k, v = self.qkv_proj(x).split([2 * cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, gate = qg.view(-1, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.reshape(-1, cfg.head_dim)).view(-1, cfg.num_heads, cfg.head_dim)
        k = self.k_norm(k.reshape(-1, cfg.head_dim)).view(-1, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = ropes[0]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        out = backend.forward(self.layer, q, k, v, self.how)
        out = out * torch.sigmoid(gate.reshape(out.shape))
        return self.tp.all_reduce(self.o_proj(out))


class Qwen3_5DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, mixer: nn.Module, mlp):
        super().__init__(cfg, layer, tp, mixer, mlp)
        self.input_layernorm = ZeroCentredNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(HybridCausalLM):
    norm_class = ZeroCentredNorm

    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        return GatedAttention(self.cfg, kv_index, self.tp)

    def make_mixer(self, i: int) -> nn.Module:
        return GatedDeltaNet(self.cfg, i, self.states, self.tp)

    def load_weights(self, weights) -> None:
        super().load_weights(delta_net_shard(weights, self.hf, self.tp))

    def make_decoder_layer(self, i: int, mixer: nn.Module) -> nn.Module:
        return Qwen3_5DecoderLayer(self.cfg, i, self.tp, mixer, self.make_mlp(i))

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        cfg = self.cfg
        rope = self.hf.get("rope_parameters") or {}
        width = int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0))
        return [RotaryEmbedding(width, max_positions, cfg.rope_theta, cfg.rope_scaling_dict)]

    def rename(self, name: str) -> str | None:
        """The mixer of every layer sits at `self_attn` (a Gated DeltaNet's `linear_attn`); the
        multi-token prediction head is skipped."""
        if name.startswith(NOT_TEXT):
            return None
        name = name.replace("model.language_model.", "model.", 1)
        name = shared_expert_name(name)
        return LINEAR_ATTENTION.sub(r"\1.self_attn.", name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 with sparse experts in every layer's MLP (the layers listed in
    `mlp_only_layers`, or off the `decoder_sparse_step`, keep a dense one) beside a gated
    shared expert; the checkpoint holds the experts stacked."""

    def make_mlp(self, i: int) -> nn.Module:
        hf, cfg = self.hf, self.cfg
        if i in hf.get("mlp_only_layers", []) or (i + 1) % hf.get("decoder_sparse_step", 1):
            return super().make_mlp(i)
        act = hf.get("hidden_act", "silu")
        routing = Routing("softmax_topk", hf["num_experts_per_tok"], hf.get("norm_topk_prob", True))
        experts = Experts(
            hf["num_experts"], cfg.hidden_size, hf["moe_intermediate_size"], self.tp, act
        )
        inter = hf["shared_expert_intermediate_size"] // self.tp.size
        shared = GatedSharedExpert(cfg.hidden_size, inter, act)
        return SparseMoE(cfg.hidden_size, experts, routing, shared=shared)

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))
