"""N-gram speculation: drafts taken from a request's own context and from recent outputs.

A decoding request whose last tokens also occur earlier in its prompt or output (a RAG answer
quoting its context, an agent repeating a tool's output) proposes the tokens that followed that
earlier occurrence. The model checks all of them in one extend step (`worker/sampler.verify`).
Nothing here touches the model: a draft costs a dictionary lookup.

When speculation pays: a verified draft token adds a row to the step; on this CPU a decode step
of B requests costs ~25 ms at B=1 and ~2 ms per extra row at B=8, so a draft token is worth
its row once the chance it is accepted exceeds roughly `PAYOFF_PER_REQUEST` x B. Each request
keeps an estimate of its acceptance rate and proposes only while that clears the bar; after
misses it backs off (exponentially longer) before it tries again with one draft token.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MIN_NGRAM = 3  # shorter matches are mostly chance in natural text (they cost rows, not output)
MAX_NGRAM = 5
PAYOFF_PER_REQUEST = 0.05  # acceptance needed per request in the batch (see the module docstring)
ACCEPT_DECAY = 0.7  # weight of the past in a request's acceptance estimate
MISSES_BEFORE_PAUSE = 2
FIRST_PAUSE = 4  # output tokens without drafts after the first run of misses; doubles each time
MAX_PAUSE = 256
SHARED_NGRAMS = 200_000  # bound of the table of n-grams from recent outputs


@dataclass
class SpecState:
    """A request's draft bookkeeping: its context index, draft length and acceptance record."""

    max_drafts: int
    drafts: list[int] = field(default_factory=list)  # proposed for the step being run
    k: int = 1  # drafts to propose next
    accept_rate: float = 0.5
    misses: int = 0
    pauses: int = 0
    paused_until: int = 0  # output length before which no drafts are proposed
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    indexed: int = 0  # context positions whose n-grams are in `index`
    verify_steps: int = 0
    accepted_total: int = 0

    def __post_init__(self) -> None:
        self.k = self.max_drafts

    def record(self, proposed: int, accepted: int, output_len: int) -> None:
        """Adapt after a verify step: grow k after a full acceptance, shrink it to what was
        accepted (plus one) otherwise; pause after repeated misses."""
        self.verify_steps += 1
        self.accepted_total += accepted
        self.accept_rate = ACCEPT_DECAY * self.accept_rate + (1 - ACCEPT_DECAY) * accepted / proposed
        self.k = min(self.max_drafts, proposed + 1) if accepted == proposed else accepted + 1
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.pause(output_len)

    def pause(self, output_len: int) -> None:
        self.paused_until = output_len + min(FIRST_PAUSE << self.pauses, MAX_PAUSE)
        self.pauses += 1
        self.misses, self.k = 0, 1

    @property
    def accept_length(self) -> float:
        """Tokens per verify step: accepted drafts plus the token every step samples."""
        return 1 + self.accepted_total / self.verify_steps if self.verify_steps else 0.0


class NgramDrafter:
    """Proposes drafts by n-gram lookup: first in the request's own prompt and output, then in
    a bounded table of n-grams from the outputs of finished requests (LRU)."""

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.shared: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def new_state(self) -> SpecState:
        return SpecState(self.max_drafts)

    def propose(self, state: SpecState, tokens: list[int], output_len: int, batch_size: int) -> list[int]:
        """Draft tokens to follow `tokens` (prompt and output so far), or none where speculation
        does not pay for this request now."""
        if output_len < state.paused_until:
            return []
        if state.accept_rate < PAYOFF_PER_REQUEST * batch_size:
            state.pause(output_len)  # probe again later with one token
            state.accept_rate = PAYOFF_PER_REQUEST * batch_size
            return []
        self._index(state, tokens)
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            key = tuple(tokens[-n:])
            end = state.index.get(key)
            if end is not None:
                return tokens[end + 1:end + 1 + state.k]
            follow = self.shared.get(key)
            if follow is not None:
                self.shared.move_to_end(key)
                return list(follow[:state.k])
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
