"""RL rollout control on a real server: weights updated from disk serve the new checkpoint's
tokens (checked against HF on it), report the new version, and nothing is read from the cache
filled by the old weights; pausing holds, aborts or retracts in-flight requests."""

import json
import threading
import time

import pytest
import torch
import transformers as hf
from server_utils import start_server, wait_idle

CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
PROMPT = list(range(100, 160))
NEW_TOKENS = 10


def build_llama(path, seed: int, **changes):
    torch.manual_seed(seed)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(**{**CONFIG, **changes}))
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.normal_(0, 0.1 if "norm" in name else 0.2)
    model.eval().save_pretrained(path)
    return model


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    old, new = build_llama(root / "old", 0), build_llama(root / "new", 1)
    build_llama(root / "wider", 2, intermediate_size=256)
    return root, old, new


@pytest.fixture(scope="module")
def server(checkpoints):
    root, _, _ = checkpoints
    srv = start_server(root, "--model", str(root / "old"), "--max-total-tokens", "2048")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def generate(client, max_new_tokens=NEW_TOKENS, **extra):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
            **extra,
        },
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def update(client, path, **extra):
    return client.post("/update_weights_from_disk", json={"model_path": str(path), **extra})


def test_weights_from_disk_serve_the_new_checkpoint_and_never_the_old_cache(client, checkpoints):
    root, old, new = checkpoints
    first = generate(client)
    assert first["output_ids"] == hf_greedy(old, PROMPT, NEW_TOKENS)
    assert first["meta_info"]["weight_version"] == "default"
    assert generate(client)["meta_info"]["cached_tokens"] >= 32  # the prompt is cached now

    r = update(client, root / "new", weight_version="step-1")
    assert r.status_code == 200 and r.json()["success"], r.text
    assert r.json()["weight_version"] == "step-1"
    after = generate(client)
    assert after["meta_info"]["cached_tokens"] == 0  # the old weights' KV is gone
    assert after["meta_info"]["weight_version"] == "step-1"
    assert after["output_ids"] == hf_greedy(new, PROMPT, NEW_TOKENS)
    assert after["output_ids"] != first["output_ids"]
    assert generate(client)["output_ids"] == after["output_ids"]  # now from the new cache
    assert client.get("/get_weight_version").json() == {"weight_version": "step-1"}
    assert client.get("/get_model_info").json()["weight_version"] == "step-1"

    assert update(client, root / "old", weight_version="step-2").status_code == 200
    assert generate(client)["output_ids"] == first["output_ids"]


@pytest.mark.parametrize(
    "where, body_extra, needle",
    [
        ("missing", {}, "config.json"),
        ("wider", {}, "intermediate_size"),
        ("old", {"load_format": "pt"}, "load_format"),
        ("old", {"flush": True}, "flush"),
    ],
)
def test_a_checkpoint_that_cannot_replace_the_weights_is_a_400(
    client, checkpoints, where, body_extra, needle
):
    root, old, _ = checkpoints
    version = client.get("/get_weight_version").json()
    r = update(client, root / where, **body_extra)
    assert r.status_code == 400 and needle in r.text, r.text
    assert client.get("/get_weight_version").json() == version
    assert generate(client)["output_ids"] == hf_greedy(old, PROMPT, NEW_TOKENS)  # still serving


def run_in_thread(client, **kw):
    box = {}

    def run():
        box["reply"] = generate(client, **kw)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def test_pause_in_place_holds_requests_until_continue(server, client):
    assert client.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
    with server.client() as other:
        thread, box = run_in_thread(other)
        time.sleep(1.5)
        assert thread.is_alive() and "reply" not in box  # held, not failed
        assert client.post("/continue_generation").status_code == 200
        thread.join(60)
    assert box["reply"]["meta_info"]["finish_reason"]["type"] == "length"
    wait_idle(client)


def held_while_running(server, client, max_new_tokens=1500):
    """A request that has started decoding (its first chunk arrived), then held there by
    pausing in place; its thread and the box its last chunk lands in."""
    started, box = threading.Event(), {}
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }

    def run():
        with server.client() as other, other.stream("POST", "/generate", json=body) as r:
            box["status"] = r.status_code
            started.set() if r.status_code != 200 else None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    box["reply"] = json.loads(line.removeprefix("data: "))
                    started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60) and box["status"] == 200, box
    assert client.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
    return thread, box


def test_pause_abort_ends_in_flight_requests(server, client):
    thread, box = held_while_running(server, client)
    paused = client.post("/pause_generation", json={"mode": "abort"}).json()
    thread.join(60)
    assert client.post("/continue_generation", json={}).status_code == 200
    assert paused["num_paused_requests"] == 1
    assert box["reply"]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_idle(client)


def test_an_update_retracts_in_flight_requests_which_then_finish(server, client, checkpoints):
    root, _, _ = checkpoints
    thread, box = held_while_running(server, client)
    reply = update(client, root / "new").json()
    assert client.post("/continue_generation").status_code == 200
    thread.join(120)
    assert reply["success"] and reply["num_paused_requests"] == 1, reply
    assert box["reply"].get("meta_info", {}).get("finish_reason", {}).get("type") == "length", box
    assert len(box["reply"]["output_ids"]) == 1500
    wait_idle(client)


def test_released_memory_holds_requests_until_resumed_from_the_checkpoint(
    server, client, checkpoints
):
    """Releasing the KV cache and the weights (an RL trainer uses the memory meanwhile) holds
    new requests; resuming reloads the weights from their checkpoint and the held request gets
    the same greedy tokens as before, from no cache."""
    root, _, new = checkpoints
    assert update(client, root / "new").status_code == 200
    expected = generate(client)["output_ids"]
    assert expected == hf_greedy(new, PROMPT, NEW_TOKENS)
    thread, _ = held_while_running(server, client)
    refused = client.post("/release_memory_occupation", json={})
    assert refused.status_code == 400 and "pause" in refused.text, refused.text
    client.post("/pause_generation", json={"mode": "abort"})
    thread.join(60)
    assert client.post("/continue_generation").status_code == 200
    assert client.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}).json()[
        "success"
    ]
    with server.client() as other:
        held, box = run_in_thread(other)
        time.sleep(1.5)
        assert held.is_alive()  # held: no step runs without weights and KV
        assert client.post("/resume_memory_occupation").json()["success"]
        held.join(60)
    assert box["reply"]["output_ids"] == expected
    assert box["reply"]["meta_info"]["cached_tokens"] == 0
    bad = client.post("/release_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400 and "tags" in bad.text
    wait_idle(client)
