"""The router's approximate prefix tree and its policies, as pure logic (no processes)."""

import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.router.config import RouterArgs
from radixserve.router.keys import routing_key
from radixserve.router.policies import CacheAware, PowerOfTwo, RoundRobin
from radixserve.router.tree import PrefixTree
from radixserve.router.workers import CircuitBreaker, Worker


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def held(tree: PrefixTree, tenant: str) -> set[str]:
    """Every key prefix the tenant holds, read back by walking the tree."""
    out, stack = set(), [(tree.root, "")]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            if tenant in child.tenants:
                text = prefix + child.edge
                out.add(text)
                stack.append((child, text))
    return out


def counted_size(tree: PrefixTree, tenant: str) -> int:
    total, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            if tenant in child.tenants:
                total += len(child.edge)
                stack.append(child)
    return total


def test_match_reports_each_tenants_prefix():
    tree = PrefixTree()
    tree.insert("system prompt A: question 1", "w1")
    tree.insert("system prompt A: question 2", "w2")
    tree.insert("system prompt B", "w2")
    assert tree.match("system prompt A: question 1?") == {"w1": 27, "w2": 26}
    assert tree.match("system prompt B and more") == {"w1": 14, "w2": 15}
    assert tree.match("other") == {}
    assert tree.sizes == {"w1": 27, "w2": 27 + 1}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.text("ab", min_size=0, max_size=12), st.sampled_from(["w1", "w2", "w3"])),
        max_size=40,
    ),
    st.integers(0, 30),
)
def test_tree_sizes_match_and_eviction_hold_their_invariants(inserts, bound):
    tree = PrefixTree(clock=Clock())
    for key, tenant in inserts:
        tree.insert(key, tenant)
    for tenant in ("w1", "w2", "w3"):
        assert tree.sizes.get(tenant, 0) == counted_size(tree, tenant)
    for key, _ in inserts:  # each tenant matches exactly the longest prefix of key it was sent
        for tenant in ("w1", "w2", "w3"):
            sent = [k for k, t in inserts if t == tenant]
            best = max((common(k, key) for k in sent), default=0)
            assert tree.match(key).get(tenant, 0) == best
    tree.evict(bound)
    for tenant in ("w1", "w2", "w3"):
        assert tree.sizes.get(tenant, 0) <= bound
        assert tree.sizes.get(tenant, 0) == counted_size(tree, tenant)


def common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_eviction_drops_the_least_recently_used_first():
    tree = PrefixTree(clock=Clock())
    tree.insert("aaaa-old", "w1")
    tree.insert("bbbb-new", "w1")
    tree.insert("aaaa-old", "w2")
    tree.evict(8)
    assert held(tree, "w1") == {"bbbb-new"}
    assert held(tree, "w2") == {"aaaa-old"}
    tree.remove_tenant("w2")
    assert tree.match("aaaa-old") == {} and "w2" not in tree.sizes


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", CircuitBreaker(), in_flight=n) for i, n in enumerate(loads)]


def test_cache_aware_keeps_a_prefix_group_on_one_worker_and_spreads_groups():
    policy = CacheAware(RouterArgs())
    pool = workers(0, 0)
    groups = [f"few-shot prefix {g} " * 20 for g in range(16)]
    rng = random.Random(0)
    arrivals = [(g, q) for g in range(16) for q in range(6)]
    rng.shuffle(arrivals)
    home: dict[int, set[str]] = {}
    for g, q in arrivals:
        home.setdefault(g, set()).add(policy.pick(pool, groups[g] + f"question {q}").url)
    assert all(len(urls) == 1 for urls in home.values())
    per_worker = [sum(1 for urls in home.values() if w.url in urls) for w in pool]
    assert per_worker == [8, 8]


def test_cache_aware_sends_to_the_idlest_worker_when_load_is_out_of_balance():
    policy = CacheAware(RouterArgs(balance_abs_threshold=4, balance_rel_threshold=1.5))
    pool = workers(0, 0)
    key = "shared prefix " * 10
    first = policy.pick(pool, key)
    first.in_flight = 3
    assert (
        policy.pick(pool, key) is first
    )  # 3 vs 0 is within the absolute threshold: the cache wins
    first.in_flight = 10
    assert policy.pick(pool, key) is not first  # 10 vs 0: out of balance


def test_cache_aware_below_threshold_picks_the_worker_holding_least():
    policy = CacheAware(RouterArgs(cache_threshold=0.5))
    pool = workers(0, 0)
    policy.tree.insert("x" * 100, pool[0].url)
    assert policy.pick(pool, "x" * 10 + "y" * 90) is pool[1]


def test_round_robin_and_power_of_two():
    pool = workers(5, 0, 5)
    rr = RoundRobin()
    assert [rr.pick(pool, "").url for _ in range(4)] == [
        "http://w1",
        "http://w2",
        "http://w0",
        "http://w1",
    ]
    p2 = PowerOfTwo(seed=1)
    picks = {p2.pick(pool, "").url for _ in range(50)}
    assert "http://w1" in picks and all(p2.pick(pool[:1], "") is pool[0] for _ in range(3))


def test_circuit_breaker_opens_after_failures_and_closes_after_a_success():
    breaker = CircuitBreaker(failure_threshold=2, success_threshold=1, cooldown_s=10)
    breaker.record_failure(0.0)
    assert breaker.allows(1.0)
    breaker.record_failure(1.0)
    assert not breaker.allows(5.0) and breaker.allows(11.0)
    breaker.record_failure(11.0)  # a half-open failure reopens at once
    assert not breaker.allows(12.0)
    breaker.record_success()
    assert breaker.opened_at is None and breaker.allows(12.0)


@pytest.mark.parametrize(
    "path, body, key",
    [
        ("/generate", b'{"text": "hello"}', "hello"),
        ("/generate", b'{"text": ["a", "b"]}', "a"),
        ("/generate", b'{"input_ids": [72, 105]}', "Hi"),
        ("/generate", b'{"input_ids": [[72], [73]]}', "H"),
        ("/v1/completions", b'{"prompt": "p"}', "p"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "q"}]}', "<user>q"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]}',
            "<user>q",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": 5}',
            "",
        ),  # malformed fields: no key, the worker names the field
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": 7}, "x"], "tools": 3}',
            "3<user>",
        ),
        ("/generate", b'{"text": {"a": 1}}', ""),
        ("/generate", b"not json", ""),
        ("/generate", b'{"input_ids": [-1]}', ""),
        ("/v1/completions", b"[1]", ""),
        ("/generate", b'{"text": "hello", "cache_salt": "t1"}', "\x00salt\x00t1\x00salt\x00hello"),
        ("/v1/responses", b'{"input": "q", "instructions": "be brief"}', "be brief<user>q"),
        (
            "/v1/messages",
            b'{"system": "s", "messages": [{"role": "user", "content": "q"}]}',
            "s<user>q",
        ),
        ("/v1/embeddings", b'{"input": ["x", "y"]}', "x"),
        (  # a LoRA adapter leads the key, after the salt
            "/generate",
            b'{"text": "hi", "lora_path": ["a1"], "cache_salt": "t"}',
            "\x00salt\x00t\x00salt\x00\x00lora\x00a1\x00lora\x00hi",
        ),
        ("/v1/completions", b'{"prompt": "hi", "model": "a2"}', "\x00lora\x00a2\x00lora\x00hi"),
        ("/v1/rerank", b'{"query": "q", "documents": ["d"]}', "q"),
    ],
)
def test_routing_keys(path, body, key):
    assert routing_key(path, body) == key


def test_routing_keys_name_images_by_a_hash_of_their_data_never_the_data():
    from radixserve.router.keys import token_key

    def chat(url: str, text: str = "what is it?") -> bytes:
        part = {"type": "image_url", "image_url": {"url": url}}
        content = [part, {"type": "text", "text": text}]
        return orjson.dumps({"messages": [{"role": "user", "content": content}]})

    red, blue = "data:image/png;base64," + "A" * 4000, "data:image/png;base64," + "B" * 4000
    key = routing_key("/v1/chat/completions", chat(red))
    assert "AAAA" not in key and len(key) < 100 and key.endswith("what is it?")
    assert key == routing_key("/v1/chat/completions", chat(red))
    assert key != routing_key("/v1/chat/completions", chat(blue))
    responses = orjson.dumps(
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": red}]}]}
    )
    anthropic = orjson.dumps(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": red}}],
                }
            ]
        }
    )
    image = key.split("<user>")[1].removesuffix("what is it?")
    assert image in routing_key("/v1/responses", responses)
    assert image in routing_key("/v1/messages", anthropic)
    generate = orjson.dumps({"input_ids": [1, 2], "image_data": [red]})
    assert routing_key("/generate", generate) == "\x01\x02" + image
    # the KV-event index keys image requests as the policy does: their tokens are only known
    # once the worker has hashed the pixels
    assert token_key("/v1/chat/completions", chat(red), None) == key


def test_kv_event_index_matches_whole_pages_from_events_and_pending_routes():
    from radixserve.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, chain_hashes
    from radixserve.router.keys import ids_key
    from radixserve.router.kv_index import KVEventIndex, events_endpoint

    clock = Clock()
    index = KVEventIndex(page_size=2, clock=clock)
    prompt = [5, 6, 7, 8, 9]
    blocks = chain_hashes(prompt, 2)
    assert len(blocks) == 2
    index.apply("w1", [BlockStored(blocks, None, prompt[:4], 2)])
    assert index.match(ids_key(prompt)) == {"w1": 4}
    assert index.match(ids_key([5, 6, 0, 0])) == {"w1": 2}
    index.apply("w1", [BlockRemoved(blocks[1:])])
    assert index.match(ids_key(prompt)) == {"w1": 2}
    index.insert(ids_key(prompt), "w2")  # routed, not yet stored: pending for a while
    assert index.match(ids_key(prompt)) == {"w1": 2, "w2": 4}
    clock.now += 60
    index.evict(0)
    assert index.match(ids_key(prompt)) == {"w1": 2}
    index.apply("w1", [AllBlocksCleared()])
    assert index.match(ids_key(prompt)) == {}
    assert events_endpoint('{"endpoint": "tcp://*:5557", "topic": "kv"}', "10.0.0.2") == (
        "tcp://10.0.0.2:5557",
        b"kv",
    )
    assert events_endpoint('{"endpoint": "tcp://127.0.0.1:1"}', "h") == ("tcp://127.0.0.1:1", b"")


def test_router_args_refuse_what_they_cannot_do():
    for bad in [
        dict(policy="lpm"),
        dict(worker_urls=("localhost:1",)),
        dict(worker_urls=("http://a:1",) * 2),
        dict(kv_events=True, policy="round_robin"),
        dict(cache_threshold=2.0),
        dict(retry_max_retries=-1),
    ]:
        with pytest.raises(ValueError):
            RouterArgs(**bad)
