"""Snapshots of a hybrid model's per-request state (convolution and recurrent layers), kept in
the radix tree: a node may carry one, valid at its end, and a cached prefix can be resumed only
where one is. The worker holds them in slots after the requests' rows (`copy_state` moves a
state between a row and a slot); this is the scheduler's side: which slots are free and which
node holds each, evicted least recently used first, apart from the KV they sit on."""

from __future__ import annotations

from collections import OrderedDict

from ..mem.radix_cache import TreeNode


class StateSnapshots:
    def __init__(self, first_slot: int, count: int):
        self.capacity = count
        self.free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.held: OrderedDict[int, TreeNode] = OrderedDict()  # least recently used first

    def take(self, node: TreeNode, evict: bool) -> int | None:
        """A slot for a snapshot at `node`'s end: a free one, else (with `evict`) the least
        recently used one (its node keeps its KV and loses the snapshot), else None."""
        if not self.free and not evict:
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
