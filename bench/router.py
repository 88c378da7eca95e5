"""Data parallelism behind the router: cluster hit rate, throughput and the router's own cost.

For each policy, `radixserve serve --dp-size 2` starts two replicas (one core each on a
2-core machine) behind the router, then:
- a workload of many prefix groups (distinct long system prompts, a short question each)
  arriving shuffled at fixed concurrency; the KV pool of one replica holds about half the
  groups, so where a group's requests land decides whether its prefix is still cached;
- the router's overhead: the same short requests sent one at a time to a replica directly
  and through the router, median against median.

    .venv/bin/python bench/router.py              # ~5 minutes on 2 cores

Writes bench/results/<date>-<machine>-router.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import servers  # noqa: E402
from loadgen import Target, run_workload  # noqa: E402
from serving import free_port  # noqa: E402
from workloads import shared_prefix_sessions  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def start_cluster(policy: str, args, log_dir: Path) -> servers.Running:
    """`policy` is a router policy, or `kv_events`: cache_aware on the replicas' KV events."""
    port = free_port()
    routing = (
        ["--router-policy", "cache_aware", "--router-kv-events"]
        if policy == "kv_events"
        else ["--router-policy", policy]
    )
    cmd = [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--dp-size",
        "2",
        "--num-threads",
        str(os.cpu_count() or 2),
        *routing,
        "--max-total-tokens",
        str(args.kv_tokens),
        "--max-running-requests",
        str(args.concurrency),
    ]
    return servers._launch(
        cmd, Target(f"dp2-{policy}", f"http://127.0.0.1:{port}", MODEL, api="sglang"), log_dir
    )


def counters(router_url: str) -> tuple[int, int]:
    """Cached and all prompt tokens, summed over the replicas' own counters."""
    workers = httpx.get(f"{router_url}/dashboard/data", timeout=30).json()["workers"]
    stats = [w["stats"] for w in workers if w["stats"]]
    return sum(s["cached_tokens_total"] for s in stats), sum(
        s["prompt_tokens_total"] for s in stats
    )


def overhead(router_url: str, samples: int) -> dict:
    """Median latency of a 1-token /generate, direct to replica 0 and through the router."""
    direct_url = httpx.get(f"{router_url}/list_workers").json()["urls"][0]
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    timings: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=60) as client:
        for i in range(samples * 2 + 4):
            which = "direct" if i % 2 else "router"
            start = time.perf_counter()
            assert (
                client.post(
                    f"{direct_url if which == 'direct' else router_url}/generate", json=body
                ).status_code
                == 200
            )
            if i >= 4:  # the first calls open connections
                timings[which].append(time.perf_counter() - start)
    direct, routed = statistics.median(timings["direct"]), statistics.median(timings["router"])
    return {
        "direct_p50_ms": 1000 * direct,
        "router_p50_ms": 1000 * routed,
        "overhead_p50_ms": 1000 * (routed - direct),
    }


def bench_policy(policy: str, args, log_dir: Path) -> dict:
    cluster = start_cluster(policy, args, log_dir)
    try:
        url = cluster.target.base_url
        sessions = shared_prefix_sessions(
            num_groups=args.groups,
            per_group=args.per_group,
            system_words=args.prefix_words,
            output_len=args.output_len,
            seed=args.seed,
        )
        before = counters(url)
        summary = asyncio.run(run_workload(cluster.target, sessions, args.concurrency))
        after = counters(url)
        row = {
            "policy": policy,
            "cold_start": cluster.cold_start,
            "hit_rate": (after[0] - before[0]) / max(after[1] - before[1], 1),
            **summary,
            **overhead(url, args.overhead_samples),
        }
        routed = httpx.get(f"{url}/list_workers").json()["workers"]
        row["routed_per_worker"] = [w["routed"] for w in routed]
    finally:
        cluster.stop()
    print(
        f"  {policy:12s} hit {100 * row['hit_rate']:5.1f}%  {row['output_tok_per_s']:6.1f} out "
        "tok/s  "
        f"TTFT p50 {row['ttft']['p50']:.2f} s p95 {row['ttft']['p95']:.2f} s  errors "
        f"{row['errors']}  "
        f"router overhead p50 {row['overhead_p50_ms']:.2f} ms  routed {row['routed_per_worker']}"
    )
    return row


def table(rows: list[dict]) -> list[str]:
    base = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
    out = [
        "| policy | cluster hit rate | vs round_robin | output tok/s | vs round_robin | TTFT p50 "
        "/ p95 (s) "
        "| router overhead p50 (ms) | requests per replica |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['policy']} | {100 * r['hit_rate']:.1f}% | "
            f"{r['hit_rate'] / max(base['hit_rate'], 1e-9):.2f}x "
            f"| {r['output_tok_per_s']:.1f} | "
            f"{r['output_tok_per_s'] / base['output_tok_per_s']:.2f}x "
            f"| {r['ttft']['p50']:.2f} / {r['ttft']['p95']:.2f} | {r['overhead_p50_ms']:.2f} "
            f"| {r['routed_per_worker']} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--policies",
        default="round_robin,cache_aware,kv_events,power_of_two",
        help="router policies; kv_events is cache_aware on the replicas' KV events",
    )
    ap.add_argument(
        "--groups", type=int, default=16, help="prefix groups (distinct system prompts)"
    )
    ap.add_argument("--per-group", type=int, default=6, help="requests per group")
    ap.add_argument(
        "--prefix-words", type=int, default=400, help="words of each group's system prompt"
    )
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=4096,
        help="KV pool of each replica (about half the groups' prefixes)",
    )
    ap.add_argument("--overhead-samples", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-router-bench-"))
    rows = [bench_policy(p, args, log_dir) for p in args.policies.split(",")]
    results = {
        "date": str(datetime.date.today()),
        "machine": f"{platform.machine()}-{os.cpu_count()}cpu",
        "args": vars(args),
        "rows": rows,
    }
    stem = (
        BENCH
        / "results"
        / f"{results['date']}-{results['machine']}-router{'-' + args.tag if args.tag else ''}"
    )
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print()
    print("\n".join(table(rows)))
    print(f"\nwrote {stem.with_suffix('.json')}; logs in {log_dir}")


if __name__ == "__main__":
    main()
