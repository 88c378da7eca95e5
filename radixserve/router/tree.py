"""The cache-aware router's approximate picture of each worker's prefix cache.

One compressed radix tree over request keys (prompt text, or token ids as characters),
shared by all workers ("tenants"): a node records, per tenant, when a request routed to
that tenant last passed through it. A tenant present on a node is present on all its
ancestors, so the tenant's match for a key is the depth of the deepest node it holds on
the key's path. Each tenant's size is the number of characters it holds; eviction drops a
tenant from its least recently used leaves until it fits a bound.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    edge: str = ""
    parent: "Node | None" = None
    children: dict[str, "Node"] = field(default_factory=dict)
    tenants: dict[str, float] = field(default_factory=dict)  # tenant -> last access time


def common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixTree:
    def __init__(self, clock=time.monotonic):
        self.root = Node()
        self.sizes: dict[str, int] = {}  # tenant -> characters held
        self.clock = clock

    def insert(self, key: str, tenant: str) -> None:
        now = self.clock()
        node, pos = self.root, 0
        node.tenants[tenant] = now
        self.sizes.setdefault(tenant, 0)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                child = Node(key[pos:], node)
                node.children[key[pos]] = child
            else:
                shared = common_prefix_len(child.edge, key[pos:])
                if shared < len(child.edge):
                    child = self._split(child, shared)
            if tenant not in child.tenants:
                self.sizes[tenant] += len(child.edge)
            child.tenants[tenant] = now
            node, pos = child, pos + len(child.edge)

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child`'s edge after `at` characters; the new upper node keeps its tenants."""
        parent = child.parent
        upper = Node(child.edge[:at], parent, {child.edge[at]: child}, dict(child.tenants))
        parent.children[upper.edge[0]] = upper
        child.edge, child.parent = child.edge[at:], upper
        return upper

    def match(self, key: str) -> dict[str, int]:
        """Characters of `key` each tenant holds as a prefix (tenants with none are absent)."""
        matched: dict[str, int] = {}
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            shared = common_prefix_len(child.edge, key[pos:])
            for tenant in child.tenants:
                matched[tenant] = pos + shared
            if shared < len(child.edge):
                break
            node, pos = child, pos + shared
        return matched

    def remove_tenant(self, tenant: str) -> None:
        self._evict_tenant(tenant, 0)
        self.root.tenants.pop(tenant, None)
        self.sizes.pop(tenant, None)

    def evict(self, max_size: int) -> None:
        """Drop each tenant's least recently used leaves until it holds at most `max_size`."""
        for tenant, size in list(self.sizes.items()):
            if size > max_size:
                self._evict_tenant(tenant, max_size)

    def _evict_tenant(self, tenant: str, max_size: int) -> None:
        heap = [(n.tenants[tenant], id(n), n) for n in self._tenant_leaves(tenant)]
        heapq.heapify(heap)
        while heap and self.sizes[tenant] > max_size:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self.sizes[tenant] -= len(node.edge)
            parent = node.parent
            if not node.tenants:
                del parent.children[node.edge[0]]
            if parent is not self.root and self._is_tenant_leaf(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))

    def _tenant_leaves(self, tenant: str) -> list[Node]:
        leaves, stack = [], [c for c in self.root.children.values() if tenant in c.tenants]
        while stack:
            node = stack.pop()
            held = [c for c in node.children.values() if tenant in c.tenants]
            stack.extend(held)
            if not held:
                leaves.append(node)
        return leaves

    @staticmethod
    def _is_tenant_leaf(node: Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(
            tenant in c.tenants for c in node.children.values()
        )
