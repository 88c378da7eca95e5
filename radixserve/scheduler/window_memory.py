"""The scheduler's side of window layers' KV kept apart (`mem/window_kv.py`), request by
request: a match cut back to where the window KV before it is whole, a request's window slots
allocated with its slots and freed as its tokens fall behind its window, and the tree keeping
them where prompts end, where requests leave a cached path and, in a hybrid model, where a
state snapshot is kept (its resumption needs both)."""

from __future__ import annotations

from typing import Callable, Sequence

from ..mem.radix_cache import TreeNode
from ..mem.window_kv import WindowKV
from ..worker_info import WindowKVInfo
from .req import Req


class WindowMemory:
    def __init__(self, num_full_slots: int, info: WindowKVInfo):
        self.kv = WindowKV(num_full_slots, info.slots, info.window)
        self.window = info.window

    def cut(self, req: Req, prefix: list[int], slots: list[int], node: TreeNode, cache):
        """The match cut back to where the window KV before it is whole."""
        if (resumable := self.kv.resumable(slots)) < len(slots):
            slots, node = cache.match_prefix(prefix[:resumable], req.cache_salt)
        return slots, node

    def attach(self, req: Req, slots: list[int]) -> None:
        """A request resumes after `slots`: a running request that computed the window KV
        before them may no longer free it."""
        req.window_trimmed = len(slots)
        self.kv.hand_to_tree(slots[-self.window :])

    def make_room(self, tokens: int, evict: Callable[[int], int]) -> int | None:
        """Evict cached prefixes (`evict`) until `tokens` window slots are free; the tokens
        evicted, or None when they cannot be."""
        evicted = 0
        while (short := tokens - self.kv.available()) > 0:
            freed = evict(short)
            if not freed:
                return None
            evicted += freed
        return evicted

    def trim(self, reqs: Sequence[Req]) -> None:
        """Each request frees the window slots of its tokens that fell behind its window."""
        for req in reqs:
            req.window_trimmed = self.kv.trim(
                req.kv_slots, req.row, req.window_trimmed, len(req.kv_slots)
            )

    def cached(self, req: Req, aligned: int, slots: list[int], snapshot: bool = False) -> None:
        """The request's first `aligned` tokens are in the tree (as `slots`): where its prompt
        ends, where it left a cached path, and where a hybrid model keeps a state snapshot
        (`snapshot`), the tree keeps the window KV before that point."""
        if snapshot or aligned in (req.branch_at, len(req.fill_ids) - 1):
            self.kv.hand_to_tree(slots[max(0, aligned - self.window - 1) : aligned])

    def figures(self) -> dict:
        return {
            "window_kv_capacity_tokens": self.kv.capacity,
            "window_kv_free_tokens": self.kv.available(),
        }
