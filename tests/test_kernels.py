"""Triton kernels against their pure-torch references (under TRITON_INTERPRET=1 on CPU).

bf16 is left to the GPU check: the interpreter's tl.dot gives garbage on bf16 inputs.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import radixserve_kernels as K  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def tol(dtype):
    return {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]


def make_pool(seq_lens, kv_heads, dim, dtype, page_size=1, seed=0):
    """A KV pool with each request's pages scattered at random, and its table rows."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages_per_req) + 3
    order = torch.randperm(num_pages - 1, generator=gen)[: sum(pages_per_req)] + 1
    table = torch.zeros(len(seq_lens), max(seq_lens) + page_size, dtype=torch.int64)
    used = 0
    for b, (n, pages) in enumerate(zip(seq_lens, pages_per_req)):
        mine = order[used : used + pages]
        used += pages
        slots = (mine[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        table[b, :n] = slots
    shape = (num_pages * page_size, kv_heads, dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return [t.to(DEVICE) for t in (k, v, table)]


SHAPES = [  # (seq lens, heads, kv heads, head dim)
    ([5], 4, 4, 64),
    ([1, 17, 40], 9, 3, 64),
    ([33, 70], 8, 1, 128),
    ([130, 3], 16, 2, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seq_lens,heads,kv_heads,dim", SHAPES)
def test_decode_attention(seq_lens, heads, kv_heads, dim, page_size, dtype):
    k_cache, v_cache, table = make_pool(seq_lens, kv_heads, dim, dtype, page_size)
    rows = torch.arange(len(seq_lens), device=DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    indptr, indices = K.build_kv_indices(table, rows, lens, page_size)
    ref_indptr, ref_indices = K.build_kv_indices_ref(table, rows, lens, page_size)
    assert torch.equal(indptr, ref_indptr) and torch.equal(indices, ref_indices)
    q = torch.randn(len(seq_lens), heads, dim).to(dtype).to(DEVICE)
    scale = dim**-0.5
    expected = K.decode_attention_ref(q, k_cache, v_cache, indptr, indices, lens, scale, page_size)
    for splits in (1, 4):
        got = K.decode_attention(
            q, k_cache, v_cache, indptr, indices, lens, scale, page_size, num_splits=splits
        )
        torch.testing.assert_close(got.float(), expected.float(), atol=tol(dtype), rtol=tol(dtype))


def test_decode_attention_reads_the_table_rows_directly():
    """The backends' decode path: the flat request-to-token table as kv_indices, row offsets as
    starts,
    with more splits than some requests have tokens (as a captured graph's fixed split count
    gives)."""
    seq_lens = [1, 17, 40]
    k_cache, v_cache, table = make_pool(seq_lens, 3, 64, torch.float32)
    rows = torch.tensor([2, 0, 1], device=DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)[rows]
    q = torch.randn(3, 9, 64, device=DEVICE)
    indptr, indices = K.build_kv_indices(table, rows, lens)
    expected = K.decode_attention_ref(q, k_cache, v_cache, indptr, indices, lens, 0.125)
    got = K.decode_attention(
        q, k_cache, v_cache, rows * table.stride(0), table.view(-1), lens, 0.125, num_splits=16
    )
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens,heads,kv_heads,dim",
    [
        ([0], [7], 4, 4, 64),
        ([0, 12, 33], [20, 1, 40], 9, 3, 64),
        ([48, 0], [5, 17], 8, 1, 128),
        ([16], [64], 16, 2, 64),
    ],
)
def test_extend_attention(prefix_lens, extend_lens, heads, kv_heads, dim, page_size, dtype):
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_cache, v_cache, table = make_pool(seq_lens, kv_heads, dim, dtype, page_size, seed=1)
    rows = torch.arange(len(seq_lens), device=DEVICE)
    indptr, indices = K.build_kv_indices(
        table, rows, torch.tensor(seq_lens, device=DEVICE), page_size
    )
    ext = torch.tensor(extend_lens, device=DEVICE)
    qo = torch.zeros(len(ext) + 1, dtype=torch.int64, device=DEVICE)
    qo[1:] = torch.cumsum(ext, 0)
    prefix = torch.tensor(prefix_lens, device=DEVICE)
    q = torch.randn(int(ext.sum()), heads, dim).to(dtype).to(DEVICE)
    scale = dim**-0.5
    expected = K.extend_attention_ref(
        q, k_cache, v_cache, qo, indptr, indices, prefix, ext, scale, page_size
    )
    got = K.extend_attention(
        q, k_cache, v_cache, qo, indptr, indices, prefix, ext, max(extend_lens), scale, page_size
    )
    torch.testing.assert_close(got.float(), expected.float(), atol=tol(dtype), rtol=tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype):
    k_cache = torch.zeros(50, 3, 64, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([7, 3, 41, 12], device=DEVICE)
    k = torch.randn(4, 3, 64).to(dtype).to(DEVICE)
    v = torch.randn(4, 3, 64).to(dtype).to(DEVICE)
    K.store_kv(k, v, k_cache, v_cache, slots)
    K.store_kv_ref(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_triton_backend_matches_torch_native_on_the_real_model(tokenizer):
    """The whole model through the Triton backend (interpreted on CPU) gives the same greedy
    tokens."""
    from radixserve import Engine

    prompts = ["The capital of France is", "def add(a, b):"]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outputs = {}
    for backend in ("torch_native", "triton"):
        with Engine(
            max_total_tokens=512, max_running_requests=4, attention_backend=backend, dtype="float32"
        ) as eng:
            first = eng.generate(prompts, params)
            again = eng.generate(prompts[0] + " Paris", params)  # a cached prefix plus new tokens
            outputs[backend] = [r["output_ids"] for r in first] + [again["output_ids"]]
    assert outputs["triton"] == outputs["torch_native"]


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (7, 8, 2), (33, 6, 3)])
def test_fused_moe_matches_reference(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter = 48, 40
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    weights, chosen = torch.softmax(logits, -1).topk(top_k, dim=-1)
    got = K.fused_moe(x, w13, w2, weights, chosen)
    torch.testing.assert_close(
        got, K.fused_moe_ref(x, w13, w2, weights, chosen), atol=2e-4, rtol=2e-4
    )
    pair_ids, block_experts = K.align_pairs(chosen, experts, 16)
    assert len(pair_ids) == 16 * len(block_experts)
    assert sorted(p for p in pair_ids.tolist() if p < tokens * top_k) == list(range(tokens * top_k))


def test_experts_stacked_for_the_fused_kernel_give_the_same_output():
    """The GPU wiring of a MoE layer (stacked weights, the Triton kernel) against its CPU path."""
    from radixserve.distributed import TPGroup
    from radixserve.models.moe import Experts

    torch.manual_seed(0)
    experts = Experts(6, 32, 48, TPGroup())
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    experts = experts.to(DEVICE)
    x = torch.randn(9, 32, device=DEVICE)
    weights, chosen = torch.softmax(torch.randn(9, 6, device=DEVICE), -1).topk(2, dim=-1)
    want = experts(x, weights, chosen)
    assert experts.stack_for_gpu()
    torch.testing.assert_close(experts(x, weights, chosen), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "rows,out,inp,group",
    [(1, 96, 128, 128), (5, 200, 192, 64), (33, 64, 256, 256), (3, 130, 100, 100)],
)
def test_fp8_linear(rows, out, inp, group):
    """The FP8 GEMM (dynamic per-token activation scales, block/channel weight scales) against
    its reference, and both near the unquantized product."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out, inp, generator=gen)
    groups = -(-inp // group)
    padded = torch.zeros(out, groups * group)
    padded[:, :inp] = w
    scales = padded.view(out, groups, group).abs().amax(dim=2) / 448.0
    data = (w / scales.repeat_interleave(group, 1)[:, :inp]).to(torch.float8_e4m3fn)
    data = data.view(torch.uint8)
    x = torch.randn(rows, inp, generator=gen)
    args = [t.to(DEVICE) for t in (x, data, scales)]
    got = K.fp8_linear(*args, group).cpu()
    want = K.fp8_linear_ref(*args, group).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    exact = x @ w.t()
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


@pytest.mark.parametrize(
    "runs,rank,inp,out",
    [
        ([(0, 1, 1)], 8, 64, 96),  # one decode token
        ([(0, 5, 2), (5, 6, 1), (9, 40, 3)], 24, 100, 130),  # rows 6..8 on the base model
        ([(0, 3, 1), (3, 4, 1)], 16, 128, 64),  # two runs on one slot
    ],
)
def test_lora_sgmv(runs, rank, inp, out):
    """The segmented LoRA shrink/expand against its reference: only the runs' rows change."""
    gen = torch.Generator().manual_seed(rank)
    tokens = max(end for _, end, _ in runs) + 2
    x = torch.randn(tokens, inp, generator=gen)
    a = torch.randn(4, rank, inp, generator=gen)
    b = torch.randn(4, out, rank, generator=gen)
    base = torch.randn(tokens, out, generator=gen)
    x, a, b = (t.to(DEVICE) for t in (x, a, b))
    got = K.lora_sgmv(x, a, b, runs, base.clone().to(DEVICE)).cpu()
    want = K.lora_sgmv_ref(x, a, b, runs, base.clone().to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    untouched = [i for i in range(tokens) if not any(s <= i < e for s, e, _ in runs)]
    assert torch.equal(got[untouched], base[untouched])


def selected_rows(queries: int, topk: int, slots: int, gen) -> torch.Tensor:
    """Each query's selected pool slots: distinct, random, the last ones -1 for some queries (a
    query that sees fewer tokens than topk)."""
    chosen = torch.stack(
        [torch.randperm(slots - 1, generator=gen)[:topk] + 1 for _ in range(queries)]
    )
    chosen[0, 3:] = -1
    chosen[-1, topk // 2 :] = -1
    return chosen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,width,value_dim,topk", [(4, 40, 32, 24), (20, 72, 64, 50)])
def test_sparse_latent_attention(dtype, heads, width, value_dim, topk):
    """DSA's attention over each query's selected latent rows (wider than q: the indexer key
    rides behind) against its reference, -1 slots ignored."""
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(6, heads, width, generator=gen).to(dtype)
    rows = torch.randn(128, width + 16, generator=gen).to(dtype)
    slots = selected_rows(6, topk, 128, gen)
    q, rows, slots = (t.to(DEVICE) for t in (q, rows, slots))
    got = K.sparse_latent_attention(q, rows, slots, width**-0.5, value_dim).float().cpu()
    want = K.sparse_latent_attention_ref(q.float(), rows.float(), slots, width**-0.5, value_dim)
    torch.testing.assert_close(got, want.cpu(), rtol=tol(dtype), atol=tol(dtype))
