"""Frozen configuration dataclasses, composed per process."""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from .kv_events import KVEventsConfig
from .lora import LORA_MODULES, parse_lora_path
from .quant import KV_CACHE_DTYPES, ONLINE_QUANTIZATIONS

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
EVICTION_POLICIES = ("lru", "lfu", "slru")  # radix cache eviction order; see mem/radix_cache.py
REQUEST_LOG_LEVELS = ("full", "hashes")  # what --log-requests stores of each prompt
LOG_LEVELS = ("debug", "info", "warning", "error")
HICACHE_STORAGE_BACKENDS = ("file",)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake",)  # NIXL would plug in beside it (disagg/transfer.py)


def option(default, help: str, choices: tuple | None = None, flag: bool = True, **extra):
    """A configuration field: its default, its `--flag` help and its allowed values, defined
    once. The CLI builds each flag from this (`cli.add_flags`) and `check_choices` enforces
    `choices`; `flag=False` marks a field that is set by the program, not by a flag."""
    metadata = dict(help=help, choices=choices, flag=flag, **extra)
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not options")
    return field(default=default, metadata=metadata)


def option_default(f):
    return f.default_factory() if f.default is MISSING else f.default


def refuse_problems(kind: str, problems) -> None:
    """Raise one ValueError naming every problem of a set of options (a one-line start-up
    error)."""
    found = list(problems)
    if found:
        raise ValueError(f"invalid {kind} arguments: " + "; ".join(found))


def check_choices(obj):
    """Each option with `choices` holds one of them (None stays allowed where it is the
    default)."""
    for f in fields(obj):
        choices = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if choices and value not in choices and not (value is None and f.default is None):
            yield f"{f.name} must be one of {choices}, got {value!r}"


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes an engine: model, memory, scheduling, numerics."""

    model: str | None = option(
        None,
        "bundled SmolLM2-135M-Instruct when omitted; a local HF checkpoint directory "
        "(Llama/Qwen2/Mistral); or dummy:<shape> random weights (dummy:llama-3-8b, "
        "dummy:qwen2-0.5b, dummy:smollm2-135m, dummy:tiny)",
    )
    dtype: str = option(
        "auto",
        "weights/KV dtype; auto = bfloat16 on GPU and on CPUs with AMX-BF16, else float32",
        DTYPES,
    )
    max_total_tokens: int | None = option(None, "KV pool size in tokens (overrides --mem-fraction)")
    mem_fraction: float = option(0.3, "fraction of free memory for the KV pool")
    max_running_requests: int = option(64, "requests decoding at once")
    max_context_len: int | None = option(None, "context length cap (default: the model's)")
    chunked_prefill_size: int = option(512, "longest prompt chunk per step")
    max_prefill_tokens: int | None = option(
        None, "prompt tokens per step (default: 2048 on CPU, 4096 on GPU, as measured)"
    )
    prefill_admit_tokens: int | None = option(
        None,
        "a waiting request joins a step only if the prompt tokens the step admits stay within "
        "this (the first always joins), so a burst of prompts completes one after another "
        "(default: 256 on CPU; on GPU the step's budget)",
    )
    schedule_policy: str = option(
        "lpm", "lpm: longest cached prefix first; dfs-weight; fcfs", SCHEDULE_POLICIES
    )
    enable_priority_scheduling: bool = option(
        False,
        "admit waiting requests by their `priority` field (higher first; the schedule policy "
        "orders each level) and retract the lowest priority first when KV memory runs out",
    )
    batch_wait_ms: float = option(
        0.0,
        "with fewer than 1/8 of --max-running-requests running, admission waits up to this long "
        "after the oldest waiting request arrived, so that arrivals close together start in one "
        "step (0: off, as measured best on CPU; bench/README.md)",
    )
    disable_radix_cache: bool = option(False, "no prefix reuse (a baseline)")
    radix_eviction_policy: str = option(
        "lru",
        "which cached prefixes go first when KV memory is short: lru; lfu (fewest hits); slru "
        "(never-hit before hit, each least recent first)",
        EVICTION_POLICIES,
    )
    disable_cache_estimates: bool = option(
        False,
        "do not estimate (on /metrics and the dashboard) what hit rate 0.5x, 2x and 4x the KV "
        "memory would give, from metadata-only shadow caches",
    )
    log_requests: str | None = option(
        None,
        "append every finished request to a rotating JSONL log in DIR, for `radixserve replay` "
        "(cache sizing)",
        metavar="DIR",
    )
    log_requests_level: str = option(
        "full",
        "full: prompt and output token ids; hashes: only chained hashes of 16-token blocks (no "
        "text can be recovered)",
        REQUEST_LOG_LEVELS,
    )
    page_size: int = option(1, "KV slots per page")
    attention_backend: str = option(
        "auto",
        "auto: flashinfer on CUDA if importable, else triton, else torch_native",
        ATTENTION_BACKENDS,
    )
    enable_jump_forward: bool = option(
        False,
        "structured output: append the text a grammar forces without decoding it token by token "
        "(fewer steps; the forced text is tokenized on its own)",
    )
    enable_deterministic_inference: bool = option(
        False,
        "batch-invariant CPU inference: greedy tokens and logprobs the same bit for bit whether "
        "a prefix was computed now or came from the radix cache or HiCache, whatever the batch "
        "and --chunked-prefill-size (attention through one kernel with fixed key tiles, dense "
        "GEMMs in fixed row blocks)",
    )
    enable_torch_compile: bool = option(
        False,
        "torch.compile the whole forward, attention kept opaque (adds minutes to the first "
        "start-up, less once inductor's on-disk cache is warm)",
    )
    watchdog_timeout: float = option(
        300.0, "seconds a scheduler step may take before the scheduler exits and the server stops"
    )
    disable_cuda_graph: bool = option(False, "run GPU decode steps eagerly (no CUDA graphs)")
    cuda_graph_max_bs: int = option(64, "largest decode batch captured in a CUDA graph")
    tp_size: int = option(
        1,
        "tensor-parallel ranks: rank 0 in the scheduler, one worker process per other rank, "
        "torch.distributed (gloo on CPU, NCCL on GPU); must divide the head counts",
    )
    nnodes: int = option(1, "machines the --tp-size ranks span (torch.distributed across them)")
    node_rank: int = option(
        0,
        "this machine's place among --nnodes; node 0 serves HTTP and hosts rank 0, the others "
        "only run their ranks",
    )
    dist_init_addr: str | None = option(
        None, "host:port of node 0 where the ranks meet (needed with --nnodes > 1)"
    )
    enable_hierarchical_cache: bool = option(
        False,
        "keep KV evicted from the device pool in host memory (and storage), and load it back on "
        "a hit instead of recomputing",
    )
    hicache_ratio: float = option(2.0, "host tier size as a multiple of the device pool")
    hicache_size: int = option(0, "host tier size in GiB (overrides --hicache-ratio when > 0)")
    hicache_write_policy: str = option(
        "write_through",
        "write_through: every cached prefix is copied to the host tier; write_through_selective: "
        "prefixes hit more than once; write_back: on eviction from the device pool",
        HICACHE_WRITE_POLICIES,
    )
    hicache_storage_backend: str | None = option(
        None,
        "also keep blocks on disk, across restarts and shared by the servers of one machine",
        HICACHE_STORAGE_BACKENDS,
    )
    hicache_storage_dir: str | None = option(None, "the folder of --hicache-storage-backend file")
    speculative_algorithm: str | None = option(
        None,
        "ngram: decoding requests draft the tokens that followed their last tokens earlier in "
        "their context (or in recent outputs); draft: a smaller model with the same tokenizer "
        "drafts them. The model verifies the drafts in one step; output is unchanged",
        SPECULATIVE_ALGORITHMS,
    )
    speculative_draft_model: str | None = option(
        None,
        "the draft model of --speculative-algorithm draft: a local HF directory or "
        "dummy:<shape>, with the served model's vocabulary",
    )
    speculative_num_draft_tokens: int = option(
        8,
        "most draft tokens a request verifies per step (fewer where the measured step cost says "
        "they would not pay)",
    )
    new_token_ratio: float = option(
        0.4,
        "share of each running request's remaining max_new_tokens that admission reserves at "
        "first; it decays to --min-new-token-ratio and rises after each retraction",
    )
    min_new_token_ratio: float = option(0.1, "the floor of --new-token-ratio")
    seed: int = option(0, "seed for dummy weights")
    num_threads: int | None = option(None, "torch threads of the worker (default: all cores)")
    quantization: str | None = option(
        None,
        "quantize a float checkpoint's linear layers at load, weight-only with one scale per "
        "output channel: int8 or fp8 (float8_e4m3fn); a quantized checkpoint (fp8, "
        "compressed-tensors, awq, gptq) is read from its config.json without this flag",
        ONLINE_QUANTIZATIONS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache dtype: auto (the model's dtype) or fp8_e4m3 (one byte a value with a scale "
        "per layer: the checkpoint's k_scale/v_scale, else 1.0)",
        KV_CACHE_DTYPES,
    )
    lora_paths: tuple[str, ...] = option(
        (),
        "LoRA adapters in peft's format to serve beside the base model, each NAME=PATH (or "
        "PATH, named after its folder); a request picks one by name (`lora_path`)",
        metavar="NAME=PATH",
    )
    enable_lora: bool = option(
        False, "serve LoRA adapters (implied by --lora-paths); load more with /load_lora_adapter"
    )
    max_lora_rank: int | None = option(
        None, "the adapter pool's rank: higher ranks are refused (default: the start-up adapters')"
    )
    lora_target_modules: tuple[str, ...] = option(
        (),
        "the modules the adapter pool holds deltas for, or all (default: the start-up "
        "adapters'); an adapter targeting others is refused",
        metavar="MODULE",
    )
    max_loras_per_batch: int = option(
        8, "adapters one step may mix, and the pool's slots: the others wait on the host (LRU)"
    )
    disaggregation_mode: str = option(
        "null",
        "prefill/decode disaggregation: a prefill server computes prompts and writes their KV "
        "into a decode server's pool, which streams the rest (behind `radixserve router "
        "--pd-disaggregation`); null serves both",
        DISAGGREGATION_MODES,
    )
    disaggregation_transfer_backend: str = option(
        "mooncake", "the engine that moves KV pages between the two servers", TRANSFER_BACKENDS
    )
    disaggregation_bootstrap_port: int = option(
        8998, "a prefill server's port where decode servers say where to write each prompt's KV"
    )
    disaggregation_host: str = option(
        "127.0.0.1",
        "the address this server's transfer engine and bootstrap listen on and announce",
    )
    disaggregation_transfer_timeout: float = option(
        30.0,
        "seconds a request waits for its KV to reach the decode server (or for the decode "
        "server to say where to write it) before it fails",
    )
    kv_events_config: str | None = option(
        None,
        "publish KV cache events for KV-aware routers (Dynamo, llm-d) as vLLM does, e.g. "
        '\'{"endpoint": "tcp://*:5557", "topic": "kv"}\'',
    )
    log_level: str = option("info", "log level", LOG_LEVELS)

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
        2048, a lower p95 TTFT than 4096 at the same throughput, bench/README.md; GPU keeps
        SGLang's 4096, not yet measured)."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return 2048 if device.startswith("cpu") else 4096

    def prefill_admit_limit(self, device: str) -> int:
        """A waiting request joins a step only if the prompt tokens the step admits stay within
        this, or it is the first admitted (a long prompt's continued chunks do not count, so
        short prompts still ride along with them).

        On CPU a step's cost is linear in its rows from a few dozen on, so prompts arriving
        together gain nothing from sharing one step: taken one per step, the first completes
        after its own prefill instead of after all of theirs (bench/README.md)."""
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


def _names(module: str) -> tuple[str, ...]:
    """The names a parser registry offers (imported here so that config stays the one place
    of each option's choices)."""
    if module == "tool_calls":
        from .tool_calls import PARSERS
    else:
        from .reasoning import PARSERS
    return tuple(sorted(PARSERS))


@dataclass(frozen=True)
class ServerArgs:
    """The HTTP front: where to listen, who may call, how many replicas."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "port to listen on")
    api_key: str | None = option(None, "require 'Authorization: Bearer <key>'")
    served_model_name: str | None = option(None, "model name reported by /v1/models")
    engine: EngineArgs = field(default_factory=EngineArgs, metadata=dict(flag=False))
    max_request_bytes: int = option(8 << 20, "largest request body accepted; a larger one is a 413")
    max_queued_requests: int | None = option(
        None,
        "requests allowed to wait beyond --max-running-requests; more are answered 503 with "
        "Retry-After (default: no limit)",
    )
    tool_call_parser: str | None = option(
        None,
        "format of the model's tool calls (default: detected from the chat template)",
        _names("tool_calls"),
    )
    reasoning_parser: str | None = option(
        None,
        "split <think>...</think> reasoning from the answer into reasoning_content (deepseek-r1 "
        "and qwen3-thinking: the output starts inside the reasoning; qwen3: only when it opens "
        "<think>)",
        _names("reasoning"),
    )
    is_embedding: bool = option(
        False,
        "also serve /v1/embeddings: the prompt's final hidden states pooled as the checkpoint's "
        "sentence-transformers config says (1_Pooling: last token or mean; last by default), "
        "L2-normalized",
    )
    dp_size: int = option(
        1,
        "data-parallel replicas, each a whole server with its share of the CPU cores (or its own "
        "GPUs), behind a router on --host/--port",
    )

    def __post_init__(self) -> None:
        refuse_problems("server", self._problems())

    def _problems(self):
        yield from check_choices(self)
        if not 0 <= self.port <= 65535:
            yield f"port must be in [0, 65535], got {self.port}"
        if self.max_request_bytes < 1:
            yield "max_request_bytes must be >= 1"
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            yield "max_queued_requests must be >= 0"
        if self.dp_size < 1:
            yield "dp_size must be >= 1"
        if self.dp_size > 1 and self.engine.nnodes > 1:
            yield (
                "dp_size with nnodes is not supported: start each multi-node replica on its own, "
                "behind `radixserve router`"
            )
        if self.dp_size > 1 and self.engine.disaggregation_mode != "null":
            yield (
                "disaggregation_mode with dp_size is not supported: start the prefill and decode "
                "servers one by one behind `radixserve router --pd-disaggregation`"
            )
        if self.dp_size > 1 and self.engine.kv_events_config is not None:
            yield (
                "kv_events_config with dp_size is not supported (each replica needs its own "
                "endpoint): --router-kv-events gives each one its own, or start them one by one "
                "behind `radixserve router`"
            )
