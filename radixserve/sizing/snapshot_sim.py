"""What-if replay of state-snapshot policies for a hybrid model (recurrent layers beside
attention), over a request log: where each policy keeps snapshots, and so how many prompt
tokens each request could have resumed from the cache, with the same number of snapshot slots.

A hybrid model resumes a cached prefix only where a snapshot of its recurrent state was kept
(`scheduler/snapshots.py`). The policies:
- `radixserve`: where each request ends (prompt and output); where a request leaves a cached
  path that keeps no snapshot (its chunk ends there); where a prompt chunk ends and every
  `interval` tokens, while a slot is free.
- `chunk_end` (SGLang's MambaRadixCache): where each prompt chunk ends and where each request
  ends.
- `block_aligned` (vLLM's `align` mode): one checkpoint per request, at the last block boundary
  of what it computed (blocks of `block` tokens, sized so a block's KV covers a state).
Snapshots are evicted least recently used first. The KV is never evicted here: the replay
isolates the snapshot policy. Requests are admitted in the log's order, each prompt computed in
chunks at admission (so requests of one batch see each other's chunks as a server that admits
one prompt a step does), each request's output cached when it finishes."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from ..mem.radix_cache import RadixCache
from ..scheduler.snapshots import StateSnapshots, at_snapshot
from .cache_sim import Trace, TraceRequest


@dataclass(frozen=True)
class SnapshotPolicy:
    name: str
    request_end: bool = True  # where each request ends, evicting if need be
    branch_points: bool = False  # where a request leaves a cached path without a snapshot
    chunk_ends: str = "no"  # "free": while a slot is free; "always": evicting if need be
    interval: int = 0  # also every `interval` tokens while a slot is free (0: no)
    block: int = 0  # one checkpoint per request at its last block boundary (0: no)


def policies(block: int, interval: int) -> list[SnapshotPolicy]:
    """The three policies: `block` vLLM's block size for the model, `interval` radixserve's."""
    return [
        SnapshotPolicy("radixserve", branch_points=True, chunk_ends="free", interval=interval),
        SnapshotPolicy("chunk_end", chunk_ends="always"),
        SnapshotPolicy("block_aligned", request_end=False, block=block),
    ]


@dataclass(frozen=True)
class SnapshotReplay:
    policy: str
    slots: int
    prompt_tokens: int
    cached_tokens: int
    kv_cached_tokens: int  # what the KV alone would give (a snapshot wherever asked)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def kv_bound(self) -> float:
        """The hit rate no snapshot policy can exceed on this log."""
        return self.kv_cached_tokens / max(self.prompt_tokens, 1)


class _Replay:
    def __init__(self, policy: SnapshotPolicy, slots: int, chunk: int):
        self.policy, self.chunk = policy, chunk
        self.snapshots = StateSnapshots(0, slots)
        self.cache = RadixCache(1, lambda slots: None, drop_snapshot=self.snapshots.drop)
        self.names = itertools.count(1)
        self.prompt = self.cached = self.kv_cached = 0

    def keep(self, units: tuple[int, ...], end: int, evict: bool) -> None:
        """A snapshot at `end` of `units` (cached up to there), if the policy's slots allow."""
        if end <= 0:
            return
        _, node = self.cache.match_prefix(list(units[:end]))
        if node.snapshot is None:
            self.snapshots.take(node, evict)
        else:
            self.snapshots.touch(node.snapshot)

    def cache_upto(self, units: tuple[int, ...], end: int) -> None:
        key = list(units[:end])
        self.cache.insert(key, [next(self.names) for _ in key])

    def admit(self, r: TraceRequest) -> None:
        slots, node = self.cache.match_prefix(list(r.units[: r.lookup_units]))
        matched = len(slots)
        self.kv_cached += matched
        slots, node = at_snapshot(slots, node)
        if slots:
            self.snapshots.touch(node.snapshot)
        self.prompt += r.prompt_tokens
        self.cached += len(slots)
        branch_at = matched if matched > len(slots) and self.policy.branch_points else None
        for end in self.chunk_ends(len(slots), r.prompt_units, branch_at):
            self.cache_upto(r.units, end)
            policy = self.policy
            at_branch = end == branch_at
            interval = policy.interval and end % policy.interval == 0
            if at_branch or policy.chunk_ends != "no" or interval:
                evict = at_branch or policy.chunk_ends == "always"
                self.keep(r.units, end, evict)

    def chunk_ends(self, start: int, end: int, branch_at: int | None):
        """Where a prompt computed from `start` to `end` ends its chunks: every `chunk`
        tokens, at the branch point and at interval multiples."""
        position, interval = start, self.policy.interval
        while position < end:
            stop = min(position + self.chunk, end)
            if branch_at is not None and position < branch_at < stop:
                stop = branch_at
            if interval and (position // interval + 1) * interval < stop:
                stop = (position // interval + 1) * interval
            position = stop
            yield position

    def finish(self, r: TraceRequest) -> None:
        self.cache_upto(r.units, len(r.units))
        if self.policy.request_end:
            self.keep(r.units, len(r.units), evict=True)
        if self.policy.block:
            self.keep(r.units, len(r.units) // self.policy.block * self.policy.block, True)


def replay_snapshots(
    trace: Trace, policy: SnapshotPolicy, slots: int, chunk: int
) -> SnapshotReplay:
    """Replay a full (token-level) trace through `policy` with `slots` snapshot slots."""
    if trace.unit_tokens != 1:
        raise ValueError("snapshot policies replay only full request logs (token ids)")
    replay = _Replay(policy, slots, chunk)
    events = [(r.admitted, 0, i) for i, r in enumerate(trace.requests)]
    events += [(r.finished, 1, i) for i, r in enumerate(trace.requests)]
    heapq.heapify(events)
    while events:
        _, kind, i = heapq.heappop(events)
        (replay.admit if kind == 0 else replay.finish)(trace.requests[i])
    return SnapshotReplay(policy.name, slots, replay.prompt, replay.cached, replay.kv_cached)
