"""The sequence ops of recurrent layers, in torch, with the state they carry between calls, so a
prompt may run in chunks and resume from a kept state: the causal depthwise convolution of
Gated DeltaNet, Mamba and short-conv layers, and the gated delta rule (Qwen3.5, Qwen3-Next).

Prompts run the chunked form (a chunk's updates solved as one triangular system), decode steps
the one-step recurrence over a batch. Both compute in float32 and agree with HF transformers'
torch references (`tests/test_recurrent_ops.py`). The requests' states they run from and into
are kept by `recurrent_states`.

The gated delta rule, per value head, with the state S of shape [key dim, value dim]:
    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
with q and k L2-normalized and q scaled by 1/sqrt(key dim). Within a chunk, with gamma the
running sum of g from the chunk's start, the updates u solve the unit lower-triangular system
(I + A) u = beta (v - exp(gamma) K S0), A[i, j] = beta_i exp(gamma_i - gamma_j) k_i.k_j for
j < i.

Kimi Delta Attention (Kimi Linear) decays each key channel on its own: `g` [.., heads, key dim]
scales S's rows, S <- diag(exp(g_t)) S, and A[i, j] = beta_i k_i.(exp(gamma_i - gamma_j) * k_j)
with the running sums per channel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens a chunk of the gated delta rule solves at once
L2_EPS = 1e-6


# ---- causal depthwise convolution ---------------------------------------------------
def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: `x` [T, C], `weight` [C, K], `state` [C, K-1] the inputs before `x` (None:
    zeros). Returns the output [T, C] (no activation) and the state after `x`."""
    channels, width = weight.shape
    if state is None:
        state = x.new_zeros(channels, width - 1)
    padded = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    out = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), bias, groups=channels)
    return out[0].t(), padded[:, padded.shape[1] - (width - 1) :].clone()


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor
) -> torch.Tensor:
    """One new input per sequence: `x` [B, C], `states` [B, C, K-1], updated in place. Returns
    the output [B, C] (no activation)."""
    window = torch.cat([states, x.unsqueeze(-1).to(states.dtype)], dim=-1)  # [B, C, K]
    out = (window * weight.to(states.dtype)).sum(-1)
    if bias is not None:
        out = out + bias
    states.copy_(window[..., 1:])
    return out.to(x.dtype)


# ---- the gated delta rule ----------------------------------------------------------
def _prepare(q, k, v, g, beta, num_v_heads: int):
    """float32 copies, heads first, q and k normalized (and repeated for grouped value heads)."""
    groups = num_v_heads // k.shape[-2]
    q = _l2norm(q.float())
    k = _l2norm(k.float())
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    q = q * q.shape[-1] ** -0.5
    return q, k, v.float(), g.float(), beta.float()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked: `q`, `k` [T, Hk, Dk], `v` [T, Hv, Dv], `g` (log decay, <= 0:
    [T, Hv], or [T, Hv, Dk] per key channel) and `beta` [T, Hv], `state` [Hv, Dk, Dv] before
    the sequence (None: zeros). Returns the output [T, Hv, Dv] in v's dtype and the float32
    state after the sequence."""
    length, num_heads, value_dim = v.shape
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, num_heads)
    s = q.new_zeros(num_heads, k.shape[-1], value_dim) if state is None else state.float()
    out = q.new_empty(length, num_heads, value_dim)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        one_chunk = _chunk if g.dim() == 2 else _chunk_per_channel
        part = (q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end])
        out[start:end], s = one_chunk(*part, s)
    return out.to(dtype), s


def _chunk(q, k, v, g, beta, s):
    """One chunk of n tokens from state `s` [H, Dk, Dv]: (output [n, H, Dv], state after)."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n, D]
    gamma = g.t().cumsum(-1)  # [H, n]
    beta = beta.t().unsqueeze(-1)  # [H, n, 1]
    n = gamma.shape[-1]
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    eye = torch.eye(n, device=q.device)
    strict = decay * (1 - eye)
    system = eye + beta * (k @ k.transpose(-1, -2)) * strict  # unit lower triangular
    rhs = beta * (v - gamma.exp().unsqueeze(-1) * (k @ s))
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (gamma.exp().unsqueeze(-1) * q) @ s + ((q @ k.transpose(-1, -2)) * decay) @ u
    last = gamma[:, -1:]
    s = (
        last.exp().unsqueeze(-1) * s
        + ((last - gamma).exp().unsqueeze(-1) * k).transpose(-1, -2) @ u
    )
    return out.transpose(0, 1), s


def _chunk_per_channel(q, k, v, g, beta, s):
    """`_chunk` with a decay per key channel (`g` [n, H, Dk])."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n, D]
    gamma = g.transpose(0, 1).cumsum(1)  # [H, n, Dk]
    beta = beta.t().unsqueeze(-1)  # [H, n, 1]
    n = gamma.shape[1]
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    pairs = gamma.unsqueeze(2) - gamma.unsqueeze(1)  # [H, i, j, Dk]: gamma_i - gamma_j
    decay = pairs.masked_fill(~lower[..., None], float("-inf")).exp()
    eye = torch.eye(n, device=q.device)
    keys = torch.einsum("hic,hjc,hijc->hij", k, k, decay) * (1 - eye)
    system = eye + beta * keys  # unit lower triangular
    rhs = beta * (v - (gamma.exp() * k) @ s)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    scores = torch.einsum("hic,hjc,hijc->hij", q, k, decay)
    out = (gamma.exp() * q) @ s + scores @ u
    last = gamma[:, -1:]  # [H, 1, Dk]
    s = last.transpose(1, 2).exp() * s + ((last - gamma).exp() * k).transpose(-1, -2) @ u
    return out.transpose(0, 1), s


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """One new token per sequence: `q`, `k` [B, Hk, Dk], `v` [B, Hv, Dv], `g` [B, Hv] (or
    [B, Hv, Dk] per key channel), `beta` [B, Hv], `states` [B, Hv, Dk, Dv] float32, updated in
    place. Returns the output [B, Hv, Dv]."""
    q, k, v32, g, beta = _prepare(q, k, v, g, beta, v.shape[-2])
    states.mul_(g.exp()[..., None, None] if g.dim() == 2 else g.exp()[..., None])
    remembered = (states * k.unsqueeze(-1)).sum(-2)  # S^T k: [B, H, Dv]
    update = (v32 - remembered) * beta.unsqueeze(-1)
    states.add_(k.unsqueeze(-1) * update.unsqueeze(-2))
    return (states * q.unsqueeze(-1)).sum(-2).to(v.dtype)


def delta_step_in_place(kernels, states, rows, q, k, v, g, beta) -> torch.Tensor:
    """`gated_delta_rule_step` through the CPU kernel, on `states[rows]` in place."""
    q, k, v32, g, beta = _prepare(q, k, v, g, beta, v.shape[-2])
    out = kernels.gated_delta_step(
        states, rows, q.contiguous(), k.contiguous(), v32.contiguous(), g.exp(), beta.contiguous()
    )
    return out.to(v.dtype)
