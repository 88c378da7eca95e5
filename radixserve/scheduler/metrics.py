"""The scheduler's figures: counters, recent hit rates and throughput, the step log lines,
the request log and the live what-if cache estimates."""

from __future__ import annotations

import logging
import time
from collections import deque

from ..config import EngineArgs
from ..mem.shadow import LiveEstimates
from ..messages import ForwardMode, SchedulerStats
from ..request_log import RequestLog, ServerRecord
from ..worker_info import WorkerInfo
from .batch import Step
from .req import Req

log = logging.getLogger(__name__)

DECODE_LOG_INTERVAL = 40  # decode steps between two decode log lines
THROUGHPUT_WINDOW_S = 10.0


class SchedulerMetrics:
    def __init__(self, args: EngineArgs, num_slots: int, info: WorkerInfo, cache_disabled: bool):
        self.args, self.num_slots = args, num_slots
        self.cache_disabled = cache_disabled
        self.stats = SchedulerStats(num_slots=num_slots)
        self.request_log = self._open_request_log(args, num_slots, info)
        self.estimates = self._live_estimates()
        self._recent_admissions: deque[tuple[int, int]] = deque(maxlen=200)
        self._recent_tokens: deque[tuple[float, int]] = deque(maxlen=512)
        self._queue_times: deque[float] = deque(maxlen=512)

    @staticmethod
    def _open_request_log(args: EngineArgs, num_slots: int, info: WorkerInfo) -> RequestLog | None:
        if args.log_requests is None:
            return None
        states = info.state_pool
        record = ServerRecord(
            num_slots,
            info.page_size,
            args.radix_eviction_policy,
            args.log_requests_level,
            time.time(),
            chunk_tokens=args.chunked_prefill_size,
            state_snapshots=states.snapshots if states else 0,
            state_interval=states.interval if states else 0,
            state_layer_tokens=states.layer_tokens if states else 0,
        )
        return RequestLog(args.log_requests, args.log_requests_level, record)

    def _live_estimates(self) -> LiveEstimates | None:
        if self.args.disable_cache_estimates or self.cache_disabled:
            return None
        return LiveEstimates(self.num_slots, self.args.radix_eviction_policy)

    def reset_cache_figures(self) -> None:
        """After a flush: the estimates and recent hit rate start again."""
        self.estimates = self._live_estimates()
        self._recent_admissions.clear()

    # ---- events ----------------------------------------------------------------
    def admitted(self, req: Req, cached: int) -> None:
        """The first admission of a request (not a re-admission after retraction)."""
        req.queue_time = time.monotonic() - req.arrival
        self._queue_times.append(req.queue_time)
        self.stats.prompt_tokens_total += len(req.input_ids)
        self.stats.cached_tokens_total += cached
        self._recent_admissions.append((len(req.input_ids), cached))
        if req.images:
            counts = self.stats.images
            tokens = sum(im.tokens for im in req.images)
            from_cache = sum(max(0, min(cached, im.end) - im.offset) for im in req.images)
            counts["image_tokens_total"] = counts.get("image_tokens_total", 0) + tokens
            counts["image_tokens_cached_total"] = (
                counts.get("image_tokens_cached_total", 0) + from_cache
            )
        if self.estimates is not None:
            self.estimates.admit(req.rid, req.input_ids, req.max_prefix_len())

    def finished(self, req: Req) -> None:
        kind = req.finish_reason.kind
        self.stats.requests_finished[kind] = self.stats.requests_finished.get(kind, 0) + 1
        if self.request_log is not None:
            self.request_log.write(req, kind)
        if self.estimates is not None and req.admitted:
            self.estimates.finish(req.rid, req.input_ids + req.output_ids[:-1])

    def generated(self, tokens: int) -> None:
        self.stats.generation_tokens_total += tokens
        self._recent_tokens.append((time.monotonic(), tokens))

    def log_step(self, step: Step, usage: float, running: int, queued: int) -> None:
        self.stats.forward_steps += 1
        self.stats.peak_running = max(self.stats.peak_running, running)
        if step.num_prefill:
            new = sum(step.batch.extend_lens[: step.num_prefill])
            cached = step.reused_tokens
            log.info(
                "prefill: %d reqs, %d new tokens, %d cached tokens (hit %.0f%%), token usage "
                "%.2f, running %d, queued %d",
                step.num_prefill,
                new,
                cached,
                100 * cached / max(new + cached, 1),
                usage,
                running,
                queued,
            )
        if step.mode != ForwardMode.EXTEND and self.stats.forward_steps % DECODE_LOG_INTERVAL == 0:
            log.info(
                "decode: %d reqs, token usage %.2f, gen throughput %.1f tok/s, queued %d",
                len(step.reqs),
                usage,
                self.throughput(),
                queued,
            )

    # ---- reading -----------------------------------------------------------------
    def snapshot(self) -> SchedulerStats:
        """The counters with the recent figures filled in (the memory ones are the caller's)."""
        s = self.stats
        prompt = sum(p for p, _ in self._recent_admissions)
        cached = sum(c for _, c in self._recent_admissions)
        s.recent_hit_rate = cached / prompt if prompt else 0.0
        if self.estimates is not None:
            s.cache_estimates = self.estimates.estimates(s.recent_hit_rate, prompt)
            s.cache_estimate_seconds = self.estimates.seconds
        s.gen_throughput = self.throughput()
        s.queue_times = list(self._queue_times)
        self._queue_times.clear()
        return s

    def throughput(self) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent_tokens if now - t <= THROUGHPUT_WINDOW_S]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0][0], 1e-6)
        return sum(n for _, n in recent) / span
