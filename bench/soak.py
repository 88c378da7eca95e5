"""A seeded soak of a real radixserve server: mixed traffic for a while, then a report.

    python bench/soak.py [--minutes 30] [--concurrency 6] [--seed 0] [--kv-tokens 4096]

Each of `--concurrency` clients loops over a seeded mix: shared-prefix and fresh prompts
(greedy and sampled, streamed and not, n > 1, grammars, stop strings), streams it drops after
a few chunks, requests it aborts by rid, bad requests that must be 4xx, and now and then a
cache flush. The pool is small, so the radix cache evicts and the scheduler retracts.

The report (printed, and JSON under bench/results/): requests by outcome, errors by kind
(any 5xx or transport error counts), latency p99 of the first and the last tenth of the run,
RSS of the server's processes after warm-up and at the end, and the KV slots still held once
the server is idle (the invariant free + cached == capacity).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from peers.servers import radixserve

RESULTS = Path(__file__).resolve().parent / "results"
SHARED = (
    "You are a careful assistant. Answer briefly and precisely. Here are the facts you know: "
    "the sky is blue, grass is green, water boils at 100 degrees Celsius at sea level. "
)
QUESTIONS = [
    "What color is the sky?",
    "Why is grass green?",
    "When does water boil?",
    "Name a planet.",
    "Count to five.",
    "Write a haiku about rain.",
    "What is 2 + 2?",
    "Say hello in French.",
]


@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (finished at, seconds)


def pick_request(rng: random.Random) -> tuple[str, str, dict]:
    """(kind, route, body) of one seeded request."""
    question = rng.choice(QUESTIONS)
    prompt = (SHARED if rng.random() < 0.7 else f"Session {rng.randrange(10**6)}. ") + question
    params: dict = {"max_new_tokens": rng.choice([4, 16, 48]), "temperature": rng.choice([0, 0.7])}
    roll = rng.random()
    if roll < 0.08:
        params["regex"] = "(yes|no)"
    elif roll < 0.14:
        params["stop"] = ["."]
    elif roll < 0.18:
        params["n"] = 2
    kind = rng.choices(
        ["plain", "stream", "drop", "abort", "bad", "chat", "flush"], [40, 20, 10, 8, 8, 12, 2]
    )[0]
    if kind == "bad":
        return (
            kind,
            "/generate",
            {
                "text": prompt,
                "sampling_params": rng.choice(
                    [
                        {"temperature": -1},
                        {"max_new_tokens": "many"},
                        {"stop_token_ids": [10**9]},
                        {"json_schema": "{"},
                        {"regex": "(" * 200},
                    ]
                ),
            },
        )
    if kind == "chat":
        return (
            kind,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": params["max_new_tokens"],
                "temperature": 0,
            },
        )
    if kind == "flush":
        return kind, "/flush_cache", {}
    return (
        kind,
        "/generate",
        {"text": prompt, "sampling_params": params, "stream": kind in ("stream", "drop")},
    )


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind, route, body = pick_request(rng)
    start = time.monotonic()
    try:
        if kind == "flush":
            r = await client.post(route)
            ok = r.status_code in (200, 400)  # 400 while requests run
        elif kind in ("stream", "drop"):
            async with client.stream("POST", route, json=body) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += bool(line)
                    if kind == "drop" and chunks >= 2:
                        break  # the client goes away mid-stream
            ok = r.status_code == 200
        elif kind == "abort":
            rid = f"soak-{rng.randrange(10**12)}"
            task = asyncio.create_task(client.post(route, json=dict(body, rid=rid)))
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            aborted = await client.post("/abort_request", json={"rid": rid})
            r = await task
            ok = r.status_code == 200 and aborted.status_code in (200, 404)  # 404: it had finished
        else:
            r = await client.post(route, json=body)
            ok = r.status_code == (400 if kind == "bad" else 200)
        status = r.status_code
    except httpx.HTTPError as exc:
        tally.errors[f"transport: {type(exc).__name__}"] += 1
        return
    tally.outcomes[kind] += 1
    if status >= 500:
        tally.errors[f"http {status}"] += 1
    elif not ok:
        tally.errors[f"unexpected {status} for {kind}"] += 1
    tally.latencies.append((time.monotonic(), time.monotonic() - start))


async def client_loop(base_url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        while time.monotonic() < until:
            await one_request(client, rng, tally)


def rss_mb(root_pid: int) -> float:
    pids = [root_pid] + [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-P", str(root_pid)], capture_output=True, text=True
        ).stdout.split()
    ]
    total = 0
    for pid in pids:
        try:
            total += int(
                next(
                    line
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS")
                ).split()[1]
            )
        except (FileNotFoundError, StopIteration):
            pass
    return total / 1024


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else float("nan")


async def soak(base_url: str, pid: int, minutes: float, concurrency: int, seed: int) -> dict:
    tally = Tally()
    start = time.monotonic()
    until = start + minutes * 60
    warm_up = start + min(120.0, minutes * 60 / 5)
    loops = [
        asyncio.create_task(client_loop(base_url, seed * 1000 + i, until, tally))
        for i in range(concurrency)
    ]
    while time.monotonic() < warm_up:
        await asyncio.sleep(1)
    rss_after_warm_up = rss_mb(pid)
    await asyncio.gather(*loops)
    rss_end = rss_mb(pid)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for _ in range(100):
            stats = (await client.get("/get_server_info")).json()["stats"]
            if stats["num_running"] == 0 and stats["num_queued"] == 0:
                break
            await asyncio.sleep(0.2)
    span = until - start
    first = [s for t, s in tally.latencies if t < start + span / 10]
    last = [s for t, s in tally.latencies if t >= until - span / 10]
    return {
        "minutes": minutes,
        "concurrency": concurrency,
        "seed": seed,
        "requests": sum(tally.outcomes.values()),
        "by_kind": dict(tally.outcomes),
        "errors": dict(tally.errors),
        "p99_first_tenth_s": p99(first),
        "p99_last_tenth_s": p99(last),
        "rss_after_warm_up_mb": rss_after_warm_up,
        "rss_end_mb": rss_end,
        "rss_growth_pct": 100 * (rss_end - rss_after_warm_up) / rss_after_warm_up,
        "leaked_slots": stats["num_slots"] - stats["free_slots"] - stats["cached_slots"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--port", type=int, default=31000)
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    running = radixserve(args.port, RESULTS, args.concurrency, args.kv_tokens)
    try:
        report = asyncio.run(
            soak(
                running.target.base_url, running.proc.pid, args.minutes, args.concurrency, args.seed
            )
        )
    finally:
        running.stop()
    print(json.dumps(report, indent=2))
    (RESULTS / f"soak-{time.strftime('%Y-%m-%d')}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
