"""What-if replay of a request trace through the real radix cache and router policies (no model).

A trace is a list of requests in cache *units*: token ids (a `full` request log, one unit per
token) or chained block hashes (a `hashes` log, one unit per 16 tokens). Each request is
replayed as three events, in time order: it arrives (the router picks a replica); it is
admitted (its prompt is matched against that replica's `RadixCache`, the hit, then cached and
locked: a server computes it in chunks from here on, and defers a request that shares a part
still being computed until that part is cached); it finishes (prompt and output cached,
unlocked). A server that retracts requests for lack of memory unlocks their KV meanwhile and
computes it again; the replay keeps it locked, so where a pool cannot hold the prompts in
flight, the two part. A replica's KV
pool holds `capacity` units; when it is full, the cache's eviction policy frees room. The
replay clock is logical, so a replay is deterministic.

`optimal_hit_rate` bounds every policy from above: Belady's MIN with bypass over units, each
unit named by its whole prefix, where any resident unit may hit (no prefix rule), nothing is
locked, the replicas' pools are pooled into one, and a unit may be loaded whenever the replay
could cache it (when its request is admitted or finished). Every replayed setting is a
feasible schedule of that relaxed problem, so its hits cannot exceed MIN's. (A server that
retracts requests caches their recomputed prefixes at times the log does not record, so it can
beat this bound where retraction is heavy.)
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, replace

from ..kv_events import block_hash, chain_hashes
from ..mem.shadow import ReplicaCache
from ..request_log import RequestRecord
from ..router.config import RouterArgs
from ..router.keys import MAX_CODE_POINT, ids_key
from ..router.policies import CacheAware, make_policy
from ..router.tree import PrefixTree
from ..router.workers import CircuitBreaker, Worker

SALT_UNITS = 0x100000  # salt units lie above every vocabulary, below the last code point


def salt_unit(salt: int) -> int:
    """The unit a salted request's units start with (`RequestRecord.salt` folded)."""
    return SALT_UNITS + salt % (MAX_CODE_POINT - SALT_UNITS)


def _block_hashes(units: tuple[int, ...], block: int) -> list[int]:
    """Chained hashes of a full trace's whole token blocks; a leading salt unit starts the
    chain instead of taking a token's place."""
    if units and units[0] >= SALT_UNITS:
        return chain_hashes(list(units[1:]), block, block_hash(None, [units[0]]))
    return chain_hashes(list(units), block)


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds
    admitted: float
    finished: float
    units: tuple[int, ...]  # prompt, then output, in cache units
    prompt_units: int  # units[:prompt_units] is the prompt
    lookup_units: int  # units the server may match (a prompt's last token is always computed)
    prompt_tokens: int
    cached_tokens: int = 0  # what the server measured, when the trace is a log


@dataclass(frozen=True)
class Trace:
    requests: list[TraceRequest]
    unit_tokens: int  # tokens per unit

    @classmethod
    def from_log(cls, records: list[RequestRecord], hash_block: int) -> "Trace":
        """The admitted requests of a log (others never touched the cache). Hashes are renamed to
        small integers, so that units are also valid routing-key characters."""
        admitted = [r for r in records if r.admitted]
        full = all(r.prompt_ids is not None for r in admitted)
        names: dict[int, int] = {}
        start = min((r.arrival for r in admitted), default=0.0)
        requests = []
        for r in admitted:
            if (
                full
            ):  # the cache holds prompt + output but the newest token (its KV is not computed)
                # a salt leads as a unit no token id reaches: salts never share a prefix
                salt = () if r.salt is None else (salt_unit(r.salt),)
                units = salt + tuple(r.prompt_ids + r.output_ids[:-1])
                prompt_units, lookup = len(salt) + r.prompt_tokens, len(salt) + r.prompt_tokens - 1
            else:
                units = tuple(names.setdefault(h, len(names)) for h in r.block_hashes)
                prompt_units, lookup = (
                    r.prompt_tokens // hash_block,
                    (r.prompt_tokens - 1) // hash_block,
                )
            arrival = r.arrival - start
            requests.append(
                TraceRequest(
                    arrival,
                    arrival + r.queue_time,
                    arrival + r.latency,
                    units,
                    prompt_units,
                    lookup,
                    r.prompt_tokens,
                    r.cached_tokens,
                )
            )
        return cls(requests, 1 if full else hash_block)

    def in_blocks(self, block: int) -> "Trace":
        """The same requests in units of `block` tokens, named by chained hashes as a `hashes`
        log names them: a replay about `block` times faster, its matches counted in whole blocks."""
        if block == self.unit_tokens:
            return self
        if self.unit_tokens != 1:
            raise ValueError(
                f"this log is stored in blocks of {self.unit_tokens} tokens; it replays only in "
                "those"
            )
        names: dict[int, int] = {}
        requests = [
            replace(
                r,
                units=tuple(names.setdefault(h, len(names)) for h in _block_hashes(r.units, block)),
                prompt_units=r.prompt_tokens // block,
                lookup_units=(r.prompt_tokens - 1) // block,
            )
            for r in self.requests
        ]
        return Trace(requests, block)

    def measured_hit_rate(self) -> float:
        """The server's own hit rate over these requests: cached prompt tokens / prompt tokens."""
        return sum(r.cached_tokens for r in self.requests) / max(
            sum(r.prompt_tokens for r in self.requests), 1
        )


@dataclass(frozen=True)
class Setting:
    cache_tokens: int  # KV pool of each replica
    eviction: str = "lru"
    dp: int = 1
    router: str = "cache_aware"


@dataclass(frozen=True)
class Result:
    setting: Setting
    hit_rate: float
    optimum: float  # Belady's MIN over the same total memory (an upper bound)


def replay(trace: Trace, setting: Setting) -> float:
    """Hit rate (cached prompt tokens / prompt tokens) of `trace` under `setting`."""
    clock = itertools.count().__next__
    # a pool larger than the whole trace is as good as unbounded (and its free list stays small)
    capacity = min(
        setting.cache_tokens // trace.unit_tokens, sum(len(r.units) for r in trace.requests)
    )
    replicas = [ReplicaCache(capacity, setting.eviction, clock) for _ in range(setting.dp)]
    workers = [Worker(f"replica-{i}", CircuitBreaker()) for i in range(setting.dp)]
    router = RouterArgs(policy=setting.router)
    policy = (
        CacheAware(router, PrefixTree(clock=clock))
        if setting.router == "cache_aware"
        else make_policy(router, seed=0)
    )
    placed: dict[int, int] = {}
    hit_tokens, next_tree_eviction = 0, router.eviction_interval_secs
    for _, kind, i in _events(trace):
        r = trace.requests[i]
        if kind == ARRIVE:
            if isinstance(policy, CacheAware) and r.arrival >= next_tree_eviction:
                policy.evict()
                next_tree_eviction += router.eviction_interval_secs
            worker = policy.pick(workers, ids_key(list(r.units[: r.prompt_units])))
            worker.in_flight += 1
            placed[i] = workers.index(worker)
        elif kind == ADMIT:
            matched = replicas[placed[i]].admit(i, r.units[: r.prompt_units], r.lookup_units)
            hit_tokens += min(matched * trace.unit_tokens, r.prompt_tokens)
        else:
            replicas[placed[i]].finish(i, r.units)
            workers[placed[i]].in_flight -= 1
    return hit_tokens / max(sum(r.prompt_tokens for r in trace.requests), 1)


ARRIVE, ADMIT, FINISH = 0, 1, 2  # at equal times, a request's own events keep this order


def _events(trace: Trace) -> list[tuple[float, int, int]]:
    """(time, kind, request) in time order."""
    events = []
    for i, r in enumerate(trace.requests):
        admitted = max(r.admitted, r.arrival)
        events += [
            (r.arrival, ARRIVE, i),
            (admitted, ADMIT, i),
            (max(r.finished, admitted), FINISH, i),
        ]
    return sorted(events)


def optimal_hit_rate(trace: Trace, capacity_tokens: int) -> float:
    """Belady's MIN with bypass over the trace's unit accesses (see the module docstring)."""
    names: dict[tuple[int, int], int] = {}
    accesses: list[tuple[int, bool]] = []  # (unit named by its prefix, counts as a possible hit)
    paths = [_prefix_names(r.units, names) for r in trace.requests]
    for _, kind, i in _events(trace):
        r = trace.requests[i]
        if kind == ADMIT:
            accesses += [(u, j < r.lookup_units) for j, u in enumerate(paths[i][: r.prompt_units])]
        elif kind == FINISH:
            accesses += [(u, False) for u in paths[i]]
    never = len(accesses)
    next_hit = [never] * len(accesses)  # index of the unit's next counted access
    upcoming: dict[int, int] = {}
    for k in range(len(accesses) - 1, -1, -1):
        unit, counted = accesses[k]
        next_hit[k] = upcoming.get(unit, never)
        if counted:
            upcoming[unit] = k
    capacity = capacity_tokens // trace.unit_tokens
    resident: dict[int, int] = {}  # unit -> its next counted access
    farthest: list[tuple[int, int]] = []  # (-next access, unit), stale entries skipped
    hits = 0
    for k, (unit, counted) in enumerate(accesses):
        if counted and unit in resident:
            hits += 1
        if next_hit[k] == never:
            resident.pop(unit, None)  # never hit again: holding it cannot help
            continue
        resident[unit] = next_hit[k]
        heapq.heappush(farthest, (-next_hit[k], unit))
        while len(resident) > capacity:
            negative, victim = heapq.heappop(farthest)
            if resident.get(victim) == -negative:
                del resident[victim]
    return hits * trace.unit_tokens / max(sum(r.prompt_tokens for r in trace.requests), 1)


def _prefix_names(units: tuple[int, ...], names: dict[tuple[int, int], int]) -> list[int]:
    """Each unit named by its whole prefix (the same token after different prefixes differs)."""
    out, parent = [], -1
    for unit in units:
        parent = names.setdefault((parent, unit), len(names))
        out.append(parent)
    return out


def sweep(trace: Trace, settings: list[Setting]) -> list[Result]:
    optimum: dict[int, float] = {}
    results = []
    for setting in settings:
        total = setting.cache_tokens * setting.dp
        if total not in optimum:
            optimum[total] = optimal_hit_rate(trace, total)
        results.append(Result(setting, replay(trace, setting), optimum[total]))
    return results
