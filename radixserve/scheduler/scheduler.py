"""The scheduler: admission, chunked prefill, decode, retraction, radix-cache bookkeeping.

It owns the radix tree, the slot allocator and the request rows; the worker owns
the KV tensors and sees only slot indices. It talks to the model only through
an `Executor`, so it runs (and is tested) without one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from ..config import EngineArgs
from ..constrained import GrammarBackend, GrammarSpec
from ..mem.allocator import ReqToTokenRows, SlotAllocator
from ..mem.hicache import HiCache, block_size, fingerprint
from ..mem.kv_pool import KVPool
from ..mem.radix_cache import RadixCache
from ..mem.shadow import LiveEstimates
from ..messages import (
    FinishReason,
    ForwardBatch,
    ForwardMode,
    ForwardResult,
    GenerateReq,
    LogprobRequest,
    ReqOutput,
    SamplingBatch,
    SchedulerStats,
    TokenLogprobs,
    WorkerInfo,
)
from ..request_log import RequestLog, ServerRecord
from ..sampling_params import SamplingParams, compile_stop_regex
from .draft_model import DraftExecutor, ModelDrafter
from .policy import order_waiting
from .req import Req
from .speculative import NgramDrafter, SpecState, StepCost, budget_drafts

log = logging.getLogger(__name__)

IN_BATCH_SHARE_MIN = 32
STOP_REGEX_WINDOW = 32  # output tokens a stop regex is matched against, counted from the end
DECODE_LOG_INTERVAL = 40
RATIO_DECAY_STEPS = 600
RETRACT_RATIO_STEP = 0.15


class Executor(Protocol):
    """What the scheduler needs from the model worker(s); `pool` (the device KV) only with the
    hierarchical cache, which copies blocks in and out of it between steps."""

    info: WorkerInfo
    pool: KVPool

    def forward(self, batch: ForwardBatch) -> ForwardResult: ...


@dataclass
class Step:
    mode: ForwardMode
    reqs: list[Req]
    prefill_lens: list[int]  # the first len(prefill_lens) reqs run prompt chunks of these lengths
    reused_tokens: int = 0
    batch: ForwardBatch | None = None  # built in `step`, once the drafts are final

    @property
    def num_prefill(self) -> int:
        return len(self.prefill_lens)


class Scheduler:
    def __init__(
        self,
        args: EngineArgs,
        executor: Executor,
        decode_tail: Callable[[list[int]], str] | None = None,
        extra_eos_ids: tuple[int, ...] = (),
        grammars: GrammarBackend | None = None,
        draft_executor: DraftExecutor | None = None,
    ):
        info = executor.info
        self.args, self.executor, self.info = args, executor, info
        self.decode_tail = decode_tail
        self.grammars = grammars
        self.eos_ids = set(info.eos_token_ids) | set(extra_eos_ids)
        self.fallback_id = min(
            info.eos_token_ids or self.eos_ids or {0}
        )  # taken when every token is forbidden
        self.allocator = SlotAllocator(info.num_pages, info.page_size)
        self.rows = ReqToTokenRows(info.max_running_requests)
        self.hicache = make_hicache(args, executor) if args.enable_hierarchical_cache else None
        write_back = self.hicache is not None and args.hicache_write_policy == "write_back"
        self.cache = RadixCache(
            info.page_size,
            self.allocator.free,
            disable=args.disable_radix_cache,
            record_events=args.kv_events_config is not None,
            on_evict=self._back_up_leaf if write_back else None,
            eviction_policy=args.radix_eviction_policy,
        )
        self.request_log = self._open_request_log(args)
        self.estimates = self._live_estimates()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.outputs: list[ReqOutput] = []
        self.drafter = (
            NgramDrafter(args.speculative_num_draft_tokens)
            if args.speculative_algorithm == "ngram"
            else None
        )
        self.model_drafter = ModelDrafter(draft_executor) if draft_executor is not None else None
        self.step_cost = StepCost()
        self.pending_aborts: set[str] = set()
        self.new_token_ratio = args.new_token_ratio
        self.prefill_budget = args.prefill_budget(info.device)
        self.prefill_admit_limit = args.prefill_admit_limit(info.device)
        self.last_was_prefill = False
        self.stats = SchedulerStats(num_slots=self.allocator.num_slots)
        self._recent_admissions: deque[tuple[int, int]] = deque(maxlen=200)
        self._recent_tokens: deque[tuple[float, int]] = deque(maxlen=512)
        self._queue_times: deque[float] = deque(maxlen=512)

    def _open_request_log(self, args: EngineArgs) -> RequestLog | None:
        if args.log_requests is None:
            return None
        return RequestLog(
            args.log_requests,
            args.log_requests_level,
            ServerRecord(
                self.allocator.num_slots,
                self.info.page_size,
                args.radix_eviction_policy,
                args.log_requests_level,
                time.time(),
            ),
        )

    def _live_estimates(self) -> LiveEstimates | None:
        if self.args.disable_cache_estimates or self.cache.disable:
            return None
        return LiveEstimates(self.allocator.num_slots, self.args.radix_eviction_policy)

    # ---- requests in -----------------------------------------------------
    def add_request(self, msg: GenerateReq) -> None:
        """Queue a request already checked by `validation.check_generate`; raises ValueError
        when its grammar does not compile."""
        params = msg.sampling_params
        params = replace(
            params,
            max_new_tokens=min(params.max_new_tokens, self._room_for_output(len(msg.input_ids))),
        )
        req = Req(
            msg.rid,
            list(msg.input_ids),
            params,
            msg.return_logprob,
            msg.logprob_start_len,
            msg.top_logprobs_num,
        )
        req.grammar = self._grammar_matcher(params)
        if self.speculates:
            req.spec = SpecState()
        self.waiting.append(req)

    @property
    def speculates(self) -> bool:
        return self.drafter is not None or self.model_drafter is not None

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
        return min(self.info.max_context_len, self.allocator.num_slots) - prompt_len

    def abort(self, rid: str) -> None:
        self.pending_aborts.add(rid)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when idle (no request holds tree nodes)."""
        if self.running or self.waiting:
            return False
        self.cache.evict(self.cache.total_size())
        self.cache.reset()
        self.estimates = self._live_estimates()
        self._recent_admissions.clear()
        if self.hicache is not None:
            self.hicache.host.clear()
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_aborts)

    # ---- one step --------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Run one forward step (if there is work) and return the outputs it produced."""
        self._apply_aborts()
        step = self._next_step()
        if step is not None:
            try:
                step.batch = self._batch_of(step)
                started = time.perf_counter()
                result = self.executor.forward(step.batch)
                if not step.num_prefill:  # the cost of rows that make logits (see StepCost)
                    self.step_cost.observe(len(step.batch.input_ids), time.perf_counter() - started)
                if self.model_drafter is not None and step.num_prefill:
                    self.model_drafter.prefill(step.reqs, step.batch, step.num_prefill)
                self._process(step, result)
            except Exception as exc:  # noqa: BLE001 - the step's requests fail, the server stays up
                log.exception("a step of %d requests failed; they are aborted", len(step.reqs))
                self._fail(
                    step.reqs,
                    f"internal error while running this request: {type(exc).__name__}: {exc}",
                )
        outputs, self.outputs = self.outputs, []
        return outputs

    def _fail(self, reqs: list[Req], message: str) -> None:
        """End the unfinished `reqs` with an abort naming the cause and free their KV."""
        for req in reqs:
            if req.finished and req not in self.running:
                continue  # finished and released before the failure
            req.finish_reason = FinishReason("abort", message=message)
            if req in self.running:
                self._drop(req)  # this step's KV may be half written: none of it enters the tree
            self._emit(req)

    def _next_step(self) -> Step | None:
        """Decoding requests advance every step; prompt chunks join them (mixed) or, with
        mixing off, alternate with them so a long prompt never stalls decoding for long."""
        if not self.args.enable_mixed_chunk:
            return self._alternating_step()
        decoding = self._prepare_decode()
        prefill, lens, reused = self._prepare_prefill(batch_started=bool(decoding))
        if not decoding and not prefill:
            return None
        mode = (
            ForwardMode.MIXED
            if prefill and decoding
            else (ForwardMode.EXTEND if prefill else _decode_mode(decoding))
        )
        return Step(mode, prefill + decoding, lens, reused)

    def _alternating_step(self) -> Step | None:
        if self.last_was_prefill and any(r.is_decoding for r in self.running):
            step = self._decode_only() or self._prefill_only()
        else:
            step = self._prefill_only() or self._decode_only()
        self.last_was_prefill = step is not None and step.num_prefill > 0
        return step

    def _prefill_only(self) -> Step | None:
        reqs, lens, reused = self._prepare_prefill(batch_started=False)
        return Step(ForwardMode.EXTEND, reqs, lens, reused) if reqs else None

    def _decode_only(self) -> Step | None:
        reqs = self._prepare_decode()
        return Step(_decode_mode(reqs), reqs, []) if reqs else None

    def _batch_of(self, step: Step) -> ForwardBatch:
        """The step's batch, once its drafts are final: a draft model's tokens are drafted now,
        and drafts a grammar refuses are dropped (so a request's chunk length is known here)."""
        decoding = step.reqs[step.num_prefill :]
        if self.model_drafter is not None and any(r.drafts for r in decoding):
            self.model_drafter.propose([r for r in decoding if r.drafts])
        for req in decoding:
            if req.drafts and req.grammar is not None:
                self._check_drafts_against_grammar(req)
        return self._build_batch(step.mode, step.reqs, step.prefill_lens + _decode_lens(decoding))

    # ---- prefill ---------------------------------------------------------
    def _prepare_prefill(self, batch_started: bool) -> tuple[list[Req], list[int], int]:
        """Continue chunked prompts, then admit waiting requests; allocates their slots."""
        budget = self.prefill_budget
        reqs, lens, reused = [], [], 0
        prefilling = [r for r in self.running if r.is_prefilling]
        for req in prefilling:
            n = min(req.pending, self.args.chunked_prefill_size, budget)
            if n <= 0 or not self._alloc(req, n):
                break
            reqs.append(req), lens.append(n)
            budget -= n
        for req, n in self._admit(budget, batch_started or bool(reqs), prefilling):
            reqs.append(req), lens.append(n)
            reused += req.cached_len
        return reqs, lens, reused

    def _admit(self, budget: int, batch_started: bool, prefilling: list[Req]):
        if not self.waiting:
            return
        shared = RadixCache(
            self.info.page_size
        )  # prompt parts being computed now: later sharers wait
        for req in prefilling:
            self._mark_shared(shared, req.fill_ids[req.cached_len :])
        reserved = self._reserved_decode_slots()
        ordered = order_waiting(
            self.args.schedule_policy,
            self.waiting,
            self.cache,
            lambda r: self.cache.match_length(r.fill_ids[: r.max_prefix_len()]),
        )
        admitted = (
            0  # prompt tokens of the requests this step admits (continued chunks not counted)
        )
        for req in ordered:
            if budget <= 0 or self.rows.available() == 0:
                break
            slots, node = self._match(req)
            uncached = req.fill_ids[len(slots) :]
            if self._share_later(shared, uncached, batch_started):
                continue
            n = min(len(uncached), self.args.chunked_prefill_size, budget)
            if admitted and admitted + n > self.prefill_admit_limit:
                break
            growth = req.remaining_new_tokens * self.new_token_ratio if n == len(uncached) else 0
            self.cache.inc_lock_ref(node)
            need = self.allocator.pages_needed(len(slots), n) * self.info.page_size
            fits = (
                need + reserved + growth <= self.allocator.available() + self.cache.evictable_size()
            )
            if not fits and (batch_started or self.running):
                self.cache.dec_lock_ref(node)
                break
            self._start(req, slots, node)
            if not self._alloc(req, n):
                self._retract(req)
                break
            self._mark_shared(shared, uncached)
            reserved += growth
            budget -= n
            admitted += n
            batch_started = True
            yield req, n

    def _mark_shared(self, shared: RadixCache, tokens: list[int]) -> None:
        aligned = len(tokens) - len(tokens) % self.info.page_size
        shared.insert(tokens[:aligned], [0] * aligned)

    def _share_later(self, shared: RadixCache, uncached: list[int], batch_started: bool) -> bool:
        """Defer a request whose uncached part starts like one being computed (admitted in this
        batch, or a chunked prompt still in progress): once that is cached, it finds the prefix
        there instead of computing it twice."""
        if self.cache.disable or not batch_started:
            return False
        matched = len(shared.match_prefix(uncached)[0])
        return matched >= min(IN_BATCH_SHARE_MIN, len(uncached) - 1) and matched > 0

    def _match(self, req: Req):
        prefix = req.fill_ids[: req.max_prefix_len()]
        slots, node = self.cache.match_prefix(prefix)
        if self.hicache is not None and len(prefix) - len(slots) >= self.hicache.block:
            slots, node = self._load_from_tiers(prefix, slots, node)
        return slots, node

    # ---- hierarchical cache ------------------------------------------------
    def _load_from_tiers(
        self, prefix: list[int], slots: list[int], node
    ) -> tuple[list[int], object]:
        """Extend a device match with blocks from the host and storage tiers: they get device
        slots (the match stays locked meanwhile) and join the tree like computed KV."""
        self.cache.inc_lock_ref(node)
        try:
            loaded = self.hicache.load(prefix, len(slots), self._alloc_for_load)
        finally:
            self.cache.dec_lock_ref(node)
        if not loaded:
            return slots, node
        key = prefix[: len(slots) + len(loaded)]
        already = self.cache.insert(key, slots + loaded)
        self.allocator.free(loaded[: max(already - len(slots), 0)])
        return self.cache.match_prefix(key)

    def _alloc_for_load(self, n: int) -> list[int] | None:
        pages = self.allocator.pages_needed(0, n)
        if not self._make_room(pages):
            return None
        return self.allocator.alloc_extend(0, None, n)

    def _back_up_leaf(self, leaf) -> None:
        tokens, slots = self.cache.path_of(leaf)
        self.hicache.backup(tokens, slots)

    def _back_up_prefix(self, tokens: list[int], slots: list[int], node) -> None:
        """write_through backs up every cached prefix; write_through_selective only those hit
        more than once."""
        policy = self.args.hicache_write_policy
        if policy == "write_through" or (
            policy == "write_through_selective" and node.hit_count >= 2
        ):
            self.hicache.backup(tokens, slots)

    def _start(self, req: Req, slots: list[int], node) -> None:
        self.waiting.remove(req)
        req.row = self.rows.alloc()
        req.kv_slots, req.cached_len, req.node, req.synced = list(slots), len(slots), node, 0
        if req.spec is not None:
            req.spec.draft_len = len(slots)  # a cached prefix carries draft-model K/V too
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = len(slots)
            req.queue_time = time.monotonic() - req.arrival
            self._queue_times.append(req.queue_time)
            self.stats.prompt_tokens_total += len(req.input_ids)
            self.stats.cached_tokens_total += len(slots)
            self._recent_admissions.append((len(req.input_ids), len(slots)))
            if self.estimates is not None:
                self.estimates.admit(req.rid, req.input_ids, req.max_prefix_len())
        self.cache.record_hit(node)
        if self.hicache is not None and slots:
            self._back_up_prefix(req.fill_ids[: len(slots)], slots, node)
        self.running.append(req)

    def _reserved_decode_slots(self) -> float:
        return sum(r.remaining_new_tokens for r in self.running) * self.new_token_ratio

    # ---- decode ----------------------------------------------------------
    def _prepare_decode(self) -> list[Req]:
        """One more slot for every decoding request, and one per draft token; when memory is
        short, drafts go first, then the cheapest requests are retracted."""
        reqs = [r for r in self.running if r.is_decoding]
        if not reqs:
            return []
        self._propose_drafts(reqs)
        while not self._make_room(
            sum(self.allocator.pages_needed(len(r.kv_slots), 1 + len(r.drafts)) for r in reqs)
        ):
            if any(r.drafts for r in reqs):
                for r in reqs:
                    r.spec.drafts = []
                continue
            victim = self._pick_victim()
            if victim is None:
                raise RuntimeError("out of KV memory with a single request; pool too small")
            self._retract(victim)
            reqs = [r for r in reqs if r is not victim]
        for req in reqs:
            assert self._alloc(req, 1 + len(req.drafts))
        self.new_token_ratio = max(
            self.args.min_new_token_ratio, self.new_token_ratio - self._ratio_decay()
        )
        return reqs

    def _propose_drafts(self, reqs: list[Req]) -> None:
        """Drafts worth their rows (`budget_drafts`) for the requests that may speculate: all but
        those still short of min_new_tokens and those paused after repeated misses."""
        proposals = []
        for req in reqs:
            if req.spec is None:
                continue
            req.spec.drafts = []
            if len(req.output_ids) < max(req.params.min_new_tokens, req.spec.paused_until):
                continue  # (a paused request skips building its token list too)
            draft = self._draft_candidates(req)
            if draft:
                proposals.append((req.spec, draft))
        if proposals:
            budget_drafts(proposals, len(reqs), self.step_cost, self._draft_step_seconds())
            if self.model_drafter is not None:
                self.model_drafter.drafting = any(state.drafts for state, _ in proposals)

    def _draft_candidates(self, req: Req) -> list[int]:
        """The n-gram drafter's tokens; for a draft model, placeholders for as many as it may
        draft."""
        limit = req.remaining_new_tokens - 1
        if self.model_drafter is not None:
            return [0] * max(min(limit, self.args.speculative_num_draft_tokens), 0)
        return self.drafter.propose(req.spec, req.fill_ids, len(req.output_ids), limit)

    def _draft_step_seconds(self) -> float:
        return self.model_drafter.step_seconds if self.model_drafter is not None else 0.0

    def _check_drafts_against_grammar(self, req: Req) -> None:
        """Keep the drafts the request's grammar allows, with the bitmask of each row after them."""
        spec = req.spec
        spec.draft_masks = self.grammars.draft_masks(req.grammar, spec.drafts)
        dropped = len(spec.drafts) - len(spec.draft_masks)
        if dropped:
            del spec.drafts[len(spec.draft_masks) :]
            self._free_tail(req, len(req.kv_slots) - dropped)

    def _free_tail(self, req: Req, keep: int) -> None:
        """Give back the request's own slots past its first `keep` (draft slots not used)."""
        self.allocator.free(req.kv_slots[keep:])
        del req.kv_slots[keep:]

    def _ratio_decay(self) -> float:
        return (self.args.new_token_ratio - self.args.min_new_token_ratio) / RATIO_DECAY_STEPS

    def _pick_victim(self) -> Req | None:
        """The running request cheapest to redo (fewest own computed tokens); never the last one."""
        if len(self.running) <= 1:
            return None
        return min(self.running, key=lambda r: (len(r.kv_slots) - r.cached_len, -len(r.input_ids)))

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its computed KV stays cached (evictable)."""
        self._release(req)
        req.kv_slots, req.cached_len, req.node, req.row, req.synced = [], 0, None, None, 0
        if req.spec is not None:
            req.spec.drafts = []
        if not req.prompt_logprobs_done:
            req.input_logprobs, req.input_top_logprobs = [], []
        self.waiting.insert(0, req)
        self.stats.retractions_total += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_STEP)
        log.info("retracted %s (%d tokens) for lack of KV memory", req.rid, len(req.fill_ids))

    # ---- memory ----------------------------------------------------------
    def _make_room(self, pages: int) -> bool:
        missing = pages * self.info.page_size - self.allocator.available()
        if missing > 0:
            self.stats.evicted_tokens_total += self.cache.evict(missing)
        return self.allocator.can_alloc_pages(pages)

    def _alloc(self, req: Req, n: int) -> bool:
        if not self._make_room(self.allocator.pages_needed(len(req.kv_slots), n)):
            return False
        last = req.kv_slots[-1] if req.kv_slots else None
        req.kv_slots += self.allocator.alloc_extend(len(req.kv_slots), last, n)
        return True

    def _cache_prefix(self, req: Req) -> None:
        """Put the request's computed, page-aligned KV into the tree and lock it there."""
        computed = len(req.kv_slots)
        aligned = computed - computed % self.info.page_size
        if self.cache.disable or aligned <= req.cached_len:
            return
        key = req.fill_ids[:aligned]
        already = self.cache.insert(key, req.kv_slots[:aligned])
        if already > req.cached_len:
            self.allocator.free(req.kv_slots[req.cached_len : already])
            req.synced = min(req.synced, req.cached_len)
        slots, node = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(node)
        if req.node is not None:
            self.cache.dec_lock_ref(req.node)
        req.kv_slots[:aligned], req.node, req.cached_len = slots, node, aligned
        if self.hicache is not None:
            self._back_up_prefix(key, slots, node)

    def _release(self, req: Req) -> None:
        """Give back everything the request holds: KV to the tree or allocator, its lock, its
        row."""
        self._cache_prefix(req)
        self._drop(req)

    def _drop(self, req: Req) -> None:
        """Give back what the request holds without caching more of it: its uncached KV to the
        allocator, its tree lock, its row."""
        self.allocator.free(req.kv_slots[req.cached_len :])
        if req.node is not None:
            self.cache.dec_lock_ref(req.node)
        if req.row is not None:
            self.rows.free(req.row)
        self.running.remove(req)

    def held_slots(self) -> int:
        return sum(self.allocator.held_slots(len(r.kv_slots) - r.cached_len) for r in self.running)

    def check_memory(self) -> None:
        """Capacity invariant: free + cached + held by running requests == pool size."""
        total = self.allocator.available() + self.cache.total_size() + self.held_slots()
        assert total == self.allocator.num_slots, (
            f"KV leak: free {self.allocator.available()} + cached {self.cache.total_size()} + "
            f"held {self.held_slots()} != {self.allocator.num_slots}"
        )
        assert self.rows.available() + len(self.running) == self.rows.num_rows
        if self.hicache is not None:
            self.hicache.host.check()

    # ---- batch building ----------------------------------------------------
    def _build_batch(self, mode: ForwardMode, reqs: list[Req], lens: list[int]) -> ForwardBatch:
        ids, positions, locs, writes, seq_lens, logprobs = [], [], [], [], [], []
        for req, n in zip(reqs, lens):
            end = len(req.kv_slots)
            start = end - n
            ids += (req.fill_ids + req.drafts)[start:end] if req.drafts else req.fill_ids[start:end]
            positions += range(start, end)
            locs += req.kv_slots[start:end]
            if req.synced < start:
                writes.append((req.row, req.synced, req.kv_slots[req.synced : start]))
            req.synced = end
            seq_lens.append(end)
            logprobs.append(self._logprob_request(req, start, end - len(req.drafts)))
        draft_lens = [len(r.drafts) for r in reqs] if any(r.drafts for r in reqs) else None
        return ForwardBatch(
            mode,
            ids,
            positions,
            locs,
            [r.row for r in reqs],
            seq_lens,
            lens,
            writes,
            self._sampling_batch(reqs),
            logprobs,
            draft_lens,
        )

    def _logprob_request(self, req: Req, start: int, end: int) -> LogprobRequest | None:
        if not req.return_logprob:
            return None
        lp = LogprobRequest(top_k=req.top_logprobs_num, want_output=end == len(req.fill_ids))
        if req.wants_prompt_logprobs:
            lo = max(start, req.logprob_start_len - 1, 0)
            hi = min(end, len(req.input_ids) - 1)
            if lo < hi:
                lp.prompt_start, lp.prompt_targets = lo - start, req.input_ids[lo + 1 : hi + 1]
        return lp

    def _sampling_batch(self, reqs: list[Req]) -> SamplingBatch:
        ps = [r.params for r in reqs]
        return SamplingBatch(
            temperatures=[p.temperature for p in ps],
            top_ps=[p.top_p for p in ps],
            top_ks=[p.top_k for p in ps],
            min_ps=[p.min_p for p in ps],
            seeds=[p.seed for p in ps],
            steps=[len(r.output_ids) for r in reqs],
            frequency_penalties=[p.frequency_penalty for p in ps],
            presence_penalties=[p.presence_penalty for p in ps],
            repetition_penalties=[p.repetition_penalty for p in ps],
            penalty_outputs=[list(r.output_ids) if r.params.has_penalties else None for r in reqs],
            penalty_prompts=[
                r.input_ids if r.params.repetition_penalty != 1 else None for r in reqs
            ],
            suppressed_ids=[self._suppressed(r) for r in reqs],
            token_masks=self._token_masks(reqs),
            logit_biases=_logit_biases(ps),
            fallback_ids=[self.fallback_id] * len(reqs),
            draft_token_masks=[
                r.spec.draft_masks if r.drafts and r.grammar is not None else None for r in reqs
            ]
            if any(r.drafts and r.grammar is not None for r in reqs)
            else None,
        )

    def _token_masks(self, reqs: list[Req]) -> list[list[int] | None] | None:
        if not any(r.grammar is not None for r in reqs):
            return None
        return [None if r.grammar is None else self.grammars.token_mask(r.grammar) for r in reqs]

    def _suppressed(self, req: Req) -> list[int] | None:
        if len(req.output_ids) >= req.params.min_new_tokens:
            return None
        return sorted(
            set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else self.eos_ids)
        )

    # ---- results ---------------------------------------------------------
    def _process(self, step: Step, result: ForwardResult) -> None:
        self.stats.forward_steps += 1
        self._log_step(step)
        generated = 0
        for b, req in enumerate(step.reqs):
            self._take_prompt_logprobs(req, result, b)
            if req.drafts:
                generated += self._take_verified(req, result, b)
            elif req.pending == 0:
                generated += self._take_token(req, result, b)
            if b < step.num_prefill and not req.finished:
                self._cache_prefix(req)
            self._emit(req)
            if req.finished:
                self._release(req)
                if self.drafter is not None:
                    self.drafter.remember(req.output_ids)
        self.stats.generation_tokens_total += generated
        self._recent_tokens.append((time.monotonic(), generated))

    def _take_prompt_logprobs(self, req: Req, result: ForwardResult, b: int) -> None:
        if not req.wants_prompt_logprobs:
            return
        if not req.input_logprobs and req.logprob_start_len == 0:
            req.input_logprobs.append([None, req.input_ids[0]])
            req.input_top_logprobs.append(None)
        got = result.prompt_logprobs[b]
        if got is not None:
            first = len(req.input_logprobs) + max(req.logprob_start_len, 0)
            targets = req.input_ids[first : first + len(got.logprobs)]
            req.input_logprobs += [[lp, t] for lp, t in zip(got.logprobs, targets)]
            req.input_top_logprobs += (
                [_pairs(t) for t in got.top] if got.top else [None] * len(targets)
            )
        if len(req.kv_slots) >= len(req.input_ids):
            req.prompt_logprobs_done = True

    def _take_token(self, req: Req, result: ForwardResult, b: int) -> int:
        if req.params.max_new_tokens == 0:
            req.finish_reason = FinishReason("length", length=0)
            return 0
        self._append(req, result.next_token_ids[b], result.output_logprobs[b], 0)
        if req.grammar is not None and not req.finished and self.args.enable_jump_forward:
            return 1 + self._jump_forward(req)
        return 1

    def _append(self, req: Req, token: int, got: TokenLogprobs | None, i: int) -> None:
        """Add one output token (with the i-th logprob of `got`, when asked for) and set the
        finish reason it causes."""
        req.output_ids.append(token)
        if got is not None:
            req.output_logprobs.append([got.logprobs[i], token])
            req.output_top_logprobs.append(_pairs(got.top[i]) if got.top else None)
        if req.grammar is not None and not req.grammar.accept_token(token):
            req.finish_reason = FinishReason(
                "abort",
                message="no token satisfies both the grammar and the "
                "other sampling constraints (stop_token_ids, min_new_tokens)",
            )
            return
        req.finish_reason = self._finish_reason(req, token)

    def _take_verified(self, req: Req, result: ForwardResult, b: int) -> int:
        """Append the accepted drafts and the sampled token, up to a finish; then free the KV
        slots of the drafts that were not kept, so that only accepted tokens reach the tree."""
        proposed, accepted = len(req.drafts), result.accepted_drafts[b]
        fed = len(req.fill_ids)  # the positions before the drafts
        taken = 0
        for i, token in enumerate(accepted + [result.next_token_ids[b]]):
            self._append(req, token, result.output_logprobs[b], i)
            taken += 1
            if req.finished:
                break
        keep = len(req.fill_ids) - 1  # the newest token's KV is computed next step
        self._free_tail(req, keep)
        req.synced = min(req.synced, keep)
        req.spec.draft_len = min(req.spec.draft_len, fed + len(accepted), keep)
        req.spec.record(proposed, len(accepted), len(req.output_ids))
        req.spec.drafts = []
        s = self.stats
        s.spec_verify_steps_total += 1
        s.spec_draft_tokens_total += proposed
        s.spec_accepted_tokens_total += len(accepted)
        return taken

    def _jump_forward(self, req: Req) -> int:
        """Append the tokens the grammar forces; the next step feeds them as one extend chunk.
        Skipped with logprobs, which only sampled tokens have."""
        if req.return_logprob:
            return 0
        tokens, req.grammar = self.grammars.forced_tokens(
            req.grammar, req.params.max_new_tokens - len(req.output_ids)
        )
        req.output_ids += tokens
        self.stats.jump_forward_tokens_total += len(tokens)
        if tokens and len(req.output_ids) >= req.params.max_new_tokens:
            req.finish_reason = FinishReason("length", length=len(req.output_ids))
        return len(tokens)

    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        p, out = req.params, req.output_ids
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason("stop", matched=token)
        if len(out) >= p.min_new_tokens:
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                return FinishReason("stop", matched=token)
            matched = self._matched_stop_string(req)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if len(out) >= p.max_new_tokens:
            return FinishReason("length", length=len(out))
        return None

    def _matched_stop_string(self, req: Req) -> str | None:
        """The stop string, or the text a stop regex matched, at the end of the output."""
        p = req.params
        if not (p.stop or p.stop_regex) or self.decode_tail is None:
            return None
        window = max([len(s) + 4 for s in p.stop] + [STOP_REGEX_WINDOW if p.stop_regex else 0])
        tail = self.decode_tail(req.output_ids[-window:])
        for stop in p.stop:
            if stop in tail:
                return stop
        for pattern in p.stop_regex:
            found = compile_stop_regex(pattern).search(tail)
            if found and found.group(0):
                return found.group(0)
        return None

    def _emit(self, req: Req) -> None:
        new = req.output_ids[req.sent_len :]
        if not new and not req.finished:
            return
        first = req.sent_len == 0
        req.sent_len = len(req.output_ids)
        out = ReqOutput(
            req.rid,
            new,
            req.finished,
            req.finish_reason,
            len(req.input_ids),
            len(req.output_ids),
            req.cached_tokens,
            queue_time=req.queue_time,
            stop=req.params.stop if first else None,
            skip_special_tokens=req.params.skip_special_tokens,
        )
        if req.spec is not None:
            out.spec_verify_ct, out.spec_accepted_tokens = (
                req.spec.verify_steps,
                req.spec.accepted_total,
            )
        if req.return_logprob:
            out.output_logprobs = req.output_logprobs[req.sent_logprobs :]
            out.output_top_logprobs = req.output_top_logprobs[req.sent_logprobs :]
            req.sent_logprobs = len(req.output_logprobs)
            if req.finished or len(req.output_ids) == len(new):
                out.input_logprobs, out.input_top_logprobs = (
                    req.input_logprobs,
                    req.input_top_logprobs,
                )
        if req.finished:
            kind = req.finish_reason.kind
            self.stats.requests_finished[kind] = self.stats.requests_finished.get(kind, 0) + 1
            if self.request_log is not None:
                self.request_log.write(req, kind)
            if self.estimates is not None and req.admitted:
                self.estimates.finish(req.rid, req.input_ids + req.output_ids[:-1])
        self.outputs.append(out)

    # ---- aborts ----------------------------------------------------------
    def _apply_aborts(self) -> None:
        if not self.pending_aborts:
            return
        for req in [r for r in self.waiting + self.running if r.rid in self.pending_aborts]:
            req.finish_reason = FinishReason("abort", message="aborted")
            if req in self.running:
                self._release(req)
            else:
                self.waiting.remove(req)
            self.stats.aborted_total += 1
            self._emit(req)
        self.pending_aborts.clear()

    # ---- figures ---------------------------------------------------------
    def _log_step(self, step: Step) -> None:
        usage = 1 - self.allocator.available() / self.allocator.num_slots
        if step.num_prefill:
            new = sum(step.batch.extend_lens[: step.num_prefill])
            cached = step.reused_tokens
            log.info(
                "prefill: %d reqs, %d new tokens, %d cached tokens (hit %.0f%%), token usage %.2f, "
                "running %d, queued %d",
                step.num_prefill,
                new,
                cached,
                100 * cached / max(new + cached, 1),
                usage,
                len(self.running),
                len(self.waiting),
            )
        if step.mode != ForwardMode.EXTEND and self.stats.forward_steps % DECODE_LOG_INTERVAL == 0:
            log.info(
                "decode: %d reqs, token usage %.2f, gen throughput %.1f tok/s, queued %d",
                len(step.reqs),
                usage,
                self._throughput(),
                len(self.waiting),
            )

    def snapshot(self) -> SchedulerStats:
        s = self.stats
        s.num_running, s.num_queued = len(self.running), len(self.waiting)
        s.free_slots = self.allocator.available()
        s.cached_slots = self.cache.total_size()
        s.evictable_slots = self.cache.evictable_size()
        s.running_slots = self.held_slots()
        s.radix_nodes = self.cache.num_nodes()
        prompt = sum(p for p, _ in self._recent_admissions)
        s.recent_hit_rate = sum(c for _, c in self._recent_admissions) / prompt if prompt else 0.0
        if self.estimates is not None:
            s.cache_estimates = self.estimates.estimates(s.recent_hit_rate, prompt)
            s.cache_estimate_seconds = self.estimates.seconds
        s.gen_throughput = self._throughput()
        s.queue_times = list(self._queue_times)
        self._queue_times.clear()
        if self.hicache is not None:
            s.hicache = self.hicache.snapshot()
        return s

    def top_prefixes(self, limit: int) -> list[dict]:
        """The dashboard's biggest cached prefixes, each with the tiers that hold it."""
        rows = []
        for prefix in self.cache.top_prefixes(limit):
            tiers = ["device"] + (
                self.hicache.tiers_of(prefix.tokens) if self.hicache is not None else []
            )
            rows.append(dict(vars(prefix), tiers=tiers))
        return rows

    def _throughput(self, window: float = 10.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent_tokens if now - t <= window]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0][0], 1e-6)
        return sum(n for _, n in recent) / span


def make_hicache(args: EngineArgs, executor: Executor) -> HiCache:
    """The tiers under the radix tree, sized from the device pool; blocks are named for this
    model, dtype, block size and TP layout."""
    info, pool = executor.info, executor.pool
    if args.hicache_size > 0:
        host_tokens = int(args.hicache_size * 2**30 // info.bytes_per_token)
    else:
        host_tokens = int(args.hicache_ratio * info.num_slots)
    model = args.model or "bundled"
    identity = fingerprint(
        model,
        args.seed if model.startswith("dummy:") else None,
        args.quantization,
        info.dtype,
        block_size(info.page_size),
        tuple(pool.k[0].shape[1:]),
        len(pool.k),
        args.tp_size,
    )
    hicache = HiCache.create(pool, info.page_size, host_tokens, identity, args.hicache_storage_dir)
    log.info(
        "hierarchical cache: host tier %d tokens (%.1f MB), %s%s",
        hicache.capacity_tokens(),
        hicache.capacity_tokens() * info.bytes_per_token / 2**20,
        args.hicache_write_policy,
        f", storage {hicache.storage.folder}" if hicache.storage else "",
    )
    return hicache


def _decode_mode(reqs: list[Req]) -> ForwardMode:
    """Decoding requests with drafts to verify run as an extend step (several tokens each)."""
    return ForwardMode.EXTEND if any(r.drafts for r in reqs) else ForwardMode.DECODE


def _decode_lens(reqs: list[Req]) -> list[int]:
    return [1 + len(r.drafts) for r in reqs]


def _logit_biases(ps: list[SamplingParams]) -> list[list[tuple[int, float]] | None] | None:
    if not any(p.logit_bias for p in ps):
        return None
    return [[(int(k), v) for k, v in p.logit_bias.items()] if p.logit_bias else None for p in ps]


def _pairs(top: list[tuple[int, float]]) -> list[list]:
    return [[lp, tid] for tid, lp in top]
