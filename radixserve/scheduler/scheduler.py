"""The scheduler: one step at a time, it asks its parts for the step's requests, runs the
forward and hands the results back.

- `admission`: which waiting requests join and how much of each prompt (priorities, the
  batching window, in-batch sharing);
- `decode`: the decoding requests' next slots, drafts, and retraction when memory is short;
- `kv_manager`: the allocator, request rows, radix tree and its tiers;
- `batch`: the step's `ForwardBatch`;
- `results`: tokens, logprobs, stops, jump-forward and the outputs;
- `metrics`: counters, hit rates, throughput, the request log.

It talks to the model only through an `Executor`, so it runs (and is tested) without one."""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..config import EngineArgs
from ..constrained import GrammarBackend
from ..messages import FinishReason, ForwardMode, GenerateReq, ReqOutput, SchedulerStats
from .adapters import AdapterTable
from .admission import Admission
from .batch import SamplingContext, Step, build_batch, decode_lens, decode_mode
from .decode import DecodePlanner, OutOfMemory, Retraction
from .disagg import DecodeStage, PrefillStage
from .draft_model import DraftExecutor, ModelDrafter
from .executor import Executor
from .intake import Intake
from .kv_manager import KVManager
from .metrics import SchedulerMetrics
from .queues import RequestQueues
from .req import Req
from .results import ResultProcessor
from .speculative import NgramDrafter

log = logging.getLogger(__name__)

__all__ = ["Executor", "Scheduler"]
TRANSFER_POLL_S = 0.002  # how often the loop looks for KV transfers done, while some run


class Scheduler:
    def __init__(
        self,
        args: EngineArgs,
        executor: Executor,
        decode_tail: Callable[[list[int]], str] | None = None,
        extra_eos_ids: tuple[int, ...] = (),
        grammars: GrammarBackend | None = None,
        draft_executor: DraftExecutor | None = None,
        transfers=None,
    ):
        """`transfers`: with --disaggregation-mode, that side's `radixserve.disagg` transfers."""
        info = executor.info
        self.args, self.executor, self.info, self.grammars = args, executor, info, grammars
        # an id outside the vocabulary (a config's default left in place) can never be sampled
        model_eos = [t for t in info.eos_token_ids if 0 <= t < info.vocab_size]
        eos_ids = frozenset(model_eos) | frozenset(
            t for t in extra_eos_ids if 0 <= t < info.vocab_size
        )
        fallback_id = min(model_eos or eos_ids or {0})  # when every token is forbidden
        self.sampling = SamplingContext(eos_ids, fallback_id, grammars)
        self.queues = RequestQueues()
        self.pending_aborts: set[str] = set()
        self.kv = KVManager(args, executor)
        self.adapters = AdapterTable(args, executor)
        num_slots, cache_off = self.kv.allocator.num_slots, self.kv.cache.disable
        self.metrics = SchedulerMetrics(args, num_slots, info, cache_off)
        self.stats: SchedulerStats = self.metrics.stats
        self.retraction = Retraction(args, self.kv, self.queues, self.stats)
        ngram = args.speculative_algorithm == "ngram"
        self.drafter = NgramDrafter(args.speculative_num_draft_tokens) if ngram else None
        self.model_drafter = ModelDrafter(draft_executor) if draft_executor is not None else None
        self.decode = DecodePlanner(
            args, self.kv, self.retraction, grammars, self.drafter, self.model_drafter
        )
        self.admission = Admission(
            args,
            info.device,
            self.kv,
            self.retraction,
            self.metrics,
            self.queues,
            self.adapters.max_per_batch,
        )
        self.results = ResultProcessor(args, self.kv, self.metrics, eos_ids, decode_tail, grammars)
        self.prefill_stage = self.decode_stage = None
        if args.disaggregation_mode == "prefill":
            self.prefill_stage = PrefillStage(self.kv, self.results, self.stats, transfers)
        elif args.disaggregation_mode == "decode":
            self.decode_stage = DecodeStage(
                self.kv, self.results, self.metrics, self.queues, transfers
            )
        speculative = self.drafter is not None or self.model_drafter is not None
        first_token_only = self.prefill_stage is not None
        self.intake = Intake(
            info, num_slots, self.adapters, grammars, speculative, first_token_only
        )
        self.paused = False  # /pause_generation: no step runs until /continue_generation
        self.released: frozenset[str] = frozenset()  # memory given back: no step runs either

    # ---- requests in -----------------------------------------------------
    def add_request(self, msg: GenerateReq) -> None:
        """Queue a request already checked by `validation.check_generate`; raises ValueError
        when its grammar does not compile."""
        if msg.bootstrap is not None and self._room_taken(msg.bootstrap.room):
            raise ValueError(f"bootstrap_room: {msg.bootstrap.room} is in use on this server")
        req = self.intake.make(msg)
        if self.decode_stage is not None:
            self.decode_stage.add(req)
        else:
            self.queues.enqueue(req)

    def _room_taken(self, room: int) -> bool:
        """Whether a request of this server already goes by this bootstrap room."""
        stage = self.prefill_stage or self.decode_stage
        staged = stage.requests() if stage is not None else []
        reqs = (*self.queues.all(), *staged)
        return any(r.bootstrap.room == room for r in reqs if r.bootstrap)

    def abort(self, rid: str) -> None:
        self.pending_aborts.add(rid)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when idle (no request holds tree nodes)."""
        if self.queues:
            return False
        self.kv.flush()
        self.metrics.reset_cache_figures()
        return True

    def has_work(self) -> bool:
        return bool(self.pending_aborts) or (
            not self.stopped and bool(self.queues or self.transferring())
        )

    def transferring(self) -> bool:
        """Whether a disaggregated request waits for its KV to move."""
        stage = self.prefill_stage or self.decode_stage
        return stage is not None and stage.busy()

    @property
    def stopped(self) -> bool:
        """No step may run: generation is paused, or memory was released."""
        return self.paused or bool(self.released)

    def poll_timeout_s(self, idle_s: float) -> float:
        """How long the loop may block on its inbox before the next step: 0 with a step to
        run, the batching window's remainder while admission waits, `idle_s` with no work."""
        if not self.has_work():
            return idle_s
        if self.pending_aborts or self.queues.num_running():
            return 0.0
        if self.transferring():
            return TRANSFER_POLL_S
        return self.admission.window_wait_s()

    # ---- one step --------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Run one forward step (if there is work) and return the outputs it produced."""
        self._apply_aborts()
        if not self.stopped:
            for stage in (self.prefill_stage, self.decode_stage):
                if stage is not None:
                    stage.poll()
        step = None if self.stopped else self._next_step()
        if step is not None:
            try:
                self._run(step)
            except Exception as exc:  # noqa: BLE001 - the step's requests fail, the server stays up
                log.exception("a step of %d requests failed; they are aborted", len(step.reqs))
                error = f"internal error while running this request: {type(exc).__name__}: {exc}"
                self._fail(step.reqs, error)
        return self.results.take_outputs()

    def _run(self, step: Step) -> None:
        decoding = step.reqs[step.num_prefill :]
        self.decode.finalize_drafts(decoding)
        lens = step.prefill_lens + decode_lens(decoding)
        step.batch = build_batch(step.mode, step.reqs, lens, self.sampling, self.kv.window_map())
        started = time.perf_counter()
        result = self.executor.forward(step.batch)
        if not step.num_prefill:  # the cost of rows that make logits (see StepCost)
            elapsed = time.perf_counter() - started
            self.decode.step_cost.observe(len(step.batch.input_ids), elapsed)
        if self.model_drafter is not None and step.num_prefill:
            self.model_drafter.prefill(step.reqs, step.batch, step.num_prefill)
        self.metrics.log_step(
            step, self.kv.usage(), self.queues.num_running(), self.queues.num_waiting()
        )
        generated = 0
        for b, req in enumerate(step.reqs):
            generated += self.results.take(req, result, b)
            if b < step.num_prefill and not req.finished:
                self.kv.cache_prefix(req)
            if req.finished and self.prefill_stage and self.prefill_stage.hand_over(req):
                self.queues.finish(req)  # answered once its KV reached the decode server
                continue
            self.results.emit(req)
            if req.finished:
                self.kv.release(req)
                self.queues.finish(req)
                if self.drafter is not None:
                    self.drafter.remember(req.output_ids)
        self.metrics.generated(generated)

    def _fail(self, reqs: list[Req], message: str) -> None:
        """End the unfinished `reqs` with an abort naming the cause and free their KV."""
        for req in reqs:
            running = self.queues.is_running(req)
            if req.finished and not running:
                continue  # finished and released before the failure
            req.finish_reason = FinishReason("abort", message=message)
            if running:
                self.kv.drop(req)  # this step's KV may be half written: none of it enters the tree
                self.queues.finish(req)
            self.results.emit(req)

    def _next_step(self) -> Step | None:
        """Decoding requests advance every step and prompt chunks join them (a mixed step)."""
        try:
            decoding = self.decode.prepare(self.queues.running)
            prefill, lens, reused = self.admission.prepare(batch_started=bool(decoding))
        except OutOfMemory as exc:  # the lone request fails; the loop goes on
            log.warning("%s", exc)
            self._fail([exc.req], str(exc))
            return None
        if not decoding and not prefill:
            return None
        if prefill and decoding:
            mode = ForwardMode.MIXED
        else:
            mode = ForwardMode.EXTEND if prefill else decode_mode(decoding)
        return Step(mode, prefill + decoding, lens, reused)

    # ---- aborts ----------------------------------------------------------
    def _apply_aborts(self) -> None:
        if not self.pending_aborts:
            return
        if self.decode_stage is not None:
            for req in self.decode_stage.abort(self.pending_aborts):
                self._end(req, "aborted")
        for req in [r for r in self.queues.all() if r.rid in self.pending_aborts]:
            if self.queues.is_running(req):
                self.kv.release(req)
            self.queues.remove(req)
            self._end(req, "aborted")
        self.pending_aborts.clear()

    def _end(self, req: Req, message: str) -> None:
        """Emit `req` as aborted with `message`; it holds no KV and is in no queue."""
        req.finish_reason = FinishReason("abort", message=message)
        self.stats.aborted_total += 1
        self.results.emit(req)

    # ---- every request at once (rollout control) ------------------------------------
    def retract_all(self) -> int:
        """Send every running request back to the queue; returns how many."""
        running = self.queues.running
        for req in running:
            self.retraction.retract(req, reason="to recompute it")
        return len(running)

    def end_all(self, message: str) -> int:
        """Abort every queued and running request with `message`; returns how many."""
        running = self.queues.running
        for req in running:
            self.kv.release(req)
        reqs = self.queues.clear()
        for req in reqs:
            self._end(req, message)
        return len(reqs)

    # ---- figures ---------------------------------------------------------
    def snapshot(self) -> SchedulerStats:
        s = self.metrics.snapshot()
        s.num_running, s.num_queued = self.queues.num_running(), self.queues.num_waiting()
        stage = self.prefill_stage or self.decode_stage
        s.kv_transfer_waiting = stage.waiting() if stage is not None else 0
        self.kv.fill_figures(s, self.queues.running)
        s.images.update(self.executor.vision_figures())
        return s

    def top_prefixes(self, limit: int) -> list[dict]:
        return self.kv.top_prefixes(limit)

    def check_memory(self) -> None:
        stage = self.prefill_stage or self.decode_stage
        self.kv.check_memory([*self.queues.running, *(stage.held() if stage is not None else [])])
