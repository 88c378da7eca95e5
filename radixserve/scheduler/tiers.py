"""The host and storage tiers under the device radix tree (`mem/hicache`) as the scheduler
uses them: a match extended from the tiers, prefixes backed up by the write policy, the tiers
named for the served weights."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from ..config import EngineArgs
from ..mem.allocator import SlotAllocator
from ..mem.hicache import HiCache, block_size, fingerprint
from ..mem.radix_cache import RadixCache, TreeNode
from ..mem.radix_node import path_of, salt_of
from .executor import Executor

log = logging.getLogger(__name__)


class DeviceMemory(Protocol):
    """What the tiers use of the device's KV memory (the scheduler's KVManager)."""

    cache: RadixCache
    allocator: SlotAllocator

    def make_room(self, pages: int) -> bool: ...

    def free_slots(self, slots: list[int]) -> None: ...


class Tiers:
    def __init__(self, args: EngineArgs, executor: Executor, kv: DeviceMemory):
        self.args, self.executor, self.kv = args, executor, kv
        self.write_policy = args.hicache_write_policy
        self.weight_updates = 0  # weight updates since start: the tiers' blocks name them
        self.hicache = make_hicache(args, executor)

    def extend(
        self, prefix: list[int], slots: list[int], node: TreeNode, salt: str | None
    ) -> tuple[list[int], TreeNode]:
        """Extend a device match with blocks from the host and storage tiers: they get device
        slots (the match stays locked meanwhile) and join the tree like computed KV."""
        cache = self.kv.cache
        cache.inc_lock_ref(node)
        try:
            loaded = self.hicache.load(prefix, len(slots), self._alloc_for_load, salt)
        finally:
            cache.dec_lock_ref(node)
        if not loaded:
            return slots, node
        key = prefix[: len(slots) + len(loaded)]
        already = cache.insert(key, slots + loaded, salt)
        self.kv.free_slots(loaded[: max(already - len(slots), 0)])
        return cache.match_prefix(key, salt)

    def _alloc_for_load(self, n: int) -> list[int] | None:
        allocator = self.kv.allocator
        pages = allocator.pages_needed(0, n)
        if not self.kv.make_room(pages):
            return None
        return allocator.alloc_extend(0, None, n)

    def back_up_leaf(self, leaf: TreeNode) -> None:
        tokens, slots = path_of(leaf)
        self.hicache.backup(tokens, slots, salt_of(leaf))

    def back_up_prefix(
        self, tokens: list[int], slots: list[int], node: TreeNode, salt: str | None
    ) -> None:
        """write_through backs up every cached prefix; write_through_selective only those hit
        more than once."""
        policy = self.write_policy
        if policy == "write_through" or (
            policy == "write_through_selective" and node.hit_count >= 2
        ):
            self.hicache.backup(tokens, slots, salt)

    def renew(self, model_path: str) -> None:
        """New weights: the tiers start afresh, their blocks named for the new weights (a
        checkpoint rewritten in place gets new names too)."""
        self.weight_updates += 1
        args = replace(self.args, model=model_path)
        self.hicache = make_hicache(args, self.executor, self.weight_updates)


def make_hicache(args: EngineArgs, executor: Executor, weight_updates: int = 0) -> HiCache:
    """The tiers under the radix tree, sized from the device pool; blocks are named for this
    model (and how many times its weights were updated), dtype, block size and TP layout."""
    info, pool = executor.info, executor.pool
    if args.hicache_size > 0:
        host_tokens = int(args.hicache_size * 2**30 // info.bytes_per_token)
    else:
        host_tokens = int(args.hicache_ratio * info.num_slots)
    model = args.model or "bundled"
    identity = fingerprint(
        model,
        args.seed if model.startswith("dummy:") else None,
        args.quantization,
        info.dtype,
        info.kv_cache_dtype,
        block_size(info.page_size),
        tuple(tuple(k.shape[1:]) for k in pool.k),
        args.tp_size,
        *([weight_updates] if weight_updates else []),
    )
    storage = args.hicache_storage_dir if args.hicache_storage_backend == "file" else None
    hicache = HiCache.create(pool, info.page_size, host_tokens, identity, storage)
    log.info(
        "hierarchical cache: host tier %d tokens (%.1f MB), %s%s",
        hicache.capacity_tokens(),
        hicache.capacity_tokens() * info.bytes_per_token / 2**20,
        args.hicache_write_policy,
        f", storage {hicache.storage.folder}" if hicache.storage else "",
    )
    return hicache
