"""Radix tree of cached KV (RadixAttention).

Keys are token ids, values are the KV slots holding those tokens. Edges are
compressed runs; with pages of `page_size` slots every edge length is a multiple
of the page size, so a node never splits inside a page.

Contract: the slots returned by `match_prefix` stay valid only while the returned
node is locked (`inc_lock_ref`); an unlocked leaf may be evicted at any time and
its slots handed back to the allocator through `free_slots`.

A `salt` (a request's `cache_salt`) puts a run in its own namespace: an empty node under the
root, so runs of different salts never share a node, and the salt's hash heads their chained
block hashes (KV events).

Eviction policies (names as in SGLang) order the unlocked leaves to evict first:
`lru` the least recently used; `lfu` the fewest hits, then least recent; `slru` (segmented
LRU) the leaves never hit since they were inserted, least recent first, before any leaf hit
at least once.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable

from ..kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    chain_hashes,
    salt_hash,
)
from ..lora import namespace_lora_id
from .radix_node import TreeNode, salt_of, walk

EVICTION_PRIORITY: dict[str, Callable[[TreeNode], tuple]] = {
    "lru": lambda node: (node.last_access,),
    "lfu": lambda node: (node.hit_count, node.last_access),
    "slru": lambda node: (node.hit_count > 0, node.last_access),
}


class RadixCache:
    def __init__(
        self,
        page_size: int = 1,
        free_slots: Callable[[list[int]], None] | None = None,
        disable: bool = False,
        record_events: bool = False,
        on_evict: Callable[["TreeNode"], None] | None = None,
        eviction_policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        drop_snapshot: Callable[[int], None] | None = None,
    ):
        """`clock` stamps each access (the replayer passes a logical clock); `drop_snapshot`
        hears of each state snapshot whose node leaves the tree."""
        self.page_size = page_size
        self.priority = EVICTION_PRIORITY[eviction_policy]
        self.clock = clock
        self.disable = disable
        self.free_slots = free_slots or (lambda slots: None)
        self.on_evict = on_evict  # sees each leaf before its slots are freed (hicache write-back)
        self.drop_snapshot = drop_snapshot
        self.events: list[KVEvent] | None = [] if record_events else None  # taken by `take_events`
        self.root = TreeNode()
        self.reset()

    def take_events(self) -> list[KVEvent]:
        """The KV events (stored, removed, cleared pages) since the last call."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    def reset(self) -> None:
        if self.events is not None and self.root.children:
            self.events.append(AllBlocksCleared())
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 1

    # ---- queries -------------------------------------------------------
    def total_size(self) -> int:
        return self._evictable + self._protected

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def num_nodes(self) -> int:
        return self._num_nodes

    def match_prefix(self, key: list[int], salt: str | None = None) -> tuple[list[int], TreeNode]:
        """Longest cached, page-aligned prefix of `key`: (its slots, its last node)."""
        start = self._start(salt)
        if self.disable or start is None:
            return [], self.root
        key = key[: len(key) - len(key) % self.page_size]
        node, slots = start, []
        self._touch(node)
        while key:
            child = node.children.get(self._edge(key))
            if child is None:
                break
            n = self._common_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            slots += child.value
            node, key = child, key[n:]
        return slots, node

    def match_length(self, key: list[int], salt: str | None = None) -> tuple[int, TreeNode]:
        """Length of the cached prefix of `key` and the deepest node it reaches, without
        splitting nodes or touching their LRU clocks (for ordering the queue)."""
        start = self._start(salt)
        if self.disable or start is None:
            return 0, self.root
        node, matched = start, 0
        while matched < len(key):
            child = node.children.get(self._edge(key[matched:]))
            if child is None:
                break
            n = self._common_len(child.key, key[matched:])
            matched += n
            if n < len(child.key):
                break
            node = child
        return matched - matched % self.page_size, node

    # ---- updates -------------------------------------------------------
    def insert(self, key: list[int], value: list[int], salt: str | None = None) -> int:
        """Insert a page-aligned run; returns how many leading tokens were already cached.

        The caller owns `value[:returned]` still (they duplicate cached slots) and
        must free them; the rest now belongs to the tree.
        """
        if self.disable:
            return len(key)
        assert len(key) == len(value) and len(key) % self.page_size == 0
        node, done = self._start(salt, create=bool(key)), 0
        self._touch(node)
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._edge(rest))
            if child is None:
                self._add_leaf(node, rest, value[done:])
                return done
            n = self._common_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            node, done = child, done + n
        return done

    def record_hit(self, node: TreeNode) -> None:
        while node is not self.root:
            node.hit_count += 1
            node = node.parent

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unbalanced dec_lock_ref"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, first in the eviction policy's order, until `num_tokens` are
        freed."""
        order = itertools.count()  # ties keep insertion order; nodes themselves are not compared
        leaves = [
            (self.priority(n), next(order), n)
            for n in walk(self.root)
            if not n.children and n.lock_ref == 0 and n is not self.root
        ]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)[2]
            if self.on_evict is not None and leaf.salt is None:
                self.on_evict(leaf)
            self.free_slots(leaf.value)
            freed += len(leaf.key)
            parent = self._remove_leaf(leaf)
            if parent is self.root or parent.children or parent.lock_ref:
                continue
            if parent.salt is not None:
                self._remove_leaf(parent)  # an emptied namespace holds nothing: gone at once
            else:
                heapq.heappush(leaves, (self.priority(parent), next(order), parent))
        return freed

    # ---- internals -----------------------------------------------------
    def _start(self, salt: str | None, create: bool = False) -> TreeNode | None:
        """Where a run of `salt` starts: the root, or the salt's namespace node (None when it
        has none and `create` is off)."""
        if salt is None:
            return self.root
        edge = ("salt", salt)
        node = self.root.children.get(edge)
        if node is None and create:
            node = TreeNode(parent=self.root, salt=salt, block_hashes=[salt_hash(salt)])
            self.root.children[edge] = node
            self._num_nodes += 1
        return node

    def _touch(self, node: TreeNode) -> None:
        node.last_access = self.clock()

    def _edge(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _common_len(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after `n` tokens; returns the new upper node."""
        parent = child.parent
        pages = n // self.page_size
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
            hit_count=child.hit_count,
            block_hashes=child.block_hashes[:pages],
        )
        child.block_hashes = child.block_hashes[pages:]
        parent.children[self._edge(upper.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._edge(child.key)] = child
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: list[int]) -> None:
        leaf = TreeNode(key=list(key), value=list(value), parent=parent)
        self._touch(leaf)
        if self.events is not None:
            self._record_stored(leaf)
        parent.children[self._edge(leaf.key)] = leaf
        self._evictable += len(key)
        self._num_nodes += 1

    def _record_stored(self, leaf: TreeNode) -> None:
        """A salted run's first blocks chain from the salt's hash, published without a parent
        (no block of that hash was ever stored), as vLLM publishes a salted first block; a
        LoRA adapter's blocks carry its `lora_id`."""
        parent = leaf.parent
        chain_from = parent.block_hashes[-1] if parent.block_hashes else None
        leaf.block_hashes.extend(chain_hashes(leaf.key, self.page_size, chain_from))
        published = None if parent.salt is not None else chain_from
        lora_id = namespace_lora_id(salt_of(leaf))
        self.events.append(
            BlockStored(list(leaf.block_hashes), published, list(leaf.key), self.page_size, lora_id)
        )

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        if leaf.salt is not None:  # an emptied namespace: it stored no block
            del parent.children[("salt", leaf.salt)]
            self._num_nodes -= 1
            return parent
        if self.events is not None:
            self.events.append(BlockRemoved(list(leaf.block_hashes)))
        if leaf.snapshot is not None and self.drop_snapshot is not None:
            self.drop_snapshot(leaf.snapshot)
        del parent.children[self._edge(leaf.key)]
        self._evictable -= len(leaf.key)
        self._num_nodes -= 1
        return parent
