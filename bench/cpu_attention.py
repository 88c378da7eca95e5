"""One layer's CPU attention: the paged extend kernel against the path it replaced (gather K/V,
pad the queries and run masked SDPA; or, for a few new tokens, the decode kernel once per token).

    python bench/cpu_attention.py          # SmolLM2-135M's heads: 9 query, 3 KV, dim 64

Both run interleaved in one process over the same scattered slots; prints the best of 7 each.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from radixserve_kernels.cpu_ops import load

SHAPES = {
    "8 x (300 + 2)": ([300] * 8, [2] * 8),
    "8 x (300 + 5)": ([300] * 8, [5] * 8),
    "8 x (600 + 16)": ([600] * 8, [16] * 8),
    "8 x (600 + 20)": ([600] * 8, [20] * 8),
    "8 x (400 + 40)": ([400] * 8, [40] * 8),
    "4 x (0 + 330)": ([0] * 4, [330] * 4),
    "1 x (0 + 2048)": ([0], [2048]),
    "1 x (8000 + 512)": ([8000], [512]),
}


def gathered_sdpa(q, k_cache, v_cache, table, rows, prefix, ext, scale):
    seq = prefix + ext
    length, most = int(seq.max()), int(ext.max())
    kv_heads, dim = k_cache.shape[1:]
    index = table[rows, :length].flatten()
    k = k_cache.index_select(0, index).view(len(rows), length, kv_heads, dim).transpose(1, 2)
    v = v_cache.index_select(0, index).view(len(rows), length, kv_heads, dim).transpose(1, 2)
    pad_req = torch.repeat_interleave(torch.arange(len(rows)), ext)
    pad_pos = torch.arange(len(pad_req)) - (torch.cumsum(ext, 0) - ext)[pad_req]
    padded = q.new_zeros(len(rows), most, *q.shape[1:])
    padded[pad_req, pad_pos] = q
    mask = torch.arange(length).view(1, 1, length) <= (
        prefix.view(-1, 1, 1) + torch.arange(most).view(1, -1, 1)
    )
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)[pad_req, pad_pos]


def decode_per_token(kernels, q, k_cache, v_cache, table, rows, prefix, ext, scale):
    offset = torch.arange(int(ext.sum())) - torch.repeat_interleave(torch.cumsum(ext, 0) - ext, ext)
    lens = torch.repeat_interleave(prefix, ext) + offset + 1
    return kernels.paged_decode_attention(
        q, k_cache, v_cache, table, torch.repeat_interleave(rows, ext), lens, scale
    )


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    kernels = load()
    if kernels is None or not kernels.extend_supported(a.dim):
        raise SystemExit(
            "no CPU extend kernel here (no compiler, no AVX, or an unsupported head dim)"
        )
    gen = torch.Generator().manual_seed(0)
    slots = 40000
    k_cache, v_cache = (
        torch.randn(slots, a.kv_heads, a.dim, generator=gen),
        torch.randn(slots, a.kv_heads, a.dim, generator=gen),
    )
    scale = a.dim**-0.5
    print(
        "| shape (requests x (prefix + new)) | old path | extend kernel | ratio |\n| --- | --- | "
        "--- | --- |"
    )
    for name, (prefix, ext) in SHAPES.items():
        prefix, ext = torch.tensor(prefix), torch.tensor(ext)
        rows = torch.arange(len(ext))
        table = torch.stack([torch.randperm(slots - 1, generator=gen)[:9000] + 1 for _ in rows])
        q = torch.randn(int(ext.sum()), a.heads, a.dim, generator=gen)
        args = (q, k_cache, v_cache, table, rows, prefix, ext, scale)
        new = lambda: kernels.paged_extend_attention(*args)  # noqa: E731
        short = int(ext.max()) <= 16
        old = (
            (lambda: decode_per_token(kernels, *args)) if short else (lambda: gathered_sdpa(*args))
        )  # noqa: E731
        torch.testing.assert_close(new(), old(), atol=1e-4, rtol=1e-4)
        pairs = [
            (seconds(old), seconds(new)) for _ in range(a.repeats)
        ]  # interleaved: drift hits both alike
        t_old, t_new = (min(times) * 1e3 for times in zip(*pairs))
        label = "decode kernel per token" if short else "gather + masked SDPA"
        print(f"| {name} | {t_old:.3f} ms ({label}) | {t_new:.3f} ms | {t_new / t_old:.2f} |")


if __name__ == "__main__":
    main()
