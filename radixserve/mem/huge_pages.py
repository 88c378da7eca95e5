"""Host memory from anonymous mappings advised for transparent huge pages (2 MiB).

A decode step on CPU streams every packed weight and each request's K/V rows once. In 4 KiB pages
those reads walk the page tables every 4 KiB, and the hardware prefetchers stop at each page's end;
huge pages measured a few percent faster (bench/results/cpu.md). Where the kernel grants none
(THP off), the memory is ordinary pages and nothing else changes."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading

import torch

HUGE_PAGE = 2 << 20


def anonymous_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from an anonymous mapping, which the OS zeroes page by page on first touch (a 3 GB
    KV pool costs nothing at start-up; filling it took 3.6 s), advised for huge pages."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(_mapping(nbytes), dtype=dtype, count=count).view(shape)


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU tensors, back to back (64-byte aligned) in one mapping advised for huge
    pages."""
    if not tensors:
        return []
    sizes = [(t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors]
    flat = torch.frombuffer(_mapping(sum(sizes) + HUGE_PAGE), dtype=torch.uint8)
    offset = -flat.data_ptr() % HUGE_PAGE  # start on a huge page's boundary
    copies = []
    for t, size in zip(tensors, sizes):
        view = flat[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copies.append(view.copy_(t))
        offset += size
    return copies


def _mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping (a shared one would be shmem, which takes no huge pages here),
    advised for huge pages before anything touches it."""
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their contents
POPULATE_CHUNK_ROWS = 256  # rows of every tensor a populate round covers
# The most a pool has faulted in ahead of use: its lowest rows, which the first requests take. The
# rest faults in as it is used, as before, so that servers sized from the same free memory (dp
# replicas, several test servers) never make all of their pools resident at once.
POPULATE_BUDGET_BYTES = 512 << 20


def populate_in_background(tensors: list[torch.Tensor]) -> threading.Thread:
    """Fault in the pages under CPU tensors of one row count (a KV pool's per-layer K and V) from
    a daemon thread at the lowest priority, a chunk of rows of every tensor at a time, lowest rows
    first (the allocator hands out the lowest pages first), up to POPULATE_BUDGET_BYTES. Contents
    are left as they are, so the rows may already be in use. On the VMs measured here a page's
    first touch costs ~3 ms a MiB (bench/results/cpu.md); without this, the first requests after
    start-up paid it in their prefill."""
    thread = threading.Thread(
        target=_populate, args=(tensors,), name="radixserve-populate-kv", daemon=True
    )
    thread.start()
    return thread


def _populate(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        return
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    page = mmap.PAGESIZE
    row_bytes_all = sum(t.stride(0) * t.element_size() for t in tensors)
    rows = min(tensors[0].shape[0], POPULATE_BUDGET_BYTES // max(row_bytes_all, 1))
    for first in range(0, rows, POPULATE_CHUNK_ROWS):
        for t in tensors:
            row_bytes = t.stride(0) * t.element_size()
            start = t.data_ptr() + first * row_bytes
            end = t.data_ptr() + min(rows, first + POPULATE_CHUNK_ROWS) * row_bytes
            start -= start % page
            if _madvise(start, end - start, MADV_POPULATE_WRITE):
                return  # a kernel without MADV_POPULATE_WRITE: pages fault in on first use


def release_pages(tensor: torch.Tensor) -> None:
    """Give the whole pages under a CPU tensor back to the OS, keeping its addresses (every
    pointer to it stays valid): they read as zeros until written again (MADV_DONTNEED)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    first = -(-start // page) * page
    last = (start + tensor.numel() * tensor.element_size()) // page * page
    if last > first and _madvise(first, last - first, mmap.MADV_DONTNEED):
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")


def _madvise(start: int, length: int, advice: int) -> int:
    """libc's madvise on raw addresses (mmap.mmap.madvise wants a mapping object): 0, or -1
    with errno set."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)
