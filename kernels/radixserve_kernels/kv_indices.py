"""Gather each request's slot (or page) indices from the request-to-token table into one flat
array."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_indices_kernel(
    table_ptr, rows_ptr, lens_ptr, indptr_ptr, out_ptr, table_stride, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    length = tl.load(lens_ptr + b)
    start = tl.load(indptr_ptr + b)
    for offset in range(0, length, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        mask = offs < length
        values = tl.load(table_ptr + row * table_stride + offs, mask=mask)
        tl.store(out_ptr + start + offs, values, mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, page_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (kv_indptr `[B+1]`, kv_indices): token slots, or page ids when page_size > 1.

    With pages, request b's page ids are read from its table row at every page_size-th
    position (the first slot of each page), divided by page_size.
    """
    table = (
        req_to_token if page_size == 1 else (req_to_token[:, ::page_size] // page_size).contiguous()
    )
    counts = lens if page_size == 1 else (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(rows) + 1, dtype=torch.int64, device=rows.device)
    indptr[1:] = torch.cumsum(counts, 0)
    out = torch.empty(int(indptr[-1].item()), dtype=table.dtype, device=rows.device)
    if len(rows):
        _kv_indices_kernel[(len(rows),)](
            table, rows, counts, indptr, out, table.stride(0), BLOCK=512
        )
    return indptr, out


def build_kv_indices_ref(req_to_token, rows, lens, page_size: int = 1):
    parts, indptr = [], [0]
    for row, length in zip(rows.tolist(), lens.tolist()):
        slots = req_to_token[row, :length]
        part = slots if page_size == 1 else slots[::page_size] // page_size
        parts.append(part)
        indptr.append(indptr[-1] + len(part))
    out = torch.cat(parts) if parts else req_to_token.new_empty(0)
    return torch.tensor(indptr, dtype=torch.int64, device=rows.device), out
