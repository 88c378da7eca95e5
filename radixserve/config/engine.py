"""`EngineArgs`: everything that shapes an engine (model, memory, scheduling, numerics), the
topics of config/engine_options.py joined, with the checks that span them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..kv_events import KVEventsConfig
from ..lora import LORA_MODULES, parse_lora_path
from .engine_options import (
    CacheOptions,
    DecodingOptions,
    ModelOptions,
    ParallelOptions,
    ScheduleOptions,
)
from .options import check_choices, refuse_problems


# A dataclass lists the fields of its bases last base first: the flags follow this order
# backwards (model, schedule, cache, parallel, decoding).
@dataclass(frozen=True)
class EngineArgs(DecodingOptions, ParallelOptions, CacheOptions, ScheduleOptions, ModelOptions):
    """Everything that shapes an engine: model, memory, scheduling, numerics."""

    def __post_init__(self) -> None:
        refuse_problems("engine", self._problems())

    def _problems(self):
        yield from check_choices(self)
        if self.page_size < 1:
            yield "page_size must be >= 1"
        if self.kv_events_config is not None:
            try:
                KVEventsConfig.from_json(self.kv_events_config)
            except ValueError as exc:
                yield str(exc)
        if self.chunked_prefill_size < self.page_size:
            yield "chunked_prefill_size must be >= page_size"
        if self.swa_full_tokens_ratio is not None and not 0 < self.swa_full_tokens_ratio <= 1:
            yield "swa_full_tokens_ratio must be in (0, 1]"
        if self.mamba_full_memory_ratio is not None and self.mamba_full_memory_ratio <= 0:
            yield "mamba_full_memory_ratio must be > 0"
        if self.mamba_track_interval is not None and self.mamba_track_interval < 0:
            yield "mamba_track_interval must be >= 0"
        if self.mm_encoder_cache_mb < 0:
            yield "mm_encoder_cache_mb must be >= 0"
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < 0:
            yield "max_mamba_cache_size must be >= 0"
        if self.prefill_admit_tokens is not None and self.prefill_admit_tokens < 1:
            yield "prefill_admit_tokens must be >= 1"
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            yield "max_total_tokens is too small"
        if not 0 < self.mem_fraction <= 1:
            yield "mem_fraction must be in (0, 1]"
        if self.max_running_requests < 1:
            yield "max_running_requests must be >= 1"
        if not 0 <= self.batch_wait_ms <= 10_000:
            yield "batch_wait_ms must be between 0 and 10000"
        if not 0 <= self.min_new_token_ratio <= self.new_token_ratio <= 1:
            yield "min_new_token_ratio <= new_token_ratio must both be in [0, 1]"
        if self.tp_size < 1:
            yield "tp_size must be >= 1"
        if self.cuda_graph_max_bs < 1:
            yield "cuda_graph_max_bs must be >= 1"
        yield from self._distributed_problems()
        yield from self._hicache_problems()
        if (self.speculative_algorithm == "draft") != (self.speculative_draft_model is not None):
            yield "speculative_algorithm draft and speculative_draft_model go together"
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            yield "speculative_num_draft_tokens must be between 1 and 16"
        if self.log_requests is not None:
            yield from log_folder_problems(self.log_requests)
        yield from self._lora_problems()
        yield from self._disaggregation_problems()
        if self.enable_deterministic_inference:
            for name, value in (
                ("enable_torch_compile", self.enable_torch_compile),
                ("speculative_algorithm", self.speculative_algorithm is not None),
                ("lora_paths / enable_lora", self.enable_lora or bool(self.lora_paths)),
                ("tp_size", self.tp_size > 1),
                # states rounded where a chunk ends would depend on where chunks end
                ("mamba_ssm_dtype other than float32", self.mamba_ssm_dtype != "float32"),
            ):
                if value:
                    yield f"{name} with enable_deterministic_inference is not supported"

    def _disaggregation_problems(self):
        if self.disaggregation_mode == "null":
            return
        if not 0 < self.disaggregation_bootstrap_port <= 65535:
            yield "disaggregation_bootstrap_port must be in [1, 65535]"
        if self.disaggregation_transfer_timeout <= 0:
            yield "disaggregation_transfer_timeout must be > 0"
        for name, value in (
            ("tp_size", self.tp_size > 1),
            ("speculative_algorithm", self.speculative_algorithm is not None),
            ("enable_hierarchical_cache", self.enable_hierarchical_cache),
            ("lora_paths / enable_lora", self.enable_lora or bool(self.lora_paths)),
        ):
            if value:
                yield f"{name} with disaggregation_mode is not supported"

    def _lora_problems(self):
        if not self.enable_lora and not self.lora_paths:
            return
        unknown = sorted(set(self.lora_target_modules) - {*LORA_MODULES, "all"})
        if unknown:
            yield f"lora_target_modules {unknown}: choose from {', '.join(LORA_MODULES)} or all"
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            yield "max_lora_rank must be >= 1"
        if self.max_loras_per_batch < 1:
            yield "max_loras_per_batch must be >= 1"
        if not self.lora_paths and (self.max_lora_rank is None or not self.lora_target_modules):
            yield "enable_lora without lora_paths needs max_lora_rank and lora_target_modules"
        names = []
        for item in self.lora_paths:
            try:
                names.append(parse_lora_path(item)[0])
            except ValueError as exc:
                yield str(exc)
        if len(set(names)) < len(names):
            yield f"lora_paths: adapter names repeat: {names}"
        if self.tp_size > 1 or self.enable_torch_compile or self.speculative_algorithm:
            yield "LoRA runs with tp_size 1, without torch compile or speculation (yet)"

    def _distributed_problems(self):
        if not 1 <= self.nnodes <= self.tp_size:
            yield f"nnodes must be between 1 and tp_size ({self.tp_size}): every node hosts a rank"
        if not 0 <= self.node_rank < self.nnodes:
            yield f"node_rank must be in [0, nnodes), got {self.node_rank}"
        addr = self.dist_init_addr
        if addr is not None and not re.fullmatch(r"[\w.\-\[\]:]+:\d+", addr):
            yield f"dist_init_addr must be host:port, got {addr!r}"
        if self.nnodes > 1 and addr is None:
            yield "dist_init_addr (host:port of node 0) is needed when nnodes > 1"

    def _hicache_problems(self):
        if (self.hicache_storage_backend is None) != (self.hicache_storage_dir is None):
            yield "hicache_storage_backend file and hicache_storage_dir go together"
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            yield "hicache_ratio must be > 0 and hicache_size >= 0"
        if not self.enable_hierarchical_cache:
            if self.hicache_storage_backend is not None:
                yield "a hicache storage backend needs enable_hierarchical_cache"
            return
        if self.disable_radix_cache:
            yield "enable_hierarchical_cache needs the radix cache"
        if self.tp_size > 1:
            yield "enable_hierarchical_cache runs with tp_size 1 only (the tiers do not shard yet)"

    def prefill_budget(self, device: str) -> int:
        """Prompt tokens per step: the flag, else what measured best on the device type (CPU:
        2048, a lower p95 TTFT than 4096 at the same throughput, bench/results/scheduling.md;
        GPU keeps SGLang's 4096, not yet measured)."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return 2048 if device.startswith("cpu") else 4096

    def prefill_admit_limit(self, device: str) -> int:
        """A waiting request joins a step only if the prompt tokens the step admits stay within
        this, or it is the first admitted (a long prompt's continued chunks do not count, so
        short prompts still ride along with them).

        On CPU a step's cost is linear in its rows from a few dozen on, so prompts arriving
        together gain nothing from sharing one step: taken one per step, the first completes
        after its own prefill instead of after all of theirs (bench/results/scheduling.md)."""
        if self.prefill_admit_tokens is not None:
            return self.prefill_admit_tokens
        return 256 if device.startswith("cpu") else self.prefill_budget(device)

    def local_tp_ranks(self) -> list[int]:
        """The tensor-parallel ranks this node hosts: node k gets the ranks r with
        r * nnodes // tp_size == k (contiguous, as even as the counts allow)."""
        return [r for r in range(self.tp_size) if r * self.nnodes // self.tp_size == self.node_rank]

    def dist_init_method(self, init_file: str | None = None) -> str:
        """Where the ranks meet: node 0's address when one is given (always across nodes),
        else `init_file` in the server's private folder."""
        if self.dist_init_addr:
            return f"tcp://{self.dist_init_addr}"
        assert init_file is not None, "ranks on one node without dist_init_addr meet at a file"
        return f"file://{init_file}"

    def with_(self, **changes) -> "EngineArgs":
        return replace(self, **changes)


def log_folder_problems(folder: str):
    """An unusable --log-requests folder is refused before anything starts (it is created)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        yield f"log_requests: cannot create the folder {folder!r}: {exc.strerror}"
        return
    if not os.access(folder, os.W_OK):
        yield f"log_requests: the folder {folder!r} is not writable"
