"""The router in front of two real replicas: proxying (streamed and not), cache-aware
placement, worker management, metrics, and a replica killed mid-run.

The kill test runs last: it takes one replica down for good."""

import asyncio
import glob
import os
import shutil
import signal
import time

import httpx
import pytest
from server_utils import (
    alive,
    child_pids,
    free_port,
    ipc_folder,
    start_router,
    start_server,
    wait_idle,
)

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    replicas = [
        start_server(
            tmp,
            "--num-threads",
            "1",
            "--max-total-tokens",
            "4096",
            "--kv-events-config",
            f'{{"endpoint": "tcp://*:{free_port()}", "topic": "kv"}}',
        )
        for _ in range(2)
    ]
    router = start_router(
        tmp,
        "--worker-urls",
        *[r.url for r in replicas],
        "--policy",
        "cache_aware",
        "--health-check-interval-secs",
        "1",
    )
    yield router, replicas
    assert router.stop() == 0, router.log()
    for replica in replicas:
        if replica.proc.poll() is None:
            assert replica.stop() == 0, replica.log()


def worker_of(response: httpx.Response) -> str:
    return response.headers["x-radixserve-worker"]


def test_generate_and_chat_through_the_router_equal_a_direct_call(cluster):
    router, replicas = cluster
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    with router.client() as c, replicas[0].client() as direct:
        routed = c.post("/generate", json=body)
        assert routed.status_code == 200 and worker_of(routed) in {r.url for r in replicas}
        assert routed.json()["text"] == direct.post("/generate", json=body).json()["text"]
        chat = {
            "model": "m",
            "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 6,
            "temperature": 0,
        }
        routed = c.post("/v1/chat/completions", json=chat).json()
        assert (
            routed["choices"][0]["message"]
            == direct.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        )
        assert c.get("/v1/models").json()["data"][0]["id"]


def test_responses_follow_ups_reach_the_replica_that_stored_them(cluster):
    """Each replica keeps its own stored responses: a body naming `previous_response_id`, and
    GET or DELETE of a response, go to the one holding it; the agent routes pass through."""
    router, _ = cluster
    with router.client() as client:
        body = {"input": "Name a color.", "max_output_tokens": 4, "temperature": 0}
        first = client.post("/v1/responses", json=body)
        assert first.status_code == 200, first.text
        owner, previous = worker_of(first), first.json()["id"]
        for question in ("Another?", "And one more, in a longer question than before?"):
            follow = {**body, "input": question, "previous_response_id": previous}
            reply = client.post("/v1/responses", json=follow)
            assert reply.status_code == 200 and worker_of(reply) == owner, reply.text
            previous = reply.json()["id"]
        assert client.get(f"/v1/responses/{previous}").json()["id"] == previous
        assert client.delete(f"/v1/responses/{previous}").status_code == 200
        assert client.get(f"/v1/responses/{previous}").status_code == 404
        message = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/messages", json=message).json()["type"] == "message"


def test_a_stream_is_passed_through_chunk_by_chunk(cluster):
    """The first chunk reaches the client while the worker is still generating."""
    router, _ = cluster
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with router.client() as c, c.stream("POST", "/v1/chat/completions", json=chat) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"role":"assistant"' in first.replace(" ", "")
        busy = sum(w["in_flight"] for w in c.get("/list_workers").json()["workers"])
        rest = [line for line in lines if line.startswith("data: ")]
    assert busy == 1
    assert rest[-1] == "data: [DONE]" and '"completion_tokens":48' in rest[-2].replace(" ", "")
    with router.client() as c:
        assert sum(w["in_flight"] for w in c.get("/list_workers").json()["workers"]) == 0


def test_prefix_groups_stay_on_one_worker_and_hit_its_cache(cluster):
    router, replicas = cluster
    groups = [
        f"Document {g}: " + " ".join(f"fact {g}-{i} is true." for i in range(40)) for g in range(4)
    ]
    homes: dict[int, set[str]] = {g: set() for g in range(4)}
    cached = []
    with router.client() as c:
        for q in range(3):
            for g in range(4):
                r = c.post(
                    "/generate",
                    json={"text": groups[g] + f" Question {q}?", "sampling_params": GREEDY},
                )
                assert r.status_code == 200
                homes[g].add(worker_of(r))
                if q:
                    cached.append(
                        r.json()["meta_info"]["cached_tokens"]
                        / r.json()["meta_info"]["prompt_tokens"]
                    )
    assert all(len(h) == 1 for h in homes.values()), homes
    assert {next(iter(h)) for h in homes.values()} == {
        r.url for r in replicas
    }  # groups spread over both
    assert min(cached) > 0.9
    for replica in replicas:
        with replica.client() as direct:
            wait_idle(direct)


def test_bad_requests_get_the_workers_4xx_or_the_routers(cluster):
    router, _ = cluster
    with router.client() as c:
        r = c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}})
        assert r.status_code == 400 and "max_new_tokens" in r.json()["message"]
        r = c.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["message"]
        r = c.post(
            "/generate", content=b"x" * (9 << 20), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        assert c.get("/no_such_route").status_code == 404
        assert c.post("/add_worker").status_code == 400
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": 5})
        assert r.status_code == 400 and "messages" in r.json()["message"]
        for bad in ["ftp://host", "http://h:99999", "http://[::1", "http://h/path", "x" * 5000]:
            r = c.post("/add_worker", params={"url": bad})
            assert r.status_code == 400 and "url" in r.json()["message"], bad
        r = c.post("/add_worker", params={"url": c.get("/list_workers").json()["urls"][0]})
        assert r.status_code == 400 and "already" in r.json()["message"]
        assert c.post("/remove_worker", params={"url": "http://127.0.0.1:1"}).status_code == 404


def test_a_worker_added_while_down_gets_no_requests_until_removed(cluster):
    router, replicas = cluster
    ghost = f"http://127.0.0.1:{free_port()}"
    with router.client() as c:
        added = c.post("/add_worker", params={"url": ghost}).json()
        assert added["url"] == ghost and not added["healthy"]
        for i in range(4):
            r = c.post("/generate", json={"text": f"Count to {i}", "sampling_params": GREEDY})
            assert r.status_code == 200 and worker_of(r) != ghost
        assert c.post("/remove_worker", params={"url": ghost}).status_code == 200
        assert ghost not in c.get("/list_workers").json()["urls"]


def test_metrics_dashboard_and_flush_span_the_cluster(cluster):
    router, replicas = cluster
    with router.client() as c:
        metrics = c.get("/metrics").text
        for replica in replicas:
            assert f'radixserve_router:requests_total{{worker="{replica.url}"}}' in metrics
        rate = float(
            next(
                line.split()[-1]
                for line in metrics.splitlines()
                if line.startswith("radixserve_router:cluster_cache_hit_rate")
            )
        )
        totals = [r.client().get("/get_server_info").json()["stats"] for r in replicas]
        want = sum(s["cached_tokens_total"] for s in totals) / sum(
            s["prompt_tokens_total"] for s in totals
        )
        assert rate == pytest.approx(want) and rate > 0.3
        data = c.get("/dashboard/data").json()
        assert data["policy"] == "cache_aware" and all(
            w["stats"]["num_slots"] == 4096 for w in data["workers"]
        )
        assert "radixserve cluster" in c.get("/dashboard").text
        assert c.post("/flush_cache").status_code == 200
        assert all(
            r.client().get("/get_server_info").json()["stats"]["cached_slots"] == 0
            for r in replicas
        )


def test_kv_events_router_mirrors_each_replicas_cache_and_routes_by_it(cluster, tmp_path):
    """`--kv-events`: the router follows both replicas' events; after a flush and a workload,
    the blocks it holds per replica equal the replica's own cached slots, and each prefix
    group (sent as chat and as completions) stays on one replica."""
    _, replicas = cluster
    router = start_router(
        tmp_path,
        "--worker-urls",
        *[r.url for r in replicas],
        "--policy",
        "cache_aware",
        "--kv-events",
    )
    try:
        with router.client() as c:
            deadline = time.time() + 60
            while any(w["kv_blocks"] is None for w in c.get("/list_workers").json()["workers"]):
                assert time.time() < deadline, router.log()
                time.sleep(0.2)
            time.sleep(0.5)  # the subscriptions reach the publishers
            assert c.post("/flush_cache").status_code == 200
            homes: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
            for q in range(3):
                for g in homes:
                    system = f"You answer questions about topic {g}. " + " ".join(
                        f"Rule {g}.{i}." for i in range(30)
                    )
                    chat = {
                        "model": "m",
                        "max_tokens": 4,
                        "temperature": 0,
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"Q{q}?"},
                        ],
                    }
                    r = c.post("/v1/chat/completions", json=chat)
                    assert r.status_code == 200
                    homes[g].add(worker_of(r))
            assert all(len(h) == 1 for h in homes.values()), homes
            for replica in replicas:
                with replica.client() as direct:
                    wait_idle(direct)
            time.sleep(0.3)  # the last step's events
            views = {w["url"]: w["kv_blocks"] for w in c.get("/list_workers").json()["workers"]}
        for replica in replicas:
            cached = replica.client().get("/get_server_info").json()["stats"]["cached_slots"]
            assert views[replica.url] == cached, (views, replica.url, cached)
        assert sum(views.values()) > 0
    finally:
        assert router.stop() == 0


def test_an_api_key_is_checked_by_the_router_and_forwarded(cluster, tmp_path):
    _, replicas = cluster
    keyed = start_router(tmp_path, "--worker-urls", replicas[0].url, "--api-key", "sekret")
    try:
        assert httpx.post(f"{keyed.url}/generate", json={"text": "a"}).status_code == 401
        assert httpx.get(f"{keyed.url}/health").status_code == 200
        r = httpx.post(
            f"{keyed.url}/generate",
            json={"text": "a", "sampling_params": GREEDY},
            headers={"Authorization": "Bearer sekret"},
            timeout=60,
        )
        assert r.status_code == 200
    finally:
        assert keyed.stop() == 0


def test_killing_a_replica_mid_run_loses_no_request_that_had_not_streamed(cluster, tmp_path):
    """Replica 0 is killed while it runs requests: each is retried on replica 1 and succeeds,
    replica 0 is marked dead within 5 s, and later traffic goes to replica 1. (A round-robin
    router, so that replica 0 surely has requests in flight.)"""
    _, replicas = cluster
    router = start_router(
        tmp_path, "--worker-urls", *[r.url for r in replicas], "--policy", "round_robin"
    )

    async def run() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as c:

            def body(i: int) -> dict:
                return {
                    "text": f"Story {i}: once upon a time",
                    "sampling_params": {"max_new_tokens": 32},
                }

            tasks = [asyncio.create_task(c.post("/generate", json=body(i))) for i in range(10)]
            deadline = time.monotonic() + 30
            while not (await c.get("/list_workers")).json()["workers"][0]["in_flight"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            killed = time.monotonic()
            os.kill(replicas[0].proc.pid, signal.SIGKILL)
            responses = await asyncio.gather(*tasks)
            while (await c.get("/list_workers")).json()["workers"][0]["healthy"]:
                await asyncio.sleep(0.05)
            return responses, time.monotonic() - killed

    kids = replicas[0].children()
    folder = ipc_folder(replicas[0].proc.pid)
    assert folder and os.path.isdir(folder)
    responses, dead_after = asyncio.run(run())
    shutil.rmtree(folder)  # a SIGKILLed server cannot remove its socket folder
    assert [r.status_code for r in responses] == [200] * 10
    assert dead_after < 5
    with router.client() as c:
        for i in range(3):
            r = c.post("/generate", json={"text": f"After the kill {i}", "sampling_params": GREEDY})
            assert r.status_code == 200 and worker_of(r) == replicas[1].url
        assert c.get("/health").status_code == 200
    assert router.stop() == 0
    replicas[0].proc.wait(timeout=10)
    deadline = time.time() + 10
    while any(alive(k) for k in kids) and time.time() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)], "the killed replica's children outlived it"


def descendants(pid: int) -> list[int]:
    kids = child_pids(pid)
    return kids + [d for k in kids for d in descendants(k)]


def test_serve_dp_size_two_runs_two_pinned_replicas_behind_a_router(
    tmp_path, server_socket_folders
):
    """The one-command launch: two replicas, each on its own core, behind the router on the
    given port; SIGTERM stops everything it started."""
    folders = set(glob.glob(os.path.join(server_socket_folders, "radixserve-*")))
    server = start_server(
        tmp_path, "--dp-size", "2", "--num-threads", "2", "--max-total-tokens", "2048"
    )
    everything = descendants(server.proc.pid)
    try:
        with server.client() as c:
            workers = c.get("/list_workers").json()["workers"]
            assert len(workers) == 2 and all(w["healthy"] for w in workers)
            seen = {
                worker_of(
                    c.post(
                        "/generate", json={"text": f"Topic {i} " * 30, "sampling_params": GREEDY}
                    )
                )
                for i in range(4)
            }
            assert seen == {w["url"] for w in workers}
        replicas = [
            p for p in child_pids(server.proc.pid) if b"multiprocessing.spawn" in cmdline(p)
        ]
        assert len(replicas) == 2
        cores = [os.sched_getaffinity(p) for p in replicas]
        if len(os.sched_getaffinity(0)) >= 2:
            assert not cores[0] & cores[1], cores
        for pid in (
            replicas
        ):  # as a process-group SIGTERM does: the replicas get it as well as the launcher
            os.kill(pid, signal.SIGTERM)
    finally:
        assert server.stop() == 0, server.log()
    deadline = time.time() + 10
    while any(alive(p) for p in everything) and time.time() < deadline:
        time.sleep(0.1)
    assert not [p for p in everything if alive(p)], "processes outlived the launcher"
    assert set(glob.glob(os.path.join(server_socket_folders, "radixserve-*"))) <= folders, (
        "socket folders left behind"
    )


def test_a_replica_killed_under_dp_size_is_started_again(tmp_path):
    """SIGKILL (as the OOM killer sends) one of two replicas: the launcher starts it again on its
    port, the router finds it healthy and routes to it; the launcher still stops cleanly."""
    server = start_server(
        tmp_path, "--dp-size", "2", "--num-threads", "2", "--max-total-tokens", "2048"
    )
    try:
        replicas = [
            p for p in child_pids(server.proc.pid) if b"multiprocessing.spawn" in cmdline(p)
        ]
        os.kill(replicas[0], signal.SIGKILL)
        deadline = time.time() + 180
        with server.client() as c:
            while (
                time.time() < deadline
            ):  # restarted, serving on its port, and back in the router's rotation
                workers = c.get("/list_workers").json()["workers"]
                up = [
                    _answers(w["url"]) and w["healthy"] and w["circuit"] != "open" for w in workers
                ]
                if "starting it again" in server.log() and all(up):
                    break
                time.sleep(1)
            else:
                raise AssertionError(
                    f"the killed replica did not come back: {server.log()[-3000:]}"
                )
            now = [
                p
                for p in child_pids(server.proc.pid)
                if b"multiprocessing.spawn" in cmdline(p) and alive(p)
            ]
            assert len(now) == 2 and replicas[0] not in now
            seen = {
                worker_of(
                    c.post(
                        "/generate", json={"text": f"Topic {i} " * 30, "sampling_params": GREEDY}
                    )
                )
                for i in range(6)
            }
            assert seen == {w["url"] for w in workers}
    finally:
        assert server.stop() == 0, server.log()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()
