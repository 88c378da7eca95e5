"""N-gram speculation: drafts taken from a request's own context and from recent outputs.

A decoding request whose last tokens also occur earlier in its prompt or output (a RAG answer
quoting its context, an agent repeating a tool's output) proposes the tokens that followed that
earlier occurrence. The model checks all of them in one extend step (`worker/sampler.verify`).
Nothing here touches the model: a draft costs a dictionary lookup.

When speculation pays: each draft token adds a row to the step. `StepCost` learns the step time of
each row count as the server runs; `budget_drafts` keeps as many of the likeliest drafts (p^j for
the j-th draft of a request whose drafts are accepted with chance p) as give the step the most
expected tokens per second. On a GPU a row is nearly free and every draft is kept; on a small CPU
long drafts pay at batch 1, and at batch 8, where a row costs about a decoded token's share, only
the surest do (bench/results/speculative.md). A request that keeps missing stops proposing for
a while (exponentially longer after each run of misses)."""

from __future__ import annotations

import bisect
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..multimodal.processing import is_image_token

MIN_NGRAM = 3  # shorter matches are mostly chance in natural text (they cost rows, not output)
MAX_NGRAM = 5
ACCEPT_DECAY = 0.8  # weight of the past in a request's acceptance estimate
MISSES_BEFORE_PAUSE = 2
FIRST_PAUSE = 4  # output tokens without drafts after the first run of misses; doubles each time
MAX_PAUSE = 256
SHARED_NGRAMS = 200_000  # bound of the table of n-grams from recent outputs
COST_SAMPLES = 5  # recent steps of a row count whose median is its cost
PRIOR_STEP_S, PRIOR_ROW_S = 0.025, 0.0025  # the cost model before steps are measured (2-core CPU)
MIN_STEP_S = 1e-4
MIN_DRAFT_GAIN = 1e-3  # expected tokens below which a draft is not weighed


@dataclass
class SpecState:
    """A request's draft bookkeeping: its context index and acceptance record."""

    drafts: list[int] = field(default_factory=list)  # proposed for the step being run
    draft_masks: list[list[int]] = field(default_factory=list)  # grammar bitmasks after each draft
    accepted_ema: float = 1.0  # decayed sums: drafts accepted, and drafts tried (accepted or the
    tried_ema: float = 2.0  # first rejected), so accept_rate = P(next draft kept | previous kept)
    misses: int = 0
    pauses: int = 0
    paused_until: int = 0  # output length before which no drafts are proposed
    index: dict[tuple[int, ...], int] = field(
        default_factory=dict
    )  # n-gram -> end of its latest occurrence
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
    """Seconds of a forward step by its row count, as measured: the median of the last few steps
    of each count seen, linear between counts, and extended past the ends with the slope of the
    nearest two.

    Only steps without prompt chunks are measured: every row of a decode or verify step makes
    logits, a prompt row does not, so prompt steps would make verify rows look cheap. Drafts in a
    step that prompt chunks join are budgeted as in a decode step: the chunk costs the same with
    them or without, and a draft row costs about as much in either.

    A step's cost is not one line in its rows (GEMM tiles make some counts cheaper than fewer rows;
    bench/results/speculative.md), so no line is fitted over them. The median keeps a step
    slowed by something else (the api process's work on the same cores) from setting a count's
    cost."""

    def __init__(self) -> None:
        self.counts: list[int] = []  # row counts seen, sorted
        self.recent: dict[int, deque[float]] = {}
        self.medians: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        recent = self.recent.get(rows)
        if recent is None:
            bisect.insort(self.counts, rows)
            recent = self.recent[rows] = deque(maxlen=COST_SAMPLES)
        recent.append(seconds)
        self.medians[rows] = statistics.median(recent)

    def seconds(self, rows: int) -> float:
        """The expected seconds of a step of `rows` rows."""
        counts, medians = self.counts, self.medians
        if rows in medians:
            return medians[rows]
        if not counts:
            return PRIOR_STEP_S + PRIOR_ROW_S * rows
        if len(counts) == 1:
            return max(medians[counts[0]] + PRIOR_ROW_S * (rows - counts[0]), MIN_STEP_S)
        i = min(max(bisect.bisect_left(counts, rows), 1), len(counts) - 1)
        lo, hi = counts[i - 1], counts[i]
        slope = max((medians[hi] - medians[lo]) / (hi - lo), 0.0)
        return max(medians[lo] + slope * (rows - lo), MIN_STEP_S)


def budget_drafts(
    proposals: list[tuple[SpecState, list[int]]],
    rows: int,
    cost: StepCost,
    depth_seconds: float = 0.0,
) -> None:
    """Set each request's drafts to the prefix of its proposal worth verifying this step: the
    most likely draft tokens, as many as give the step the most expected tokens per second.
    `rows` is the step's rows without drafts (one per request, plus prompt chunks).

    `depth_seconds` is what drafting one token deeper costs the whole batch (a draft model's
    step; n-gram drafts cost nothing). Since that cost is shared, each depth limit is tried
    and the one with the most tokens per second is kept."""
    candidates = sorted(
        (
            (state.accept_rate ** (j + 1), j, i)
            for i, (state, draft) in enumerate(proposals)
            for j in range(len(draft))
        ),
        key=lambda c: (-c[0], c[1]),
    )
    longest = max((len(draft) for _, draft in proposals), default=0)
    best_rate, best = len(proposals) / cost.seconds(rows), [0] * len(proposals)
    for depth in range(1, longest + 1) if depth_seconds > 0 else [longest]:
        keep, tokens, added = [0] * len(proposals), float(len(proposals)), 0
        for gain, j, i in candidates:
            if gain < MIN_DRAFT_GAIN:
                break
            if j >= depth or j != keep[i]:
                continue
            keep[i] += 1
            tokens, added = tokens + gain, added + 1
            rate = tokens / (cost.seconds(rows + added) + depth * depth_seconds)
            if rate > best_rate:
                best_rate, best = rate, list(keep)
    for (state, draft), n in zip(proposals, best):
        state.drafts = draft[:n]


def text_only(draft: list[int]) -> list[int]:
    """The draft up to its first image token: an image's tokens are its features, which a
    decoding step has not got (a model only ever outputs text)."""
    cut = next((i for i, t in enumerate(draft) if is_image_token(t)), len(draft))
    return draft[:cut]


class NgramDrafter:
    """Proposes drafts by n-gram lookup: first in the request's own prompt and output, then in
    a bounded table of n-grams from the outputs of finished requests (LRU)."""

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.shared: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def propose(
        self, state: SpecState, tokens: list[int], output_len: int, limit: int
    ) -> list[int]:
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
                return text_only(tokens[end + 1 : end + 1 + limit])
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
                state.index[tuple(tokens[end + 1 - n : end + 1])] = end
        state.indexed = max(state.indexed, len(tokens) - 1)

    def remember(self, output: list[int]) -> None:
        """Keep a finished request's output n-grams, each with the tokens that followed it."""
        for end in range(MIN_NGRAM - 1, len(output) - 1):
            follow = tuple(output[end + 1 : end + 1 + self.max_drafts])
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                key = tuple(output[end + 1 - n : end + 1])
                self.shared[key] = follow
                self.shared.move_to_end(key)
        while len(self.shared) > SHARED_NGRAMS:
            self.shared.popitem(last=False)
