"""Mamba2 (state space duality) layers, for Nemotron-H and Falcon-H1: the scan in torch, chunked
for prompts and one step for decode, with the state it carries between calls, and the mixer
around it.

Per head h, with the state S of shape [head dim, state size], dt_t = softplus(dt_t + dt_bias)
clamped to `time_step_limit`, and A = -exp(A_log):
    S <- exp(dt_t A) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t
B and C are shared by the heads of a group. Within a chunk, with gamma the running sum of
dt A from the chunk's start, y_i = sum_{j<=i} exp(gamma_i - gamma_j) (C_i . B_j) dt_j x_j
+ exp(gamma_i) S0 C_i + D x_i. Everything computes in float32 and agrees with HF transformers'
torch reference (`tests/test_recurrent_ops.py`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from .layers import Linear, fused
from .rank_shards import Part, RankShardedLoading
from .recurrent_states import RecurrentStates

CHUNK = 64  # tokens a chunk of the scan computes at once


def mamba2_scan(x, dt, a, b, c, d, state, chunk: int = CHUNK):
    """One sequence: `x` [T, H, P], `dt` [T, H] (after softplus and clamp), `a` [H] (negative),
    `b`, `c` [T, G, N], `d` [H], `state` [H, P, N] before it (None: zeros). Returns the output
    [T, H, P] in x's dtype and the float32 state after the sequence."""
    length, heads, head_dim = x.shape
    dtype = x.dtype
    b, c = _per_head(b, heads), _per_head(c, heads)
    x32, dt = x.float(), dt.float()
    s = x32.new_zeros(heads, head_dim, b.shape[-1]) if state is None else state.float()
    out = x32.new_empty(length, heads, head_dim)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        out[start:end], s = _chunk(x32[start:end], dt[start:end], a, b[start:end], c[start:end], s)
    return (out + d.float()[:, None] * x32).to(dtype), s


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, G, N] float32 -> [T, H, N], each group's vector for its heads."""
    return t.float().repeat_interleave(heads // t.shape[-2], dim=-2)


def _chunk(x, dt, a, b, c, s):
    """One chunk of n tokens from state `s` [H, P, N]: (output [n, H, P] without D, state)."""
    gamma = (dt * a).t().cumsum(-1)  # [H, n]
    n = gamma.shape[-1]
    lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    xdt = (x * dt.unsqueeze(-1)).transpose(0, 1)  # [H, n, P]
    b, c = b.transpose(0, 1), c.transpose(0, 1)  # [H, n, N]
    within = ((c @ b.transpose(-1, -2)) * decay) @ xdt
    carried = gamma.exp().unsqueeze(-1) * (c @ s.transpose(-1, -2))
    last = gamma[:, -1:]
    s = last.exp().unsqueeze(-1) * s + (
        ((last - gamma).exp().unsqueeze(-1) * xdt).transpose(-1, -2) @ b
    )
    return (within + carried).transpose(0, 1), s


def mamba2_step(x, dt, a, b, c, d, states):
    """One new token per sequence: `x` [B, H, P], `dt` [B, H], `b`, `c` [B, G, N], `states`
    [B, H, P, N] float32, updated in place. Returns the output [B, H, P]."""
    heads = x.shape[1]
    b, c, x32, dt = _per_head(b, heads), _per_head(c, heads), x.float(), dt.float()
    states.mul_((dt * a).exp()[..., None, None])
    states.add_((x32 * dt.unsqueeze(-1)).unsqueeze(-1) * b.unsqueeze(-2))
    out = (states * c.unsqueeze(-2)).sum(-1) + d.float()[:, None] * x32
    return out.to(x.dtype)


def mamba2_step_in_place(kernels, states, rows, x, dt, a, b, c, d) -> torch.Tensor:
    """`mamba2_step` through the CPU kernel, on `states[rows]` in place."""
    out = kernels.mamba2_step(
        states,
        rows,
        x.float().contiguous(),
        dt.float().contiguous(),
        a.float(),
        b.float().contiguous(),
        c.float().contiguous(),
        d.float(),
    )
    return out.to(x.dtype)


def time_step_limit(hf: dict) -> tuple[float, float]:
    """config.json's `time_step_limit`, whose infinity HF writes as {"__float__": "Infinity"}."""
    limits = hf.get("time_step_limit") or (0.0, float("inf"))
    return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in limits)


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 layer's sizes and options, read from each family's config names."""

    hidden: int
    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_taps: int
    conv_bias: bool
    proj_bias: bool
    out_bias: bool
    eps: float
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    gated_norm: bool = True  # else the output is only gated by SiLU(z)
    norm_before_gate: bool = False

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


class Mamba2Mixer(nn.Module, RankShardedLoading):
    """in_proj -> (z, x|B|C, dt); x|B|C through the causal convolution and SiLU; the scan;
    gated grouped RMS norm (or a SiLU gate); out_proj. The convolution's and the scan's states
    are resumed per request (`recurrent.RecurrentStates`). Under tensor parallelism each rank
    keeps its share of the heads and groups (`rank_shards` slices the checkpoint's tensors part
    by part) and all-reduces its output."""

    def __init__(
        self, shape: Mamba2Shape, index: int, states: RecurrentStates, tp: TPGroup = TPGroup()
    ):
        super().__init__()
        # one group (B and C shared by all heads) is kept whole by every rank; more are split
        self.split_groups = shape.groups > 1 and tp.size > 1
        if shape.heads % tp.size or (self.split_groups and shape.groups % tp.size):
            raise ValueError(f"tp_size {tp.size} does not divide the Mamba2 heads and groups")
        self.full_shape, self.tp, self.loaded = shape, tp, set()
        groups = shape.groups // tp.size if self.split_groups else shape.groups
        shape = replace(shape, heads=shape.heads // tp.size, groups=groups)
        self.shape, self.index, self.states = shape, index, states
        inner, groups_state = shape.inner, shape.groups * shape.state_size
        self.conv_width = inner + 2 * groups_state
        self.in_proj = Linear(
            shape.hidden, inner + self.conv_width + shape.heads, bias=shape.proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_width,
            self.conv_width,
            shape.conv_taps,
            groups=self.conv_width,
            bias=shape.conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(shape.heads))
        self.A_log = nn.Parameter(torch.zeros(shape.heads))
        self.D = nn.Parameter(torch.ones(shape.heads))
        spread = None if self.split_groups else tp  # one group spans the ranks' channels
        gated = shape.gated_norm
        self.norm = GroupedGatedNorm(inner, shape.groups, shape.eps, spread) if gated else None
        self.out_proj = Linear(inner, shape.hidden, bias=shape.out_bias)
        self.cpu_ops = None

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state: the convolution's last inputs, the scan's state."""
        shape = self.shape
        conv = self.conv_width * (shape.conv_taps - 1)
        scan = shape.heads * shape.head_dim * shape.state_size
        return conv * dtype.itemsize + scan * self.states.ssm_dtype.itemsize

    def forward(self, x: torch.Tensor, ropes, backend: AttentionBackend) -> torch.Tensor:
        shape, inputs, tokens = self.shape, backend.inputs, x.shape[0]
        inner, groups_state = shape.inner, shape.groups * shape.state_size
        z, xbc, dt = self.in_proj(x).split([inner, self.conv_width, shape.heads], dim=-1)
        xbc = self.states.convolve(
            self.index, xbc, self.conv1d.weight[:, 0], self.conv1d.bias, inputs
        )
        xs, b, c = F.silu(xbc).split([inner, groups_state, groups_state], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*shape.time_step_limit)
        a, d = -self.A_log.float().exp(), self.D
        kernels = fused(self.cpu_ops)
        y = self.states.resume(
            "ssm",
            self.index,
            (shape.heads, shape.head_dim, shape.state_size),
            self.states.ssm_dtype,
            inputs,
            lambda x, dt, b, c, s: mamba2_step(x, dt, a, b, c, d, s),
            lambda x, dt, b, c, s: mamba2_scan(x, dt, a, b, c, d, s),
            xs.reshape(tokens, shape.heads, shape.head_dim),
            dt,
            b.reshape(tokens, shape.groups, shape.state_size),
            c.reshape(tokens, shape.groups, shape.state_size),
            in_place=None
            if kernels is None
            else lambda s, rows, x, dt, b, c: mamba2_step_in_place(
                kernels, s, rows, x, dt, a, b, c, d
            ),
        ).reshape(tokens, inner)
        if self.norm is None:
            y = y * F.silu(z)
        else:
            y = self.norm(y, z, shape.norm_before_gate)
        return self.tp.all_reduce(self.out_proj(y.to(x.dtype)))

    def fused_parts(self) -> dict[str, list[Part]]:
        """in_proj's rows (z, x, B, C, dt) and the convolution's (x, B, C); one group's B and C
        are every rank's."""
        full = self.full_shape
        inner, groups_state, whole = (
            full.inner,
            full.groups * full.state_size,
            not self.split_groups,
        )
        bc = [(groups_state, whole), (groups_state, whole)]
        return {
            "in_proj": [(inner, False), (inner, False), *bc, (full.heads, False)],
            "conv1d": [(inner, False), *bc],
        }


class GroupedGatedNorm(nn.Module):
    """RMS norm over each group of channels, weighted, with a SiLU(z) gate applied before the
    norm (Nemotron-H, Falcon-H1's default in HF) or after it. `spread`: the TP ranks one group's
    channels lie on (their squares summed over them), where it spans more than this one."""

    def __init__(self, width: int, groups: int, eps: float, spread: TPGroup | None = None):
        super().__init__()
        self.groups, self.eps, self.spread = groups, eps, spread
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, y: torch.Tensor, z: torch.Tensor, norm_before_gate: bool) -> torch.Tensor:
        dtype, y = y.dtype, y.float()
        gate = F.silu(z.float())
        if not norm_before_gate:
            y = y * gate
        grouped = y.view(*y.shape[:-1], self.groups, -1)
        if self.spread is None or self.spread.size == 1:
            mean = grouped.pow(2).mean(-1, keepdim=True)
        else:
            total = self.spread.all_reduce(grouped.pow(2).sum(-1, keepdim=True))
            mean = total / (grouped.shape[-1] * self.spread.size)
        grouped = grouped * torch.rsqrt(mean + self.eps)
        y = self.weight.float() * grouped.view(y.shape)
        if norm_before_gate:
            y = y * gate
        return y.to(dtype)
