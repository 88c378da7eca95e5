"""FP8 linear layers on GPUs: `y = x W^T` for float8_e4m3fn weights `W` (bytes `[out, in]`, one
float32 scale per output row and group of `group` input columns: block, per-channel or
per-tensor scales all take this form) with dynamic activation scales: each token's row of `x` is
quantized to e4m3 with its own scale (its largest magnitude over 448), the products accumulate
in float32, and the row's scale multiplies the sum.

The kernel widens the e4m3 bytes of both operands inside the tile loop by bit arithmetic (any
GPU, and Triton's interpreter on CPU), so the weights cross memory as one byte each.
`fp8_linear_ref` is the same in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _e4m3_to_float(bits):
    """e4m3fn bytes (int32 holding 0..255) to float32; NaN bytes are refused at load."""
    sign = tl.where((bits & 0x80) != 0, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).to(tl.float32) / 8.0
    normal = (1.0 + mantissa) * tl.exp2((exponent - 7).to(tl.float32))
    subnormal = mantissa * 0.015625  # 2 ** -6
    return sign * tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    y_ptr,
    rows,
    n_cols,
    k_dim,
    groups,
    group,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_bits = tl.load(
            x_ptr + offs_m[:, None] * k_dim + offs_k[None, :],
            mask=(offs_m[:, None] < rows) & (offs_k[None, :] < k_dim),
            other=0,
        ).to(tl.int32)
        w_mask = (offs_n[None, :] < n_cols) & (offs_k[:, None] < k_dim)
        w_bits = tl.load(
            w_ptr + offs_n[None, :] * k_dim + offs_k[:, None], mask=w_mask, other=0
        ).to(tl.int32)
        w_scale = tl.load(
            w_scale_ptr + offs_n[None, :] * groups + offs_k[:, None] // group,
            mask=w_mask,
            other=0.0,
        )
        acc += tl.dot(_e4m3_to_float(x_bits), _e4m3_to_float(w_bits) * w_scale)
    acc *= tl.load(x_scale_ptr + offs_m, mask=offs_m < rows, other=0.0)[:, None]
    tl.store(
        y_ptr + offs_m[:, None] * n_cols + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < rows) & (offs_n[None, :] < n_cols),
    )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` as e4m3 bytes with its float32 scale (largest magnitude over 448)."""
    x = x.float()
    scales = (x.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    data = (x / scales[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return data.contiguous(), scales.contiguous()


def fp8_linear(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, group: int):
    """`x [rows, in]` times the FP8 weight (`data [out, in]` uint8, `scales [out, groups]`)
    transposed, in x's dtype."""
    x_bytes, x_scales = quantize_rows(x)
    rows, k_dim = x.shape
    n_cols = data.shape[0]
    y = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = 16, 64, 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n_cols, block_n))
    _fp8_linear_kernel[grid](
        x_bytes,
        x_scales,
        data.contiguous(),
        scales.contiguous(),
        y,
        rows,
        n_cols,
        k_dim,
        scales.shape[1],
        group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y


def fp8_linear_ref(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, group: int):
    x_bytes, x_scales = quantize_rows(x)
    xq = x_bytes.view(torch.float8_e4m3fn).float() * x_scales[:, None]
    w = data.view(torch.float8_e4m3fn).float()
    w = w * scales.repeat_interleave(group, dim=1)[:, : w.shape[1]]
    return (xq @ w.t()).to(x.dtype)
