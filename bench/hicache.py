"""The hierarchical cache against the device pool alone, and a restart with the file tier.

1. Multi-turn chats whose live histories are several times the device KV pool but fit in
   the host tier, interleaved so that a chat's next turn comes after the others have
   pushed its history out of the pool: hit rate and TTFT without and with
   `--enable-hierarchical-cache` (one server each, same pool).
2. A long prefix sent to a server with `--hicache-storage-backend file`, the server
   restarted, the prefix sent again: TTFT and cached tokens of both.

    .venv/bin/python bench/hicache.py          # ~6 minutes on 2 cores

Writes bench/results/<date>-<machine>-hicache.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import servers  # noqa: E402
from loadgen import run_workload  # noqa: E402
from serving import free_port  # noqa: E402
from workloads import multi_turn_sessions  # noqa: E402


def chats(args, hicache: bool, log_dir: Path) -> dict:
    extra = (
        ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)]
        if hicache
        else []
    )
    server = servers.radixserve(free_port(), log_dir, args.concurrency, args.kv_tokens, extra=extra)
    try:
        sessions = multi_turn_sessions(
            conversations=args.conversations,
            turns=args.turns,
            system_words=args.system_words,
            output_len=args.output_len,
            seed=args.seed,
        )
        before = servers.hit_rate_counters(server.target)
        summary = asyncio.run(run_workload(server.target, sessions, args.concurrency))
        after = servers.hit_rate_counters(server.target)
        stats = httpx.get(f"{server.target.base_url}/get_server_info").json()["stats"]
    finally:
        server.stop()
    row = {
        "hicache": hicache,
        "hit_rate": (after[0] - before[0]) / (after[1] - before[1]),
        "prompt_tokens": after[1] - before[1],
        "hicache_stats": stats.get("hicache"),
        **summary,
    }
    print(
        f"  hicache {'on ' if hicache else 'off'}  hit {100 * row['hit_rate']:5.1f}%  "
        f"TTFT p50 {row['ttft']['p50']:.2f} s p95 {row['ttft']['p95']:.2f} s  "
        f"{row['output_tok_per_s']:.1f} out tok/s  errors {row['errors']}"
    )
    return row


def restart(args, log_dir: Path) -> dict:
    """TTFT of a long prefix on a fresh server with an empty file tier, then after a restart."""
    folder = tempfile.mkdtemp(prefix="radixserve-hicache-")
    extra = [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-dir",
        folder,
    ]
    prompt = "Chapter one. " + " ".join(
        f"Line {i} of the long shared document." for i in range(args.restart_lines)
    )
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    runs = []
    for attempt in ("cold", "after restart"):
        server = servers.radixserve(free_port(), log_dir, 1, 8192, extra=extra)
        try:
            runs.append({"run": attempt, **first_token(server.target.base_url, body)})
            wait_written(server.target.base_url, runs[-1]["prompt_tokens"] // 64)
        finally:
            server.stop()
        print(
            f"  {attempt:14s} TTFT {runs[-1]['ttft']:.2f} s, cached {runs[-1]['cached_tokens']} of "
            f"{runs[-1]['prompt_tokens']} tokens"
        )
    return {"runs": runs, "ttft_ratio": runs[1]["ttft"] / runs[0]["ttft"]}


def first_token(url: str, body: dict) -> dict:
    start = time.perf_counter()
    ttft, last = None, None
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                ttft = ttft or time.perf_counter() - start
                last = json.loads(line[6:])
    meta = last["meta_info"]
    return {
        "ttft": ttft,
        "prompt_tokens": meta["prompt_tokens"],
        "cached_tokens": meta["cached_tokens"],
    }


def wait_written(url: str, blocks: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = httpx.get(f"{url}/metrics").text
        done = [
            float(x.split()[-1])
            for x in text.splitlines()
            if x.startswith("radixserve:hicache_storage_written")
        ]
        if done and done[0] >= blocks:
            return
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=3072, help="the device pool")
    ap.add_argument("--hicache-ratio", type=float, default=6.0)
    ap.add_argument(
        "--restart-lines", type=int, default=260, help="the restart prefix (~2.3k tokens)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-hicache-bench-"))
    rows = [chats(args, False, log_dir), chats(args, True, log_dir)]
    restarted = restart(args, log_dir)
    results = {
        "date": str(datetime.date.today()),
        "machine": f"{platform.machine()}-{os.cpu_count()}cpu",
        "args": vars(args),
        "chats": rows,
        "restart": restarted,
    }
    stem = (
        BENCH
        / "results"
        / f"{results['date']}-{results['machine']}-hicache{'-' + args.tag if args.tag else ''}"
    )
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    off, on = rows
    print("\n| | hit rate | TTFT p50 (s) | TTFT p95 (s) | output tok/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in (("device pool only", off), ("with the host tier", on)):
        print(
            f"| {name} | {100 * r['hit_rate']:.1f}% | {r['ttft']['p50']:.2f} | "
            f"{r['ttft']['p95']:.2f} "
            f"| {r['output_tok_per_s']:.1f} |"
        )
    print(
        f"\nhit rate {on['hit_rate'] / off['hit_rate']:.2f}x; restart TTFT "
        f"{restarted['ttft_ratio']:.2f}x the cold one"
    )
    print(f"wrote {stem.with_suffix('.json')}; logs in {log_dir}")


if __name__ == "__main__":
    main()
