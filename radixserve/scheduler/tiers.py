"""The host and storage tiers under the device radix tree (`mem/hicache`) as the scheduler
uses them: a match extended from the tiers, prefixes backed up by the write policy, the tiers
named for the served weights. A hybrid model's state snapshots at block ends go with their
KV, and a match resumes from one the tiers hold past the device's deepest snapshot."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from ..config import EngineArgs
from ..mem.allocator import SlotAllocator
from ..mem.hicache import HiCache, TierState, block_size, fingerprint
from ..mem.radix_cache import RadixCache, TreeNode
from ..mem.radix_node import path_of, salt_of
from .executor import Executor
from .snapshots import StateSnapshots, at_snapshot

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

    def resume_state(
        self,
        prefix: list[int],
        slots: list[int],
        node: TreeNode,
        salt: str | None,
        snapshots: StateSnapshots,
    ) -> None:
        """A hybrid model's match: where the tiers hold a state at a block's end past the
        deepest snapshot on the matched path, the deepest such state takes a snapshot slot at
        that point of the path (the match then resumes there)."""
        block, held = self.hicache.block, len(at_snapshot(slots, node)[0])
        ends = len(slots) - len(slots) % block
        if ends <= held:
            return
        hashes = self.hicache.hashes(prefix[:ends], salt)
        for end in range(ends, held, -block):
            state = self.hicache.find_state(hashes[end // block - 1], prefix[end - block : end])
            if state is None:
                continue
            _, at = self.kv.cache.match_prefix(prefix[:end], salt)
            slot = snapshots.take(at, evict=True)
            if slot is None:
                return
            device = self.executor.pool.device
            try:
                self.executor.states.put_row(slot, state.layout, state.data, device)
            except ValueError as exc:  # another model's states under this one's name
                log.warning("hicache: a state in the tiers does not fit this model: %s", exc)
                snapshots.drop(slot)
                at.snapshot = None
            return

    def back_up_state(self, tokens: list[int], hashes: list[int], node: TreeNode) -> None:
        """A hybrid model's snapshot at `node`, the end of `tokens` (their block `hashes`),
        follows its KV into the tiers where that is a block's end."""
        block, slot = self.hicache.block, node.snapshot
        if slot is not None and tokens and len(tokens) % block == 0:
            states = self.executor.states
            self.hicache.backup_state(
                hashes[-1], tokens[-block:], lambda: TierState(*states.row_bytes(slot))
            )

    def back_up_leaf(self, leaf: TreeNode) -> None:
        tokens, slots = path_of(leaf)
        hashes = self.hicache.backup(tokens, slots, salt_of(leaf))
        self.back_up_state(tokens, hashes, leaf)

    def back_up_prefix(
        self, tokens: list[int], slots: list[int], node: TreeNode, salt: str | None
    ) -> None:
        """write_through backs up every cached prefix; write_through_selective only those hit
        more than once."""
        policy = self.write_policy
        if policy == "write_through" or (
            policy == "write_through_selective" and node.hit_count >= 2
        ):
            hashes = self.hicache.backup(tokens, slots, salt)
            self.back_up_state(tokens, hashes, node)

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
        *([args.mamba_ssm_dtype] if info.state_pool else []),
    )
    storage = args.hicache_storage_dir if args.hicache_storage_backend == "file" else None
    states = max(int(args.hicache_ratio * info.state_pool.snapshots), 1) if info.state_pool else 0
    hicache = HiCache.create(
        pool, info.page_size, host_tokens, identity, storage, host_states=states
    )
    log.info(
        "hierarchical cache: host tier %d tokens (%.1f MB), %s%s",
        hicache.capacity_tokens(),
        hicache.capacity_tokens() * info.bytes_per_token / 2**20,
        args.hicache_write_policy,
        f", storage {hicache.storage.folder}" if hicache.storage else "",
    )
    return hicache
