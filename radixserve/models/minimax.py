"""MiniMax-Text-01 and MiniMax-M1 (`MiniMaxForCausalLM`, transformers' layout): lightning
attention layers beside full-attention layers (`layer_types`), Mixtral's experts in every layer,
and each sublayer's residual taken after its input norm and weighted (`*_alpha_factor` times
the normed input plus `*_beta_factor` times the sublayer's output).

Lightning attention is linear attention with a fixed decay per head: q, k and v are SiLU of one
projection (each head's three side by side), the state S [head dim, head dim] of each head
decays by exp(-slope) a token, S <- exp(-slope) S + v k^T and the output is S q, without a
score scale; the heads' outputs are RMS-normed together, gated by a sigmoid of the input's own
projection and projected out. It is the Mamba2 scan (`mamba2`) with dt = 1, A = -slope, B = k,
C = q and x = v, chunked for prompts and one step for decode, its state resumed per request."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig, is_attention_layer
from .decoder import Attention
from .hybrid import HybridCausalLM
from .layers import Linear, RMSNorm, fused
from .mamba2 import mamba2_scan, mamba2_step, mamba2_step_in_place
from .mixtral import mixtral_name
from .moe import Experts, Routing, SparseMoE
from .rank_shards import RankShardedLoading
from .recurrent_states import RecurrentStates

DECAY_TABLES = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")  # HF's buffers


def slopes(heads: int, layer: int, layers: int) -> torch.Tensor:
    """Each head's decay rate in layer `layer`, as MiniMax sets it: a geometric series over
    the heads, scaled down linearly with depth."""
    base = 1 / (2 ** (8 / heads))
    depth = 1 - layer / (layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(heads, dtype=torch.float64) + 1) * depth


class LightningAttention(nn.Module, RankShardedLoading):
    """`cfg`: this rank's heads (under tensor parallelism each rank keeps a block of them, their
    decay rates among all heads', and norms the output over all ranks' channels)."""

    def __init__(self, cfg: ModelConfig, layer: int, states: RecurrentStates, tp: TPGroup):
        super().__init__()
        self.index, self.states, self.tp, self.loaded = layer, states, tp, set()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        width = self.heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, 3 * width)
        self.output_gate = Linear(cfg.hidden_size, width)
        self.norm = RMSNorm(width, 1e-6)
        self.out_proj = Linear(width, cfg.hidden_size)
        decay = tp.shard(-slopes(self.heads * tp.size, layer, cfg.num_layers), 0)
        self.register_buffer("decay", decay.float(), persistent=False)
        self.register_buffer("no_skip", torch.zeros(self.heads), persistent=False)
        self.cpu_ops = None

    def state_bytes(self, dtype: torch.dtype) -> int:
        return self.heads * self.head_dim**2 * self.states.ssm_dtype.itemsize

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        tokens, heads, dim = x.shape[0], self.heads, self.head_dim
        q, k, v = F.silu(self.qkv_proj(x)).view(tokens, heads, 3 * dim).split(dim, dim=-1)
        a, d, kernels = self.decay, self.no_skip, fused(self.cpu_ops)
        dt = torch.ones(tokens, heads, dtype=torch.float32, device=x.device)
        y = self.states.resume(
            "ssm",
            self.index,
            (heads, dim, dim),
            self.states.ssm_dtype,
            backend.inputs,
            lambda x, dt, b, c, s: mamba2_step(x, dt, a, b, c, d, s),
            lambda x, dt, b, c, s: mamba2_scan(x, dt, a, b, c, d, s),
            v.contiguous(),
            dt,
            k.contiguous(),
            q.contiguous(),
            in_place=None
            if kernels is None
            else lambda s, rows, x, dt, b, c: mamba2_step_in_place(
                kernels, s, rows, x, dt, a, b, c, d
            ),
        )
        y = self.normed(y.reshape(tokens, -1).to(x.dtype))
        return self.tp.all_reduce(self.out_proj(torch.sigmoid(self.output_gate(x)) * y))

    def normed(self, y: torch.Tensor) -> torch.Tensor:
        """The output RMS-normed over all heads' channels (their squares summed over ranks)."""
        if self.tp.size == 1:
            return self.norm(y)
        squares = self.tp.all_reduce(y.float().pow(2).sum(-1, keepdim=True))
        scale = torch.rsqrt(squares / (y.shape[-1] * self.tp.size) + self.norm.eps)
        return (self.norm.weight.float() * y.float() * scale).to(y.dtype)

    def fused_parts(self):
        return {}


class WeightedResidualLayer(nn.Module):
    """x <- a * norm(x) + b * sublayer(norm(x)), for the mixer and then the MLP, each with its
    own (a, b)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, mixer, mlp, mixer_factors, mlp_factors):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        self.mixer_factors, self.mlp_factors = mixer_factors, mlp_factors

    def forward(self, x, normed, ropes, backend, next_norm):
        (a, b), (c, d) = self.mixer_factors, self.mlp_factors
        mixed = normed * a + self.self_attn(normed, ropes, backend) * b
        normed = self.post_attention_layernorm(mixed)
        out = normed * c + self.tp.all_reduce(self.mlp(normed)) * d
        return out, next_norm(out)


class MiniMaxForCausalLM(HybridCausalLM):
    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        how = LayerAttention(window=self.hf.get("sliding_window"))
        return Attention(self.cfg, kv_index, self.tp, how)

    def make_mixer(self, i: int) -> nn.Module:
        return LightningAttention(self.cfg, i, self.states, self.tp)

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        act = hf.get("hidden_act", "silu")
        experts = Experts(hf["num_local_experts"], hidden, hf["intermediate_size"], self.tp, act)
        routing = Routing("softmax_topk", hf["num_experts_per_tok"], renormalize=True)
        return SparseMoE(hidden, experts, routing)

    def make_decoder_layer(self, i: int, mixer: nn.Module) -> nn.Module:
        hf = self.hf
        kind = "full_attn" if is_attention_layer(hf["layer_types"][i]) else "linear_attn"
        mixer_factors = (hf.get(f"{kind}_alpha_factor", 1), hf.get(f"{kind}_beta_factor", 1))
        mlp_factors = (hf.get("mlp_alpha_factor", 1), hf.get("mlp_beta_factor", 1))
        mlp = self.make_mlp(i)
        return WeightedResidualLayer(self.cfg, self.tp, mixer, mlp, mixer_factors, mlp_factors)

    def rename(self, name: str) -> str | None:
        if name.rpartition(".")[2] in DECAY_TABLES:
            return None  # computed from the head count and depth
        return mixtral_name(name)
