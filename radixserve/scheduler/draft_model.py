"""Draft-model speculation: a smaller model with the same tokenizer drafts each request's next
tokens.

The draft model's K/V lives in a pool of its own at the target's slot numbers, and it reads the
target's request-to-token table (`worker.model_runner.SlotLayout`): a slot holds both models'
K/V for its token, so allocation, the radix tree, retraction and freeing serve both unchanged.

Which slots hold draft K/V: while drafting pays, the draft runs over every prompt chunk the
target computes (`prefill`), so cached prefixes carry it. While decoding, `SpecState.draft_len`
counts a request's leading positions whose draft K/V is written. A round (`propose`) starts
with one extend step over the positions since then (the newest token, and accepted drafts the
draft model never fed), which drafts the first token, then runs one decode step per further
draft. The draft writes the rank-0 table entries it needs but leaves `req.synced` alone: with
tensor parallelism the target's next step must still send those entries to the other ranks,
whose tables are their own.

When the draft budget has stopped asking for drafts (the draft model costs more than its
drafts bring), prompt chunks skip the draft model; a request that drafts again later catches
up from its own `draft_len` in its first extend step. K/V loaded from the hierarchical cache's
tiers, and cached prefixes computed while drafting was off, have no draft K/V: drafts there
are worse, the output is the same, since the target verifies every draft.

Drafts are the draft model's greedy tokens, for every request: verification (`sampler.verify`)
keeps the target's distribution whatever the draft proposes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from ..messages import ForwardBatch, ForwardMode, ForwardResult, SamplingBatch
from ..worker_info import WorkerInfo

if TYPE_CHECKING:
    from .req import Req

STEP_DECAY = 0.9  # weight of the past in the measured seconds of a draft step


class DraftExecutor(Protocol):
    info: WorkerInfo

    def forward(self, batch: ForwardBatch) -> ForwardResult: ...


class ModelDrafter:
    def __init__(self, executor: DraftExecutor):
        self.executor = executor
        self.step_seconds = (
            0.0  # measured cost of one draft step (0 until measured: drafts get tried)
        )
        self.drafting = True  # whether the last draft budget kept any draft

    def prefill(self, reqs: list[Req], batch: ForwardBatch, num_prefill: int) -> None:
        """Run the draft model over the prompt chunks the target just computed: the first
        `num_prefill` requests of `batch`, whose table entries the target step has written."""
        if not self.drafting:
            return
        n, tokens = num_prefill, sum(batch.extend_lens[:num_prefill])
        self.executor.forward(
            ForwardBatch(
                ForwardMode.EXTEND,
                batch.input_ids[:tokens],
                batch.positions[:tokens],
                batch.out_cache_loc[:tokens],
                batch.rows[:n],
                batch.seq_lens[:n],
                batch.extend_lens[:n],
                [],
                SamplingBatch.greedy(n),
                [None] * n,
            )
        )
        for req, seq_len in zip(reqs[:n], batch.seq_lens[:n]):
            req.spec.draft_len = seq_len

    def propose(self, reqs: list[Req]) -> None:
        """Replace each request's placeholder drafts (their number budgeted, their slots
        allocated) with the draft model's tokens."""
        wanted = [len(r.drafts) for r in reqs]
        firsts = []
        for req in reqs:
            end = len(req.fill_ids)
            start = min(req.spec.draft_len, end - 1)
            firsts.append((req, req.fill_ids[start:end], start))
        drafts = [[t] for t in self._run(ForwardMode.EXTEND, firsts)]
        for j in range(1, max(wanted)):
            live = [i for i, k in enumerate(wanted) if k > j]
            steps = [(reqs[i], drafts[i][-1:], len(reqs[i].fill_ids) + j - 1) for i in live]
            for i, token in zip(live, self._run(ForwardMode.DECODE, steps)):
                drafts[i].append(token)
        for req, draft in zip(reqs, drafts):
            req.spec.drafts = draft
            req.spec.draft_len = len(req.fill_ids) + len(draft) - 1  # the last draft is never fed

    def _run(self, mode: ForwardMode, items: list[tuple[Req, list[int], int]]) -> list[int]:
        """One draft step: request r feeds `tokens` from position `start`, into its own slots."""
        ids, positions, locs, writes, seq_lens = [], [], [], [], []
        for req, tokens, start in items:
            end = start + len(tokens)
            ids += tokens
            positions += range(start, end)
            locs += req.kv_slots[start:end]
            if req.synced < start:  # the table is rank 0's: make sure its row's prefix is written
                writes.append((req.row, req.synced, req.kv_slots[req.synced : start]))
            # `req.synced` stays the target's: its step sends the same entries to the other TP ranks
            seq_lens.append(end)
        n = len(items)
        batch = ForwardBatch(
            mode,
            ids,
            positions,
            locs,
            [r.row for r, _, _ in items],
            seq_lens,
            [len(t) for _, t, _ in items],
            writes,
            SamplingBatch.greedy(n),
            [None] * n,
        )
        started = time.perf_counter()
        tokens = self.executor.forward(batch).next_token_ids
        seconds = time.perf_counter() - started
        self.step_seconds = (
            STEP_DECAY * self.step_seconds + (1 - STEP_DECAY) * seconds
            if self.step_seconds
            else seconds
        )
        return tokens
