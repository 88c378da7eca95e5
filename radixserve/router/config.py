"""`radixserve router`'s options (SGLang's router names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import (
    LOG_LEVELS,
    ROUTER_POLICIES,
    EngineArgs,
    check_choices,
    option,
    option_default,
    refuse_problems,
)

DEFAULT_BOOTSTRAP_PORT = option_default(
    EngineArgs.__dataclass_fields__["disaggregation_bootstrap_port"]
)


@dataclass(frozen=True)
class RouterArgs:
    """`radixserve router`: the workers, the policy and its thresholds (SGLang's router names
    and meanings), health checks, the circuit breaker and retries. Under `serve --dp-size`
    the `tuning` options are the `--router-` flags; the others come from the server's."""

    worker_urls: tuple[str, ...] = option(
        (),
        "workers, e.g. http://127.0.0.1:30001; more can join through POST /add_worker?url=...",
    )
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "port to listen on")
    policy: str = option(
        "cache_aware",
        "cache_aware: the worker holding the longest prefix of the prompt while load is "
        "balanced; round_robin; random; power_of_two: the idler of two drawn at random",
        ROUTER_POLICIES,
        tuning=True,
    )
    cache_threshold: float = option(
        0.3,
        "cache_aware: smallest matched share of a prompt that sends it to the matching worker "
        "(else to the worker holding least)",
        tuning=True,
    )
    balance_abs_threshold: int = option(
        8,  # SGLang's 64 suits GPU batches of hundreds; CPU replicas run ~10
        "cache_aware: load is out of balance when the busiest worker has more than this many "
        "requests in flight over the idlest...",
        tuning=True,
    )
    balance_rel_threshold: float = option(
        1.5, "...and more than this many times as many", tuning=True
    )
    max_tree_size: int = option(
        1 << 26, "cache_aware: characters of prompts remembered per worker", tuning=True
    )
    eviction_interval_secs: float = option(
        120.0, "cache_aware: seconds between evictions to --max-tree-size", tuning=True
    )
    health_check_interval_secs: float = option(
        2.0, "seconds between health checks of each worker", tuning=True
    )
    health_check_timeout_secs: float = option(5.0, "timeout of one health check", tuning=True)
    health_failure_threshold: int = option(
        2,
        "failed checks in a row that mark a worker dead (a refused connection marks it at once)",
        tuning=True,
    )
    cb_failure_threshold: int = option(
        3, "failed requests in a row that open a worker's circuit", tuning=True
    )
    cb_success_threshold: int = option(1, "successes that close a half-open circuit", tuning=True)
    cb_timeout_duration_secs: float = option(
        10.0, "seconds an open circuit keeps a worker out", tuning=True
    )
    retry_max_retries: int = option(
        2, "other workers tried when a request fails before its first byte", tuning=True
    )
    request_timeout_secs: float = option(
        1800.0, "longest wait for a worker's response", tuning=True
    )
    api_key: str | None = option(
        None, "require 'Authorization: Bearer <key>' (forwarded to workers)"
    )
    max_request_bytes: int = option(8 << 20, "largest request body accepted")
    log_level: str = option("info", "log level", LOG_LEVELS)
    kv_events: bool = option(
        False,
        "cache_aware on the workers' own KV events (workers started with --kv-events-config; "
        "found through their /get_server_info) instead of the approximate tree",
        tuning=True,
    )
    tokenizer_path: str | None = option(
        None, "with --kv-events: the workers' tokenizer (default: the bundled model's)", tuning=True
    )
    pd_disaggregation: bool = option(
        False,
        "prefill/decode disaggregation: each generate or completion request goes to a prefill "
        "server (--prefill, cache-aware) and a decode server (--decode, the less loaded of two)",
    )
    prefill: tuple[str, ...] = option(
        (),
        "with --pd-disaggregation: a prefill server's URL and its --disaggregation-bootstrap-port "
        f"(default {DEFAULT_BOOTSTRAP_PORT}); repeat the flag for each server",
        repeat=True,
        metavar="URL [BOOTSTRAP_PORT]",
    )
    decode: tuple[str, ...] = option(
        (),
        "with --pd-disaggregation: a decode server's URL; repeat the flag for each server",
        repeat=True,
        metavar="URL",
    )

    def __post_init__(self) -> None:
        refuse_problems("router", self._problems())

    def _problems(self):
        yield from check_choices(self)
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
        timeouts = (
            self.health_check_interval_secs,
            self.health_check_timeout_secs,
            self.cb_timeout_duration_secs,
        )
        if min(timeouts) <= 0:
            yield "health check interval and timeout and cb_timeout_duration_secs must be positive"
        thresholds = (
            self.health_failure_threshold,
            self.cb_failure_threshold,
            self.cb_success_threshold,
        )
        if min(thresholds) < 1:
            yield (
                "health_failure_threshold, cb_failure_threshold and cb_success_threshold "
                "must be >= 1"
            )
        if self.retry_max_retries < 0:
            yield "retry_max_retries must be >= 0"
        if self.kv_events and self.policy != "cache_aware":
            yield "kv_events needs the cache_aware policy"
        yield from self._pd_problems()

    def _pd_problems(self):
        if not self.pd_disaggregation:
            if self.prefill or self.decode:
                yield "prefill and decode servers need --pd-disaggregation"
            return
        if not self.prefill or not self.decode:
            yield "pd_disaggregation needs at least one --prefill and one --decode server"
        if self.worker_urls:
            yield "pd_disaggregation takes --prefill and --decode servers, not worker_urls"
        servers = []
        for item in self.prefill:
            try:
                servers.append(parse_prefill(item))
            except ValueError as exc:
                yield str(exc)
        for url, port in servers:
            if not 0 < port <= 65535:
                yield f"prefill {url}: the bootstrap port must be in [1, 65535]"
        for url in [url for url, _ in servers] + list(self.decode):
            if (problem := worker_url_problem(url)) is not None:
                yield problem

    def prefill_servers(self) -> list[tuple[str, int]]:
        """(URL, bootstrap port) of each --prefill server."""
        return [parse_prefill(item) for item in self.prefill]


def parse_prefill(item: str) -> tuple[str, int]:
    """`URL` or `URL BOOTSTRAP_PORT`."""
    words = item.split()
    if len(words) not in (1, 2) or (len(words) == 2 and not words[1].isdigit()):
        raise ValueError(f"prefill {item!r}: expected URL [BOOTSTRAP_PORT]")
    return words[0].rstrip("/"), int(words[1]) if len(words) == 2 else DEFAULT_BOOTSTRAP_PORT


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
