"""`radixserve serve`, `radixserve router`, `radixserve generate` and `radixserve replay`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import (
    ATTENTION_BACKENDS,
    DTYPES,
    EVICTION_POLICIES,
    HICACHE_WRITE_POLICIES,
    REQUEST_LOG_LEVELS,
    ROUTER_POLICIES,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    EngineArgs,
    RouterArgs,
    ServerArgs,
)
from .reasoning import PARSERS as REASONING_PARSERS
from .tool_calls import PARSERS

ENGINE_FLAGS = [
    (
        "--model",
        dict(
            default=None,
            help="bundled SmolLM2-135M-Instruct when omitted; a local HF "
            "checkpoint directory (Llama/Qwen2/Mistral); or dummy:<shape> random weights "
            "(dummy:llama-3-8b, dummy:qwen2-0.5b, dummy:smollm2-135m, dummy:tiny)",
        ),
    ),
    (
        "--dtype",
        dict(
            default="auto",
            choices=DTYPES,
            help="weights/KV dtype; auto = bfloat16 on GPU and on CPUs with AMX-BF16, else float32",
        ),
    ),
    (
        "--max-total-tokens",
        dict(type=int, default=None, help="KV pool size in tokens (overrides --mem-fraction)"),
    ),
    (
        "--mem-fraction",
        dict(type=float, default=0.3, help="fraction of free memory for the KV pool"),
    ),
    ("--max-running-requests", dict(type=int, default=64, help="requests decoding at once")),
    (
        "--max-context-len",
        dict(type=int, default=None, help="context length cap (default: the model's)"),
    ),
    ("--chunked-prefill-size", dict(type=int, default=512, help="longest prompt chunk per step")),
    (
        "--max-prefill-tokens",
        dict(
            type=int,
            default=None,
            help="prompt tokens per step (default: 2048 on CPU, 4096 on GPU, as measured)",
        ),
    ),
    (
        "--prefill-admit-tokens",
        dict(
            type=int,
            default=None,
            help="a waiting request joins a step only if the prompt tokens the step "
            "admits stay within this (the first always joins), so a burst of prompts "
            "completes one after another (default: 256 on CPU; on GPU the step's budget)",
        ),
    ),
    (
        "--schedule-policy",
        dict(
            default="lpm",
            choices=SCHEDULE_POLICIES,
            help="lpm: longest cached prefix first; dfs-weight; fcfs",
        ),
    ),
    ("--disable-radix-cache", dict(action="store_true", help="no prefix reuse (a baseline)")),
    (
        "--radix-eviction-policy",
        dict(
            default="lru",
            choices=EVICTION_POLICIES,
            help="which cached prefixes go first when KV memory is short: lru; lfu (fewest "
            "hits); slru (never-hit before hit, each least recent first)",
        ),
    ),
    (
        "--disable-cache-estimates",
        dict(
            action="store_true",
            help="do not estimate (on /metrics and the dashboard) "
            "what hit rate 0.5x, 2x and 4x the KV memory would give, from metadata-only "
            "shadow caches",
        ),
    ),
    (
        "--log-requests",
        dict(
            default=None,
            metavar="DIR",
            help="append every finished request to a rotating JSONL "
            "log in DIR, for `radixserve replay` (cache sizing)",
        ),
    ),
    (
        "--log-requests-level",
        dict(
            default="full",
            choices=REQUEST_LOG_LEVELS,
            help="full: prompt and output token ids; hashes: only chained hashes of "
            "16-token blocks (no text can be recovered)",
        ),
    ),
    ("--page-size", dict(type=int, default=1, help="KV slots per page")),
    (
        "--attention-backend",
        dict(
            default="auto",
            choices=ATTENTION_BACKENDS,
            help="auto: flashinfer on CUDA if importable, else triton, else torch_native",
        ),
    ),
    (
        "--enable-jump-forward",
        dict(
            action="store_true",
            help="structured output: append the text a grammar forces without decoding it "
            "token by token (fewer steps; the forced text is tokenized on its own)",
        ),
    ),
    (
        "--enable-torch-compile",
        dict(
            action="store_true",
            help="torch.compile the whole forward, attention kept opaque (adds minutes to the "
            "first start-up, "
            "less once inductor's on-disk cache is warm)",
        ),
    ),
    (
        "--watchdog-timeout",
        dict(
            type=float,
            default=300.0,
            help="seconds a scheduler step may take before the scheduler exits and the server "
            "stops",
        ),
    ),
    (
        "--disable-cuda-graph",
        dict(action="store_true", help="run GPU decode steps eagerly (no CUDA graphs)"),
    ),
    (
        "--cuda-graph-max-bs",
        dict(type=int, default=64, help="largest decode batch captured in a CUDA graph"),
    ),
    (
        "--tp-size",
        dict(
            type=int,
            default=1,
            help="tensor-parallel ranks: rank 0 in the scheduler, one worker process per other "
            "rank, torch.distributed "
            "(gloo on CPU, NCCL on GPU); must divide the head counts",
        ),
    ),
    (
        "--nnodes",
        dict(
            type=int,
            default=1,
            help="machines the --tp-size ranks span (torch.distributed across them)",
        ),
    ),
    (
        "--node-rank",
        dict(
            type=int,
            default=0,
            help="this machine's place among --nnodes; node 0 serves HTTP and "
            "hosts rank 0, the others only run their ranks",
        ),
    ),
    (
        "--dist-init-addr",
        dict(
            default=None, help="host:port of node 0 where the ranks meet (needed with --nnodes > 1)"
        ),
    ),
    (
        "--enable-hierarchical-cache",
        dict(
            action="store_true",
            help="keep KV evicted from the device pool in host "
            "memory (and storage), and load it back on a hit instead of recomputing",
        ),
    ),
    (
        "--hicache-ratio",
        dict(type=float, default=2.0, help="host tier size as a multiple of the device pool"),
    ),
    (
        "--hicache-size",
        dict(
            type=int, default=0, help="host tier size in GiB (overrides --hicache-ratio when > 0)"
        ),
    ),
    (
        "--hicache-write-policy",
        dict(
            default="write_through",
            choices=HICACHE_WRITE_POLICIES,
            help="write_through: every cached prefix is copied to the host tier; "
            "write_through_selective: prefixes hit more than once; write_back: on "
            "eviction from the device pool",
        ),
    ),
    (
        "--hicache-storage-backend",
        dict(
            default=None,
            choices=["file"],
            help="also keep blocks on disk, across "
            "restarts and shared by the servers of one machine",
        ),
    ),
    (
        "--hicache-storage-dir",
        dict(default=None, help="the folder of --hicache-storage-backend file"),
    ),
    (
        "--speculative-algorithm",
        dict(
            default=None,
            choices=SPECULATIVE_ALGORITHMS,
            help="ngram: decoding requests draft the tokens that followed their last "
            "tokens earlier in their context (or in recent outputs); draft: a "
            "smaller model with the same tokenizer drafts them. The model verifies "
            "the drafts in one step; output is unchanged",
        ),
    ),
    (
        "--speculative-draft-model",
        dict(
            default=None,
            help="the draft model of --speculative-algorithm draft: a local HF directory or "
            "dummy:<shape>, with the served model's vocabulary",
        ),
    ),
    (
        "--speculative-num-draft-tokens",
        dict(
            type=int,
            default=8,
            help="most draft tokens a request verifies per step "
            "(fewer where the measured step cost says they would not pay)",
        ),
    ),
    ("--seed", dict(type=int, default=0, help="seed for dummy weights")),
    (
        "--num-threads",
        dict(type=int, default=None, help="torch threads of the worker (default: all cores)"),
    ),
    (
        "--quantization",
        dict(
            default=None,
            choices=["int8"],
            help="weight-only int8 (faster CPU decode; outputs differ slightly from fp32)",
        ),
    ),
    (
        "--kv-events-config",
        dict(
            default=None,
            help="publish KV cache events for KV-aware routers (Dynamo, llm-d) "
            'as vLLM does, e.g. \'{"endpoint": "tcp://*:5557", "topic": "kv"}\'',
        ),
    ),
    (
        "--log-level",
        dict(default="info", choices=["debug", "info", "warning", "error"], help="log level"),
    ),
]


ROUTER_FLAGS = [
    (
        "--policy",
        dict(
            choices=ROUTER_POLICIES,
            help="cache_aware: the worker holding the longest prefix of the prompt while load is "
            "balanced; round_robin; random; power_of_two: the idler of two drawn at random",
        ),
    ),
    (
        "--cache-threshold",
        dict(
            type=float,
            help="cache_aware: smallest matched share of a prompt that "
            "sends it to the matching worker (else to the worker holding least)",
        ),
    ),
    (
        "--balance-abs-threshold",
        dict(
            type=int,
            help="cache_aware: load is out of balance when the busiest "
            "worker has more than this many requests in flight over the idlest...",
        ),
    ),
    ("--balance-rel-threshold", dict(type=float, help="...and more than this many times as many")),
    (
        "--max-tree-size",
        dict(type=int, help="cache_aware: characters of prompts remembered per worker"),
    ),
    (
        "--eviction-interval-secs",
        dict(type=float, help="cache_aware: seconds between evictions to --max-tree-size"),
    ),
    (
        "--health-check-interval-secs",
        dict(type=float, help="seconds between health checks of each worker"),
    ),
    ("--health-check-timeout-secs", dict(type=float, help="timeout of one health check")),
    (
        "--health-failure-threshold",
        dict(
            type=int,
            help="failed checks in a row that mark a worker dead "
            "(a refused connection marks it at once)",
        ),
    ),
    (
        "--cb-failure-threshold",
        dict(type=int, help="failed requests in a row that open a worker's circuit"),
    ),
    ("--cb-success-threshold", dict(type=int, help="successes that close a half-open circuit")),
    (
        "--cb-timeout-duration-secs",
        dict(type=float, help="seconds an open circuit keeps a worker out"),
    ),
    (
        "--retry-max-retries",
        dict(type=int, help="other workers tried when a request fails before its first byte"),
    ),
    ("--request-timeout-secs", dict(type=float, help="longest wait for a worker's response")),
    (
        "--kv-events",
        dict(
            action="store_true",
            help="cache_aware on the workers' own KV events (workers started with "
            "--kv-events-config; found through their /get_server_info) instead of the approximate "
            "tree",
        ),
    ),
    (
        "--tokenizer-path",
        dict(help="with --kv-events: the workers' tokenizer (default: the bundled model's)"),
    ),
]


def _add_router_flags(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The flags, with RouterArgs' defaults; under `serve`, prefixed `--router-`."""
    for flag, kwargs in ROUTER_FLAGS:
        name = flag[2:].replace("-", "_")
        help_text = ("with --dp-size: router " + flag + ": " if prefix else "") + kwargs["help"]
        parser.add_argument(
            "--" + prefix + flag[2:],
            **dict(kwargs, default=getattr(RouterArgs, name), help=help_text),
        )


def router_args_from(ns: argparse.Namespace, prefix: str = "", **fixed) -> RouterArgs:
    values = {
        flag[2:].replace("-", "_"): getattr(ns, prefix + flag[2:].replace("-", "_"))
        for flag, _ in ROUTER_FLAGS
    }
    return RouterArgs(**values, log_level=ns.log_level, **fixed)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in ENGINE_FLAGS:
        parser.add_argument(flag, **kwargs)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        **{
            flag[2:].replace("-", "_"): getattr(ns, flag[2:].replace("-", "_"))
            for flag, _ in ENGINE_FLAGS
        }
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="LLM serving with a radix prefix cache"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve the HTTP API (SGLang native + OpenAI)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=30000, help="port to listen on")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    serve.add_argument(
        "--served-model-name", default=None, help="model name reported by /v1/models"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 << 20,
        help="largest request body accepted; a larger one is a 413",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests allowed to wait beyond --max-running-requests; more are "
        "answered 503 with Retry-After (default: no limit)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(PARSERS),
        help="format of the model's tool calls (default: detected from the chat template)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> reasoning from the answer into reasoning_content "
        "(deepseek-r1 and qwen3-thinking: the output starts inside the reasoning; "
        "qwen3: only when it opens <think>)",
    )
    serve.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="data-parallel replicas, each a whole server with its share of the CPU cores "
        "(or its own GPUs), behind a router on --host/--port",
    )
    _add_router_flags(serve, "router-")
    _add_engine_flags(serve)
    router = sub.add_parser(
        "router",
        help="route requests across radixserve (or SGLang) workers",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    router.add_argument(
        "--worker-urls",
        nargs="*",
        default=[],
        help="workers, e.g. http://127.0.0.1:30001; more can join through POST /add_worker?url=...",
    )
    router.add_argument("--host", default="127.0.0.1", help="address to listen on")
    router.add_argument("--port", type=int, default=30000, help="port to listen on")
    router.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' (forwarded to workers)",
    )
    router.add_argument(
        "--max-request-bytes", type=int, default=8 << 20, help="largest request body accepted"
    )
    router.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )
    _add_router_flags(router)
    gen = sub.add_parser(
        "generate",
        help="generate offline, in this process",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gen.add_argument("prompt", nargs="+", help="prompt(s)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--json", action="store_true", help="print the full results as JSON")
    _add_engine_flags(gen)
    _add_replay_parser(sub)
    return parser


def _add_replay_parser(sub) -> None:
    from .replay import SYNTHETIC

    replay = sub.add_parser(
        "replay",
        help="replay a request log (or synthetic traffic) through the radix cache "
        "at other sizes, eviction policies and replica counts, next to the optimum",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    replay.add_argument(
        "log", nargs="?", default=None, help="folder of `radixserve serve --log-requests DIR`"
    )
    replay.add_argument(
        "--synthetic",
        default=None,
        choices=SYNTHETIC,
        help="generate traffic of this shape instead of reading a log",
    )
    replay.add_argument("--requests", type=int, default=400, help="--synthetic: how many requests")
    replay.add_argument(
        "--cache-tokens",
        default=None,
        help="comma-separated KV pool sizes per replica, e.g. "
        "4k,16k,64k (default: the server's own; 16k for --synthetic)",
    )
    replay.add_argument(
        "--eviction",
        default=None,
        help=f"comma-separated policies from {EVICTION_POLICIES} (default: the server's own)",
    )
    replay.add_argument(
        "--dp", default=None, help="comma-separated replica counts (default: the server's own)"
    )
    replay.add_argument(
        "--router", default="cache_aware", help=f"comma-separated policies from {ROUTER_POLICIES}"
    )
    replay.add_argument(
        "--block-tokens",
        type=int,
        default=1,
        help="replay in blocks of this many tokens, "
        "named by chained hashes: about that many times faster on long logs, matches counted in "
        "whole blocks (a --log-requests-level hashes log is always in blocks of 16)",
    )
    replay.add_argument("--json", default=None, help="write the results here")
    replay.add_argument(
        "--plot", default=None, help="write a plot of hit rate against cache size here (.png)"
    )


def replay_args_from(ns: argparse.Namespace):
    from .replay import ReplayArgs, parse_tokens

    def listed(flag: str, text: str | None, convert, allowed=None) -> tuple:
        """A comma-separated flag's values; a bad one is refused naming the flag."""
        try:
            values = tuple(convert(v.strip()) for v in text.split(",") if v.strip()) if text else ()
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        bad = [v for v in values if allowed is not None and v not in allowed]
        if bad:
            raise ValueError(f"{flag}: {bad[0]!r} is not one of {allowed}")
        return values

    dp = listed("--dp", ns.dp, int)
    if any(d < 1 for d in dp) or ns.requests < 1 or ns.block_tokens < 1:
        raise ValueError("--dp, --requests and --block-tokens must be >= 1")
    return ReplayArgs(
        ns.log,
        ns.synthetic,
        ns.requests,
        listed("--cache-tokens", ns.cache_tokens, parse_tokens),
        listed("--eviction", ns.eviction, str, EVICTION_POLICIES),
        dp,
        listed("--router", ns.router, str, ROUTER_POLICIES),
        ns.block_tokens,
        ns.json,
        ns.plot,
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "replay":
            from .replay import run_replay

            return run_replay(replay_args_from(ns))
        if ns.command == "router":
            from .router.launch import run_router

            args = router_args_from(
                ns,
                worker_urls=tuple(ns.worker_urls),
                host=ns.host,
                port=ns.port,
                api_key=ns.api_key,
                max_request_bytes=ns.max_request_bytes,
            )
            return run_router(args)
        engine_args = engine_args_from(ns)
        _check_log_folder(engine_args.log_requests)
        if ns.command == "serve":
            return _serve(ns, engine_args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixserve: {exc}", file=sys.stderr)
        return 2
    return _generate(ns, engine_args)


def _check_log_folder(folder: str | None) -> None:
    """Refuse an unusable --log-requests folder before anything starts."""
    if folder is None:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--log-requests: cannot create the folder {folder!r}: {exc.strerror}"
        ) from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--log-requests: the folder {folder!r} is not writable")


def _serve(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    server_args = ServerArgs(
        ns.host,
        ns.port,
        ns.api_key,
        ns.served_model_name,
        engine_args,
        ns.max_request_bytes,
        ns.max_queued_requests,
        ns.tool_call_parser,
        ns.reasoning_parser,
    )
    if ns.dp_size < 1:
        raise ValueError("--dp-size must be >= 1")
    if ns.dp_size == 1:
        from .server.launch import launch_server

        return launch_server(server_args)
    if engine_args.nnodes > 1:
        raise ValueError(
            "--dp-size with --nnodes is not supported: start each multi-node replica on its own, "
            "behind `radixserve router`"
        )
    if engine_args.kv_events_config is not None:
        raise ValueError(
            "--kv-events-config with --dp-size is not supported (each replica needs its own "
            "endpoint): "
            "--router-kv-events gives each one its own, or start them one by one behind "
            "`radixserve router`"
        )
    from .router.launch import launch_data_parallel

    router_args = router_args_from(ns, prefix="router_", max_request_bytes=ns.max_request_bytes)
    return launch_data_parallel(server_args, ns.dp_size, router_args)


def _generate(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from .engine import Engine

    with Engine(**{k: v for k, v in vars(engine_args).items()}) as engine:
        results = engine.generate(
            list(ns.prompt), {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
        )
    for prompt, result in zip(ns.prompt, results):
        print(json.dumps(result) if ns.json else f"{prompt}{result['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
