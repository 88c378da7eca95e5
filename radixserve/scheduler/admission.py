"""Admission: which waiting requests join a step, and how much of each prompt.

Each step continues the chunked prompts first, then admits waiting requests in queue order
(priority first when enabled, then the schedule policy) under three limits: the step's prompt
token budget, the admit limit (a request joins only if the prompt tokens admitted stay within
it, or it is the first), and memory (free + evictable >= its pages + the decode growth
reserved for the running requests); with LoRA, a step mixes at most --max-loras-per-batch
adapters. A request whose uncached part starts like a prompt being
computed now waits for that prefix to reach the tree (in-batch sharing)."""

from __future__ import annotations

import time
from typing import Iterator

from ..config import EngineArgs
from ..mem.radix_cache import RadixCache
from .decode import OutOfMemory, Retraction
from .kv_manager import KVManager
from .metrics import SchedulerMetrics
from .policy import order_waiting
from .queues import RequestQueues
from .req import Req

IN_BATCH_SHARE_MIN = 32  # shared tokens that make a request wait for a prefix being computed
SMALL_BATCH_SHARE = 8  # the batching window holds while fewer than 1/8 of the rows run


class Admission:
    def __init__(
        self,
        args: EngineArgs,
        device: str,
        kv: KVManager,
        retraction: Retraction,
        metrics: SchedulerMetrics,
        queues: RequestQueues,
        max_loras_per_batch: int | None = None,
    ):
        self.args, self.kv, self.retraction, self.metrics = args, kv, retraction, metrics
        self.max_loras = max_loras_per_batch
        self.queues = queues
        self.prefill_budget = args.prefill_budget(device)
        self.admit_limit = args.prefill_admit_limit(device)
        self.window_s = args.batch_wait_ms / 1000
        self.small_batch = max(1, kv.rows.num_rows // SMALL_BATCH_SHARE)

    def prepare(self, batch_started: bool) -> tuple[list[Req], list[int], int]:
        """Continue chunked prompts, then admit waiting requests; allocates their slots.
        Returns the requests, their chunk lengths and the prompt tokens they reuse."""
        budget = self.prefill_budget
        reqs, lens, reused = [], [], 0
        prefilling = [r for r in self.queues.running if r.is_prefilling]
        for req in prefilling:
            n = self._chunk(
                req, len(req.kv_slots), min(req.pending, self.args.chunked_prefill_size, budget)
            )
            if n <= 0 or not self.kv.alloc(req, n):
                break
            reqs.append(req), lens.append(n)
            budget -= n
        if self.window_wait_s() > 0:
            return reqs, lens, reused
        for req, n in self._admit(budget, batch_started or bool(reqs), prefilling):
            reqs.append(req), lens.append(n)
            reused += req.cached_len
        return reqs, lens, reused

    def window_wait_s(self) -> float:
        """With --batch-wait-ms: while the running batch is small and the queue has room to
        grow, admission waits until the oldest waiting request has waited that long, so that
        arrivals close together start together. Returns the seconds left (0: admit now)."""
        queued, running = self.queues.num_waiting(), self.queues.num_running()
        if self.window_s <= 0 or not queued or running >= self.small_batch:
            return 0.0
        if queued + running >= self.kv.rows.num_rows:
            return 0.0
        oldest = min(r.arrival for r in self.queues.waiting)
        return max(0.0, oldest + self.window_s - time.monotonic())

    def queue_order(self) -> list[Req]:
        """The schedule policy's order; with priority scheduling, higher priority first (a
        stable sort, so the policy still orders requests of one level)."""
        ordered = order_waiting(
            self.args.schedule_policy, self.queues.waiting, self.kv.cache, self.kv.match_length
        )
        if self.args.enable_priority_scheduling:
            ordered.sort(key=lambda r: -r.priority)
        return ordered

    def _admit(self, budget: int, batch_started: bool, prefilling: list[Req]) -> Iterator:
        if not self.queues.num_waiting():
            return
        shared = RadixCache(self.kv.page_size)  # prompt parts computed now: later sharers wait
        for req in prefilling:
            self._mark_shared(shared, req, req.fill_ids[req.cached_len :])
        reserved = self.retraction.reserved_decode_slots()
        ratio = self.retraction.new_token_ratio
        admitted = (
            0  # prompt tokens of the requests this step admits (continued chunks not counted)
        )
        adapters = {r.lora for r in self.queues.running if r.lora is not None}
        for req in self.queue_order():
            if budget <= 0 or self.kv.rows.available() == 0:
                break
            if self._over_adapter_limit(req, adapters):
                continue
            slots, node = self.kv.match(req)
            uncached = req.fill_ids[len(slots) :]
            if self._share_later(shared, req, uncached, batch_started):
                continue
            n = self._chunk(
                req, len(slots), min(len(uncached), self.args.chunked_prefill_size, budget)
            )
            if admitted and admitted + n > self.admit_limit:
                break
            growth = req.remaining_new_tokens * ratio if n == len(uncached) else 0
            self.kv.cache.inc_lock_ref(node)
            need = self.kv.allocator.pages_needed(len(slots), n) * self.kv.page_size
            if not self.kv.fits(need + reserved + growth) and (
                batch_started or self.queues.num_running()
            ):
                self.kv.cache.dec_lock_ref(node)
                break
            self._start(req, slots, node)
            if not self.kv.alloc(req, n):
                # alone, it would be retracted and admitted forever
                if self.queues.num_running() == 1:
                    raise OutOfMemory(req, self.kv.allocator.available())
                self.retraction.retract(req)
                break
            self._mark_shared(shared, req, uncached)
            reserved += growth
            budget -= n
            admitted += n
            batch_started = True
            if req.lora is not None:
                adapters.add(req.lora)
            yield req, n

    def _chunk(self, req: Req, start: int, n: int) -> int:
        """`n`, or less: a request leaving a cached path where no state snapshot (or window
        KV) is ends its chunk from `start` there, so that one is kept there for the next
        request branching off there; a hybrid model's chunks also end at multiples of the
        snapshot interval, where one is kept while a slot is free. Where images are computed
        whole, no chunk ends inside one."""
        if req.branch_at is not None and start < req.branch_at:
            n = min(n, req.branch_at - start)
        if self.kv.snapshots is not None and (interval := self.kv.snapshots.interval):
            n = min(n, (start // interval + 1) * interval - start)
        if req.whole_images:  # an image inside the chunk's end: before it, or all of it
            edge = req.image_edge(start + n, forward=False)
            n = edge - start if edge > start else req.image_edge(start + n, forward=True) - start
        return n

    def _over_adapter_limit(self, req: Req, adapters: set[str]) -> bool:
        """A request on an adapter the batch lacks waits while the batch has as many adapters
        as the pool has slots."""
        return (
            req.lora is not None
            and req.lora not in adapters
            and len(adapters) >= (self.max_loras or 0)
        )

    def _start(self, req: Req, slots: list[int], node) -> None:
        self.queues.admit(req)
        self.kv.attach(req, slots, node)
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = len(slots)
            self.metrics.admitted(req, len(slots))

    def _mark_shared(self, shared: RadixCache, req: Req, tokens: list[int]) -> None:
        aligned = len(tokens) - len(tokens) % self.kv.page_size
        shared.insert(tokens[:aligned], [0] * aligned, req.cache_salt)

    def _share_later(
        self, shared: RadixCache, req: Req, uncached: list[int], batch_started: bool
    ) -> bool:
        """Defer a request whose uncached part starts like one being computed (admitted in this
        batch, or a chunked prompt still in progress): once that is cached, it finds the prefix
        there instead of computing it twice."""
        if self.kv.cache.disable or not batch_started:
            return False
        matched = len(shared.match_prefix(uncached, req.cache_salt)[0])
        return matched >= min(IN_BATCH_SHARE_MIN, len(uncached) - 1) and matched > 0
