"""The engine's options, one dataclass a topic; `EngineArgs` (config/engine.py) joins them.
Each field is an `option`: its default, flag help and choices, defined once."""

from __future__ import annotations

from dataclasses import dataclass

from ..quant import KV_CACHE_DTYPES, ONLINE_QUANTIZATIONS
from .options import (
    ATTENTION_BACKENDS,
    DISAGGREGATION_MODES,
    DTYPES,
    EVICTION_POLICIES,
    HICACHE_STORAGE_BACKENDS,
    HICACHE_WRITE_POLICIES,
    LOG_LEVELS,
    REQUEST_LOG_LEVELS,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    TRANSFER_BACKENDS,
    option,
)


@dataclass(frozen=True)
class ModelOptions:
    """The model, its numerics and how its forward runs."""

    model: str | None = option(
        None,
        "bundled SmolLM2-135M-Instruct when omitted; a local HF checkpoint directory "
        "(Llama/Qwen2/Mistral); or dummy:<shape> random weights (dummy:llama-3-8b, "
        "dummy:qwen2-0.5b, dummy:smollm2-135m, dummy:tiny)",
    )
    dtype: str = option(
        "auto",
        "weights/KV dtype; auto = bfloat16 on GPU and on CPUs where it is faster (AMX-BF16; "
        "AVX512-BF16 on AMD), else float32",
        DTYPES,
    )
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
    attention_backend: str = option(
        "auto",
        "auto: flashinfer on CUDA if importable, else triton, else torch_native",
        ATTENTION_BACKENDS,
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
    disable_cuda_graph: bool = option(False, "run GPU decode steps eagerly (no CUDA graphs)")
    cuda_graph_max_bs: int = option(64, "largest decode batch captured in a CUDA graph")
    seed: int = option(0, "seed for dummy weights")
    num_threads: int | None = option(None, "torch threads of the worker (default: all cores)")
    watchdog_timeout: float = option(
        300.0, "seconds a scheduler step may take before the scheduler exits and the server stops"
    )
    log_level: str = option("info", "log level", LOG_LEVELS)


MAMBA_SSM_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ScheduleOptions:
    """KV memory and scheduling: the pool, the batch, the prompt budget per step."""

    max_total_tokens: int | None = option(None, "KV pool size in tokens (overrides --mem-fraction)")
    mem_fraction: float = option(0.3, "fraction of free memory for the KV pool")
    max_running_requests: int = option(64, "requests decoding at once")
    context_length: int | None = option(
        None, "the context length, at most the model's (default: the model's)"
    )
    chunked_prefill_size: int = option(512, "longest prompt chunk per step")
    disable_hybrid_swa_memory: bool = option(
        False,
        "keep every token's KV in sliding-window layers (Gemma 2/3, gpt-oss) too, instead of a "
        "pool of their own that frees it once the token leaves the window",
    )
    swa_full_tokens_ratio: float | None = option(
        None,
        "the window layers' pool in tokens as a fraction of the full layers' pool (default: what "
        "--max-running-requests windows and a --chunked-prefill-size chunk need)",
    )
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
        "step (0: off, as measured best on CPU; bench/results/scheduling.md)",
    )
    new_token_ratio: float = option(
        0.4,
        "share of each running request's remaining max_new_tokens that admission reserves at "
        "first; it decays to --min-new-token-ratio and rises after each retraction",
    )
    min_new_token_ratio: float = option(0.1, "the floor of --new-token-ratio")
    page_size: int = option(1, "KV slots per page")


@dataclass(frozen=True)
class CacheOptions:
    """The radix cache, its tiers, its estimates, request logs and KV events."""

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
    max_mamba_cache_size: int | None = option(
        None,
        "state snapshots the radix cache of a hybrid model (convolution or recurrent layers "
        "beside attention) keeps, each a request's state at a cached prefix's end, where the "
        "next request on that prefix resumes; 0 turns prefix reuse off for such models "
        "(default: 4x --max-running-requests)",
    )
    mamba_full_memory_ratio: float | None = option(
        None,
        "a hybrid model's state pool (one state per running request, then the snapshots) in "
        "bytes as a multiple of the KV pool's: the snapshots are what it holds beyond the "
        "running requests' states (default: 4 snapshots per running request; "
        "--max-mamba-cache-size overrides both)",
    )
    mamba_ssm_dtype: str = option(
        "float32",
        "how a hybrid model's recurrent states (delta rule, SSM) are stored, running and in "
        "snapshots; they are computed in float32 (bfloat16 halves their memory)",
        MAMBA_SSM_DTYPES,
    )
    mamba_track_interval: int | None = option(
        None,
        "a hybrid model's prompt chunks end, and keep a state snapshot while a slot is free, "
        "every this many tokens; 0: not at intervals (default: the tokens whose KV takes as "
        "much memory as one state; 256 for a model without attention)",
    )
    kv_events_config: str | None = option(
        None,
        "publish KV cache events for KV-aware routers (Dynamo, llm-d) as vLLM does, e.g. "
        '\'{"endpoint": "tcp://*:5557", "topic": "kv"}\'',
    )
    mm_encoder_cache_mb: int = option(
        256,
        "vision-language models: MiB of image features kept by content hash, so a repeated "
        "image skips the vision tower even when its KV was evicted (0: none kept)",
    )


@dataclass(frozen=True)
class ParallelOptions:
    """Tensor parallelism across processes and nodes, and prefill/decode disaggregation."""

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


@dataclass(frozen=True)
class DecodingOptions:
    """Speculative decoding, jump-forward and LoRA adapters."""

    enable_jump_forward: bool = option(
        False,
        "structured output: append the text a grammar forces without decoding it token by token "
        "(fewer steps; the forced text is tokenized on its own)",
    )
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
