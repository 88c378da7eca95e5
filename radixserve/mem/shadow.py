"""Metadata-only radix caches: the replayer's replicas, and live what-if hit rates.

A `ReplicaCache` is the real `RadixCache` over a free list of slot numbers and no KV: it
answers which prompts would have hit with a pool of another size or policy.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from .allocator import SlotAllocator
from .radix_cache import RadixCache, TreeNode


class ReplicaCache:
    """One replica's radix cache over a pool of `capacity` units, fed admissions and finishes;
    `locked` holds what each request in flight keeps in place."""

    def __init__(self, capacity: int, eviction: str, clock):
        self.allocator = SlotAllocator(max(capacity, 1))
        self.cache = RadixCache(1, self.allocator.free, eviction_policy=eviction, clock=clock)
        self.locked: dict[object, TreeNode] = {}

    def admit(self, key, prompt: tuple[int, ...], lookup_units: int) -> int:
        """Match the prompt's first `lookup_units` (returns the units hit), then cache the prompt,
        locked until the finish."""
        slots, node = self.cache.match_prefix(list(prompt[:lookup_units]))
        self.cache.record_hit(node)
        self.cache.inc_lock_ref(node)
        self.locked[key] = node
        self._store(key, prompt)
        return len(slots)

    def finish(self, key, units: tuple[int, ...]) -> None:
        """A request admitted before this cache was made (before a weight update's flush) is
        not known here and changes nothing."""
        if key not in self.locked:
            return
        self._store(key, units)
        self.cache.dec_lock_ref(self.locked.pop(key))

    def _store(self, key, units: tuple[int, ...]) -> None:
        """Cache as much of `units` as the pool allows, keeping what the request locks in place;
        the request's lock moves to the deepest node of what was cached."""
        held = self.locked[key]
        slots, _ = self.cache.match_prefix(list(units))
        missing = len(units) - len(slots)
        if missing > self.allocator.available():
            self.cache.evict(missing - self.allocator.available())
        fresh = self.allocator.alloc_pages(min(missing, self.allocator.available())) or []
        stored = list(units[: len(slots) + len(fresh)])
        self.cache.insert(stored, slots + fresh)
        node = self.cache.match_prefix(stored)[1]
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(held)
        self.locked[key] = node


MEMORY_FACTORS = (
    0.5,
    1.0,
    2.0,
    4.0,
)  # the live estimates' KV pool sizes, as multiples of the real one


class LiveEstimates:
    """What hit rate 0.5x, 2x and 4x the KV memory would have given over the last `window`
    admitted requests, while serving: each admission and finish is also fed to metadata-only
    radix caches (`ReplicaCache`, no KV) of those sizes and of the real size.

    An estimate is the real recent hit rate plus (shadow at k x - shadow at 1x): the 1x shadow
    sees the same simplifications as the others (prompts cached at admission, no retraction),
    so the difference cancels most of what they get wrong alike."""

    def __init__(self, pool_tokens: int, eviction: str, window: int = 200):
        clock = itertools.count().__next__
        self.shadows = {
            f: ReplicaCache(max(int(pool_tokens * f), 1), eviction, clock) for f in MEMORY_FACTORS
        }
        self.hits: dict[float, deque[int]] = {f: deque(maxlen=window) for f in MEMORY_FACTORS}
        self.seconds = 0.0  # time spent here, to show what the estimates cost

    def admit(self, rid: str, prompt: list[int], lookup_len: int) -> None:
        start = time.perf_counter()
        units = tuple(prompt)
        for factor, shadow in self.shadows.items():
            self.hits[factor].append(shadow.admit(rid, units, lookup_len))
        self.seconds += time.perf_counter() - start

    def finish(self, rid: str, tokens: list[int]) -> None:
        """`tokens`: prompt and output whose KV exists (all but the newest output token)."""
        start = time.perf_counter()
        units = tuple(tokens)
        for shadow in self.shadows.values():
            shadow.finish(rid, units)
        self.seconds += time.perf_counter() - start

    def estimates(self, recent_hit_rate: float, recent_prompt_tokens: int) -> dict[str, float]:
        """{"0.5x": rate, "2x": ..., "4x": ...} over the window (`recent_*`: the real cache's)."""
        if not recent_prompt_tokens:
            return {}
        base = sum(self.hits[1.0])
        return {
            f"{f:g}x": min(
                max(recent_hit_rate + (sum(self.hits[f]) - base) / recent_prompt_tokens, 0.0), 1.0
            )
            for f in MEMORY_FACTORS
            if f != 1.0
        }
