"""Cache sizing, measured (issue 17): the live estimate of the hit rate with 2x the KV memory
against a rerun with 2x the memory, what the estimates cost, and the recorded log replayed at
other sizes and policies (the plot for the README).

    python bench/cache_sizing.py [--kv-tokens 4096] [--workloads shared_prefix multi_turn
    agent_tree]

Per workload, fresh servers on the same requests, concurrency 8: (1) `--max-total-tokens C
--log-requests`, read the recent hit rate and the 0.5x/2x/4x estimates; (2) 2C, read its
recent hit rate; (3) C with `--disable-cache-estimates`, for the throughput cost.
Results go to bench/results/cache_sizing.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import tempfile
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH / "peers")]

import servers  # noqa: E402
from loadgen import run_workload  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from radixserve.request_log import read_log  # noqa: E402
from radixserve.sizing.cache_sim import Setting, Trace, sweep  # noqa: E402
from radixserve.sizing.replay import plot  # noqa: E402

# big enough that C = 4096 tokens evicts, and every request fits the window of 200
SIZES = {
    "shared_prefix": dict(num_groups=8, per_group=8, system_words=300, output_len=16),
    "multi_turn": dict(conversations=16, turns=5, output_len=16),
    "agent_tree": dict(trees=8, branches=6, output_len=16),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(
            r"radixserve:(recent_cache_hit_rate|cache_estimate_seconds_total|cache_hit_rate_estimate)"
            r'(?:\{memory="([^"]+)"\})? ([-\d.e+]+)$',
            line,
        )
        if m:
            out[m.group(1) + (f"[{m.group(2)}]" if m.group(2) else "")] = float(m.group(3))
    return out


def run(workload: str, kv_tokens: int, log_dir: Path, extra: list[str]) -> dict:
    running = servers.radixserve(free_port(), log_dir, 8, kv_tokens, extra=extra)
    try:
        summary = asyncio.run(
            run_workload(running.target, WORKLOADS[workload](**SIZES[workload], seed=11), 8)
        )
        return {"summary": summary, "metrics": metrics(running.target.base_url)}
    finally:
        running.stop()


def bench_workload(workload: str, kv: int, work: Path) -> dict:
    log = work / f"log-{workload}"
    one = run(workload, kv, work, ["--log-requests", str(log)])
    two = run(workload, 2 * kv, work, [])
    off = run(workload, kv, work, ["--disable-cache-estimates"])
    m = one["metrics"]
    row = {
        "workload": workload,
        "kv_tokens": kv,
        "requests": one["summary"]["requests"],
        "hit_rate_1x": m["recent_cache_hit_rate"],
        "estimate_0.5x": m.get("cache_hit_rate_estimate[0.5x]"),
        "estimate_2x": m.get("cache_hit_rate_estimate[2x]"),
        "estimate_4x": m.get("cache_hit_rate_estimate[4x]"),
        "measured_2x": two["metrics"]["recent_cache_hit_rate"],
        "estimate_seconds": m.get("cache_estimate_seconds_total"),
        "seconds": one["summary"]["seconds"],
        "tok_s_estimates_on": one["summary"]["output_tok_per_s"],
        "tok_s_estimates_off": off["summary"]["output_tok_per_s"],
    }
    servers_, records = read_log(log)
    trace = Trace.from_log(records, servers_[0].hash_block)
    results = sweep(
        trace,
        [Setting(int(kv * f), e) for f in (0.25, 0.5, 1, 2, 4) for e in ("lru", "lfu", "slru")],
    )
    row["replay"] = [
        {
            "cache_tokens": r.setting.cache_tokens,
            "eviction": r.setting.eviction,
            "hit_rate": r.hit_rate,
            "optimum": r.optimum,
        }
        for r in results
    ]
    row["replay_measured_1x"] = trace.measured_hit_rate()
    plot(
        results,
        str(BENCH / "results" / f"cache_sizing_{workload}.png"),
        f"{workload}: replayed request log",
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--workloads", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cache_sizing_"))
    rows = []
    for workload in args.workloads:
        rows.append(bench_workload(workload, args.kv_tokens, work))
        r = rows[-1]
        print(
            f"{workload}: 1x {r['hit_rate_1x']:.3f}  estimate 2x {r['estimate_2x']:.3f}  measured "
            "2x "
            f"{r['measured_2x']:.3f}  (0.5x {r['estimate_0.5x']:.3f}, 4x {r['estimate_4x']:.3f})  "
            "estimates "
            f"{r['estimate_seconds']:.3f} s of {r['seconds']:.1f} s; tok/s on "
            f"{r['tok_s_estimates_on']:.1f} "
            f"off {r['tok_s_estimates_off']:.1f}",
            flush=True,
        )
    out = BENCH / "results" / "cache_sizing.json"
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
