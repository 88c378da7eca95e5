"""The scheduler's side of window layers' KV kept apart (`mem/window_kv.py`), request by
request: a match cut back to where the window KV before it is whole, a request's window slots
allocated with its slots and freed as its tokens fall behind its window, and the tree keeping
them where prompts end and where requests leave a cached path."""

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
        """The match cut back to where it resumes; `req.branch_at` where it left the path."""
        cached = len(slots)
        if (resumable := self.kv.resumable(slots)) < cached:
            slots, node = cache.match_prefix(prefix[:resumable], req.cache_salt)
        req.branch_at = cached if cached > len(slots) else None
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

    def cached(self, req: Req, aligned: int, slots: list[int]) -> None:
        """The request's first `aligned` tokens are in the tree (as `slots`): where its prompt
        ends or it left a cached path, the tree keeps their window KV."""
        if aligned in (req.branch_at, len(req.fill_ids) - 1):
            self.kv.hand_to_tree(slots[aligned - self.window - 1 :])

    def figures(self) -> dict:
        return {
            "window_kv_capacity_tokens": self.kv.capacity,
            "window_kv_free_tokens": self.kv.available(),
        }
