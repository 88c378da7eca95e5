import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.config import EVICTION_POLICIES
from radixserve.mem.allocator import SlotAllocator
from radixserve.mem.radix_cache import EVICTION_PRIORITY, RadixCache


def make_cache(page_size=1, num_pages=1000, policy="lru"):
    alloc = SlotAllocator(num_pages, page_size)
    return RadixCache(
        page_size, alloc.free, eviction_policy=policy, clock=itertools.count().__next__
    ), alloc


def test_every_configurable_policy_has_an_eviction_order():
    assert set(EVICTION_POLICIES) == set(EVICTION_PRIORITY)


@pytest.mark.parametrize(
    "policy, order",
    [
        ("lru", [[7, 8], [1, 2], [5, 6], [3, 4]]),  # least recently used first; hits do not matter
        (
            "lfu",
            [[7, 8], [3, 4], [5, 6], [1, 2]],
        ),  # fewest hits first ([1,2] hit twice), then least recent
        (
            "slru",
            [[7, 8], [3, 4], [1, 2], [5, 6]],
        ),  # never hit, least recent first, then the hit ones
    ],
)
def test_eviction_order_of_each_policy(policy, order):
    cache, alloc = make_cache(policy=policy)
    for key in ([1, 2], [3, 4], [5, 6], [7, 8]):
        cache.insert(key, alloc.alloc_extend(0, None, 2))
    for key in ([1, 2], [1, 2], [5, 6]):  # hits, as the scheduler records them on admission
        cache.record_hit(cache.match_prefix(key)[1])
    cache.match_prefix([3, 4])  # used last, but not a hit
    evicted = []
    while cache.total_size():
        before = {tuple(k) for k, _ in _all_paths(cache)}
        cache.evict(1)
        evicted += [list(k) for k in before - {tuple(k) for k, _ in _all_paths(cache)}]
    assert evicted == order


def test_match_insert_split():
    cache, _ = make_cache()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    slots, node = cache.match_prefix([1, 2, 9])
    assert slots == [10, 11]
    assert node.key == [1, 2]  # split at the mismatch
    assert cache.insert([1, 2, 5], [20, 21, 22]) == 2
    assert cache.match_prefix([1, 2, 5, 6])[0] == [10, 11, 22]
    assert cache.total_size() == 5
    assert cache.num_nodes() == 4  # root, [1,2], [3,4], [5]


def test_lock_protects_from_eviction_and_lru_order():
    cache, alloc = make_cache()
    before = alloc.available()
    cache.insert([1, 2], alloc.alloc_extend(0, None, 2))
    cache.insert([3, 4], alloc.alloc_extend(0, None, 2))
    cache.insert([5, 6], alloc.alloc_extend(0, None, 2))
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    cache.match_prefix([5, 6])  # touch: [3,4] is now least recently used
    assert cache.evict(2) == 2
    assert cache.match_prefix([3, 4])[0] == []
    assert cache.match_prefix([5, 6])[0] != []
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2])[0] != []
    assert cache.protected_size() == 2
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 2
    cache.evict(100)
    assert cache.total_size() == 0 and alloc.available() == before


def test_page_aligned_matching():
    cache, _ = make_cache(page_size=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [4, 5, 6, 7, 8, 9, 10, 11])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])[0] == [4, 5, 6, 7]
    assert cache.match_prefix([1, 2, 3])[0] == []
    assert cache.insert([1, 2, 3, 4, 9, 9, 9, 9], [4, 5, 6, 7, 20, 21, 22, 23]) == 4


def test_disabled_cache_matches_nothing():
    cache = RadixCache(disable=True)
    assert cache.insert([1, 2], [5, 6]) == 2
    assert cache.match_prefix([1, 2])[0] == []


class NaiveCache:
    """Reference: a dict of every cached token prefix -> slot of its last token."""

    def __init__(self):
        self.slot_of: dict[tuple, int] = {}

    def insert(self, key, value) -> int:
        existing = 0
        for i in range(len(key)):
            prefix = tuple(key[: i + 1])
            if prefix in self.slot_of:
                existing = i + 1
            else:
                self.slot_of[prefix] = value[i]
        return existing

    def match(self, key) -> list[int]:
        out = []
        for i in range(len(key)):
            slot = self.slot_of.get(tuple(key[: i + 1]))
            if slot is None:
                break
            out.append(slot)
        return out


keys = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "hit", "evict"]), keys), max_size=40)
)
def test_radix_cache_agrees_with_naive_reference(policy, ops):
    cache, alloc = make_cache(num_pages=10_000, policy=policy)
    naive = NaiveCache()
    for op, key in ops:
        if op == "insert":
            value = alloc.alloc_extend(0, None, len(key))
            dup = cache.insert(key, value)
            assert dup == naive.insert(key, value)
            alloc.free(value[:dup])
        elif op == "match":
            slots, _ = cache.match_prefix(key)
            assert slots == naive.match(key)
        elif op == "hit":
            cache.record_hit(cache.match_prefix(key)[1])
        else:
            cache.evict(len(key))
            naive = NaiveCache()
            for tokens in _all_paths(cache):
                naive.insert(tokens[0], tokens[1])
        assert cache.total_size() + alloc.available() == alloc.num_slots
        assert cache.total_size() == len(naive.slot_of)


def _all_paths(cache):
    out = []

    def walk(node, key, value):
        if node is not cache.root:
            out.append((key, value))
        for child in node.children.values():
            walk(child, key + child.key, value + child.value)

    walk(cache.root, [], [])
    return out


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@settings(max_examples=60, deadline=None)
@given(
    inserts=st.lists(
        st.lists(st.integers(0, 2), min_size=1, max_size=6).map(lambda k: k * 2),
        min_size=1,
        max_size=20,
    ),
    evict_n=st.integers(1, 30),
    hits=st.lists(st.integers(0, 19), max_size=10),
)
def test_locked_paths_survive_any_eviction(policy, inserts, evict_n, hits):
    cache, alloc = make_cache(page_size=2, num_pages=10_000, policy=policy)
    for key in inserts:
        value = alloc.alloc_extend(0, None, len(key))
        alloc.free(value[: cache.insert(key, value)])
    for i in hits:
        cache.record_hit(cache.match_prefix(inserts[i % len(inserts)])[1])
    locked_key = inserts[0]
    slots, node = cache.match_prefix(locked_key)
    cache.inc_lock_ref(node)
    cache.evict(evict_n)
    assert cache.match_prefix(locked_key)[0] == slots
    cache.dec_lock_ref(node)
    cache.evict(10**9)
    assert cache.total_size() == 0 and alloc.available() == alloc.num_slots


@settings(max_examples=100, deadline=None)
@given(st.lists(keys, min_size=1, max_size=10), keys)
def test_match_length_agrees_with_match_prefix_without_changing_the_tree(inserted, probe):
    cache, alloc = make_cache(num_pages=10_000)
    for key in inserted:
        value = alloc.alloc_extend(0, None, len(key))
        alloc.free(value[: cache.insert(key, value)])
    nodes_before = cache.num_nodes()
    length, _ = cache.match_length(probe)
    assert cache.num_nodes() == nodes_before
    assert length == len(cache.match_prefix(probe)[0])


def test_salts_keep_runs_apart_and_their_hashes_too():
    from radixserve.mem.radix_cache import RadixCache

    freed = []
    cache = RadixCache(page_size=2, free_slots=freed.extend, record_events=True)
    key = [1, 2, 3, 4]
    assert cache.insert(key, [10, 11, 12, 13]) == 0
    assert cache.insert(key, [20, 21, 22, 23], salt="a") == 0  # not shared with the unsalted
    assert cache.insert(key, [30, 31, 32, 33], salt="b") == 0
    assert cache.match_prefix(key)[0] == [10, 11, 12, 13]
    assert cache.match_prefix(key, "a")[0] == [20, 21, 22, 23]
    assert cache.match_prefix(key, "zzz")[0] == []
    assert cache.match_length(key, "b")[0] == 4 and cache.match_length(key, "zzz")[0] == 0
    stored = [e for e in cache.take_events() if type(e).__name__ == "BlockStored"]
    assert len({tuple(e.block_hashes) for e in stored}) == 3  # the salt heads each chain
    assert cache.total_size() == 12
    cache.evict(12)
    assert cache.total_size() == 0 and cache.num_nodes() == 1  # emptied namespaces go too
    assert sorted(freed) == sorted([10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33])
