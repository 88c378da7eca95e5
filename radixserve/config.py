"""Frozen configuration dataclasses, composed per process."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .kv_events import KVEventsConfig

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
EVICTION_POLICIES = ("lru", "lfu", "slru")  # radix cache eviction order; see mem/radix_cache.py
REQUEST_LOG_LEVELS = ("full", "hashes")  # what --log-requests stores of each prompt


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Qwen2, Mistral)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type not in (None, "default"):
            scaling = tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", False) or cfg.get("model_type") == "qwen2",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes an engine: model, memory, scheduling, numerics."""

    model: str | None = None
    dtype: str = "auto"
    max_total_tokens: int | None = None
    mem_fraction: float = 0.3
    max_running_requests: int = 64
    max_context_len: int | None = None
    chunked_prefill_size: int = 512
    max_prefill_tokens: int | None = None  # None: `prefill_budget` picks it for the device
    prefill_admit_tokens: int | None = None  # None: `prefill_admit_limit` picks it for the device
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"
    disable_cache_estimates: bool = False  # no live what-if hit rates for 0.5x/2x/4x the KV memory
    log_requests: str | None = (
        None  # folder of the rotating JSONL request log (cache sizing, `radixserve replay`)
    )
    log_requests_level: str = (
        "full"  # full: token ids; hashes: chained hashes of 16-token blocks, no text
    )
    page_size: int = 1
    attention_backend: str = "auto"
    tp_size: int = 1
    seed: int = 0
    num_threads: int | None = None
    new_token_ratio: float = 0.4
    min_new_token_ratio: float = 0.1
    log_level: str = "info"
    max_n: int = 16
    quantization: str | None = None
    enable_mixed_chunk: bool = True
    disable_cuda_graph: bool = False
    enable_jump_forward: bool = False
    enable_torch_compile: bool = False
    watchdog_timeout: float = (
        300.0  # the scheduler exits when a step takes longer (the server then stops)
    )
    cuda_graph_max_bs: int = 64
    kv_events_config: str | None = None  # JSON (kv_events.KVEventsConfig): publish KV cache events
    nnodes: int = 1  # machines the tensor-parallel ranks span
    node_rank: int = 0  # this machine's place among them; node 0 serves HTTP and hosts rank 0
    dist_init_addr: str | None = None  # host:port where the ranks meet (needed across nodes)
    enable_hierarchical_cache: bool = False  # host-memory (and storage) tiers under the radix tree
    hicache_ratio: float = 2.0  # host tier size / device pool size
    hicache_size: int = 0  # host tier in GiB; overrides hicache_ratio when > 0
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None  # "file": blocks kept on disk, across restarts
    hicache_storage_dir: str | None = None
    speculative_algorithm: str | None = (
        None  # ngram: drafts by n-gram lookup; draft: by a smaller model
    )
    speculative_num_draft_tokens: int = 8  # most drafts a request proposes per step
    speculative_draft_model: str | None = None  # the draft model of speculative_algorithm "draft"

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid engine arguments: " + "; ".join(problems))

    def _problems(self):
        if self.schedule_policy not in SCHEDULE_POLICIES:
            yield (
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            yield (
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.dtype not in DTYPES:
            yield f"dtype must be one of {DTYPES}, got {self.dtype!r}"
        if self.page_size < 1:
            yield "page_size must be >= 1"
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            yield (
                f"radix_eviction_policy must be one of {EVICTION_POLICIES}, "
                f"got {self.radix_eviction_policy!r}"
            )
        if self.log_requests_level not in REQUEST_LOG_LEVELS:
            yield (
                f"log_requests_level must be one of {REQUEST_LOG_LEVELS}, "
                f"got {self.log_requests_level!r}"
            )
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
        if self.quantization not in (None, "int8"):
            yield f"quantization must be None or 'int8', got {self.quantization!r}"
        if self.tp_size < 1:
            yield "tp_size must be >= 1"
        if self.cuda_graph_max_bs < 1:
            yield "cuda_graph_max_bs must be >= 1"
        if not 1 <= self.nnodes <= self.tp_size:
            yield f"nnodes must be between 1 and tp_size ({self.tp_size}): every node hosts a rank"
        if not 0 <= self.node_rank < self.nnodes:
            yield f"node_rank must be in [0, nnodes), got {self.node_rank}"
        if self.dist_init_addr is not None and not re.fullmatch(
            r"[\w.\-\[\]:]+:\d+", self.dist_init_addr
        ):
            yield f"dist_init_addr must be host:port, got {self.dist_init_addr!r}"
        if self.nnodes > 1 and self.dist_init_addr is None:
            yield "dist_init_addr (host:port of node 0) is needed when nnodes > 1"
        yield from self._hicache_problems()
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            yield (
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got "
                f"{self.speculative_algorithm!r}"
            )
        if (self.speculative_algorithm == "draft") != (self.speculative_draft_model is not None):
            yield "speculative_algorithm draft and speculative_draft_model go together"
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            yield "speculative_num_draft_tokens must be between 1 and 16"

    def _hicache_problems(self):
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            yield (
                f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, "
                f"got {self.hicache_write_policy!r}"
            )
        if self.hicache_storage_backend not in (None, "file"):
            yield f"hicache_storage_backend must be 'file', got {self.hicache_storage_backend!r}"
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
        """Prompt tokens per step: the flag, else what measured best on the device type.

        CPU (bench/README.md, 2-core EPYC, concurrency 8): 2048 against 4096 gave a lower p95
        TTFT on no_sharing (5.38 s against 6.02 s) at the same throughput; a step's cost grows
        linearly with its prompt tokens there, so smaller steps start requests sooner. GPU
        keeps SGLang-like 4096 (not yet measured)."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return 2048 if device.startswith("cpu") else 4096

    def prefill_admit_limit(self, device: str) -> int:
        """A waiting request joins a step only if the prompt tokens the step admits stay within
        this, or it is the first admitted (a long prompt's continued chunks do not count, so
        short prompts still ride along with them).

        On CPU a step's cost is linear in its rows from a few dozen on (the linear layers are
        bound by arithmetic there), so prompts arriving together gain nothing from sharing one
        step: taken one per step, the first completes after its own prefill instead of after all
        of theirs, and the running requests decode between them. Taken in pairs (the rule was
        "until the step holds this many"), multi_turn's eight ~190-token first turns finished
        two by two, so the last two waited as long as in one shared step."""
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


@dataclass(frozen=True)
class ServerArgs:
    """The HTTP front: where to listen and who may call."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    engine: EngineArgs = field(default_factory=EngineArgs)
    max_request_bytes: int = 8 << 20  # a larger body is a 413
    max_queued_requests: int | None = (
        None  # beyond the running ones; more is a 503 (None: no limit)
    )
    tool_call_parser: str | None = (
        None  # None: detected from the chat template (tool_calls.detect_parser)
    )
    reasoning_parser: str | None = None  # None: no reasoning is split out (reasoning.PARSERS)


ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


@dataclass(frozen=True)
class RouterArgs:
    """`radixserve router`: the workers, the policy and its thresholds (SGLang's router names
    and meanings), health checks, the circuit breaker and retries."""

    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = (
        8  # SGLang's 64 suits GPU batches of hundreds; CPU replicas run ~10
    )
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 26
    eviction_interval_secs: float = 120.0
    health_check_interval_secs: float = 2.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 2
    cb_failure_threshold: int = 3
    cb_success_threshold: int = 1
    cb_timeout_duration_secs: float = 10.0
    retry_max_retries: int = 2
    request_timeout_secs: float = 1800.0
    api_key: str | None = None
    max_request_bytes: int = 8 << 20
    log_level: str = "info"
    kv_events: bool = False  # cache_aware on the workers' KV events instead of the approximate tree
    tokenizer_path: str | None = None  # with kv_events; None: the bundled model's

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid router arguments: " + "; ".join(problems))

    def _problems(self):
        if self.policy not in ROUTER_POLICIES:
            yield f"policy must be one of {ROUTER_POLICIES}, got {self.policy!r}"
        for url in self.worker_urls:
            if (problem := worker_url_problem(url)) is not None:
                yield problem
        if len(set(self.worker_urls)) != len(self.worker_urls):
            yield "worker_urls has duplicates"
        if not 0 <= self.cache_threshold <= 1:
            yield "cache_threshold must be in [0, 1]"
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            yield "balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1"
        if self.max_tree_size < 1 or self.eviction_interval_secs <= 0:
            yield "max_tree_size and eviction_interval_secs must be positive"
        if (
            min(
                self.health_check_interval_secs,
                self.health_check_timeout_secs,
                self.cb_timeout_duration_secs,
            )
            <= 0
        ):
            yield "health check interval and timeout and cb_timeout_duration_secs must be positive"
        if (
            min(self.health_failure_threshold, self.cb_failure_threshold, self.cb_success_threshold)
            < 1
        ):
            yield (
                "health_failure_threshold, cb_failure_threshold and cb_success_threshold "
                "must be >= 1"
            )
        if self.retry_max_retries < 0:
            yield "retry_max_retries must be >= 0"
        if self.kv_events and self.policy != "cache_aware":
            yield "kv_events needs the cache_aware policy"


def worker_url_problem(url: str) -> str | None:
    """Why `url` cannot name a worker (an http(s) URL with a host and no path), or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        return f"worker url {url!r} is malformed: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return f"worker url {url!r} must look like http://host:port"
    return None
