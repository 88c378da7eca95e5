"""CUDA graphs for decode steps: captured once per batch size, replayed padded to the next size up.

A decode step launches hundreds of small kernels, and on a GPU their launch cost bounds
small batches. A captured graph replays them all at once. The graph reads its inputs from
static buffers: a step copies its ids, positions, slots, rows and lengths into the first
`n` entries and fills the rest with a padding request that writes its K/V into the
reserved slot 0, attends over one token, and whose logits are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..attention import AttentionInputs
from ..attention.base import GraphBackend

PAD_SLOT = 0  # page 0 is never allocated (mem/allocator.py)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including `max_bs`."""
    sizes = {s for s in [1, 2, 4, *range(8, max_bs + 1, 8)] if s <= max_bs}
    return sorted(sizes | {max_bs})


class CudaGraph:
    """One captured step on the GPU; all graphs of a runner share one memory pool."""

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels and set up cuBLAS outside the capture
                step()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool, stream=stream):
            output = step()
        self.pool = self.graph.pool()
        return output

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """Stands in for `CudaGraph` off the GPU: replay re-runs the captured step on the static
    buffers and writes into the captured output, so CPU tests exercise the same capture,
    padding and replay path."""

    def __init__(self, pool=None):
        self.pool = pool

    def capture(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.step = step
        self.output = step()
        return self.output

    def replay(self) -> None:
        self.output.copy_(self.step())


@dataclass
class StaticInputs:
    """The buffers every captured graph reads; `view(bs)` is what a step of `bs` sees."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    ones: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, device: torch.device) -> "StaticInputs":
        zeros = lambda: torch.zeros(max_bs, dtype=torch.long, device=device)  # noqa: E731
        return cls(zeros(), zeros(), zeros(), zeros(), zeros() + 1, zeros() + 1)

    def fill(self, n: int, bs: int, input_ids, positions, out_cache_loc, rows, seq_lens) -> None:
        """Copy a step of `n` requests in, padding entries n..bs-1."""
        for buffer, values, pad in (
            (self.input_ids, input_ids, 0),
            (self.positions, positions, 0),
            (self.out_cache_loc, out_cache_loc, PAD_SLOT),
            (self.rows, rows, 0),
            (self.seq_lens, seq_lens, 1),
        ):
            buffer[:n].copy_(values)
            buffer[n:bs].fill_(pad)

    def attention_inputs(
        self, bs: int, req_to_token: torch.Tensor, max_context_len: int
    ) -> AttentionInputs:
        return AttentionInputs(
            is_decode=True,
            out_cache_loc=self.out_cache_loc[:bs],
            rows=self.rows[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.ones[:bs],
            req_to_token=req_to_token,
            max_seq_len=max_context_len,
            max_extend_len=1,
        )


class CudaGraphRunner:
    """Decode steps of up to `max(batch_sizes)` requests through captured graphs."""

    def __init__(
        self,
        model,
        backend: GraphBackend,
        req_to_token: torch.Tensor,
        max_context_len: int,
        batch_sizes: list[int],
        graph_cls=CudaGraph,
    ):
        self.model, self.backend, self.req_to_token = model, backend, req_to_token
        self.max_context_len = max_context_len
        self.batch_sizes = sorted(batch_sizes)
        self.static = StaticInputs.allocate(self.batch_sizes[-1], req_to_token.device)
        backend.init_graph_buffers(self.batch_sizes[-1], max_context_len)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs fit in its pool
            self.graphs[bs] = graph = graph_cls(pool)
            self._plan(bs)
            self.outputs[bs] = graph.capture(lambda bs=bs: self._step(bs))
            pool = graph.pool

    @property
    def max_bs(self) -> int:
        return self.batch_sizes[-1]

    def replay(self, input_ids, positions, out_cache_loc, rows, seq_lens) -> torch.Tensor:
        """Logits `[n, vocab]` of a decode step of n <= max_bs requests."""
        n = len(input_ids)
        bs = next(size for size in self.batch_sizes if size >= n)
        self.static.fill(n, bs, input_ids, positions, out_cache_loc, rows, seq_lens)
        self._plan(bs)
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs][:n]

    def _plan(self, bs: int) -> None:
        self.backend.plan_graph(
            bs, self.static.attention_inputs(bs, self.req_to_token, self.max_context_len)
        )

    def _step(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.static.input_ids[:bs], self.static.positions[:bs], self.backend)
        return self.model.compute_logits(hidden)
