"""Runs one forward step of the model over the paged KV pool and samples."""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass

import torch

from ..attention import AttentionInputs, create_backend, resolve_backend_name
from ..config import EngineArgs
from ..distributed import TPGroup
from ..lora import AdapterConfig, lora_spec
from ..mem.huge_pages import release_pages
from ..mem.kv_pool import KVPool, kv_storage_dtype
from ..memory_plan import context_problem, kv_pages
from ..messages import ForwardBatch, ForwardMode, ForwardResult, TokenLogprobs, WorkerInfo
from ..models.layers import make_batch_invariant
from ..models.loader import build_model, model_bytes, with_max_context
from ..models.lora_weights import LoraPool
from ..models.source import ModelSource, resolve_model
from .cuda_graph import CudaGraph, CudaGraphRunner, capture_batch_sizes
from .sampler import sample, verify
from .step_inputs import StepInputs
from .torch_compile import CompiledForward

log = logging.getLogger(__name__)

# a checkpoint that replaces the served weights must agree on these (the pool and the step
# buffers are sized by them)
WEIGHT_SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "latent_kv",
)


def resolve_dtype(name: str, device: torch.device, checkpoint: str | None = None) -> torch.dtype:
    """`auto`: on GPU the checkpoint's half-precision dtype (bf16 for a float32 one); bf16 on
    CPUs with AMX-BF16 (faster than fp32 there, bench/README.md); fp32 on other CPUs, where
    bf16 is slower."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.float16 if checkpoint == "float16" else torch.bfloat16
    return torch.bfloat16 if cpu_has_amx_bf16() else torch.float32


def cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_bf16" in f.read()
    except OSError:
        return False


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class SlotLayout:
    """Where a draft model's KV goes: the target's slot numbers (a pool of as many pages) and
    the target's request-to-token table, shared, so one allocation and one radix tree serve both."""

    num_pages: int
    req_to_token: torch.Tensor
    max_context_len: int


class ModelRunner:
    """`reserve_bytes_per_token`: KV memory per slot kept back for a draft model's pool.
    `layout`: run as a draft model on a target's slots (see SlotLayout)."""

    def __init__(
        self,
        source: ModelSource,
        args: EngineArgs,
        device: torch.device | None = None,
        graph_cls=None,
        tp: TPGroup = TPGroup(),
        reserve_bytes_per_token: int = 0,
        layout: SlotLayout | None = None,
    ):
        self.device = device or default_device()
        self.dtype = resolve_dtype(args.dtype, self.device, source.config.checkpoint_dtype)
        if self.device.type == "cpu":
            torch.set_num_threads(args.num_threads or max((os.cpu_count() or 1) // args.tp_size, 1))
        self.max_context_len = (
            layout.max_context_len
            if layout is not None
            else with_max_context(source.config, args.max_context_len)
        )
        self.tp = tp
        self.model = build_model(
            source, self.dtype, self.device, self.max_context_len, args.seed, args.quantization, tp
        )
        spec = lora_spec(args)
        self.lora = LoraPool(self.model, spec, self.dtype, self.device) if spec else None
        cfg = self.config = self.model.cfg  # this rank's heads
        self.weights_bytes = model_bytes(self.model)
        self.kv_dtype = kv_storage_dtype(args.kv_cache_dtype, self.dtype)
        per_token = KVPool.bytes_per_token(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, cfg.value_dim
        )
        num_pages = (
            layout.num_pages
            if layout is not None
            else tp.min_int(self._num_pages(args, per_token + reserve_bytes_per_token))
        )
        ps = args.page_size
        self.pool = KVPool(
            (num_pages + 1) * ps,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
            cfg.value_dim,
        )
        if self.pool.is_fp8:
            self.pool.set_scales(self.model.kv_cache_scales())
        self.req_to_token = (
            layout.req_to_token
            if layout is not None
            else torch.zeros(
                args.max_running_requests,
                self.max_context_len,
                dtype=torch.long,
                device=self.device,
            )
        )
        needs = self.model.attention_features() | ({"fp8_kv"} if self.pool.is_fp8 else frozenset())
        deterministic = args.enable_deterministic_inference
        if deterministic and self.model.attention_features() - {"scale"}:
            raise ValueError(
                "enable_deterministic_inference: this model's attention "
                f"({', '.join(sorted(self.model.attention_features()))}) is not batch-invariant yet"
            )
        needs |= {"deterministic"} if deterministic else frozenset()
        backend = resolve_backend_name(args.attention_backend, self.device.type, needs)
        self.backend = create_backend(
            backend,
            pool=self.pool,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            device=self.device,
            **({"deterministic": True} if deterministic else {}),
        )
        self.args, self.graph_cls, self.model_path = args, graph_cls, args.model
        self._prepare_forward()
        self.info = WorkerInfo(
            num_pages,
            ps,
            self.max_context_len,
            args.max_running_requests,
            cfg.vocab_size,
            cfg.eos_token_ids,
            str(self.dtype).removeprefix("torch."),
            str(self.device),
            backend,
            per_token,
            self.weights_bytes,
            str(self.kv_dtype if not self.pool.is_fp8 else "fp8_e4m3").removeprefix("torch."),
        )
        asked = self.max_context_len if args.max_context_len is not None else None
        if (problem := context_problem(self.info.memory_plan(), asked)) is not None:
            raise ValueError(problem)

    def _prepare_forward(self) -> None:
        """What runs the model's steps: fused CPU layers, decode graphs or a compiled forward."""
        args = self.args
        if args.enable_deterministic_inference:
            make_batch_invariant(self.model)
        if (
            self.device.type == "cpu"
            and not args.enable_torch_compile
            and self.model.fuse_cpu_layers(self.backend)
        ):
            log.info(
                "CPU forward: the decoder layers run in one C++ call "
                "(radixserve_kernels/cpu_decoder.cpp)"
            )
        self.graphs = self._capture_graphs(args, self.graph_cls)
        self.compiled = (
            CompiledForward(self.model, self.backend, self.req_to_token)
            if args.enable_torch_compile
            else None
        )

    def update_weights(self, model_path: str) -> None:
        """Serve the weights of the checkpoint at `model_path` instead. The new model is built
        beside the old one and swapped in once it loaded: a checkpoint that fails leaves the
        old weights serving. Raises ValueError (or FileNotFoundError) when it cannot be loaded
        or its shape differs (the KV pool is sized for the served one)."""
        if self.tp.size > 1:
            raise ValueError("updating weights with --tp-size > 1 is not supported")
        source = resolve_model(model_path)
        for name in WEIGHT_SHAPE_FIELDS:
            old, new = getattr(self.config, name), getattr(source.config, name)
            if old != new:
                raise ValueError(
                    f"the new checkpoint's {name} is {new}; the served model's is {old}"
                )
        model = build_model(
            source,
            self.dtype,
            self.device,
            self.max_context_len,
            self.args.seed,
            self.args.quantization,
            self.tp,
        )
        if self.lora is not None:
            self.lora.attach(model)
        self.model, self.graphs, self.compiled = model, None, None
        self.model_path = model_path
        if self.pool.is_fp8:
            self.pool.set_scales(model.kv_cache_scales())
        self._prepare_forward()

    def load_lora(self, adapter: AdapterConfig) -> None:
        """Read an adapter onto the host, ready for a slot; ValueError when it does not fit."""
        if self.lora is None:
            raise ValueError("LoRA is off: start the server with --enable-lora or --lora-paths")
        self.lora.add(adapter)

    def unload_lora(self, name: str) -> None:
        self.lora.remove(name)

    def release_memory(self, tags: frozenset[str]) -> None:
        """Give back the memory of the `kv_cache` (CPU: its pages, addresses kept, reading as
        zeros) and/or the `weights` (the model is dropped; `resume_memory` loads it again from
        its checkpoint). No step may run until `resume_memory`."""
        if "kv_cache" in tags:
            if self.device.type != "cpu":
                raise ValueError("releasing the KV cache is implemented on CPU only")
            for tensor in self.pool.k + self.pool.v:
                release_pages(tensor)
        if "weights" in tags:
            if self.tp.size > 1:
                raise ValueError("releasing weights with --tp-size > 1 is not supported")
            self.model = self.graphs = self.compiled = None
            gc.collect()

    def resume_memory(self, tags: frozenset[str]) -> None:
        if "weights" in tags and self.model is None:
            self.update_weights(self.model_path)

    def slot_layout(self) -> SlotLayout:
        return SlotLayout(self.info.num_pages, self.req_to_token, self.max_context_len)

    def _num_pages(self, args: EngineArgs, per_token: int) -> int:
        if self.device.type == "cuda":
            available, _ = torch.cuda.mem_get_info(self.device)  # the weights are in already
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            available = total - self.weights_bytes
        return kv_pages(
            available,
            per_token,
            args.mem_fraction,
            args.max_total_tokens,
            self.device.type,
            args.page_size,
        )

    def _capture_graphs(self, args: EngineArgs, graph_cls) -> CudaGraphRunner | None:
        """Decode graphs on CUDA with a graph-capable backend, unless disabled; `graph_cls`
        (EagerGraph) runs the same path on CPU for tests."""
        graph_cls = graph_cls or (CudaGraph if self.device.type == "cuda" else None)
        if (
            graph_cls is None
            or args.disable_cuda_graph
            or self.lora is not None  # segments change from step to step
            or not getattr(self.backend, "supports_cuda_graph", False)
        ):
            return None
        sizes = capture_batch_sizes(min(args.cuda_graph_max_bs, args.max_running_requests))
        start = time.perf_counter()
        with torch.inference_mode():
            graphs = CudaGraphRunner(
                self.model, self.backend, self.req_to_token, self.max_context_len, sizes, graph_cls
            )
        log.info(
            "captured decode graphs for batch sizes %s in %.1f s",
            sizes,
            time.perf_counter() - start,
        )
        return graphs

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardResult:
        """Run one scheduler step and sample; as TP rank 0, first send the step to the other ranks.
        Logits stay on the model's device: only token ids and asked-for logprobs come back."""
        inputs = StepInputs.from_batch(fb, self.device)
        if self.lora is not None:
            self.lora.prepare_step(fb.lora_names or [None] * fb.batch_size, fb.extend_lens)
        if self.tp.size > 1:
            self.tp.send_step(inputs.pack())
        logits, hidden = self.run_model(inputs)
        accepted = None
        if fb.pooling is not None and None not in fb.pooling:  # nothing to sample
            next_ids, rows = [0] * fb.batch_size, range(fb.batch_size)
        elif fb.draft_lens is None:
            next_ids, rows = sample(logits, fb.sampling).tolist(), range(fb.batch_size)
        else:
            next_ids, accepted, rows = verify(logits, fb.sampling, self._drafts(fb))
        prompt_logprobs = (
            [None] * fb.batch_size
            if hidden is None
            else self._prompt_logprobs(hidden, inputs.extend_lens, fb)
        )
        return ForwardResult(
            next_ids,
            self._output_logprobs(logits, next_ids, accepted, rows, fb),
            prompt_logprobs,
            accepted,
            None if fb.pooling is None else self._pooled(hidden, fb),
        )

    @staticmethod
    def _drafts(fb: ForwardBatch) -> list[list[int]]:
        """Each request's draft tokens: the last draft_lens[b] of its chunk."""
        drafts, end = [], 0
        for n, k in zip(fb.extend_lens, fb.draft_lens):
            end += n
            drafts.append(fb.input_ids[end - k : end])
        return drafts

    def follow(self) -> None:
        """TP ranks > 0: run every step rank 0 sends; its results are rank 0's to report."""
        with torch.inference_mode():
            while True:
                self.run_model(StepInputs.unpack(self.tp.receive_step(self.device)))

    def run_model(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits at `logit_index` (each request's last token, and its drafts before it), and the
        hidden states of every token of the step (None when a CUDA graph ran it: graphed decode
        steps never need them)."""
        self.req_to_token[inputs.table_rows, inputs.table_cols] = inputs.table_slots
        if self._fits_graph(inputs):
            return self.graphs.replay(
                inputs.input_ids,
                inputs.positions,
                inputs.out_cache_loc,
                inputs.rows,
                inputs.seq_lens,
            ), None
        is_decode = inputs.mode == ForwardMode.DECODE
        self.backend.plan(
            AttentionInputs(
                is_decode=is_decode,
                out_cache_loc=inputs.out_cache_loc,
                rows=inputs.rows,
                seq_lens=inputs.seq_lens,
                extend_lens=inputs.extend_lens,
                req_to_token=self.req_to_token,
                max_seq_len=inputs.max_seq_len,
                max_extend_len=inputs.max_extend_len,
            )
        )
        hidden = (self.compiled or self.model)(inputs.input_ids, inputs.positions, self.backend)
        return self.model.compute_logits(hidden[inputs.logit_index]), hidden

    def _fits_graph(self, inputs: StepInputs) -> bool:
        return (
            self.graphs is not None
            and inputs.mode == ForwardMode.DECODE
            and inputs.batch_size <= self.graphs.max_bs
        )

    def _output_logprobs(
        self, logits, next_ids: list[int], accepted: list[list[int]] | None, rows, fb: ForwardBatch
    ) -> list[TokenLogprobs | None]:
        """Logprobs of the tokens each request emits this step, for the requests that asked:
        its next token, from logits row `rows[b]`, after a verify step preceded by its accepted
        drafts, from the rows before it."""
        wanted = [b for b, lp in enumerate(fb.logprobs) if lp is not None and lp.want_output]
        out: list[TokenLogprobs | None] = [None] * fb.batch_size
        if not wanted:
            return out
        emitted = [(accepted[b] if accepted else []) + [next_ids[b]] for b in wanted]
        picked = [
            row
            for b, tokens in zip(wanted, emitted)
            for row in range(rows[b] - len(tokens) + 1, rows[b] + 1)
        ]
        logprobs = torch.log_softmax(logits[picked], dim=-1)
        first = 0
        for b, tokens in zip(wanted, emitted):
            targets = torch.tensor(tokens, device=logits.device)
            out[b] = _token_logprobs(
                logprobs[first : first + len(tokens)], targets, fb.logprobs[b].top_k
            )
            first += len(tokens)
        return out

    def _pooled(self, hidden: torch.Tensor, fb: ForwardBatch) -> list[torch.Tensor | None]:
        """Per pooling request, from its tokens' hidden states in this step: their sum
        (`mean`), the last one (`last`), or the classifier head's logits of the last one
        (`score`)."""
        out: list[torch.Tensor | None] = []
        first = 0
        for n, pooling in zip(fb.extend_lens, fb.pooling):
            states = hidden[first : first + n]
            if pooling == "mean":
                out.append(states.float().sum(0))
            elif pooling == "last":
                out.append(states[-1].float())
            elif pooling == "score":
                out.append(self.model.compute_logits(states[-1:])[0])
            else:
                out.append(None)
            first += n
        return out

    def _prompt_logprobs(
        self, hidden, extend_lens: torch.Tensor, fb: ForwardBatch
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * fb.batch_size
        if all(lp is None or lp.prompt_start < 0 or not lp.prompt_targets for lp in fb.logprobs):
            return out
        starts = (torch.cumsum(extend_lens, 0) - extend_lens).tolist()
        for b, lp in enumerate(fb.logprobs):
            if lp is None or lp.prompt_start < 0 or not lp.prompt_targets:
                continue
            first = starts[b] + lp.prompt_start
            states = hidden[first : first + len(lp.prompt_targets)]
            logprobs = torch.log_softmax(self.model.compute_logits(states), dim=-1)
            targets = torch.tensor(lp.prompt_targets, device=logprobs.device)
            out[b] = _token_logprobs(logprobs, targets, lp.top_k)
        return out


def _token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, top_k: int) -> TokenLogprobs:
    chosen = logprobs.gather(1, targets.view(-1, 1)).flatten().tolist()
    if top_k <= 0:
        return TokenLogprobs(chosen)
    values, ids = logprobs.topk(top_k, dim=-1)
    top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return TokenLogprobs(chosen, top)
