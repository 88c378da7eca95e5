"""Decode: every decoding request gets its next slot (and one per draft token) each step;
when memory is short, drafts go first, then requests are retracted."""

from __future__ import annotations

import logging

from ..config import EngineArgs
from ..constrained import GrammarBackend
from ..messages import SchedulerStats
from .draft_model import ModelDrafter
from .kv_manager import KVManager
from .queues import RequestQueues
from .req import Req
from .speculative import NgramDrafter, StepCost, budget_drafts

log = logging.getLogger(__name__)

RATIO_DECAY_STEPS = 600  # decode steps for the new-token ratio to fall from its start to its floor
RETRACT_RATIO_STEP = 0.15  # how much a retraction raises it


class OutOfMemory(RuntimeError):
    """A lone request needs more KV than the pool can give; it fails, the server goes on."""

    def __init__(self, req: Req, free: int):
        super().__init__(
            f"out of KV memory: request {req.rid} holds {len(req.kv_slots)} slots and needs more, "
            f"with {free} free and no other request to retract (--max-total-tokens)"
        )
        self.req = req


class Retraction:
    """Sends running requests back to the queue when KV memory runs out, and keeps the
    new-token ratio: the share of each request's remaining output that admission reserves."""

    def __init__(
        self,
        args: EngineArgs,
        kv: KVManager,
        queues: RequestQueues,
        stats: SchedulerStats,
    ):
        self.args, self.kv, self.queues, self.stats = args, kv, queues, stats
        self.new_token_ratio = args.new_token_ratio

    def decay(self) -> None:
        step = (self.args.new_token_ratio - self.args.min_new_token_ratio) / RATIO_DECAY_STEPS
        self.new_token_ratio = max(self.args.min_new_token_ratio, self.new_token_ratio - step)

    def reserved_decode_slots(self) -> float:
        return sum(r.remaining_new_tokens for r in self.queues.running) * self.new_token_ratio

    def pick_victim(self) -> Req | None:
        """The running request to retract: the lowest priority, then the cheapest to redo
        (fewest own computed tokens); never the last one."""
        if self.queues.num_running() <= 1:
            return None
        return min(
            self.queues.running,
            key=lambda r: (r.priority, len(r.kv_slots) - r.cached_len, -len(r.input_ids)),
        )

    def retract(self, req: Req, reason: str = "for lack of KV memory") -> None:
        """Send a running request back to the queue; its computed KV stays cached (evictable)."""
        self.kv.release(req)
        req.kv_slots, req.cached_len, req.node, req.row, req.synced = [], 0, None, None, 0
        req.pooled = None  # an embedding request pools its prompt again from the start
        if req.spec is not None:
            req.spec.drafts = []
        if not req.prompt_logprobs_done:
            req.input_logprobs, req.input_top_logprobs = [], []
        self.queues.retract(req)
        self.stats.retractions_total += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_STEP)
        log.info("retracted %s (%d tokens) %s", req.rid, len(req.fill_ids), reason)


class DecodePlanner:
    def __init__(
        self,
        args: EngineArgs,
        kv: KVManager,
        retraction: Retraction,
        grammars: GrammarBackend | None,
        drafter: NgramDrafter | None,
        model_drafter: ModelDrafter | None,
    ):
        self.args, self.kv, self.retraction, self.grammars = args, kv, retraction, grammars
        self.drafter, self.model_drafter = drafter, model_drafter
        self.step_cost = StepCost()

    def prepare(self, running: list[Req]) -> list[Req]:
        """One more slot for every decoding request, and one per draft token; when memory is
        short, drafts go first, then the lowest-priority, cheapest requests are retracted.
        Raises OutOfMemory when a lone request cannot grow."""
        reqs = [r for r in running if r.is_decoding]
        if not reqs:
            return []
        self._propose_drafts(reqs)
        self.kv.trim_windows(reqs)
        while not self.kv.make_room(sum(self.kv.pages_for(r, 1 + len(r.drafts)) for r in reqs)):
            if any(r.drafts for r in reqs):
                for r in reqs:
                    r.spec.drafts = []
                continue
            victim = self.retraction.pick_victim()
            if victim is None:
                raise OutOfMemory(reqs[0], self.kv.allocator.available())
            self.retraction.retract(victim)
            reqs = [r for r in reqs if r is not victim]
        for req in reqs:
            assert self.kv.alloc(req, 1 + len(req.drafts))
        self.retraction.decay()
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
            budget_drafts(proposals, len(reqs), self.step_cost, self.draft_step_seconds())
            if self.model_drafter is not None:
                self.model_drafter.drafting = any(state.drafts for state, _ in proposals)

    def _draft_candidates(self, req: Req) -> list[int]:
        """The n-gram drafter's tokens; for a draft model, placeholders for as many as it may
        draft."""
        limit = req.remaining_new_tokens - 1
        if self.model_drafter is not None:
            return [0] * max(min(limit, self.args.speculative_num_draft_tokens), 0)
        return self.drafter.propose(req.spec, req.fill_ids, len(req.output_ids), limit)

    def draft_step_seconds(self) -> float:
        return self.model_drafter.step_seconds if self.model_drafter is not None else 0.0

    def finalize_drafts(self, decoding: list[Req]) -> None:
        """Once a step's requests are known: a draft model drafts its tokens now, and drafts a
        grammar refuses are dropped (so each request's chunk length is final)."""
        if self.model_drafter is not None and any(r.drafts for r in decoding):
            self.model_drafter.propose([r for r in decoding if r.drafts])
        for req in decoding:
            if req.drafts and req.grammar is not None:
                self._check_drafts_against_grammar(req)

    def _check_drafts_against_grammar(self, req: Req) -> None:
        """Keep the drafts the request's grammar allows, with the bitmask of each row after
        them."""
        spec = req.spec
        spec.draft_masks = self.grammars.draft_masks(req.grammar, spec.drafts)
        dropped = len(spec.drafts) - len(spec.draft_masks)
        if dropped:
            del spec.drafts[len(spec.draft_masks) :]
            self.kv.free_tail(req, len(req.kv_slots) - dropped)
