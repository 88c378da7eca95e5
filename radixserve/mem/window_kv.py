"""The KV of sliding-window layers, freed once it leaves the window (the scheduler's side).

A model whose layers are partly windowed (Gemma 2 and 3, gpt-oss) keeps its full-attention
layers in the main pool, one slot per token for the token's whole life, and its window layers
in a pool of their own, whose slots a token holds only while some query can still see it. A
token's full slot names it everywhere (request rows, the radix tree); `window_of[full slot]` is
its window slot, 0 when it holds none (slot 0 is never handed out, and a read of it is
masked: it lies outside every window that reads it).

Who frees a window slot: the request that computed the token (`owner`, its row + 1) frees it
once the token falls `window` positions behind the request's end (`trim`); when the request
ends, or when another request resumes from a prefix whose window it holds, the tree takes the
slot over (owner 0), and frees it with the token's full slot when that leaves the tree. So a
cached prefix can be resumed only where the last `window` tokens still hold their window slots
(`resumable`)."""

from __future__ import annotations

import numpy as np


class WindowKV:
    def __init__(self, num_full_slots: int, num_window_slots: int, window: int):
        self.window = window
        self.capacity = num_window_slots - 1  # slot 0 pads
        self.free_slots = list(range(num_window_slots - 1, 0, -1))
        self.window_of = np.zeros(num_full_slots, dtype=np.int64)
        self.owner = np.zeros(num_full_slots, dtype=np.int64)
        self.updates: dict[int, int] = {}  # full slot -> window slot, not yet sent to the worker

    def available(self) -> int:
        return len(self.free_slots)

    def alloc(self, full_slots: list[int], row: int) -> list[int] | None:
        """Window slots for new tokens of the request in `row`; None when too few are free."""
        if len(full_slots) > len(self.free_slots):
            return None
        taken = self.free_slots[len(self.free_slots) - len(full_slots) :]
        del self.free_slots[len(self.free_slots) - len(full_slots) :]
        self.window_of[full_slots] = taken
        self.owner[full_slots] = row + 1
        self.updates.update(zip(full_slots, taken))
        return taken

    def adopt(self, tree_slots: list[int], own_slots: list[int]) -> None:
        """A request computed tokens the tree already held (its own slots are about to be
        freed): where the tree's copy lacks window KV, it takes the request's."""
        tree, own = np.asarray(tree_slots, dtype=np.int64), np.asarray(own_slots, dtype=np.int64)
        moving = (self.window_of[tree] == 0) & (self.window_of[own] != 0)
        tree, own = tree[moving], own[moving]
        self.window_of[tree], self.owner[tree] = self.window_of[own], self.owner[own]
        self.window_of[own], self.owner[own] = 0, 0
        self.updates.update(zip(tree.tolist(), self.window_of[tree].tolist()))

    def take_updates(self) -> tuple[list[int], list[int]]:
        """The (full slots, window slots) the worker's table lacks, once."""
        fulls, windows = list(self.updates), list(self.updates.values())
        self.updates.clear()
        return fulls, windows

    def release(self, full_slots) -> None:
        """The tokens' full slots were freed: free the window slots they hold."""
        slots = np.asarray(full_slots, dtype=np.int64)
        held = slots[self.window_of[slots] != 0]
        self.free_slots.extend(self.window_of[held].tolist())
        self.window_of[held] = 0
        self.owner[held] = 0

    def trim(self, full_slots: list[int], row: int, start: int, end: int) -> int:
        """Free the window slots the request in `row` owns among its tokens at positions
        [start, end - window) (`full_slots` its slots by position); returns where the next trim
        starts."""
        stop = end - self.window
        if stop <= start:
            return start
        slots = np.asarray(full_slots[start:stop], dtype=np.int64)
        self.release(slots[self.owner[slots] == row + 1])
        return stop

    def hand_to_tree(self, full_slots) -> None:
        """The tree owns these tokens' window slots from now on."""
        slots = np.asarray(full_slots, dtype=np.int64)
        self.owner[slots] = 0

    def resumable(self, full_slots: list[int]) -> int:
        """The longest prefix of these tokens (a cached match) whose last `window` tokens, or all
        of them when fewer, still hold window slots."""
        if not full_slots:
            return 0
        present = self.window_of[np.asarray(full_slots, dtype=np.int64)] != 0
        length = len(present)
        if present[max(0, length - self.window) :].all():
            return length
        # run[i]: present tokens in a row ending at i; resumable at q when run[q-1] >= min(W, q)
        at = np.arange(length)
        last_gap = np.maximum.accumulate(np.where(present, -1, at))
        run = at - last_gap
        q = at + 1
        ok = np.flatnonzero(run >= np.minimum(self.window, q))
        return int(q[ok[-1]]) if len(ok) else 0

    def check(self) -> None:
        """Every window slot free or held by exactly one token."""
        held = self.window_of[self.window_of != 0]
        assert len(held) == len(set(held.tolist())), "a window slot is held by two tokens"
        assert len(self.free_slots) + len(held) == self.capacity, (
            f"window KV leak: {len(self.free_slots)} free + {len(held)} held != {self.capacity}"
        )
