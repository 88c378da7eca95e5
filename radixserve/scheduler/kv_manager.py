"""The scheduler's side of KV memory: the slot allocator, the request rows, the radix tree
and the tiers under it (`mem/hicache`).

A request's `kv_slots[:cached_len]` belong to the tree and are locked through `req.node`; the
rest are its own pages. Invariant (`check_memory`): free + cached + held by running == pool."""

from __future__ import annotations

import logging
from typing import Sequence

from ..config import EngineArgs
from ..mem.allocator import ReqToTokenRows, SlotAllocator
from ..mem.hicache import HiCache
from ..mem.radix_cache import RadixCache, TreeNode
from ..mem.radix_node import top_prefixes, walk
from ..messages import SchedulerStats
from ..worker_info import WorkerInfo
from .executor import Executor
from .req import Req
from .snapshots import StateSnapshots, at_snapshot
from .tiers import Tiers
from .window_memory import WindowMemory

log = logging.getLogger(__name__)


class KVManager:
    def __init__(self, args: EngineArgs, executor: Executor):
        info = executor.info
        self.args, self.executor = args, executor
        self.page_size = info.page_size
        self.evicted_tokens = 0  # evicted from the tree to make room, over the server's life
        self.allocator = SlotAllocator(info.num_pages, info.page_size)
        self.rows = ReqToTokenRows(info.max_running_requests)
        self.tiers = Tiers(args, executor, self) if args.enable_hierarchical_cache else None
        write_back = self.tiers is not None and args.hicache_write_policy == "write_back"
        self.keeps_state = info.state_pool is not None
        self.snapshots = state_snapshots(info, self.tiers)
        self.windows = (
            WindowMemory(self.allocator.num_slots + info.page_size, info.window_kv)
            if info.window_kv is not None
            else None
        )
        self.cache = RadixCache(
            info.page_size,
            self.free_slots,
            disable=args.disable_radix_cache or not info.prefix_reuse,
            record_events=args.kv_events_config is not None,
            on_evict=self.tiers.back_up_leaf if write_back else None,
            eviction_policy=args.radix_eviction_policy,
            drop_snapshot=self.snapshots.drop if self.snapshots is not None else None,
        )

    @property
    def hicache(self) -> HiCache | None:
        return None if self.tiers is None else self.tiers.hicache

    # ---- prefix matches ------------------------------------------------------
    def match(self, req: Req) -> tuple[list[int], TreeNode]:
        """The request's longest cached prefix, extended from the tiers when they hold more."""
        prefix = req.fill_ids[: req.max_prefix_len()]
        slots, node = self.cache.match_prefix(prefix, req.cache_salt)
        if self.tiers is not None and len(prefix) - len(slots) >= self.hicache.block:
            slots, node = self.tiers.extend(prefix, slots, node, req.cache_salt)
        if (edge := req.image_edge(len(slots), forward=False)) < len(slots):
            slots, node = self.cache.match_prefix(prefix[:edge], req.cache_salt)
        matched = len(slots)
        if self.snapshots is not None:  # (the tree keeps the window before each snapshot)
            if self.tiers is not None:
                self.tiers.resume_state(prefix, slots, node, req.cache_salt, self.snapshots)
            slots, node = at_snapshot(slots, node)
        if self.windows is not None:
            slots, node = self.windows.cut(req, prefix, slots, node, self.cache)
        req.branch_at = matched if matched > len(slots) else None  # where it left the path
        return slots, node

    def match_length(self, req: Req) -> tuple[int, TreeNode]:
        """(cached prefix length, deepest node) without changing the tree."""
        return self.cache.match_length(req.fill_ids[: req.max_prefix_len()], req.cache_salt)

    # ---- a request's memory --------------------------------------------------
    def attach(self, req: Req, slots: list[int], node: TreeNode) -> None:
        """Give an admitted request a row and its matched prefix (already locked)."""
        req.row = self.rows.alloc()
        req.kv_slots, req.cached_len, req.node, req.synced = list(slots), len(slots), node, 0
        if self.windows is not None:
            self.windows.attach(req, slots)
        if req.spec is not None:
            req.spec.draft_len = len(slots)  # a cached prefix carries draft-model K/V too
        self.cache.record_hit(node)
        if self.snapshots is not None:
            self.snapshots.resume(req, slots, node, self.executor.copy_state)
        if self.tiers is not None and slots:
            self.tiers.back_up_prefix(req.fill_ids[: len(slots)], slots, node, req.cache_salt)

    def make_room(self, pages: int) -> bool:
        """Evict cached prefixes until `pages` more pages can be allocated (and, with window
        layers kept apart, as many window slots), if possible."""
        missing = pages * self.page_size - self.allocator.available()
        if missing > 0:
            self.evicted_tokens += self.cache.evict(missing)
        if self.windows is not None:
            evicted = self.windows.make_room(pages * self.page_size, self.cache.evict)
            if evicted is None:
                return False
            self.evicted_tokens += evicted
        return self.allocator.can_alloc_pages(pages)

    def alloc(self, req: Req, n: int) -> bool:
        """`n` more slots for the request, evicting if needed; False when they do not fit.
        With window layers kept apart, the request first frees the window slots its tokens
        left behind (`WindowKV.trim`)."""
        self.trim_windows([req])
        if not self.make_room(self.allocator.pages_needed(len(req.kv_slots), n)):
            return False
        last = req.kv_slots[-1] if req.kv_slots else None
        new = self.allocator.alloc_extend(len(req.kv_slots), last, n)
        req.kv_slots += new
        if self.windows is not None:
            self.windows.kv.alloc(new, req.row)
        return True

    def trim_windows(self, reqs: Sequence[Req]) -> None:
        """With window layers kept apart: each request frees the window slots of its tokens
        that fell behind its window."""
        if self.windows is not None:
            self.windows.trim(reqs)

    def free_slots(self, slots: list[int]) -> None:
        """Give slots back to the allocator (and their window slots to the window pool)."""
        self.allocator.free(slots)
        if self.windows is not None:
            self.windows.kv.release(slots)

    def window_map(self) -> tuple[list[int], list[int]] | None:
        """(full slots, their window slots) the worker has not seen yet; None without window
        layers kept apart."""
        return None if self.windows is None else self.windows.kv.take_updates()

    def pages_for(self, req: Req, n: int) -> int:
        return self.allocator.pages_needed(len(req.kv_slots), n)

    def fits(self, tokens: float) -> bool:
        """Whether `tokens` fit in free plus evictable memory."""
        return tokens <= self.allocator.available() + self.cache.evictable_size()

    def free_tail(self, req: Req, keep: int) -> None:
        """Give back the request's own slots past its first `keep` (draft slots not used)."""
        self.free_slots(req.kv_slots[keep:])
        del req.kv_slots[keep:]

    def keep_verified(self, req: Req, fed: int, keep: int) -> None:
        """After a verify step whose segment started at position `fed - 1`, a hybrid model's
        request keeps its state at `keep` tokens, as it keeps its KV."""
        if self.keeps_state:
            self.executor.states.keep_verified(req.row, keep - fed + 1)

    def cache_prefix(self, req: Req, ending: bool = False) -> None:
        """Put the request's computed, page-aligned KV into the tree and lock it there. A
        hybrid model's state there is kept as a snapshot: always where a request ends
        (`ending`), where a prompt chunk ends only while a snapshot slot is free."""
        computed = len(req.kv_slots)
        aligned = computed - computed % self.page_size
        if self.cache.disable or aligned <= req.cached_len:
            return
        key = req.fill_ids[:aligned]
        already = self.cache.insert(key, req.kv_slots[:aligned], req.cache_salt)
        slots, node = self.cache.match_prefix(key, req.cache_salt)
        if already > req.cached_len:
            duplicates = req.kv_slots[req.cached_len : already]
            if self.windows is not None:
                self.windows.kv.adopt(slots[req.cached_len : already], duplicates)
            self.free_slots(duplicates)
            req.synced = min(req.synced, req.cached_len)
        self.cache.inc_lock_ref(node)
        if req.node is not None:
            self.cache.dec_lock_ref(req.node)
        req.kv_slots[:aligned], req.node, req.cached_len = slots, node, aligned
        if self.snapshots is not None:
            self.snapshots.keep(req, node, aligned, ending, self.executor.copy_state)
        if self.windows is not None:
            self.windows.cached(req, aligned, slots, snapshot=node.snapshot is not None)
        if self.tiers is not None:
            self.tiers.back_up_prefix(key, slots, node, req.cache_salt)

    def release(self, req: Req) -> None:
        """Give back all the request holds: KV to the tree or allocator, its lock, its row."""
        self.cache_prefix(req, ending=True)
        self.drop(req)

    def drop(self, req: Req) -> None:
        """Give back what the request holds without caching more of it: its uncached KV to the
        allocator, its tree lock, its row."""
        self.free_slots(req.kv_slots[req.cached_len :])
        if self.windows is not None:  # the tree keeps the window slots the request still owns
            self.windows.kv.hand_to_tree(req.kv_slots[: req.cached_len])
        if req.node is not None:
            self.cache.dec_lock_ref(req.node)
        if req.row is not None:
            self.rows.free(req.row)

    # ---- figures -----------------------------------------------------------------
    def fill_figures(self, s: SchedulerStats, running: Sequence[Req]) -> None:
        """The memory figures of a stats snapshot."""
        s.free_slots = self.allocator.available()
        s.cached_slots = self.cache.total_size()
        s.evictable_slots = self.cache.evictable_size()
        s.running_slots = self.held_slots(running)
        s.radix_nodes = self.cache.num_nodes()
        s.evicted_tokens_total = self.evicted_tokens
        if self.hicache is not None:
            s.hicache = self.hicache.snapshot()
        s.hybrid_memory = self.hybrid_figures()

    def hybrid_figures(self) -> dict:
        """State snapshots held and free and the prompt tokens resumed from them; window KV
        free and held."""
        parts = (self.snapshots, self.windows)
        return {k: v for part in parts if part is not None for k, v in part.figures().items()}

    def top_prefixes(self, limit: int) -> list[dict]:
        """The dashboard's biggest cached prefixes, each with the tiers that hold it."""
        rows = []
        for prefix in top_prefixes(self.cache.root, self.cache.clock(), limit):
            tiers = ["device"]
            if self.hicache is not None:
                tiers += self.hicache.tiers_of(prefix.tokens)
            rows.append(dict(vars(prefix), tiers=tiers))
        return rows

    # ---- the whole pool -------------------------------------------------------
    def flush(self) -> None:
        self.cache.evict(self.cache.total_size())
        self.cache.reset()
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.hicache is not None:
            self.hicache.clear_host()

    def renew(self, model_path: str) -> None:
        """New weights: drop every cached prefix and start the tiers below afresh, their blocks
        named for the new weights (a checkpoint rewritten in place gets new names too)."""
        self.flush()
        if self.tiers is not None:
            self.tiers.renew(model_path)

    def held_slots(self, running: Sequence[Req]) -> int:
        return sum(self.allocator.held_slots(len(r.kv_slots) - r.cached_len) for r in running)

    def usage(self) -> float:
        return 1 - self.allocator.available() / self.allocator.num_slots

    def check_memory(self, running: Sequence[Req], set_aside: int = 0) -> None:
        """Capacity invariant: free + cached + held by running requests (+ `set_aside` slots
        out of use) == pool size; every request in `running` holds a row."""
        free, cached, held = (
            self.allocator.available(),
            self.cache.total_size(),
            self.held_slots(running) + set_aside,
        )
        assert free + cached + held == self.allocator.num_slots, (
            f"KV leak: free {free} + cached {cached} + held {held} != {self.allocator.num_slots}"
        )
        assert self.rows.available() + len(running) == self.rows.num_rows
        if self.snapshots is not None:
            self.snapshots.check(sum(n.snapshot is not None for n in walk(self.cache.root)))
        if self.windows is not None:
            self.windows.kv.check()
        if self.hicache is not None:
            self.hicache.host.check()


def state_snapshots(info: WorkerInfo, tiers: Tiers | None) -> StateSnapshots | None:
    """A hybrid model's snapshot slots (None: no hybrid, or no slots), their interval a whole
    number of the tiers' blocks where there are tiers (they keep states at blocks' ends)."""
    states = info.state_pool
    if states is None or not states.snapshots:
        return None
    interval = states.interval
    if tiers is not None and interval:
        interval = -(-interval // tiers.hicache.block) * tiers.hicache.block
    return StateSnapshots(info.max_running_requests, states.snapshots, interval)
