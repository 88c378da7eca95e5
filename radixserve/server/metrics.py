"""Prometheus metrics and the dashboard's data.

The scheduler owns the cache and batch figures: the api process asks it for a
snapshot (one small control message) and exports it through a custom collector,
so nothing is shared between processes. Request latencies are measured here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..request_state import RequestState
from .tokenizer_manager import TokenizerManager

log = logging.getLogger(__name__)
P = "radixserve:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
HISTORY_POINTS = 600
TOP_PREFIXES = 10


class Metrics:
    def __init__(self, tm: TokenizerManager):
        self.tm = tm
        self.registry = CollectorRegistry()
        histogram = lambda name, doc, buckets=LATENCY_BUCKETS: Histogram(  # noqa: E731
            P + name, doc, buckets=buckets, registry=self.registry
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between output tokens",
            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.queue = histogram("queue_time_seconds", "Time from arrival to admission")
        self.adapters = AdapterFigures(self.registry)
        self.registry.register(_SchedulerCollector(self))
        self.snapshot: dict = {}
        self.history: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self.recent_ttft: deque[float] = deque(maxlen=2000)
        tm.observers.append(self.observe)

    def observe(self, state: RequestState) -> None:
        if state.ttft is not None:
            self.ttft.observe(state.ttft)
            self.recent_ttft.append(state.ttft)
        for gap in state.inter_token_latencies:
            self.itl.observe(gap)
        self.e2e.observe(time.monotonic() - state.created)
        self.queue.observe(state.queue_time)
        if state.lora_path is not None:
            self.adapters.observe(state)

    async def refresh(self) -> dict:
        """Scheduler figures for metrics and the dashboard's history (cheap counters only)."""
        self.snapshot = await self.tm.control("stats")
        self.history.append(self._point(self.snapshot))
        return self.snapshot

    async def sample_forever(self, period: float = 1.0) -> None:
        while True:
            try:
                await self.refresh()
            except (asyncio.TimeoutError, OSError) as exc:
                log.warning("metrics refresh failed: %s", exc)
            await asyncio.sleep(period)

    async def render(self) -> bytes:
        await self.refresh()
        return generate_latest(self.registry)

    @staticmethod
    def _point(s: dict) -> dict:
        return {
            "t": time.time(),
            "hit_rate": s["cache_hit_rate"],
            "recent_hit_rate": s["recent_hit_rate"],
            "cached_total": s["cached_tokens_total"],
            "computed_total": s["prompt_tokens_total"] - s["cached_tokens_total"],
            "throughput": s["gen_throughput"],
            "running": s["num_running"],
            "queued": s["num_queued"],
            "kv_running": s["running_slots"],
            "kv_cached": s["cached_slots"],
            "kv_free": s["free_slots"],
        }

    async def dashboard_data(self) -> dict:
        """The dashboard's payload; the radix-tree walk for the top prefixes runs only here,
        when someone is looking."""
        if not self.history:
            await self.refresh()
        prefixes = (await self.tm.control("top_prefixes", TOP_PREFIXES))["top_prefixes"]
        return {
            "model": self.tm.model_name,
            "now": time.time(),
            "current": self.snapshot,
            "ttft": _percentiles(self.recent_ttft),
            "history": list(self.history),
            "top_prefixes": [self._prefix_row(p) for p in prefixes],
            "adapters": self.adapters.rows(),
            "disaggregation_mode": self.tm.disaggregation_mode,
        }

    def _prefix_row(self, p: dict) -> dict:
        return {
            "tokens": p["num_tokens"],
            "hits": p["hit_count"],
            "idle_s": p["idle_seconds"],
            "locked": p["locked"],
            "saved_tokens": p["hit_count"] * p["num_tokens"],
            "tiers": p["tiers"],
            "preview": self._preview(p["tokens"]),
        }

    def _preview(self, tokens: list[int]) -> str:
        """The start and the end of a cached prefix, so siblings can be told apart."""
        if self.tm.tokenizer is None:
            return ""
        decode = lambda ids: self.tm.tokenizer.decode(ids).replace("\n", " ")  # noqa: E731
        if len(tokens) <= 40:
            return decode(tokens)
        return f"{decode(tokens[:24])} … {decode(tokens[-12:])}"


class AdapterFigures:
    """Per LoRA adapter: requests finished, prompt tokens and the cached share of them."""

    def __init__(self, registry: CollectorRegistry):
        def counter(name: str, doc: str) -> Counter:
            return Counter(P + name, doc, ["lora_name"], registry=registry)

        self.requests = counter("lora_requests", "Requests finished on a LoRA adapter")
        self.prompt = counter("lora_prompt_tokens", "Prompt tokens of an adapter's requests")
        self.cached = counter("lora_cached_tokens", "Of those, tokens read from the cache")
        self.totals: dict[str, list[int]] = {}  # name -> [requests, prompt, cached]

    def observe(self, state: RequestState) -> None:
        name = state.lora_path
        self.requests.labels(name).inc()
        self.prompt.labels(name).inc(state.prompt_tokens)
        self.cached.labels(name).inc(state.cached_tokens)
        total = self.totals.setdefault(name, [0, 0, 0])
        total[0] += 1
        total[1] += state.prompt_tokens
        total[2] += state.cached_tokens

    def rows(self) -> list[dict]:
        return [
            {"name": name, "requests": n, "prompt_tokens": p, "hit_rate": c / max(p, 1)}
            for name, (n, p, c) in sorted(self.totals.items())
        ]


def _percentiles(values) -> dict:
    data = sorted(values)
    if not data:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    pick = lambda q: data[min(int(q * len(data)), len(data) - 1)]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "count": len(data)}


class _SchedulerCollector:
    """Exports the latest scheduler snapshot as Prometheus families."""

    GAUGES = [
        (
            "cache_hit_rate",
            "Prompt tokens served from the radix cache / all prompt tokens",
            "cache_hit_rate",
        ),
        (
            "recent_cache_hit_rate",
            "Cache hit rate over the last 200 admitted requests",
            "recent_hit_rate",
        ),
        ("num_running_reqs", "Requests in the running batch", "num_running"),
        ("num_queue_reqs", "Requests waiting for admission", "num_queued"),
        ("kv_capacity_tokens", "KV pool size in tokens", "num_slots"),
        ("kv_free_tokens", "Free KV slots", "free_slots"),
        ("kv_cached_tokens", "KV slots held by the radix tree", "cached_slots"),
        ("kv_evictable_tokens", "Cached KV slots no request holds (evictable)", "evictable_slots"),
        (
            "kv_running_tokens",
            "KV slots held by running requests outside the tree",
            "running_slots",
        ),
        ("radix_tree_nodes", "Nodes of the radix tree", "radix_nodes"),
        (
            "kv_transfer_queue_reqs",
            "Requests waiting for their KV to move (disaggregation)",
            "kv_transfer_waiting",
        ),
        ("gen_throughput", "Generated tokens per second (last 10 s)", "gen_throughput"),
    ]
    COUNTERS = [
        ("prompt_tokens", "Prompt tokens of admitted requests", "prompt_tokens_total"),
        ("cached_tokens", "Prompt tokens served from the radix cache", "cached_tokens_total"),
        ("generation_tokens", "Generated tokens", "generation_tokens_total"),
        ("evicted_tokens", "Tokens evicted from the radix cache", "evicted_tokens_total"),
        ("retractions", "Requests retracted for lack of KV memory", "retractions_total"),
        (
            "jump_forward_tokens",
            "Output tokens a grammar forced, added without decode steps",
            "jump_forward_tokens_total",
        ),
        ("aborted_requests", "Aborted requests", "aborted_total"),
        (
            "spec_verify_steps",
            "Request-steps that verified draft tokens (speculative decoding)",
            "spec_verify_steps_total",
        ),
        ("spec_draft_tokens", "Draft tokens verified", "spec_draft_tokens_total"),
        ("spec_accepted_tokens", "Draft tokens accepted", "spec_accepted_tokens_total"),
        ("kv_transfers", "Prompts whose KV moved (disaggregation)", "kv_transfers_total"),
        (
            "kv_transfer_failures",
            "KV transfers that failed or timed out (disaggregation)",
            "kv_transfer_failures_total",
        ),
        ("kv_transfer_bytes", "KV bytes a prefill server wrote", "kv_transfer_bytes_total"),
        (
            "kv_transfer_seconds",
            "Seconds of a prefill server's transfers, prompt end to written",
            "kv_transfer_seconds_total",
        ),
        (
            "kv_received_tokens",
            "Prompt tokens whose KV a decode server received",
            "kv_received_tokens_total",
        ),
    ]

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.snapshot
        if not s:
            return
        for name, doc, key in self.GAUGES:
            yield GaugeMetricFamily(P + name, doc, value=s[key])
        used = s["num_slots"] - s["free_slots"]
        yield GaugeMetricFamily(
            P + "token_usage", "Used share of the KV pool", value=used / max(s["num_slots"], 1)
        )
        for name, doc, key in self.COUNTERS:
            yield CounterMetricFamily(P + name, doc, value=s[key])
        computed = s["prompt_tokens_total"] - s["cached_tokens_total"]
        computed -= s["kv_received_tokens_total"]
        yield CounterMetricFamily(
            P + "computed_prompt_tokens",
            "Prompt tokens computed (not cached, not received from a prefill server)",
            value=computed,
        )
        if s["spec_verify_steps_total"]:
            yield GaugeMetricFamily(
                P + "spec_accept_length",
                "Tokens per verify step: accepted drafts + 1",
                value=1 + s["spec_accepted_tokens_total"] / s["spec_verify_steps_total"],
            )
        yield from _estimate_families(s)
        yield from _hicache_families(s.get("hicache") or {})
        yield from _hybrid_families(s.get("hybrid_memory") or {})
        yield from _hybrid_families(s.get("images") or {})
        family = CounterMetricFamily(
            P + "requests", "Finished requests by finish reason", labels=["finish_reason"]
        )
        for reason, count in sorted(s["requests_finished"].items()):
            family.add_metric([reason], count)
        yield family


HYBRID = {  # hybrid_memory key -> help (a name ending _total is a counter)
    "state_snapshots": "State snapshots held in the radix tree (hybrid models)",
    "state_snapshot_slots_free": "Free state snapshot slots (hybrid models)",
    "state_resumed_tokens_total": "Prompt tokens resumed from state snapshots (hybrid models)",
    "window_kv_capacity_tokens": "Tokens the window layers' own KV pool holds",
    "window_kv_free_tokens": "Free tokens of the window layers' own KV pool",
    "image_tokens_total": "Prompt tokens of images admitted (vision-language models)",
    "image_tokens_cached_total": "Image tokens read from the radix cache",
    "images_encoded_total": "Images run through the vision tower",
    "encoder_cache_hits_total": "Images whose features came from the encoder cache",
    "encoder_seconds_total": "Seconds spent in the vision tower",
    "encoder_cache_bytes": "Bytes of image features held by the encoder cache",
}


def _hybrid_families(h: dict):
    """A hybrid model's state snapshots and window layers' KV, and a vision-language model's
    images, where the model has them."""
    for key, value in h.items():
        if key.endswith("_total"):
            yield CounterMetricFamily(P + key.removesuffix("_total"), HYBRID[key], value=value)
        else:
            yield GaugeMetricFamily(P + key, HYBRID[key], value=value)


def _estimate_families(s: dict):
    """What the recent hit rate would have been with the KV memory scaled (`mem.shadow`)."""
    if not s.get("cache_estimates"):
        return
    family = GaugeMetricFamily(
        P + "cache_hit_rate_estimate",
        "Recent cache hit rate estimated for the KV memory scaled by `memory` (shadow caches)",
        labels=["memory"],
    )
    for memory, value in s["cache_estimates"].items():
        family.add_metric([memory], value)
    yield family
    yield CounterMetricFamily(
        P + "cache_estimate_seconds",
        "Scheduler time spent on those estimates",
        value=s["cache_estimate_seconds"],
    )


def _hicache_families(h: dict):
    """The hierarchical cache's figures per tier (host memory, storage), when it is on."""
    if not h:
        return
    hits = CounterMetricFamily(
        P + "hicache_hit_tokens",
        "Prompt tokens found in a tier below the device pool",
        labels=["tier"],
    )
    hits.add_metric(["host"], h["host_hit_tokens"])
    hits.add_metric(["storage"], h["storage_hit_tokens"])
    yield hits
    for name, doc, key in [
        ("hicache_loaded_tokens", "Tokens loaded back into the device pool", "loaded_tokens"),
        ("hicache_load_seconds", "Time spent loading blocks back", "load_seconds"),
        ("hicache_loaded_bytes", "Bytes copied into the device pool", "loaded_bytes"),
        (
            "hicache_backed_up_bytes",
            "Bytes copied from the device pool to the host tier",
            "backed_up_bytes",
        ),
        ("hicache_storage_written_blocks", "Blocks written to storage", "storage_written_blocks"),
        (
            "hicache_storage_skipped_blocks",
            "Blocks not written to storage (disk full or writer behind)",
            "storage_skipped_blocks",
        ),
        (
            "hicache_storage_bad_blocks",
            "Stored blocks found corrupt, truncated or foreign (recomputed)",
            "storage_bad_blocks",
        ),
        ("hicache_load_timeouts", "Loads cut short by the timeout", "load_timeouts"),
    ]:
        yield CounterMetricFamily(P + name, doc, value=h[key])
    yield GaugeMetricFamily(
        P + "hicache_host_used_tokens", "Tokens held by the host tier", value=h["host_used_tokens"]
    )
    yield GaugeMetricFamily(
        P + "hicache_host_capacity_tokens",
        "Host tier size in tokens",
        value=h["host_capacity_tokens"],
    )
