"""Mamba (the selective scan, Mamba1) layers, for Mamba, Falcon Mamba and Jamba: the scan in
torch, chunked for prompts and one step for decode, with the state it carries between calls,
and the mixer around it.

Per channel d, with the state h of shape [state size], dt_t = softplus(dt_t + dt_bias) and
A = -exp(A_log) of shape [channels, state size]:
    h <- exp(dt_t A_d) * h + dt_t x_t B_t;   y_t = h . C_t + D x_t
B and C are shared by every channel. Within a chunk, with L_t the running sum of dt A from the
chunk's start, y_t = sum_{s<=t} (exp(L_t - L_s) * B_s) . C_t dt_s x_s + (exp(L_t) * h0) . C_t
+ D x_t. Everything computes in float32 and agrees with HF transformers' torch reference
(`tests/test_recurrent_ops.py`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from .layers import Linear, RMSNorm
from .rank_shards import RankShardedLoading
from .recipe import UnweightedNorm
from .recurrent_states import RecurrentStates

CHUNK = 16  # tokens a chunk of the scan computes at once ([CHUNK, CHUNK, channels, state])


def mamba1_scan(x, dt, a, b, c, d, state, chunk: int = CHUNK):
    """One sequence: `x`, `dt` [T, D] (dt after softplus), `a` [D, N] (negative), `b`, `c`
    [T, N], `d` [D], `state` [D, N] before it (None: zeros). Returns the output [T, D] in x's
    dtype and the float32 state after the sequence."""
    dtype, x32, dt, b, c = x.dtype, x.float(), dt.float(), b.float(), c.float()
    h = x32.new_zeros(a.shape) if state is None else state.float()
    out = torch.empty_like(x32)
    for start in range(0, x.shape[0], chunk):
        end = min(start + chunk, x.shape[0])
        out[start:end], h = _chunk(x32[start:end], dt[start:end], a, b[start:end], c[start:end], h)
    return (out + d.float() * x32).to(dtype), h


def _chunk(x, dt, a, b, c, h):
    """One chunk of n tokens from state `h` [D, N]: (output [n, D] without D x, state)."""
    n = x.shape[0]
    decay = (dt.unsqueeze(-1) * a).cumsum(0)  # L: [n, D, N]
    lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()[..., None, None]
    between = (decay.unsqueeze(1) - decay.unsqueeze(0)).masked_fill(~lower, float("-inf")).exp()
    weights = between * b[None, :, None, :] * c[:, None, None, :]  # [t, s, D, N]
    within = (weights.sum(-1) * (dt * x).unsqueeze(0)).sum(1)
    carried = (decay.exp() * h * c[:, None, :]).sum(-1)
    last = decay[-1]
    h = last.exp() * h + ((last - decay).exp() * (dt * x).unsqueeze(-1) * b[:, None, :]).sum(0)
    return within + carried, h


def mamba1_step(x, dt, a, b, c, d, states):
    """One new token per sequence: `x`, `dt` [B, D], `b`, `c` [B, N], `states` [B, D, N]
    float32, updated in place. Returns the output [B, D]."""
    x32, dt = x.float(), dt.float()
    states.mul_((dt.unsqueeze(-1) * a).exp())
    states.add_((dt * x32).unsqueeze(-1) * b.float().unsqueeze(1))
    out = (states * c.float().unsqueeze(1)).sum(-1) + d.float() * x32
    return out.to(x.dtype)


@dataclass(frozen=True)
class Mamba1Shape:
    """A Mamba layer's sizes and options. `norms`: RMS norms on dt, B and C before dt_proj,
    "weighted" (Jamba's) or "weightless" (Falcon Mamba's), or None (Mamba's)."""

    hidden: int
    inner: int
    state_size: int
    conv_taps: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    norms: str | None
    eps: float


def dt_rank(rank: int | str, hidden: int) -> int:
    """The rank of dt's projection: as configured, or "auto", hidden / 16 rounded up."""
    return -(-hidden // 16) if rank == "auto" else rank


def jamba_shape(hf: dict) -> Mamba1Shape:
    hidden = hf["hidden_size"]
    return Mamba1Shape(
        hidden=hidden,
        inner=hf.get("mamba_expand", 2) * hidden,
        state_size=hf.get("mamba_d_state", 16),
        conv_taps=hf.get("mamba_d_conv", 4),
        dt_rank=dt_rank(hf.get("mamba_dt_rank", "auto"), hidden),
        conv_bias=hf.get("mamba_conv_bias", True),
        proj_bias=hf.get("mamba_proj_bias", False),
        norms="weighted",
        eps=hf.get("rms_norm_eps", 1e-6),
    )


def mamba_shape(hf: dict) -> Mamba1Shape:
    """Mamba's and Falcon Mamba's (`mixer_rms_eps`: weightless norms on dt, B and C)."""
    hidden = hf["hidden_size"]
    falcon = hf.get("model_type") == "falcon_mamba"
    return Mamba1Shape(
        hidden=hidden,
        inner=hf.get("intermediate_size") or hf.get("expand", 2) * hidden,
        state_size=hf.get("state_size", 16),
        conv_taps=hf.get("conv_kernel", 4),
        dt_rank=dt_rank(hf.get("time_step_rank", "auto"), hidden),
        conv_bias=hf.get("use_conv_bias", True),
        proj_bias=hf.get("use_bias", False),
        norms="weightless" if falcon else None,
        eps=hf.get("mixer_rms_eps", 1e-6),
    )


class Mamba1Mixer(nn.Module, RankShardedLoading):
    """in_proj -> (x, z); x through the causal convolution and SiLU; x_proj -> (dt, B, C)
    (each RMS-normed where the shape says), dt through dt_proj; the scan; times SiLU(z);
    out_proj. The convolution's and the scan's states are resumed per request
    (`recurrent.RecurrentStates`). Under tensor parallelism each rank keeps its share of the
    channels: x_proj's outputs and out_proj's are summed over the ranks."""

    by_columns = ("out_proj", "x_proj")
    kept_whole = ("dt_layernorm", "b_layernorm", "c_layernorm")

    def __init__(
        self, shape: Mamba1Shape, index: int, states: RecurrentStates, tp: TPGroup = TPGroup()
    ):
        super().__init__()
        if shape.inner % tp.size:
            raise ValueError(f"tp_size {tp.size} does not divide the Mamba layer's channels")
        self.full_inner, self.tp, self.loaded = shape.inner, tp, set()
        shape = replace(shape, inner=shape.inner // tp.size)
        self.shape, self.index, self.states = shape, index, states
        inner, rank, size = shape.inner, shape.dt_rank, shape.state_size
        self.in_proj = Linear(shape.hidden, 2 * inner, bias=shape.proj_bias)
        self.conv1d = nn.Conv1d(inner, inner, shape.conv_taps, groups=inner, bias=shape.conv_bias)
        self.x_proj = Linear(inner, rank + 2 * size)
        self.dt_proj = Linear(rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(inner, size))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = Linear(inner, shape.hidden, bias=shape.proj_bias)
        if shape.norms is not None:
            norm = partial(RMSNorm if shape.norms == "weighted" else UnweightedNorm, eps=shape.eps)
            self.dt_layernorm = norm(rank)
            self.b_layernorm, self.c_layernorm = norm(size), norm(size)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state: the convolution's last inputs, the scan's state."""
        shape = self.shape
        conv = shape.inner * (shape.conv_taps - 1)
        scan = shape.inner * shape.state_size
        return conv * dtype.itemsize + scan * self.states.ssm_dtype.itemsize

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        shape, inputs = self.shape, backend.inputs
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        xs = self.states.convolve(
            self.index, xs.contiguous(), self.conv1d.weight[:, 0], self.conv1d.bias, inputs
        )
        xs = F.silu(xs)
        projected = self.tp.all_reduce(self.x_proj(xs))
        dt, b, c = projected.split([shape.dt_rank, shape.state_size, shape.state_size], -1)
        if shape.norms is not None:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = F.softplus(self.dt_proj(dt).float())
        a, d = -self.A_log.float().exp(), self.D
        y = self.states.resume(
            "ssm",
            self.index,
            (shape.inner, shape.state_size),
            self.states.ssm_dtype,
            inputs,
            lambda x, dt, b, c, s: mamba1_step(x, dt, a, b, c, d, s),
            lambda x, dt, b, c, s: mamba1_scan(x, dt, a, b, c, d, s),
            xs,
            dt,
            b,
            c,
        )
        return self.tp.all_reduce(self.out_proj((y * F.silu(z)).to(x.dtype)))

    def fused_parts(self):
        return {"in_proj": [(self.full_inner, False)] * 2}
