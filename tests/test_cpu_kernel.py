"""The CPU kernels against their torch references: paged decode and extend attention (against
gathering K/V and running SDPA) and the fused RMSNorm, SwiGLU activation and rotary embedding."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixserve.models.rotary import apply_rotary
from radixserve_kernels.cpu_ops import build_dir, load

kernel = load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler to build the CPU kernel")


def reference(q, k_cache, v_cache, table, rows, seq_lens, scale):
    out = []
    for b in range(q.shape[0]):
        slots = table[rows[b], : seq_lens[b]]
        k, v = (
            k_cache[slots].transpose(0, 1).float(),
            v_cache[slots].transpose(0, 1).float(),
        )  # [kvh, L, D]
        out.append(
            F.scaled_dot_product_attention(
                q[b].unsqueeze(1).float(), k, v, scale=scale, enable_gqa=True
            ).squeeze(1)
        )
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_decode_kernel_matches_sdpa_over_scattered_slots(dtype, tol, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * dim)
    seq_lens = torch.tensor([1, 17, 300, 64, 5])
    slots = torch.randperm(2000, generator=gen) + 1  # slot 0 stays unused, as in the pool
    table = torch.zeros(8, 400, dtype=torch.long)
    rows = torch.tensor([6, 0, 3, 7, 1])
    used = 0
    for row, n in zip(rows.tolist(), seq_lens.tolist()):
        table[row, :n] = slots[used : used + n]
        used += n
    k_cache = torch.randn(2001, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(2001, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(rows), heads, dim, generator=gen).to(dtype)
    expected = reference(q, k_cache, v_cache, table, rows, seq_lens, dim**-0.5)
    strided = torch.cat([q.flatten(1), q.new_zeros(len(q), 8)], 1)[:, : heads * dim].view_as(
        q
    )  # a view, as in the model
    for n in (
        len(rows),
        2,
    ):  # tasks per request (whole token rows), and per KV head for few requests
        for queries in (q, strided):
            out = kernel.paged_decode_attention(
                queries[-n:], k_cache, v_cache, table, rows[-n:], seq_lens[-n:], dim**-0.5
            )
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), expected[-n:], atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (10, 2, 80)])
def test_extend_kernel_matches_causal_sdpa_after_a_cached_prefix(heads, kv_heads, dim):
    """New tokens of several requests (1 to 70 of them: partial and whole query blocks and key
    tiles) after prefixes of 0 to 300 cached tokens, over scattered slots."""
    if not kernel.extend_supported(dim):
        pytest.skip("no extend kernel on this CPU")
    gen = torch.Generator().manual_seed(heads + dim)
    prefix_lens, extend_lens = (
        torch.tensor([0, 17, 300, 5, 0, 31]),
        torch.tensor([1, 9, 45, 70, 3, 16]),
    )
    rows = torch.tensor([4, 0, 2, 1, 3, 5])
    table = torch.stack([torch.randperm(1999, generator=gen)[:400] + 1 for _ in range(6)])
    k_cache = torch.randn(2000, kv_heads, dim, generator=gen)
    v_cache = torch.randn(2000, kv_heads, dim, generator=gen)
    q = torch.randn(int(extend_lens.sum()), heads, dim, generator=gen)
    expected, start = [], 0
    for row, prefix, n in zip(rows.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        slots = table[row, : prefix + n]
        causal = torch.arange(prefix + n).view(1, -1) <= (prefix + torch.arange(n)).view(-1, 1)
        expected.append(
            F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1),
                k_cache[slots].transpose(0, 1),
                v_cache[slots].transpose(0, 1),
                attn_mask=causal,
                scale=dim**-0.5,
                enable_gqa=True,
            ).transpose(0, 1)
        )
        start += n
    strided = torch.cat([q.flatten(1), torch.randn(len(q), 8, generator=gen)], 1)[
        :, : heads * dim
    ].view_as(q)
    for queries in (q, strided):  # the model's q is a view into the fused projection
        out = kernel.paged_extend_attention(
            queries, k_cache, v_cache, table, rows, prefix_lens, extend_lens, dim**-0.5
        )
        torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (10, 2, 80)])
def test_bf16_extend_kernel_is_near_sdpa_and_the_same_for_a_token_alone(heads, kv_heads, dim):
    """bf16 caches (AMX tiles on a CPU with AMX-BF16, head dims a multiple of 32): near causal
    SDPA in float32, and each token's row the same bits when it is attended alone (what
    deterministic inference relies on)."""
    if not kernel.extend_supported(dim):
        pytest.skip("no extend kernel on this CPU")
    gen = torch.Generator().manual_seed(dim)
    prefix_lens, extend_lens = torch.tensor([0, 37, 300]), torch.tensor([50, 1, 129])
    rows = torch.tensor([2, 0, 1])
    table = torch.stack([torch.randperm(2999, generator=gen)[:800] + 1 for _ in range(3)])
    k_cache = torch.randn(3000, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(3000, kv_heads, dim, generator=gen).bfloat16()
    q = torch.randn(int(extend_lens.sum()), heads, dim, generator=gen).bfloat16()
    out = kernel.paged_extend_attention(
        q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, dim**-0.5
    )
    assert out.dtype == torch.bfloat16
    start = 0
    for row, prefix, n in zip(rows.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        slots = table[row, : prefix + n]
        causal = torch.arange(prefix + n).view(1, -1) <= (prefix + torch.arange(n)).view(-1, 1)
        expected = F.scaled_dot_product_attention(
            q[start : start + n].float().transpose(0, 1),
            k_cache[slots].float().transpose(0, 1),
            v_cache[slots].float().transpose(0, 1),
            attn_mask=causal,
            scale=dim**-0.5,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n].float(), expected, atol=3e-2, rtol=3e-2)
        for i in (0, n // 2, n - 1):
            alone = kernel.paged_extend_attention(
                q[start + i : start + i + 1],
                k_cache,
                v_cache,
                table,
                torch.tensor([row]),
                torch.tensor([prefix + i]),
                torch.tensor([1]),
                dim**-0.5,
            )
            assert torch.equal(alone[0], out[start + i])
        start += n


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_ops_match_torch(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype)
    expected = F.rms_norm(x.float(), (576,), weight.float(), 1e-5)
    torch.testing.assert_close(
        kernel.rms_norm(x, weight, 1e-5).float(), expected, atol=tol, rtol=tol
    )
    delta = torch.randn(37, 576, generator=gen).to(dtype)
    total = x.float() + delta.float()
    normed = kernel.add_rms_norm_(x, delta, weight, 1e-5)  # x becomes x + delta
    torch.testing.assert_close(x.float(), total, atol=tol, rtol=tol)
    torch.testing.assert_close(
        normed.float(), F.rms_norm(total, (576,), weight.float(), 1e-5), atol=tol, rtol=tol
    )
    gate_up = torch.randn(37, 2 * 96, generator=gen).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(
        kernel.silu_and_mul(gate_up).float(), F.silu(gate) * up, atol=tol, rtol=tol
    )


def test_argmax_rows_matches_torch_ties_included():
    gen = torch.Generator().manual_seed(6)
    for rows, width in ((8, 49152), (1, 7), (5, 300)):
        x = torch.randn(rows, width, generator=gen)
        assert torch.equal(kernel.argmax_rows(x), x.argmax(-1))
    ties = torch.zeros(3, 600)
    ties[1, 255:258] = 2.0  # three-way tie across a 256-value boundary: the first wins
    ties[2, -1] = 1.0
    assert kernel.argmax_rows(ties).tolist() == ties.argmax(-1).tolist() == [0, 255, 599]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_strided_rows_at_their_slots(dtype):
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    k, v = (
        qkv[:, 9 * 64 + i * 192 : 9 * 64 + (i + 1) * 192].view(6, 3, 64) for i in range(2)
    )  # views, as in the model
    k_cache, v_cache = torch.zeros(50, 3, 64, dtype=dtype), torch.zeros(50, 3, 64, dtype=dtype)
    slots = torch.tensor([7, 3, 49, 0, 12, 8])
    kernel.store_kv_(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.store_kv_(k_cache, v_cache, torch.tensor([1, 2, 3, 4, 5, 50]), k, v)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rotary_rotates_a_strided_view_in_place(dtype, tol):
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(11, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    q = qkv[:, : 9 * 64].view(11, 9, 64)  # a view into the fused projection, as in the model
    angles = torch.rand(11, 1, 32, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    expected = apply_rotary(q.float(), cos, sin)
    rest = qkv[:, 9 * 64 :].clone()
    kernel.rotary_(q, cos, sin)
    torch.testing.assert_close(
        qkv[:, : 9 * 64].view(11, 9, 64).float(), expected, atol=tol, rtol=tol
    )
    assert torch.equal(qkv[:, 9 * 64 :], rest)  # k and v untouched


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 20, 97, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (200, 300), (37, 100), (1, 5)])
def test_packed_linear_matches_float64_reference(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed = kernel.pack_linear_weight(weight)
    for b in (None, bias):
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
        torch.testing.assert_close(
            kernel.packed_linear(x, packed, b, out_features), expected, atol=1e-4, rtol=1e-4
        )
    strided = torch.randn(rows, 2 * in_features, generator=gen)[:, ::2]  # a non-contiguous view
    torch.testing.assert_close(
        kernel.packed_linear(strided, packed, None, out_features),
        F.linear(strided.double(), weight.double()).float(),
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.parametrize("rows", [0, 1, 5, 8, 13, 97, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (37, 100), (3, 2)])
def test_packed_bf16_linear_accumulates_bf16_products_in_float32(rows, out_features, in_features):
    """A bf16 weight's GEMM: inputs rounded to bf16, products summed in float32; bf16 in gives
    bf16 out, float32 in gives float32 out."""
    gen = torch.Generator().manual_seed(rows * 5 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed = kernel.pack_linear_weight(weight)
    assert packed.dtype == torch.bfloat16
    for b in (None, bias):
        expected = F.linear(
            x.bfloat16().double(), weight.double(), None if b is None else b.double()
        ).float()
        out = kernel.packed_linear(x, packed, b, out_features)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        out16 = kernel.packed_linear(x.bfloat16(), packed, b, out_features)
        assert out16.dtype == torch.bfloat16
        torch.testing.assert_close(out16.float(), expected, atol=0.02, rtol=0.01)
    with pytest.raises(RuntimeError, match="even number of inputs"):
        kernel.pack_linear_weight(torch.ones(4, 3, dtype=torch.bfloat16))


def test_a_build_killed_midway_does_not_block_later_loads():
    """torch's build guard is a `lock` file left behind by a process killed while it built;
    a later load must not wait on it forever."""
    stale = build_dir() / "lock"
    stale.touch()
    code = "from radixserve_kernels.cpu_ops import load; assert load() is not None"
    done = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not stale.exists()


@pytest.mark.parametrize(
    "dtype,heads,width,value_dim",
    [
        (torch.float32, 8, 72, 64),
        (torch.bfloat16, 8, 72, 64),
        (torch.bfloat16, 8, 96, 64),  # bf16 dot products where the CPU has AVX512-BF16
        (torch.bfloat16, 6, 96, 64),  # heads not a multiple of 4: the general path
    ],
)
def test_sparse_latent_attention_matches_its_reference(dtype, heads, width, value_dim):
    """DSA's CPU kernel: each query over its selected latent rows of a bf16 or float32 pool
    (rows wider than q: the indexer key rides behind), -1 slots ignored; against the reference
    on q rounded to bf16 where the kernel's bf16 dot products round it."""
    from radixserve_kernels.sparse_mla_ref import sparse_latent_attention_ref

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(9, heads, width, generator=gen)
    rows = torch.randn(300, width + 16, generator=gen).to(dtype)
    slots = torch.stack([torch.randperm(299, generator=gen)[:43] + 1 for _ in range(9)])
    slots[0, 1:] = -1
    slots[4, 20:] = -1
    got = kernel.sparse_latent_attention(q, rows, slots, 0.12, value_dim)
    rounded = sparse_latent_attention_ref(q.to(dtype).float(), rows.float(), slots, 0.12, value_dim)
    exact = sparse_latent_attention_ref(q, rows.float(), slots, 0.12, value_dim)
    assert min((got - rounded).abs().max(), (got - exact).abs().max()) < 1e-5
