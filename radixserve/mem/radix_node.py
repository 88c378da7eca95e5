"""The radix tree's nodes and the read-only walks over a tree: a node's path and namespace from
the root, and the dashboard's biggest cached prefixes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    value: list[int] = field(default_factory=list)
    parent: "TreeNode | None" = None
    children: dict[tuple[int, ...], "TreeNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: float = 0.0
    hit_count: int = 0
    block_hashes: list[int] = field(default_factory=list)  # one per page, with KV events on
    salt: str | None = None  # set on a namespace node only (see RadixCache)
    snapshot: int | None = None  # a hybrid model's state at this node's end (its slot)


@dataclass(frozen=True)
class CachedPrefix:
    """A cached path from the root, for the dashboard."""

    tokens: list[int]
    num_tokens: int
    hit_count: int
    idle_seconds: float
    locked: bool


def salt_of(node: TreeNode) -> str | None:
    """The namespace `node` lies in (None: the shared one): the salt of the namespace node
    under the root on its path."""
    while node.parent is not None and node.parent.parent is not None:
        node = node.parent
    return node.salt


def path_of(node: TreeNode) -> tuple[list[int], list[int]]:
    """The tokens and slots from the root down to `node`."""
    keys, values = [], []
    while node.parent is not None:
        keys.append(node.key)
        values.append(node.value)
        node = node.parent
    return [t for k in reversed(keys) for t in k], [s for v in reversed(values) for s in v]


def top_prefixes(root: TreeNode, now: float, limit: int = 10) -> list[CachedPrefix]:
    """Cached paths that earned the most (hits x length), then the biggest leaves."""
    paths = []
    for node in walk(root):
        if node is root or node.salt is not None or (node.children and not node.hit_count):
            continue
        tokens = path_of(node)[0]
        idle = now - node.last_access
        paths.append(CachedPrefix(tokens, len(tokens), node.hit_count, idle, node.lock_ref > 0))
    paths.sort(key=lambda p: (p.hit_count * p.num_tokens, p.num_tokens), reverse=True)
    return paths[:limit]


def walk(root: TreeNode):
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
