"""The scheduler's part in prefill/decode disaggregation (`radixserve.disagg`).

- `PrefillStage` (`--disaggregation-mode prefill`): a request ends after its first token;
  instead of being released, its KV stays locked while the transfer thread writes it to the
  decode server, and the request's answer goes out once the transfer is done (or failed: 503).
- `DecodeStage` (`--disaggregation-mode decode`): a request skips admission. Its prompt is
  matched in the radix tree, slots are reserved for the rest and the prefill server is told
  where they are; once the KV has arrived, the prompt enters the tree, the first token is
  appended and the request joins the running batch. One that waits past the timeout fails
  with a 503 and gives its slots back at once: a late write lands in its landing buffer,
  which `DecodeTransfers` keeps for one more timeout.
"""

from __future__ import annotations

import time

import zmq

from ..disagg.prefill import TransferJob
from ..messages import FinishReason, KVArrived, SchedulerStats
from .kv_manager import KVManager
from .metrics import SchedulerMetrics
from .queues import RequestQueues
from .req import Req
from .results import ResultProcessor


def unavailable(message: str) -> FinishReason:
    return FinishReason("abort", message=message, unavailable=True)


class PrefillStage:
    def __init__(self, kv: KVManager, results: ResultProcessor, stats: SchedulerStats, transfers):
        self.kv, self.results, self.stats, self.transfers = kv, results, stats, transfers
        self.timeout = transfers.timeout
        self.handed: dict[int, Req] = {}  # room -> the request whose KV is being sent

    def hand_over(self, req: Req) -> bool:
        """Take a finished request whose KV goes to a decode server (False: not one)."""
        if req.bootstrap is None or req.finish_reason.kind == "abort":
            return False
        self.kv.cache_prefix(req)
        prompt = len(req.input_ids)
        first = req.output_ids[0] if req.output_ids else -1
        deadline = time.monotonic() + self.timeout
        job = TransferJob(
            req.bootstrap.room, req.kv_slots[:prompt], first, req.cached_tokens, deadline, req.row
        )
        self.handed[req.bootstrap.room] = req
        self.transfers.submit(job)
        return True

    def poll(self) -> None:
        for done in self.transfers.finished():
            req = self.handed.pop(done.room)
            self.stats.kv_transfers_total += 1
            self.stats.kv_transfer_bytes_total += done.bytes
            self.stats.kv_transfer_seconds_total += done.seconds
            if done.error is not None:
                self.stats.kv_transfer_failures_total += 1
                req.finish_reason = unavailable(done.error)
            self.kv.release(req)
            self.results.emit(req)

    def busy(self) -> bool:
        return bool(self.handed)

    def held(self) -> list[Req]:
        return list(self.handed.values())

    def requests(self) -> list[Req]:
        """The requests this stage holds (none of them in the queue or the batch)."""
        return self.held()

    def waiting(self) -> int:
        return len(self.handed)


class DecodeStage:
    def __init__(
        self,
        kv: KVManager,
        results: ResultProcessor,
        metrics: SchedulerMetrics,
        queues: RequestQueues,
        transfers,
    ):
        self.kv, self.results, self.metrics, self.queues = kv, results, metrics, queues
        self.stats = metrics.stats
        self.transfers, self.timeout = transfers, transfers.timeout
        self.queued: list[Req] = []  # not yet reserved
        self.awaiting: dict[int, tuple[Req, float]] = {}  # room -> (request, deadline)

    def add(self, req: Req) -> None:
        self.queued.append(req)

    def poll(self) -> None:
        self._reserve()
        for arrived in self.transfers.arrivals():
            self._receive(arrived)
        self._expire(time.monotonic())

    def abort(self, rids: set[str]) -> list[Req]:
        """Take the aborted requests out; returns them (to be emitted)."""
        gone = [r for r in self.queued if r.rid in rids]
        for req in gone:
            self.queued.remove(req)
        for room, (req, _) in list(self.awaiting.items()):
            if req.rid in rids:
                del self.awaiting[room]
                self._give_up(req, room)
                gone.append(req)
        return gone

    def busy(self) -> bool:
        return bool(self.queued or self.awaiting) or self.transfers.busy()

    def held(self) -> list[Req]:
        return [req for req, _ in self.awaiting.values()]

    def requests(self) -> list[Req]:
        """The requests this stage holds (none of them in the queue or the batch)."""
        return self.queued + self.held()

    def waiting(self) -> int:
        return len(self.queued) + len(self.awaiting)

    # ---- steps -------------------------------------------------------------------
    def _reserve(self) -> None:
        """Reserve slots for queued prompts, first come first served, while they fit."""
        while self.queued and self.kv.rows.available():
            req = self.queued[0]
            slots, node = self.kv.match(req)
            self.kv.cache.inc_lock_ref(node)
            self.kv.attach(req, slots, node)
            if not self.kv.alloc(req, len(req.input_ids) - len(slots)):
                self.kv.drop(req)
                req.row, req.node, req.kv_slots, req.cached_len = None, None, [], 0
                if not self.queues.num_running() and not self.awaiting:
                    self.queued.pop(0)
                    self._end(req, unavailable("the prompt does not fit in this server's KV pool"))
                return
            self.queued.pop(0)
            req.admitted = True
            self.metrics.admitted(req, len(slots))
            room = req.bootstrap.room
            self.awaiting[room] = (req, time.monotonic() + self.timeout)
            start = len(slots)
            try:
                prompt, slots = len(req.input_ids), req.kv_slots[start:]
                self.transfers.ask(req.bootstrap, prompt, start, slots, req.row)
            except (OSError, ValueError, zmq.ZMQError) as exc:
                del self.awaiting[room]
                self._give_up(req, room)
                self._end(req, unavailable(f"cannot reach the prefill server: {exc}"))

    def _receive(self, arrived: KVArrived) -> None:
        entry = self.awaiting.pop(arrived.room, None)
        if entry is None:  # not a room of this server's
            return
        req = entry[0]
        if arrived.error is not None:
            self.stats.kv_transfer_failures_total += 1
            self._give_up(req, arrived.room)
            self._end(req, unavailable(f"prefill server: {arrived.error}"))
            return
        try:
            self.transfers.land(arrived)
        except ValueError as exc:
            self.stats.kv_transfer_failures_total += 1
            self._give_up(req, arrived.room)
            self._end(req, unavailable(f"the prefill server's state: {exc}"))
            return
        self.stats.kv_transfers_total += 1
        self.stats.kv_received_tokens_total += len(req.input_ids) - req.cached_len
        req.cached_tokens = max(arrived.cached_tokens, req.cached_len)
        if arrived.first_token < 0:
            req.finish_reason = FinishReason("length", length=0)
        else:
            self.results.append_token(req, arrived.first_token)
            self.metrics.generated(1)
        self.kv.cache_prefix(req)
        self.results.emit(req)
        if req.finished:
            self.kv.release(req)
        else:
            self.queues.join(req)

    def _expire(self, now: float) -> None:
        for room, (req, deadline) in list(self.awaiting.items()):
            if now > deadline:
                del self.awaiting[room]
                self.stats.kv_transfer_failures_total += 1
                self._give_up(req, room)
                message = f"the prompt's KV did not arrive within {self.timeout:g} s"
                self._end(req, unavailable(message))

    def _give_up(self, req: Req, room: int) -> None:
        """Free what a waiting request holds; its landing buffer outlives it (a late write)."""
        self.kv.drop(req)
        self.transfers.abandon(room)

    def _end(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        self.results.emit(req)
