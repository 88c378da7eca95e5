"""The hierarchical cache: blocks kept in host memory and on disk, loaded back on a hit.

Storage is checked block by block (corrupt, truncated, missing, foreign, disk full), then
the real model: greedy output is the same with and without the tiers while the device pool
thrashes, for every write policy, and a restarted server finds a long prefix on disk."""

import time

import httpx
import pytest
import torch
from server_utils import start_server

from radixserve import Engine
from radixserve.mem.hicache import HiCache, chain_hashes
from radixserve.mem.kv_pool import KVPool

BLOCK = 64


def small_pool() -> KVPool:
    pool = KVPool(512, [(1, 4, 4)] * 2, dtype=torch.float32)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn_like(t))
    return pool


def allocator(start: int):
    return lambda n: list(range(start, start + n))


def test_blocks_survive_in_storage_and_come_back_exactly(tmp_path):
    pool = small_pool()
    tokens = list(range(1000, 1000 + 2 * BLOCK + 10))
    slots = list(range(1, len(tokens) + 1))
    writer = HiCache.create(pool, 1, 4 * BLOCK, "00" * 8, str(tmp_path))
    writer.backup(tokens, slots)
    writer.storage.flush()
    assert writer.stats.storage_written_blocks == 2 and len(list(tmp_path.rglob("*.kv"))) == 2
    want = [pool.k[1][slots[: 2 * BLOCK]].clone(), pool.v[0][slots[: 2 * BLOCK]].clone()]
    reader = HiCache.create(pool, 1, 4 * BLOCK, "00" * 8, str(tmp_path))
    loaded = reader.load(tokens, 0, allocator(300))
    assert loaded == list(range(300, 300 + 2 * BLOCK))
    assert torch.equal(pool.k[1][loaded], want[0]) and torch.equal(pool.v[0][loaded], want[1])
    assert reader.stats.storage_hit_tokens == 2 * BLOCK
    partial = HiCache.create(pool, 1, 4 * BLOCK, "00" * 8, str(tmp_path)).load(
        tokens, 16, allocator(300)
    )
    assert len(partial) == 2 * BLOCK - 16  # a match ending inside a block loads the rest of it
    assert torch.equal(pool.k[1][partial], want[0][16:])


def stored(tmp_path, fingerprint="00" * 8):
    pool = small_pool()
    tokens = list(range(2 * BLOCK))
    cache = HiCache.create(pool, 1, 4 * BLOCK, fingerprint, str(tmp_path))
    cache.backup(tokens, list(range(1, 2 * BLOCK + 1)))
    cache.storage.flush()
    files = [cache.storage.path(h) for h in sorted(cache.host.index, key=cache.host.index.get)]
    return pool, tokens, files


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_a_damaged_block_is_a_miss_never_served(tmp_path, damage):
    pool, tokens, files = stored(tmp_path)
    second = files[1]
    data = bytearray(second.read_bytes())
    if damage == "corrupt":
        data[-7] ^= 0x40
        second.write_bytes(bytes(data))
    elif damage == "truncated":
        second.write_bytes(bytes(data[: len(data) // 2]))
    else:
        second.unlink()
    reader = HiCache.create(pool, 1, 4 * BLOCK, "00" * 8, str(tmp_path))
    assert len(reader.load(tokens, 0, allocator(300))) == BLOCK  # the first block only
    assert reader.stats.storage_bad_blocks == (0 if damage == "missing" else 1)
    assert not second.exists()  # a bad file is deleted, so it is rewritten next time


def test_another_models_blocks_are_never_read(tmp_path):
    pool, tokens, files = stored(tmp_path, "00" * 8)
    other = HiCache.create(pool, 1, 4 * BLOCK, "11" * 8, str(tmp_path))
    assert other.load(tokens, 0, allocator(300)) == []  # its own folder is empty
    first = chain_hashes(tokens, BLOCK, other.seed)[
        0
    ]  # a foreign file where it would look fails the header check
    target = other.storage.path(first)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(files[0].read_bytes())
    assert other.load(tokens, 0, allocator(300)) == []
    assert other.stats.storage_bad_blocks == 1


def test_a_full_disk_skips_writes(tmp_path):
    pool = small_pool()
    cache = HiCache.create(pool, 1, 4 * BLOCK, "00" * 8, str(tmp_path))
    cache.storage.min_free_bytes = 1 << 62  # no disk has that much free: it counts as full
    cache.backup(list(range(2 * BLOCK)), list(range(1, 2 * BLOCK + 1)))
    cache.storage.flush()
    assert cache.stats.storage_skipped_blocks == 2 and not list(tmp_path.rglob("*.kv"))
    assert cache.load(list(range(2 * BLOCK)), 0, allocator(300)) == allocator(300)(
        2 * BLOCK
    )  # L2 still serves


PROMPTS = [
    f"Report {i}: " + " ".join(f"item {i}-{j} is noted." for j in range(36)) for i in range(4)
]
CYCLE = [
    0,
    1,
    2,
    3,
    0,
    1,
    2,
    3,
]  # four ~240-token prompts through a 512-token pool: each evicts the last
REPEATED = [
    0,
    0,
    0,
    1,
    1,
    1,
    2,
    2,
    2,
    3,
    3,
    3,
    0,
    1,
    2,
    3,
]  # hit on the device before it is evicted
WITHOUT_TIERS: dict[tuple, tuple] = {}


def run(order: list[int], **kw) -> tuple[list[str], float, dict]:
    with Engine(dtype="float32", max_total_tokens=512, **kw) as engine:
        texts, cached, total = [], 0, 0
        for i in order:
            out = engine.generate(
                [PROMPTS[i] + " Summary:"], {"max_new_tokens": 6, "temperature": 0}
            )[0]
            texts.append(out["text"])
            cached += out["meta_info"]["cached_tokens"]
            total += out["meta_info"]["prompt_tokens"]
        engine.scheduler.check_memory()
        return texts, cached / total, engine.scheduler.snapshot().hicache


@pytest.mark.parametrize(
    "policy, order",
    [("write_through", CYCLE), ("write_back", CYCLE), ("write_through_selective", REPEATED)],
)
def test_greedy_output_is_identical_with_the_tiers_and_hits_more(policy, order):
    """write_through_selective keeps only prefixes hit more than once, hence its own order."""
    if tuple(order) not in WITHOUT_TIERS:
        WITHOUT_TIERS[tuple(order)] = run(order)
    texts, hit_rate, _ = WITHOUT_TIERS[tuple(order)]
    tiered_texts, tiered_rate, stats = run(
        order, enable_hierarchical_cache=True, hicache_ratio=4, hicache_write_policy=policy
    )
    assert tiered_texts == texts
    assert stats["loaded_tokens"] > 0 and stats["host_hit_tokens"] > 0
    assert tiered_rate > hit_rate + 0.15, (tiered_rate, hit_rate)


def test_a_restarted_server_finds_a_long_prefix_on_disk(tmp_path):
    args = [
        "--max-total-tokens",
        "4096",
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-dir",
        str(tmp_path / "kv"),
    ]
    prompt = "Chapter one. " + " ".join(
        f"Line {i} of the long shared document." for i in range(260)
    )
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    first = start_server(tmp_path, *args)
    try:
        cold = first.client().post("/generate", json=body).json()
        blocks = cold["meta_info"]["prompt_tokens"] // BLOCK
        assert cold["meta_info"]["prompt_tokens"] >= 2000
        deadline = time.time() + 30
        while written(first.url) < blocks:  # storage writes run behind the scheduler
            assert time.time() < deadline
            time.sleep(0.2)
    finally:
        assert first.stop() == 0
    second = start_server(tmp_path, *args)
    try:
        warm = second.client().post("/generate", json=body).json()
        assert warm["text"] == cold["text"]
        assert warm["meta_info"]["cached_tokens"] >= 0.9 * warm["meta_info"]["prompt_tokens"]
        assert (
            'radixserve:hicache_hit_tokens_total{tier="storage"}'
            in httpx.get(f"{second.url}/metrics").text
        )
    finally:
        assert second.stop() == 0


def written(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("radixserve:hicache_storage_written_blocks_total"):
            return float(line.split()[-1])
    return 0.0


def test_a_load_pins_its_blocks_while_making_room_backs_up_others(tmp_path):
    """write_back backs up what eviction frees while a load is making room: that must not
    reuse the host blocks the load is about to copy from."""
    pool = small_pool()
    cache = HiCache.create(pool, 1, 2 * BLOCK, "00" * 8, None)  # room for two blocks only
    first = list(range(2 * BLOCK))
    cache.backup(first, list(range(1, 2 * BLOCK + 1)))
    want = pool.k[0][1 : 2 * BLOCK + 1].clone()

    def alloc_after_backing_up_others(n):
        cache.backup(list(range(5000, 5000 + 2 * BLOCK)), list(range(300, 300 + 2 * BLOCK)))
        return list(range(200, 200 + n))

    loaded = cache.load(first, 0, alloc_after_backing_up_others)
    assert torch.equal(pool.k[0][loaded], want)
    cache.host.check()


def test_the_dashboard_names_the_tiers_holding_each_prefix(tmp_path):
    with Engine(
        dtype="float32",
        max_total_tokens=1024,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
    ) as engine:
        engine.generate([PROMPTS[0]], {"max_new_tokens": 2, "temperature": 0})
        engine.scheduler.kv.hicache.storage.flush()
        top = engine.scheduler.top_prefixes(1)[0]
    assert top["tiers"] == ["device", "host", "disk"] and top["num_tokens"] >= BLOCK


def test_a_prefix_longer_than_the_host_tier_keeps_its_first_blocks_right():
    pool = small_pool()
    cache = HiCache.create(pool, 1, 2 * BLOCK, "00" * 8, None)  # two blocks, a four-block prefix
    tokens = list(range(4 * BLOCK))
    cache.backup(tokens, list(range(1, 4 * BLOCK + 1)))
    loaded = cache.load(tokens, 0, allocator(300))
    assert loaded and torch.equal(pool.k[0][loaded], pool.k[0][1 : len(loaded) + 1])
    cache.host.check()
