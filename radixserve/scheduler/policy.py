"""Orders the waiting queue: lpm (longest cached prefix first), dfs-weight, fcfs."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from ..mem.radix_cache import RadixCache, TreeNode
from .req import Req

# Beyond this queue length, prefix matching every request each step costs more than it saves.
LPM_MAX_QUEUE = 128


def order_waiting(
    policy: str,
    waiting: Sequence[Req],
    cache: RadixCache,
    match: Callable[[Req], tuple[int, TreeNode]],
) -> list[Req]:
    """`match(req)` gives (cached prefix length, deepest node) without changing the tree."""
    if policy == "fcfs" or cache.disable or len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    nodes = {id(r): match(r) for r in waiting}
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -nodes[id(r)][0])
    return _dfs_weight_order(waiting, cache, {id(r): nodes[id(r)][1] for r in waiting})


def _dfs_weight_order(
    waiting: Sequence[Req], cache: RadixCache, last_node: dict[int, TreeNode]
) -> list[Req]:
    """Visit the tree heaviest subtree first, so requests under one prefix run together."""
    by_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in waiting:
        node = last_node[id(req)]
        by_node[id(node)].append(req)
        while node is not None:
            weight[id(node)] += 1
            node = node.parent
    ordered: list[Req] = []
    stack = [cache.root]
    while stack:
        node = stack.pop()
        ordered.extend(by_node.get(id(node), []))
        children = sorted(
            (c for c in node.children.values() if weight[id(c)]), key=lambda c: weight[id(c)]
        )
        stack.extend(children)
    return ordered
