"""Routing policies, named as in SGLang's router: round_robin, random, power_of_two, cache_aware."""

from __future__ import annotations

import random
from typing import Protocol

from ..config import ROUTER_POLICIES
from .config import RouterArgs
from .tree import PrefixTree
from .workers import Worker


class Policy(Protocol):
    def pick(self, candidates: list[Worker], key: str) -> Worker:
        """The worker for a request whose routing key (prompt text) is `key`; `candidates` is
        never empty."""

    def forget(self, url: str) -> None:
        """A worker was removed."""


def least_loaded(candidates: list[Worker]) -> Worker:
    return min(candidates, key=lambda w: w.in_flight)


class RoundRobin:
    def __init__(self):
        self.turn = 0

    def pick(self, candidates: list[Worker], key: str) -> Worker:
        self.turn += 1
        return candidates[self.turn % len(candidates)]

    def forget(self, url: str) -> None:
        pass


class Random:
    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def pick(self, candidates: list[Worker], key: str) -> Worker:
        return self.rng.choice(candidates)

    def forget(self, url: str) -> None:
        pass


class PowerOfTwo(Random):
    """Two workers drawn at random; the one with fewer requests in flight."""

    def pick(self, candidates: list[Worker], key: str) -> Worker:
        if len(candidates) < 2:
            return candidates[0]
        return least_loaded(self.rng.sample(candidates, 2))


class CacheAware:
    """SGLang's cache-aware policy over an approximate tree of what went where.

    While load is balanced, a request goes to the worker holding the longest prefix of its
    key when that covers more than `cache_threshold` of it, else to the worker holding the
    least (the one with most room). Load is out of balance when the busiest and the idlest
    worker differ by more than `balance_abs_threshold` requests in flight and by more than
    `balance_rel_threshold` times; then the idlest gets it. Either way the key is recorded
    under the chosen worker."""

    def __init__(self, config: RouterArgs, tree: PrefixTree | None = None):
        self.config = config
        self.tree = tree or PrefixTree()

    def pick(self, candidates: list[Worker], key: str) -> Worker:
        chosen = self._choose(candidates, key)
        self.tree.insert(key, chosen.url)
        return chosen

    def _choose(self, candidates: list[Worker], key: str) -> Worker:
        if self._imbalanced(candidates) or not key:
            return least_loaded(candidates)
        matched = self.tree.match(key)
        best = max(candidates, key=lambda w: (matched.get(w.url, 0), -w.in_flight))
        if matched.get(best.url, 0) / len(key) > self.config.cache_threshold:
            return best
        sizes = self.tree.sizes  # computed by the KV-event index: read once
        return min(candidates, key=lambda w: (sizes.get(w.url, 0), w.in_flight))

    def _imbalanced(self, candidates: list[Worker]) -> bool:
        loads = [w.in_flight for w in candidates]
        busiest, idlest = max(loads), min(loads)
        return (
            busiest - idlest > self.config.balance_abs_threshold
            and busiest > self.config.balance_rel_threshold * idlest
        )

    def evict(self) -> None:
        self.tree.evict(self.config.max_tree_size)

    def forget(self, url: str) -> None:
        self.tree.remove_tenant(url)


def make_policy(config: RouterArgs, seed: int | None = None) -> Policy:
    name = config.policy
    if name == "cache_aware":
        return CacheAware(config)
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random(seed)
    if name == "power_of_two":
        return PowerOfTwo(seed)
    raise ValueError(f"policy must be one of {ROUTER_POLICIES}, got {name!r}")
