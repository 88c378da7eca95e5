"""N-gram speculation: drafts taken from a request's own context and from recent outputs.

A decoding request whose last tokens also occur earlier in its prompt or output (a RAG answer
quoting its context, an agent repeating a tool's output) proposes the tokens that followed that
earlier occurrence. The model checks all of them in one extend step (`worker/sampler.verify`).
Nothing here touches the model: a draft costs a dictionary lookup.

When speculation pays: each draft token adds a row to the step. `StepCost` fits the step time
to its rows as the server runs (a + b x rows); `budget_drafts` keeps a draft only while its
expected tokens (p^j for the j-th draft of a request whose drafts are accepted with chance p)
raise the step's tokens per second. On a GPU a row is nearly free and every draft is kept; on
this CPU (~25 ms a step at 1 row, ~2.5 ms per more row) long drafts pay at batch 1, and at
batch 8 only the first drafts of requests that copy well. A request that keeps missing stops
proposing for a while (exponentially longer after each run of misses).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MIN_NGRAM = 3  # shorter matches are mostly chance in natural text (they cost rows, not output)
MAX_NGRAM = 5
ACCEPT_DECAY = 0.8  # weight of the past in a request's acceptance estimate
MISSES_BEFORE_PAUSE = 2
FIRST_PAUSE = 4  # output tokens without drafts after the first run of misses; doubles each time
MAX_PAUSE = 256
SHARED_NGRAMS = 200_000  # bound of the table of n-grams from recent outputs
COST_DECAY = 0.98  # weight of the past in the step-cost fit
PRIOR_STEP_S, PRIOR_ROW_S = 0.025, 0.0025  # the cost model before steps are measured (2-core CPU)


@dataclass
class SpecState:
    """A request's draft bookkeeping: its context index and acceptance record."""

    drafts: list[int] = field(default_factory=list)  # proposed for the step being run
    draft_masks: list[list[int]] = field(default_factory=list)  # grammar bitmasks after each draft
    accepted_ema: float = 1.0  # decayed sums: drafts accepted, and drafts tried (accepted or the
    tried_ema: float = 2.0     # first rejected), so accept_rate = P(next draft kept | previous kept)
    misses: int = 0
    pauses: int = 0
    paused_until: int = 0  # output length before which no drafts are proposed
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    indexed: int = 0  # context positions whose n-grams are in `index`
    verify_steps: int = 0
    accepted_total: int = 0
    draft_len: int = 0  # draft model only: leading positions whose draft-model K/V is written

    @property
    def accept_rate(self) -> float:
        return self.accepted_ema / self.tried_ema

    def record(self, proposed: int, accepted: int, output_len: int) -> None:
        """Update the acceptance estimate after a verify step; pause after repeated misses."""
        self.verify_steps += 1
        self.accepted_total += accepted
        tried = accepted + (accepted < proposed)
        self.accepted_ema = ACCEPT_DECAY * self.accepted_ema + accepted
        self.tried_ema = ACCEPT_DECAY * self.tried_ema + tried
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.paused_until = output_len + min(FIRST_PAUSE << self.pauses, MAX_PAUSE)
            self.pauses += 1
            self.misses = 0


class StepCost:
    """Seconds of a forward step as a + b x rows, fitted by decayed least squares over the
    steps run so far (the prior holds until the row counts have varied)."""

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = COST_DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds

    def coefficients(self) -> tuple[float, float]:
        var = self.n * self.sxx - self.sx ** 2
        if self.n < 8 or var < 1e-9 * max(self.sxx, 1.0) * self.n:
            return PRIOR_STEP_S, PRIOR_ROW_S
        b = max((self.n * self.sxy - self.sx * self.sy) / var, 0.0)
        a = max((self.sy - b * self.sx) / self.n, 1e-4)
        return a, b


def budget_drafts(proposals: list[tuple[SpecState, list[int]]], rows: int, cost: StepCost,
                  depth_seconds: float = 0.0) -> None:
    """Set each request's drafts to the prefix of its proposal worth verifying this step: add
    draft tokens, most likely first, while each raises the step's expected tokens per second.
    `rows` is the step's rows without drafts (one per request, plus prompt chunks).

    `depth_seconds` is what drafting one token deeper costs the whole batch (a draft model's
    step; n-gram drafts cost nothing). Since that cost is shared, each depth limit is tried
    and the one with the most tokens per second is kept."""
    a, b = cost.coefficients()
    candidates = sorted(((state.accept_rate ** (j + 1), j, i) for i, (state, draft) in enumerate(proposals)
                         for j in range(len(draft))), key=lambda c: (-c[0], c[1]))
    longest = max((len(draft) for _, draft in proposals), default=0)
    best_rate, best = len(proposals) / (a + b * rows), [0] * len(proposals)
    for depth in range(1, longest + 1) if depth_seconds > 0 else [longest]:
        keep = [0] * len(proposals)
        tokens, seconds = float(len(proposals)), a + b * rows + depth * depth_seconds
        for gain, j, i in candidates:
            if j >= depth or j != keep[i]:
                continue
            if (tokens + gain) / (seconds + b) <= tokens / seconds:
                break
            keep[i] += 1
            tokens, seconds = tokens + gain, seconds + b
        if tokens / seconds > best_rate:
            best_rate, best = tokens / seconds, keep
    for (state, draft), n in zip(proposals, best):
        state.drafts = draft[:n]


class NgramDrafter:
    """Proposes drafts by n-gram lookup: first in the request's own prompt and output, then in
    a bounded table of n-grams from the outputs of finished requests (LRU)."""

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.shared: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def propose(self, state: SpecState, tokens: list[int], output_len: int, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow `tokens` (prompt and output so far); none while
        the request is paused."""
        if output_len < state.paused_until or limit <= 0:
            return []
        limit = min(limit, self.max_drafts)
        self._index(state, tokens)
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            key = tuple(tokens[-n:])
            end = state.index.get(key)
            if end is not None:
                return tokens[end + 1:end + 1 + limit]
            follow = self.shared.get(key)
            if follow is not None:
                self.shared.move_to_end(key)
                return list(follow[:limit])
        return []

    @staticmethod
    def _index(state: SpecState, tokens: list[int]) -> None:
        """Index the n-grams ending before the last token (the last one is the lookup key)."""
        for end in range(state.indexed, len(tokens) - 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                state.index[tuple(tokens[end + 1 - n:end + 1])] = end
        state.indexed = max(state.indexed, len(tokens) - 1)

    def remember(self, output: list[int]) -> None:
        """Keep a finished request's output n-grams, each with the tokens that followed it."""
        for end in range(MIN_NGRAM - 1, len(output) - 1):
            follow = tuple(output[end + 1:end + 1 + self.max_drafts])
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                key = tuple(output[end + 1 - n:end + 1])
                self.shared[key] = follow
                self.shared.move_to_end(key)
        while len(self.shared) > SHARED_NGRAMS:
            self.shared.popitem(last=False)
