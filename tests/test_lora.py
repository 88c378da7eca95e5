"""Multi-LoRA serving: a tiny random base and two random peft adapters (nonzero B), checked
against HF + peft with each adapter merged; one batch mixes the base and both adapters, and
the radix cache never hands one adapter's KV to another."""

import copy
import json
import threading
import time

import httpx
import peft
import pytest
import torch
from quant_checkpoints import random_llama
from server_utils import start_router, start_server, wait_idle
from test_model_families import hf_greedy

from radixserve import Engine
from radixserve.kv_events import BlockStored
from radixserve.lora import cache_namespace, read_adapter
from radixserve.mem.radix_cache import RadixCache
from radixserve.router.keys import routing_key, token_key

PROMPTS = [[5, 17, 42, 99, 3], list(range(100, 180)), [7, 7, 7] + list(range(200, 260))]
NEW_TOKENS = 10
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
ADAPTERS = {  # name -> (rank, alpha, targets)
    "a1": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "a2": (4, 4, ["q_proj", "v_proj", "down_proj"]),
}


def write_adapter(base, path, rank, alpha, targets, seed):
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "lora_" in name:
                tensor.normal_(0, 0.15)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = random_llama()
    base.save_pretrained(root / "base")
    merged = {None: base}
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1):
        merged[name] = write_adapter(base, root / name, rank, alpha, targets, seed)
    paths = tuple(f"{name}={root / name}" for name in ADAPTERS)
    with Engine(
        model=str(root / "base"),
        lora_paths=paths,
        max_total_tokens=2048,
        chunked_prefill_size=32,
        dtype="float32",
    ) as eng:
        yield eng, merged, root


def test_one_batch_mixing_base_and_adapters_matches_hf_with_each_merged(served):
    eng, merged, _ = served
    names = [None, *ADAPTERS]
    batch = [(ids, name) for ids in PROMPTS for name in names]
    results = eng.generate(
        input_ids=[ids for ids, _ in batch],
        sampling_params=GREEDY,
        lora_path=[name for _, name in batch],
    )
    want = [hf_greedy(merged[name], ids, NEW_TOKENS) for ids, name in batch]
    assert [r["output_ids"] for r in results] == want
    outputs = {name: [] for name in names}
    for (_, name), r in zip(batch, results):
        outputs[name].append(r["output_ids"])
    assert outputs["a1"] != outputs[None] and outputs["a2"] != outputs[None]
    eng.check_memory()


def test_the_prefix_cache_never_mixes_adapters(served):
    eng, _, _ = served
    prompt = list(range(300, 364))

    def cached(name):
        result = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
        return result["meta_info"]["cached_tokens"]

    assert cached("a1") == 0
    assert cached("a2") == 0
    assert cached(None) == 0
    assert cached("a1") == len(prompt) - 1
    assert cached("a2") == len(prompt) - 1


def test_an_unknown_adapter_is_named(served):
    eng, _, _ = served
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="nope")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"max_lora_rank": 4}, "rank 8 is over --max-lora-rank 4"),
        ({"other_base": True}, "this base needs A"),
    ],
)
def test_a_bad_adapter_is_refused_at_load(served, tmp_path, change, message):
    _, merged, root = served
    path = root / "a1"
    if change.pop("other_base", False):
        other = random_llama()
        other.config.intermediate_size = 192
        wide = type(other)(other.config)
        write_adapter(wide, tmp_path / "wide", 8, 16, ["gate_proj"], 3)
        path = tmp_path / "wide"
    with pytest.raises(ValueError, match=message):
        Engine(
            model=str(root / "base"), lora_paths=(f"a1={path}",), dtype="float32", **change
        ).shutdown()


@pytest.fixture(scope="module")
def server(served):
    """Two adapters at start-up, room for a third at runtime, two pool slots."""
    _, merged, root = served
    merged["a3"] = write_adapter(merged[None], root / "a3", 6, 12, ["o_proj", "up_proj"], 3)
    write_adapter(merged[None], root / "rank16", 16, 16, ["q_proj"], 4)
    paths = [f"{name}={root / name}" for name in ADAPTERS]
    flags = ["--lora-paths", *paths, "--max-lora-rank", "8", "--lora-target-modules", "all"]
    server = start_server(
        root,
        "--model",
        str(root / "base"),
        *flags,
        "--max-loras-per-batch",
        "2",
        "--chunked-prefill-size",
        "32",
    )
    try:
        with server.client(timeout=120) as client:
            yield client, merged, root
    finally:
        assert server.stop() == 0, server.log()


def test_the_router_loads_and_unloads_an_adapter_on_its_workers(server, tmp_path):
    """/load_lora_adapter through the router reaches the worker, requests through it pick the
    adapter by `model`, a refusal keeps the worker's reason, and the KV-event index keys an
    adapter's requests apart from the base's token ids."""
    client, merged, root = server
    router = start_router(tmp_path, "--worker-urls", str(client.base_url))
    try:
        with router.client(timeout=120) as rc:
            body = {"lora_name": "r1", "lora_path": str(root / "a3")}
            loaded = rc.post("/load_lora_adapter", json=body)
            assert loaded.status_code == 200, loaded.text
            assert "r1" in [m["id"] for m in client.get("/v1/models").json()["data"]]
            ids = PROMPTS[1]
            params = {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            completion = rc.post("/v1/completions", json={"model": "r1", "prompt": ids, **params})
            assert completion.status_code == 200, completion.text
            got = generate(rc, ids, "r1").json()["output_ids"]
            assert got == hf_greedy(merged["a3"], ids, NEW_TOKENS)
            twice = rc.post("/load_lora_adapter", json=body)
            assert twice.status_code == 400 and "already loaded" in twice.text
            gone = rc.post("/unload_lora_adapter", json={"lora_name": "r1"})
            assert gone.status_code == 200, gone.text
            assert "r1" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    finally:
        router.stop()
    completion = b'{"model": "a1", "prompt": [1, 2, 3]}'
    assert token_key("/v1/completions", completion, None, {"a1"}) == routing_key(
        "/v1/completions", completion
    )
    assert token_key("/v1/completions", completion, None, set()) != routing_key(
        "/v1/completions", completion
    )


def generate(client, ids, adapter, **params):
    body = {"input_ids": ids, "sampling_params": {**GREEDY, **params}, "lora_path": adapter}
    return client.post("/generate", json=body)


def test_the_server_serves_adapters_by_lora_path_and_by_model_name(server):
    client, merged, _ = server
    ids = PROMPTS[1]
    r = client.post(
        "/generate",
        json={
            "input_ids": [ids, ids, ids],
            "sampling_params": GREEDY,
            "lora_path": [None, "a1", "a2"],
        },
    )
    assert r.status_code == 200, r.text
    got = [item["output_ids"] for item in r.json()]
    assert got == [hf_greedy(merged[n], ids, NEW_TOKENS) for n in (None, "a1", "a2")]
    completion = client.post(
        "/v1/completions",
        json={"model": "a2", "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0},
    )
    assert completion.status_code == 200, completion.text
    bad = generate(client, ids, "a3")
    assert bad.status_code == 400 and "'a3'" in bad.text
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models[1:]] == [
        ("a1", models[0]["id"]),
        ("a2", models[0]["id"]),
    ]
    again = generate(client, ids, "a2").json()
    assert again["output_ids"] == got[2]
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 1
    metrics = client.get("/metrics").text
    assert 'radixserve:lora_requests_total{lora_name="a2"} 3.0' in metrics, metrics
    rows = {row["name"]: row for row in client.get("/dashboard/data").json()["adapters"]}
    assert rows["a2"]["requests"] == 3 and rows["a2"]["hit_rate"] > 0
    assert rows["a1"]["requests"] == 1


def test_load_use_unload_and_reuse_an_adapter_under_traffic(server):
    """Base traffic runs throughout; an adapter loaded at runtime serves HF + peft's tokens;
    unloading it while a long request uses it waits for that request, which finishes whole;
    reloaded from the same files, it finds its own cached prefix again."""
    client, merged, root = server
    ids, want_base = PROMPTS[2], hf_greedy(merged[None], PROMPTS[2], NEW_TOKENS)
    stop, base_results = threading.Event(), []

    def base_traffic():
        with httpx.Client(base_url=str(client.base_url), timeout=120) as own:
            while not stop.is_set():
                r = generate(own, ids, None)
                base_results.append((r.status_code, r.json().get("output_ids")))

    traffic = threading.Thread(target=base_traffic)
    traffic.start()
    try:
        loaded = client.post(
            "/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(root / "a3")}
        )
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["loaded_adapters"] == ["a1", "a2", "a3"]
        assert "a3" in [m["id"] for m in client.get("/v1/models").json()["data"]]
        first = generate(client, PROMPTS[1], "a3").json()
        assert first["output_ids"] == hf_greedy(merged["a3"], PROMPTS[1], NEW_TOKENS)

        long_tokens, started, finished = 400, threading.Event(), []

        def long_request():
            body = {
                "input_ids": PROMPTS[0],
                "sampling_params": {**GREEDY, "max_new_tokens": long_tokens},
                "lora_path": "a3",
                "stream": True,
            }
            chunks = []
            with httpx.Client(base_url=str(client.base_url), timeout=120) as own:
                with own.stream("POST", "/generate", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunks.append(json.loads(line[6:]))
                            started.set()
            finished.append((time.monotonic(), chunks[-1]))

        worker = threading.Thread(target=long_request)
        worker.start()
        assert started.wait(60)
        asked_at = time.monotonic()
        unloaded = client.post("/unload_lora_adapter", json={"lora_name": "a3"})
        worker.join()
        assert unloaded.status_code == 200, unloaded.text
        done_at, last = finished[0]
        assert last["meta_info"]["completion_tokens"] == long_tokens, last
        assert asked_at < done_at  # the unload was asked while the request ran
        gone = generate(client, PROMPTS[1], "a3")
        assert gone.status_code == 400 and "'a3'" in gone.text

        again = client.post(
            "/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(root / "a3")}
        )
        assert again.status_code == 200, again.text
        reused = generate(client, PROMPTS[1], "a3").json()
        assert reused["output_ids"] == first["output_ids"]
        assert reused["meta_info"]["cached_tokens"] >= len(PROMPTS[1]) - 1

        mixed = client.post(  # three adapters, two pool slots: one waits, slots are swapped
            "/generate",
            json={
                "input_ids": [PROMPTS[1]] * 4,
                "sampling_params": GREEDY,
                "lora_path": ["a1", "a2", "a3", None],
            },
        )
        assert [m["output_ids"] for m in mixed.json()] == [
            hf_greedy(merged[n], PROMPTS[1], NEW_TOKENS) for n in ("a1", "a2", "a3", None)
        ]
    finally:
        stop.set()
        traffic.join()
    assert base_results and all(r == (200, want_base) for r in base_results)
    wait_idle(client)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"lora_name": "big", "lora_path": "rank16"}, "rank 16 is over --max-lora-rank 8"),
        ({"lora_name": "a1", "lora_path": "a2"}, "'a1' is already loaded"),
        ({"lora_name": "x", "lora_path": "missing"}, "expected adapter_config.json"),
        ({"lora_name": "x"}, "lora_path"),
    ],
)
def test_a_bad_runtime_load_is_a_400_with_the_reason(server, body, message):
    client, _, root = server
    if "lora_path" in body:
        body = {**body, "lora_path": str(root / body["lora_path"])}
    r = client.post("/load_lora_adapter", json=body)
    assert r.status_code == 400 and message in r.text, r.text
    r = client.post("/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 400 and "'nope'" in r.text


def test_kv_events_carry_the_adapter_and_its_blocks_hash_apart(served):
    """An adapter's blocks are published with its lora_id and hashed apart from the base's
    (the chain starts from its namespace), the same for a reload of the same files."""
    _, _, root = served
    a1, a2 = (read_adapter(name, root / name) for name in ("a1", "a2"))
    assert read_adapter("other_name", root / "a1").lora_id == a1.lora_id
    cache = RadixCache(4, record_events=True)
    tokens = list(range(8))
    stored = {}
    for adapter in (None, a1, a2):
        cache.insert(tokens, list(range(8)), cache_namespace(None, adapter))
        (event,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
        stored[adapter.name if adapter else None] = event
    assert stored[None].lora_id is None
    assert (stored["a1"].lora_id, stored["a2"].lora_id) == (a1.lora_id, a2.lora_id)
    hashes = [tuple(e.block_hashes) for e in stored.values()]
    assert len(set(hashes)) == 3
