"""Runs one forward step of the model over the paged KV pool and samples."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import torch

from ..attention import AttentionInputs
from ..config import EngineArgs
from ..distributed import TPGroup
from ..lora import AdapterConfig, lora_spec
from ..mem.kv_pool import kv_storage_dtype
from ..memory_plan import context_problem
from ..messages import ForwardBatch, ForwardMode, ForwardResult
from ..models.loader import build_model, model_bytes, with_max_context
from ..models.lora_weights import LoraPool
from ..models.source import ModelSource, resolve_model
from ..worker_info import WorkerInfo
from .build import kv_num_pages, prepare_forward, state_pool
from .device import default_device, resolve_dtype
from .outputs import drafted_rows, next_tokens, output_logprobs, pooled, prompt_logprobs
from .step_inputs import StepInputs, receive_step, send_step
from .vision import VisionEncoder
from .window_pools import make_pools, pool_bytes, window_info, window_layers

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
    "kv_layer_dims",
)


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
        self.args, self.graph_cls, self.model_path = args, graph_cls, args.model
        self.device = device or default_device()
        self.dtype, dtype_reason = resolve_dtype(
            args.dtype, self.device, source.config.checkpoint_dtype
        )
        if self.device.type == "cpu":
            torch.set_num_threads(args.num_threads or max((os.cpu_count() or 1) // args.tp_size, 1))
        self.max_context_len = (
            layout.max_context_len
            if layout is not None
            else with_max_context(source.config, args.context_length)
        )
        self.tp = tp
        self.state_copies: list[tuple[int, int]] = []  # rank 0's, for the next step to carry
        self.model = self._build_model(source)
        spec = lora_spec(args)
        self.lora = LoraPool(self.model, spec, self.dtype, self.device) if spec else None
        cfg = self.config = self.model.cfg  # this rank's heads
        self.weights_bytes = model_bytes(self.model)
        self.kv_dtype = kv_storage_dtype(args.kv_cache_dtype, self.dtype)
        self.windows = window_layers(self.model, args, self.device) if layout is None else None
        sizes = pool_bytes(cfg, self.windows, args, self.kv_dtype)
        per_token = sizes.per_token
        num_pages = (
            layout.num_pages
            if layout is not None
            else tp.min_int(
                kv_num_pages(
                    args,
                    self.device,
                    self.weights_bytes,
                    per_token + reserve_bytes_per_token,
                    sizes.reserved,
                )
            )
        )
        ps = args.page_size
        self.req_to_token = (
            layout.req_to_token
            if layout is not None
            else torch.zeros(args.max_running_requests, self.max_context_len, dtype=torch.long)
        ).to(self.device)
        self.pool, self.window_pool, self.backend_name, self.backend = make_pools(
            self.model, self.windows, args, (num_pages + 1) * ps, self.kv_dtype, self.device
        )
        states = state_pool(self.model, args, per_token, num_pages * ps, self.dtype)
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
            self.backend_name,
            per_token,
            self.weights_bytes,
            str(self.kv_dtype if not self.pool.is_fp8 else "fp8_e4m3").removeprefix("torch."),
            dtype_reason,
            states is None or states.snapshots > 0,
            states,
            window_info(self.windows, self.window_pool),
            getattr(self.model, "mrope_merge_size", None),
            getattr(self.model, "whole_images", False),
        )
        asked = self.max_context_len if args.context_length is not None else None
        if (problem := context_problem(self.info.memory_plan(), asked)) is not None:
            raise ValueError(problem)

    def _prepare_forward(self) -> None:
        self.graphs, self.compiled = prepare_forward(
            self.model,
            self.backend,
            self.req_to_token,
            self.max_context_len,
            self.args,
            self.graph_cls,
            self.lora,
        )
        self.vision = VisionEncoder.of(self.model, self.device, self.args.mm_encoder_cache_mb)

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
        model = self._build_model(source)
        if self.lora is not None:
            self.lora.attach(model)
        self.model, self.graphs, self.compiled = model, None, None
        self.model_path = model_path
        if self.pool.is_fp8:
            self.pool.set_scales(model.kv_cache_scales())
        self._prepare_forward()

    def _build_model(self, source: ModelSource):
        a = self.args
        return build_model(
            source, self.dtype, self.device, self.max_context_len, a.seed, a.quantization, self.tp
        )

    @torch.inference_mode()
    def copy_state(self, src: int, dst: int) -> None:
        """A hybrid model's per-request state from slot `src` to slot `dst` (a request's row
        or a snapshot slot); the other TP ranks copy it before the next step (`send_step`)."""
        self.model.states.copy(src, dst)
        if self.tp.size > 1:
            self.state_copies.append((src, dst))

    @property
    def states(self):
        """A hybrid model's per-request states (rank 0's), else None."""
        return self.model.states if self.config.keeps_state else None

    def vision_figures(self) -> dict:
        return self.vision.figures() if self.vision is not None else {}

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
            self.pool.release_pages()
        if "weights" in tags:
            if self.tp.size > 1:
                raise ValueError("releasing weights with --tp-size > 1 is not supported")
            self.model = self.graphs = self.compiled = self.vision = None
            gc.collect()

    def resume_memory(self, tags: frozenset[str]) -> None:
        if "weights" in tags and self.model is None:
            self.update_weights(self.model_path)

    def slot_layout(self) -> SlotLayout:
        return SlotLayout(self.info.num_pages, self.req_to_token, self.max_context_len)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardResult:
        """Run one scheduler step and sample; as TP rank 0, first send the step to the other ranks.
        Logits stay on the model's device: only token ids and asked-for logprobs come back."""
        inputs = StepInputs.from_batch(fb, self.device)
        if fb.images:
            inputs.images = self.vision.step_images(fb)
        if fb.window_map is not None:
            self.backend.map_window(*(torch.tensor(s, dtype=torch.long) for s in fb.window_map))
        if self.lora is not None:
            self.lora.prepare_step(fb.lora_names or [None] * fb.batch_size, fb.extend_lens)
        if self.config.keeps_state:
            self.model.states.start_step(drafted_rows(fb))
        if self.tp.size > 1:
            send_step(self.tp, inputs, self.state_copies)
        logits, hidden = self.run_model(inputs)
        next_ids, accepted, rows = next_tokens(logits, fb)
        prompt_lps = (
            [None] * fb.batch_size
            if hidden is None
            else prompt_logprobs(hidden, inputs.extend_lens, fb, self.model.compute_logits)
        )
        return ForwardResult(
            next_ids,
            output_logprobs(logits, next_ids, accepted, rows, fb),
            prompt_lps,
            accepted,
            None if fb.pooling is None else pooled(hidden, fb, self.model.compute_logits),
        )

    def follow(self) -> None:
        """TP ranks > 0: run every step rank 0 sends; its results are rank 0's to report."""
        with torch.inference_mode():
            while True:
                inputs = receive_step(self.tp, self.device, self.dtype)
                for src, dst in inputs.copies():
                    self.model.states.copy(src, dst)
                self.run_model(inputs)

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
        positions = inputs.positions if inputs.mrope_positions is None else inputs.mrope_positions
        images = {} if inputs.images is None else {"images": inputs.images}
        hidden = (self.compiled or self.model)(inputs.input_ids, positions, self.backend, **images)
        return self.model.compute_logits(hidden[inputs.logit_index]), hidden

    def _fits_graph(self, inputs: StepInputs) -> bool:
        return (
            self.graphs is not None
            and inputs.mode == ForwardMode.DECODE
            and inputs.mrope_positions is None
            and inputs.batch_size <= self.graphs.max_bs
        )
