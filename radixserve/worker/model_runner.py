"""Runs one forward step of the model over the paged KV pool and samples."""
from __future__ import annotations

import logging
import os
import time

import torch

from ..attention import AttentionInputs, create_backend, resolve_backend_name
from ..config import EngineArgs
from ..distributed import TPGroup
from ..mem.kv_pool import KVPool
from ..models.loader import ModelSource, build_model, with_max_context
from ..messages import ForwardBatch, ForwardMode, ForwardResult, TokenLogprobs, WorkerInfo
from .cuda_graph import CudaGraph, CudaGraphRunner, capture_batch_sizes
from .sampler import sample
from .torch_compile import compile_decode

log = logging.getLogger(__name__)

DEFAULT_CPU_MAX_TOKENS = 65536


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on GPU, and on CPUs with AMX-BF16 (measured here: prefill 2.4x and batch-32
    decode 2.2x faster than fp32, bench/decode_step.py); fp32 on other CPUs, where bf16 is slower."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_amx_bf16() else torch.float32
    return getattr(torch, name)


def cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_bf16" in f.read()
    except OSError:
        return False


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    def __init__(self, source: ModelSource, args: EngineArgs, device: torch.device | None = None,
                 graph_cls=None, tp: TPGroup = TPGroup()):
        self.device = device or default_device()
        self.dtype = resolve_dtype(args.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(args.num_threads or max((os.cpu_count() or 1) // args.tp_size, 1))
        self.max_context_len = with_max_context(source.config, args.max_context_len)
        self.model = build_model(source, self.dtype, self.device, self.max_context_len, args.seed,
                                 args.quantization, tp)
        cfg = self.config = self.model.cfg  # this rank's heads
        per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        num_pages = tp.min_int(self._num_pages(args, per_token))
        ps = args.page_size
        self.pool = KVPool((num_pages + 1) * ps, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           self.dtype, self.device)
        self.req_to_token = torch.zeros(args.max_running_requests, self.max_context_len,
                                        dtype=torch.long, device=self.device)
        backend = resolve_backend_name(args.attention_backend, self.device.type)
        self.backend = create_backend(backend, pool=self.pool, num_heads=cfg.num_heads,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                      device=self.device)
        self.graphs = self._capture_graphs(args, graph_cls)
        self.compiled_decode = compile_decode(self.model, self.backend, self.req_to_token) \
            if args.enable_torch_compile else None
        self.info = WorkerInfo(num_pages, ps, self.max_context_len, args.max_running_requests,
                               cfg.vocab_size, cfg.eos_token_ids, str(self.dtype).removeprefix("torch."),
                               str(self.device), backend, per_token)

    def _num_pages(self, args: EngineArgs, per_token: int) -> int:
        tokens = args.max_total_tokens
        if tokens is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = int(free * args.mem_fraction) // per_token
        if tokens is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            tokens = min(int(total * args.mem_fraction) // per_token, DEFAULT_CPU_MAX_TOKENS)
        return max(tokens // args.page_size, 1)

    def _capture_graphs(self, args: EngineArgs, graph_cls) -> CudaGraphRunner | None:
        """Decode graphs on CUDA with a graph-capable backend, unless disabled; `graph_cls`
        (EagerGraph) runs the same path on CPU for tests."""
        graph_cls = graph_cls or (CudaGraph if self.device.type == "cuda" else None)
        if graph_cls is None or args.disable_cuda_graph or not getattr(self.backend, "supports_cuda_graph", False):
            return None
        sizes = capture_batch_sizes(min(args.cuda_graph_max_bs, args.max_running_requests))
        start = time.perf_counter()
        with torch.inference_mode():
            graphs = CudaGraphRunner(self.model, self.backend, self.req_to_token, self.max_context_len,
                                     sizes, graph_cls)
        log.info("captured decode graphs for batch sizes %s in %.1f s", sizes, time.perf_counter() - start)
        return graphs

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardResult:
        dev = self.device
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=dev)  # noqa: E731
        for row, start, slots in fb.row_writes:
            self.req_to_token[row, start:start + len(slots)] = as_long(slots)
        extend_lens = as_long(fb.extend_lens)
        rows, positions, out_loc = as_long(fb.rows), as_long(fb.positions), as_long(fb.out_cache_loc)
        self.req_to_token[torch.repeat_interleave(rows, extend_lens), positions] = out_loc
        if self._fits_graph(fb):
            logits = self.graphs.replay(as_long(fb.input_ids), positions, out_loc, rows, as_long(fb.seq_lens)).cpu()
            next_ids = sample(logits, fb.sampling)
            return ForwardResult(next_ids.tolist(), self._output_logprobs(logits, next_ids, fb),
                                 [None] * fb.batch_size)
        self.backend.plan(AttentionInputs(
            is_decode=fb.mode == ForwardMode.DECODE, out_cache_loc=out_loc, rows=rows,
            seq_lens=as_long(fb.seq_lens), extend_lens=extend_lens, req_to_token=self.req_to_token,
            max_seq_len=max(fb.seq_lens), max_extend_len=max(fb.extend_lens)))
        model = self.compiled_decode if fb.mode == ForwardMode.DECODE and self.compiled_decode else self.model
        hidden = model(as_long(fb.input_ids), positions, self.backend)
        ends = torch.cumsum(extend_lens, 0)
        logits = self.model.compute_logits(hidden[ends - 1]).cpu()
        next_ids = sample(logits, fb.sampling)
        return ForwardResult(next_ids.tolist(), self._output_logprobs(logits, next_ids, fb),
                             self._prompt_logprobs(hidden, (ends - extend_lens).tolist(), fb))

    def _fits_graph(self, fb: ForwardBatch) -> bool:
        return self.graphs is not None and fb.mode == ForwardMode.DECODE and fb.batch_size <= self.graphs.max_bs

    def _output_logprobs(self, logits, next_ids, fb: ForwardBatch) -> list[TokenLogprobs | None]:
        wanted = [b for b, lp in enumerate(fb.logprobs) if lp is not None and lp.want_output]
        out: list[TokenLogprobs | None] = [None] * fb.batch_size
        if not wanted:
            return out
        logprobs = torch.log_softmax(logits[wanted], dim=-1)
        for i, b in enumerate(wanted):
            out[b] = _token_logprobs(logprobs[i:i + 1], next_ids[b:b + 1], fb.logprobs[b].top_k)
        return out

    def _prompt_logprobs(self, hidden, starts: list[int], fb: ForwardBatch) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * fb.batch_size
        for b, lp in enumerate(fb.logprobs):
            if lp is None or lp.prompt_start < 0 or not lp.prompt_targets:
                continue
            first = starts[b] + lp.prompt_start
            states = hidden[first:first + len(lp.prompt_targets)]
            logprobs = torch.log_softmax(self.model.compute_logits(states).cpu(), dim=-1)
            out[b] = _token_logprobs(logprobs, torch.tensor(lp.prompt_targets), lp.top_k)
        return out


def _token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, top_k: int) -> TokenLogprobs:
    chosen = logprobs.gather(1, targets.view(-1, 1)).flatten().tolist()
    if top_k <= 0:
        return TokenLogprobs(chosen)
    values, ids = logprobs.topk(top_k, dim=-1)
    top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return TokenLogprobs(chosen, top)
