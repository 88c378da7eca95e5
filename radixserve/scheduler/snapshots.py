"""Snapshots of a hybrid model's per-request state (convolution and recurrent layers), kept in
the radix tree: a node may carry one, valid at its end, and a cached prefix can be resumed only
where one is. The worker holds them in slots after the requests' rows (`copy_state` moves a
state between a row and a slot); this is the scheduler's side: which slots are free and which
node holds each, evicted least recently used first, apart from the KV they sit on."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from ..mem.radix_cache import TreeNode
from .req import Req

CopyState = Callable[[int, int], None]  # the executor's copy_state(src slot, dst slot)


class StateSnapshots:
    """`interval`: prompt chunks end at its multiples, where a snapshot is kept while a slot is
    free (0: not at intervals)."""

    def __init__(self, first_slot: int, count: int, interval: int = 0):
        self.capacity, self.interval = count, interval
        self.resumed_tokens = 0  # prompt tokens resumed from snapshots
        self.free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.held: OrderedDict[int, TreeNode] = OrderedDict()  # least recently used first

    def take(self, node: TreeNode, evict: bool) -> int | None:
        """A slot for a snapshot at `node`'s end: a free one, else (with `evict`) the least
        recently used one (its node keeps its KV and loses the snapshot), else None."""
        if not self.free and (not evict or not self.held):
            return None
        if not self.free:
            slot, old = self.held.popitem(last=False)
            old.snapshot = None
            self.free.append(slot)
        slot = self.free.pop()
        self.held[slot] = node
        node.snapshot = slot
        return slot

    def touch(self, slot: int) -> None:
        self.held.move_to_end(slot)

    def drop(self, slot: int) -> None:
        """The node holding `slot` left the tree."""
        if self.held.pop(slot, None) is not None:
            self.free.append(slot)

    def clear(self) -> None:
        for slot, node in self.held.items():
            node.snapshot = None
            self.free.append(slot)
        self.held.clear()

    def check(self, in_tree: int) -> None:
        """Every slot free or held, and every held one on a node of the tree."""
        assert len(self.free) + len(self.held) == self.capacity, (
            f"state snapshot leak: {len(self.free)} free + {len(self.held)} held != {self.capacity}"
        )
        assert in_tree == len(self.held), f"{len(self.held)} snapshots held, {in_tree} in the tree"

    # ---- a request's way through the tree -----------------------------------------
    def resume(self, req: Req, slots: list[int], node: TreeNode, copy_state: CopyState) -> None:
        """The request's row takes the state where its cached prefix ends."""
        if slots:
            self.resumed_tokens += len(slots)
            copy_state(node.snapshot, req.row)
            self.touch(node.snapshot)

    def keep(
        self, req: Req, node: TreeNode, aligned: int, ending: bool, copy_state: CopyState
    ) -> None:
        """The request's first `aligned` tokens are cached up to `node`: its state there is
        kept where it ends or left a cached path (evicting if need be), elsewhere while a slot
        is free."""
        if node.snapshot is None:
            slot = self.take(node, evict=ending or req.branch_at == aligned)
            if slot is not None:
                copy_state(req.row, slot)

    def figures(self) -> dict:
        return {
            "state_snapshots": len(self.held),
            "state_snapshot_slots_free": len(self.free),
            "state_resumed_tokens_total": self.resumed_tokens,
        }


def at_snapshot(slots: list[int], node: TreeNode) -> tuple[list[int], TreeNode]:
    """A match cut back to the deepest node on its path that holds a state snapshot (a hybrid
    model resumes only there); nothing when none does."""
    depth = len(slots)
    while node.snapshot is None and node.parent is not None:
        depth -= len(node.key)
        node = node.parent
    return (slots[:depth], node) if node.snapshot is not None else ([], node)
