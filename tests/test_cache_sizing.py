"""Cache sizing: the request log, `radixserve replay`, and the replayer against a real server."""

import asyncio
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_utils import start_server

from radixserve.config import EVICTION_POLICIES
from radixserve.kv_events import chain_hashes, salted_parent
from radixserve.mem.shadow import LiveEstimates, ReplicaCache
from radixserve.request_log import HASH_BLOCK, read_log
from radixserve.sizing.cache_sim import Setting, Trace, optimal_hit_rate, replay, sweep
from radixserve.sizing.replay import synthetic_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from loadgen import Target, run_workload  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

KV_TOKENS = 1600  # shared_prefix's prompts (~2200 distinct tokens) do not fit: the cache evicts
SMALL = {
    "shared_prefix": dict(num_groups=4, per_group=4, output_len=4),
    "multi_turn": dict(conversations=4, turns=3, output_len=6),
    "agent_tree": dict(trees=2, branches=4, output_len=6),
    "no_sharing": dict(num=10, words=200, output_len=4),
    # shorter than the bench's ~1030-token prefixes, so that two groups' prompts fit the pool at
    # once
    # (where they do not, the server retracts requests and recomputes them: see cache_sim's
    # docstring)
    "prefill_heavy": dict(num_groups=2, per_group=4, prefix_words=600, output_len=2),
}


@pytest.fixture(scope="module")
def logged_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache_sizing")
    server = start_server(
        folder, "--max-total-tokens", str(KV_TOKENS), "--log-requests", str(folder / "log")
    )
    yield server, folder / "log"
    server.stop()


def evicted(server) -> float:
    with server.client() as client:
        return float(
            re.search(
                r"radixserve:evicted_tokens_total ([\d.e+]+)", client.get("/metrics").text
            ).group(1)
        )


def records_since(log: Path, start: float):
    servers, records = read_log(log)
    return servers[0], [r for r in records if r.arrival >= start]


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_replay_matches_the_servers_hit_rate_on_each_serving_workload(logged_server, workload):
    server, log = logged_server
    with server.client() as client:
        assert client.post("/flush_cache").status_code == 200
    start, evicted_before = time.time(), evicted(server)
    target = Target("radixserve", server.url, "default", api="sglang")
    summary = asyncio.run(
        run_workload(target, WORKLOADS[workload](**SMALL[workload], seed=3), concurrency=8)
    )
    assert summary["errors"] == 0, summary["error_samples"]
    own, records = records_since(log, start)
    trace = Trace.from_log(records, own.hash_block)
    assert len(trace.requests) == len(records) > 0
    measured = trace.measured_hit_rate()
    replayed = replay(trace, Setting(own.cache_tokens, own.eviction_policy))
    optimum = optimal_hit_rate(trace, own.cache_tokens)
    assert abs(replayed - measured) <= 0.02, (workload, measured, replayed)
    assert replayed <= optimum + 1e-9
    if workload == "shared_prefix":  # the replay evicted as the server did
        assert evicted(server) > evicted_before
        assert replay(trace, Setting(own.cache_tokens * 4, own.eviction_policy)) >= replayed
    for eviction in EVICTION_POLICIES:
        for tokens in (KV_TOKENS // 4, KV_TOKENS, KV_TOKENS * 4):
            assert (
                replay(trace, Setting(tokens, eviction)) <= optimal_hit_rate(trace, tokens) + 1e-9
            )


def test_log_records_every_finished_request_and_hashes_hide_the_tokens(logged_server):
    server, log = logged_server
    start = time.time()
    with server.client() as client:
        ok = client.post(
            "/generate", json={"text": "The radix tree", "sampling_params": {"max_new_tokens": 3}}
        )
        bad = client.post(
            "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}}
        )
    assert ok.status_code == 200 and bad.status_code == 400
    _, records = records_since(log, start)
    assert [r.rid for r in records] == [ok.json()["meta_info"]["id"]]
    record = records[0]
    assert record.output_tokens == 3 and record.finish_reason == "length" and record.admitted
    assert len(record.prompt_ids) == record.prompt_tokens and len(record.output_ids) == 3
    assert (
        chain_hashes(record.prompt_ids * 8, HASH_BLOCK)[1:3]
        != chain_hashes(record.prompt_ids * 8, HASH_BLOCK)[:2]
    )  # chained


def test_replay_cli_writes_table_json_and_plot(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "replay",
            "--synthetic",
            "rag",
            "--requests",
            "120",
            "--cache-tokens",
            "2k,8k",
            "--eviction",
            "lru,slru",
            "--dp",
            "1,2",
            "--router",
            "cache_aware,round_robin",
            "--json",
            str(tmp_path / "r.json"),
            "--plot",
            str(tmp_path / "r.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert len(results) == 2 * 2 * 2 * 2 and (tmp_path / "r.png").stat().st_size > 10_000
    assert all(r["hit_rate"] <= r["optimum"] + 1e-9 for r in results)
    assert "optimum" in out.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "replay",
            "--synthetic",
            "rag",
            "--eviction",
            "mru",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "mru" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "replay", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "--log-requests" in missing.stderr


@pytest.mark.parametrize("kind", ["agent", "rag", "chat"])
def test_more_memory_never_lowers_the_optimum_and_replay_stays_under_it(kind):
    trace = synthetic_trace(kind, 150)
    results = sweep(trace, [Setting(t, e) for t in (1024, 4096, 16384) for e in EVICTION_POLICIES])
    assert all(r.hit_rate <= r.optimum + 1e-9 for r in results)
    optima = [r.optimum for r in results if r.setting.eviction == "lru"]
    assert optima == sorted(optima) and optima[-1] > optima[0]
    assert replay(trace, Setting(1 << 30)) == pytest.approx(
        optimal_hit_rate(trace, 1 << 30)
    )  # no eviction: equal


def test_live_estimates_track_shadow_caches_of_each_size():
    """Fed the same admissions and finishes as a real cache of size C (here itself a shadow, so
    that the truth is known), the 2x estimate equals a cache of 2C over the same window."""
    trace = synthetic_trace("chat", 300)
    pool = 6000
    live, real = (
        LiveEstimates(pool, "lru", window=100),
        ReplicaCache(pool, "lru", itertools.count().__next__),
    )
    double = ReplicaCache(2 * pool, "lru", itertools.count().__next__)
    window = []
    for _, kind, i in sorted(
        (t, k, i)
        for i, r in enumerate(trace.requests)
        for t, k in ((r.admitted, 0), (r.finished, 1))
    ):
        r = trace.requests[i]
        prompt = list(r.units[: r.prompt_units])
        if kind == 0:
            window.append(
                (
                    r.prompt_tokens,
                    real.admit(i, r.units[: r.prompt_units], r.lookup_units),
                    double.admit(i, r.units[: r.prompt_units], r.lookup_units),
                )
            )
            live.admit(i, prompt, r.lookup_units)
        else:
            real.finish(i, r.units), double.finish(i, r.units)
            live.finish(i, list(r.units))
    recent = window[-100:]
    prompts = sum(p for p, _, _ in recent)
    estimates = live.estimates(sum(h for _, h, _ in recent) / prompts, prompts)
    assert estimates["2x"] == pytest.approx(sum(d for _, _, d in recent) / prompts)
    assert (
        estimates["0.5x"]
        < sum(h for _, h, _ in recent) / prompts
        < estimates["2x"]
        <= estimates["4x"]
    )
    assert live.seconds > 0


def test_metrics_and_dashboard_show_what_more_memory_would_give(logged_server):
    server, _ = logged_server
    with server.client() as client:
        metrics = client.get("/metrics").text
        current = client.get("/dashboard/data").json()["current"]
    values = {
        m: float(
            re.search(rf'cache_hit_rate_estimate{{memory="{m}"}} ([\d.e+-]+)', metrics).group(1)
        )
        for m in ("0.5x", "2x", "4x")
    }
    assert current["cache_estimates"] == pytest.approx(values)
    recent = current["recent_hit_rate"]
    assert values["0.5x"] <= recent + 1e-9 <= values["2x"] + 2e-9 <= values["4x"] + 3e-9
    assert "radixserve:cache_estimate_seconds_total" in metrics


def test_a_hashes_log_replays_in_whole_blocks_close_to_the_token_level(logged_server):
    """The same records stored as block-hash chains (no token ids) replay to the token-level hit
    rate, less at most the partial block each request's match ends in."""
    from msgspec.structs import replace

    _, log = logged_server
    own, records = read_log(log)
    full = Trace.from_log(records, own[0].hash_block)
    hashed = Trace.from_log(
        [
            replace(
                r,
                prompt_ids=None,
                output_ids=None,
                block_hashes=chain_hashes(r.prompt_ids + r.output_ids, HASH_BLOCK),
            )
            for r in records
        ],
        own[0].hash_block,
    )
    assert hashed.unit_tokens == 16 and full.unit_tokens == 1
    setting = Setting(own[0].cache_tokens * 4)
    token_level, block_level = replay(full, setting), replay(hashed, setting)
    slack = 16 * len(records) / sum(r.prompt_tokens for r in records)
    assert token_level - slack <= block_level <= token_level
    assert replay(full.in_blocks(16), setting) == pytest.approx(
        block_level, abs=0.01
    )  # --block-tokens 16
    with pytest.raises(ValueError, match="blocks of 16"):
        hashed.in_blocks(32)


def test_replica_logs_merge_and_replay_with_the_servers_replica_count(tmp_path):
    """Under --dp-size each replica logs into DIR/replica-<i>; `replay DIR` merges them by arrival
    and
    replays with that many replicas and the pool of one."""
    from radixserve.request_log import RequestLog, ServerRecord
    from radixserve.sampling_params import SamplingParams
    from radixserve.scheduler.req import Req

    for i in range(2):
        log = RequestLog(
            tmp_path / f"replica-{i}", "full", ServerRecord(1000, 1, "slru", "full", time.time())
        )
        for n in range(3):
            req = Req(f"r{i}{n}", [1, 2, 3, 4, 5 + n], SamplingParams(), output_ids=[9, 9])
            req.admitted, req.cached_tokens = True, 4 * (n > 0)
            log.write(req, "length")
            time.sleep(0.01)
        log.close()
    servers, records = read_log(tmp_path)
    assert len(servers) == 2 and len(records) == 6
    assert [r.arrival for r in records] == sorted(r.arrival for r in records)
    out = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "replay", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "1000 KV tokens x 2, slru" in out.stdout and "measured hit rate 53.3%" in out.stdout


def test_salted_requests_replay_apart_at_both_log_levels(logged_server):
    """The same prompt under salt a, a again, then salt b: the server reads the cache for the
    second only, and so does the replay of the log, from token ids and from salted hash chains."""
    from msgspec.structs import replace

    server, log = logged_server
    start = time.time()
    prompt = "Salted prefixes stay apart. " * 20
    with server.client() as client:
        for salt in ("a", "a", "b"):
            body = {"text": prompt, "sampling_params": {"max_new_tokens": 2}, "cache_salt": salt}
            assert client.post("/generate", json=body).status_code == 200
    own, records = records_since(log, start)
    assert [r.cached_tokens > 0 for r in records] == [False, True, False]
    assert records[0].salt == records[1].salt != records[2].salt is not None
    hashed = [
        replace(
            r,
            prompt_ids=None,
            output_ids=None,
            block_hashes=chain_hashes(
                r.prompt_ids + r.output_ids, HASH_BLOCK, salted_parent(None, "ab"[i // 2])
            ),
        )
        for i, r in enumerate(records)
    ]
    setting = Setting(own.cache_tokens * 4)
    full = Trace.from_log(records, own.hash_block)
    assert replay(full, setting) == pytest.approx(full.measured_hit_rate(), abs=0.02)
    blocks = replay(Trace.from_log(hashed, own.hash_block), setting)
    assert 0 < blocks <= replay(full, setting)
    assert replay(full.in_blocks(16), setting) == pytest.approx(blocks, abs=0.01)
