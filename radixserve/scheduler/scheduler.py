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
from dataclasses import replace
from typing import Callable

from ..config import EngineArgs
from ..constrained import GrammarBackend, GrammarSpec
from ..lora import cache_namespace
from ..messages import FinishReason, ForwardMode, GenerateReq, ReqOutput, SchedulerStats
from ..sampling_params import SamplingParams
from .adapters import AdapterTable
from .admission import Admission
from .batch import SamplingContext, Step, build_batch, decode_lens, decode_mode
from .decode import DecodePlanner, OutOfMemory, Retraction
from .disagg import DecodeStage, PrefillStage
from .draft_model import DraftExecutor, ModelDrafter
from .kv_manager import Executor, KVManager
from .metrics import SchedulerMetrics
from .req import Req
from .results import ResultProcessor
from .speculative import NgramDrafter, SpecState

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
        eos_ids = frozenset(info.eos_token_ids) | frozenset(extra_eos_ids)
        fallback_id = min(info.eos_token_ids or eos_ids or {0})  # when every token is forbidden
        self.sampling = SamplingContext(eos_ids, fallback_id, grammars)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.pending_aborts: set[str] = set()
        self.kv = KVManager(args, executor)
        self.adapters = AdapterTable(args, executor)
        num_slots, cache_off = self.kv.allocator.num_slots, args.disable_radix_cache
        self.metrics = SchedulerMetrics(args, num_slots, info.page_size, cache_off)
        self.stats: SchedulerStats = self.metrics.stats
        self.retraction = Retraction(args, self.kv, self.waiting, self.running, self.stats)
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
            self.waiting,
            self.running,
            self.adapters.max_per_batch,
        )
        self.results = ResultProcessor(args, self.kv, self.metrics, eos_ids, decode_tail, grammars)
        self.prefill_stage = self.decode_stage = None
        if args.disaggregation_mode == "prefill":
            self.prefill_stage = PrefillStage(self.kv, self.results, self.stats, transfers)
        elif args.disaggregation_mode == "decode":
            self.decode_stage = DecodeStage(
                self.kv, self.results, self.metrics, self.running, transfers
            )
        self.paused = False  # /pause_generation: no step runs until /continue_generation
        self.released: frozenset[str] = frozenset()  # memory given back: no step runs either

    @property
    def cache(self):
        return self.kv.cache

    @property
    def hicache(self):
        return self.kv.hicache

    # ---- requests in -----------------------------------------------------
    def add_request(self, msg: GenerateReq) -> None:
        """Queue a request already checked by `validation.check_generate`; raises ValueError
        when its grammar does not compile."""
        if msg.bootstrap is not None and self._room_taken(msg.bootstrap.room):
            raise ValueError(f"bootstrap_room: {msg.bootstrap.room} is in use on this server")
        params = msg.sampling_params
        room = self._room_for_output(len(msg.input_ids))
        if self.prefill_stage is not None:  # the first token here, the rest on a decode server
            room = min(room, 1)
        params = replace(params, max_new_tokens=min(params.max_new_tokens, room))
        req = Req(
            msg.rid,
            list(msg.input_ids),
            params,
            msg.return_logprob,
            msg.logprob_start_len,
            msg.top_logprobs_num,
            priority=msg.priority,
            cache_salt=cache_namespace(msg.cache_salt, self.adapters.lookup(msg.lora_path)),
            pooling=msg.pooling,
            lora=msg.lora_path,
            bootstrap=msg.bootstrap,
        )
        req.grammar = self._grammar_matcher(params)
        if self.drafter is not None or self.model_drafter is not None:
            req.spec = SpecState()
        if self.decode_stage is not None:
            self.decode_stage.add(req)
        else:
            self.waiting.append(req)

    def _room_taken(self, room: int) -> bool:
        """Whether a request of this server already goes by this bootstrap room."""
        stage = self.prefill_stage or self.decode_stage
        staged = stage.requests() if stage is not None else []
        return any(
            r.bootstrap.room == room for r in self.waiting + self.running + staged if r.bootstrap
        )

    def _grammar_matcher(self, params: SamplingParams):
        spec = GrammarSpec.from_params(params)
        if spec is None:
            return None
        if self.grammars is None:
            raise ValueError(
                "structured output (regex, json_schema, ebnf) needs the model's tokenizer"
            )
        return self.grammars.matcher(spec)

    def _room_for_output(self, prompt_len: int) -> int:
        return min(self.info.max_context_len, self.kv.allocator.num_slots) - prompt_len

    def abort(self, rid: str) -> None:
        self.pending_aborts.add(rid)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when idle (no request holds tree nodes)."""
        if self.running or self.waiting:
            return False
        self.kv.flush()
        self.metrics.reset_cache_figures()
        return True

    def has_work(self) -> bool:
        return bool(self.pending_aborts) or (
            not self.stopped and bool(self.waiting or self.running or self.transferring())
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
        if self.pending_aborts or self.running:
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
        step.batch = build_batch(step.mode, step.reqs, lens, self.sampling)
        started = time.perf_counter()
        result = self.executor.forward(step.batch)
        if not step.num_prefill:  # the cost of rows that make logits (see StepCost)
            elapsed = time.perf_counter() - started
            self.decode.step_cost.observe(len(step.batch.input_ids), elapsed)
        if self.model_drafter is not None and step.num_prefill:
            self.model_drafter.prefill(step.reqs, step.batch, step.num_prefill)
        self.metrics.log_step(step, self.kv.usage(), len(self.running), len(self.waiting))
        generated = 0
        for b, req in enumerate(step.reqs):
            generated += self.results.take(req, result, b)
            if b < step.num_prefill and not req.finished:
                self.kv.cache_prefix(req)
            if req.finished and self.prefill_stage and self.prefill_stage.hand_over(req):
                self.running.remove(req)  # answered once its KV reached the decode server
                continue
            self.results.emit(req)
            if req.finished:
                self.kv.release(req)
                self.running.remove(req)
                if self.drafter is not None:
                    self.drafter.remember(req.output_ids)
        self.metrics.generated(generated)

    def _fail(self, reqs: list[Req], message: str) -> None:
        """End the unfinished `reqs` with an abort naming the cause and free their KV."""
        for req in reqs:
            if req.finished and req not in self.running:
                continue  # finished and released before the failure
            req.finish_reason = FinishReason("abort", message=message)
            if req in self.running:
                self.kv.drop(req)  # this step's KV may be half written: none of it enters the tree
                self.running.remove(req)
            self.results.emit(req)

    def _next_step(self) -> Step | None:
        """Decoding requests advance every step and prompt chunks join them (a mixed step)."""
        try:
            decoding = self.decode.prepare(self.running)
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
                req.finish_reason = FinishReason("abort", message="aborted")
                self.stats.aborted_total += 1
                self.results.emit(req)
        for req in [r for r in self.waiting + self.running if r.rid in self.pending_aborts]:
            req.finish_reason = FinishReason("abort", message="aborted")
            if req in self.running:
                self.kv.release(req)
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self.stats.aborted_total += 1
            self.results.emit(req)
        self.pending_aborts.clear()

    # ---- weights and pausing (RL rollouts) ---------------------------------
    def pause(self, mode: str) -> int:
        """Stop running steps until `resume`. `abort` ends every request, `retract` sends the
        running ones back to the queue (to recompute later), `in_place` leaves them as they
        are. Returns how many requests it ended or retracted."""
        touched = 0
        if mode == "abort":
            touched = self._end_all("aborted: generation was paused")
        elif mode == "retract":
            touched = self._retract_all()
        self.paused = True
        return touched

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, model_path: str, abort_all: bool) -> int:
        """Serve `model_path`'s weights from the next step on; raises ValueError (and changes
        nothing) when they cannot replace the served ones. In-flight requests are ended
        (`abort_all`) or retracted, to recompute their prompt and output so far with the new
        weights; every cached prefix, on every tier, is dropped, so no KV computed with the
        old weights is read again. Returns how many requests it ended or retracted."""
        self.executor.update_weights(model_path)
        touched = self._end_all("aborted: the weights were updated") if abort_all else 0
        touched += self._retract_all()
        self.kv.renew(model_path)
        self.metrics.reset_cache_figures()
        return touched

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve one more adapter from the next step on; ValueError with the reason."""
        self.adapters.load(name, path)

    def unload_lora_adapter(self, name: str) -> int:
        """Unload an adapter, once no queued or running request uses it; until then it takes
        no new request. Returns how many requests still use it (0: unloaded)."""
        return self.adapters.unload(name, self.waiting + self.running)

    def release_memory(self, tags: frozenset[str]) -> None:
        """Give back the KV cache's and/or the weights' memory (RL frameworks train in it
        meanwhile); only with no request running. Steps stay off until `resume_memory`; the
        cache is emptied with the KV it indexed."""
        if self.running:
            raise ValueError(
                f"{len(self.running)} requests are running: pause generation (mode abort or "
                f"retract) before releasing memory"
            )
        self.executor.release_memory(tags)
        if "kv_cache" in tags:
            self.kv.flush()
            self.metrics.reset_cache_figures()
        self.released |= tags

    def resume_memory(self, tags: frozenset[str]) -> None:
        self.executor.resume_memory(tags)
        self.released -= tags

    def _retract_all(self) -> int:
        running = list(self.running)
        for req in running:
            self.retraction.retract(req, reason="to recompute it")
        return len(running)

    def _end_all(self, message: str) -> int:
        reqs = self.waiting + self.running
        for req in reqs:
            req.finish_reason = FinishReason("abort", message=message)
            if req in self.running:
                self.kv.release(req)
            self.stats.aborted_total += 1
            self.results.emit(req)
        self.waiting.clear()
        self.running.clear()
        return len(reqs)

    # ---- figures ---------------------------------------------------------
    def snapshot(self) -> SchedulerStats:
        s = self.metrics.snapshot()
        s.num_running, s.num_queued = len(self.running), len(self.waiting)
        stage = self.prefill_stage or self.decode_stage
        s.kv_transfer_waiting = stage.waiting() if stage is not None else 0
        s.free_slots = self.kv.allocator.available()
        s.cached_slots = self.kv.cache.total_size()
        s.evictable_slots = self.kv.cache.evictable_size()
        s.running_slots = self.kv.held_slots(self.running)
        s.radix_nodes = self.kv.cache.num_nodes()
        s.evicted_tokens_total = self.kv.evicted_tokens
        if self.kv.hicache is not None:
            s.hicache = self.kv.hicache.snapshot()
        return s

    def top_prefixes(self, limit: int) -> list[dict]:
        """The dashboard's biggest cached prefixes, each with the tiers that hold it."""
        rows = []
        for prefix in self.kv.cache.top_prefixes(limit):
            tiers = ["device"]
            if self.kv.hicache is not None:
                tiers += self.kv.hicache.tiers_of(prefix.tokens)
            rows.append(dict(vars(prefix), tiers=tiers))
        return rows

    def check_memory(self) -> None:
        stage = self.prefill_stage or self.decode_stage
        self.kv.check_memory(self.running + (stage.held() if stage is not None else []))
