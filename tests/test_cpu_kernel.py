"""The CPU paged decode-attention kernel against gathering K/V and running SDPA."""
import pytest
import torch
import torch.nn.functional as F

from radixserve_kernels.cpu_attention import load

kernel = load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler to build the CPU kernel")


def reference(q, k_cache, v_cache, table, rows, seq_lens, scale):
    out = []
    for b in range(q.shape[0]):
        slots = table[rows[b], :seq_lens[b]]
        k, v = k_cache[slots].transpose(0, 1).float(), v_cache[slots].transpose(0, 1).float()  # [kvh, L, D]
        out.append(F.scaled_dot_product_attention(q[b].unsqueeze(1).float(), k, v, scale=scale,
                                                  enable_gqa=True).squeeze(1))
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
        table[row, :n] = slots[used:used + n]
        used += n
    k_cache = torch.randn(2001, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(2001, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(rows), heads, dim, generator=gen).to(dtype)
    out = kernel.paged_decode_attention(q, k_cache, v_cache, table, rows, seq_lens, dim ** -0.5)
    expected = reference(q, k_cache, v_cache, table, rows, seq_lens, dim ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
