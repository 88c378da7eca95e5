"""Prefill/decode disaggregation on this machine: one core prefill + one core decode behind
`radixserve router --pd-disaggregation`, against one 2-core co-located server and against two
1-core replicas behind the router (`serve --dp-size 2`).

The load mixes decode-heavy streams with long prompts that arrive while they run: the long
prefills stall every decode that shares an engine with them, which is what PD removes.

    .venv/bin/python bench/pd.py            # ~4 minutes on 2 cores

Reported per set-up: the streams' inter-token latency (p50, p99) and TTFT (p95), the long
prompts' TTFT (p95), the output throughput of both, and with PD the transfer's cost: bytes
and milliseconds per prompt token moved. Writes bench/results/<date>-<machine>-pd.json and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import servers  # noqa: E402
from loadgen import Result, Target, send, summarize  # noqa: E402
from serving import free_port  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
WORDS = "river stone cloud paper light metal forest signal garden engine winter orbit".split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def serve(name: str, log_dir: Path, *flags: str) -> tuple[servers.Running, str]:
    """A `radixserve serve` (its readiness: /health, as a PD server takes no bare request)."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), *flags]
    cmd += ["--log-level", "warning", "--dtype", "float32"]
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{name}.log"
    proc = servers.subprocess.Popen(
        cmd, stdout=open(log_path, "w"), stderr=servers.subprocess.STDOUT, start_new_session=True
    )
    running = servers.Running(proc, Target(name, url, MODEL, api="sglang"), 0.0, log_path)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited during start-up; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return running, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    running.stop()
    raise TimeoutError(f"{name} did not come up; see {log_path}")


def start(setup: str, log_dir: Path) -> tuple[list[servers.Running], str, list[str]]:
    """The processes, the URL to send to, and (PD) the prefill and decode servers' URLs."""
    if setup == "co-located, 2 cores":
        running, url = serve("colocated", log_dir, "--num-threads", "2")
        return [running], url, []
    if setup == "2 replicas + router":
        running, url = serve("replicas", log_dir, "--dp-size", "2", "--num-threads", "2")
        return [running], url, []
    bootstrap = free_port()
    prefill, prefill_url = serve(
        "prefill",
        log_dir,
        "--num-threads",
        "1",
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(bootstrap),
    )
    decode, decode_url = serve(
        "decode", log_dir, "--num-threads", "1", "--disaggregation-mode", "decode"
    )
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.cli", "router", "--port", str(port)]
    cmd += ["--pd-disaggregation", "--prefill", prefill_url, str(bootstrap)]
    cmd += ["--decode", decode_url, "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    router = servers._launch(cmd, Target("pd-router", url, MODEL), log_dir)
    return [router, decode, prefill], url, [prefill_url, decode_url]


async def workload(url: str, args, seed: int) -> tuple[list[Result], list[Result], float]:
    """`args.streams` decode-heavy streams, twice each, while `args.long` long prompts arrive
    `args.gap` seconds apart."""
    rng = random.Random(seed)
    target = Target("pd", url, MODEL, api="sglang")
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def stream_loop() -> list[Result]:
            out = []
            for _ in range(2):
                out.append(await send(client, target, text(rng, 40), args.stream_tokens))
            return out

        async def long_prompts() -> list[Result]:
            tasks = []
            for _ in range(args.long):
                await asyncio.sleep(args.gap)
                prompt = text(rng, args.long_words)
                tasks.append(asyncio.create_task(send(client, target, prompt, 8)))
            return list(await asyncio.gather(*tasks))

        started = time.perf_counter()
        streams = asyncio.gather(*(stream_loop() for _ in range(args.streams)))
        longs = await long_prompts()
        stream_results = [r for group in await streams for r in group]
        return stream_results, longs, time.perf_counter() - started


def counters(urls: list[str]) -> dict[str, float]:
    """The servers' radixserve counters, summed."""
    totals: dict[str, float] = {}
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("radixserve:") and name.endswith("_total"):
                key = name.removeprefix("radixserve:").removesuffix("_total")
                totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def bench(setup: str, args, log_dir: Path) -> dict:
    procs, url, pd_urls = start(setup, log_dir)
    try:
        asyncio.run(workload(url, argparse.Namespace(**{**vars(args), "long": 1}), seed=99))
        before = counters(pd_urls) if pd_urls else None
        streams, longs, elapsed = asyncio.run(workload(url, args, seed=1))
        after = counters(pd_urls) if pd_urls else None
    finally:
        for proc in procs:
            proc.stop()
    s, long_summary = summarize(streams, elapsed), summarize(longs, elapsed)
    row = {
        "setup": setup,
        "errors": s["errors"] + long_summary["errors"],
        "stream_itl_p50_ms": 1000 * s["itl"]["p50"],
        "stream_itl_p99_ms": 1000 * s["itl"]["p99"],
        "stream_ttft_p95_s": s["ttft"]["p95"],
        "long_ttft_p95_s": long_summary["ttft"]["p95"],
        "output_tok_per_s": s["output_tok_per_s"] + long_summary["output_tok_per_s"],
    }
    if before is not None:
        moved = {k: after[k] - before.get(k, 0.0) for k in after}
        tokens = max(moved["kv_received_tokens"], 1)
        row["transfer_bytes_per_token"] = moved["kv_transfer_bytes"] / tokens
        row["transfer_ms_per_token"] = 1000 * moved["kv_transfer_seconds"] / tokens
        prompts = max(moved["kv_transfers"] / 2, 1)  # counted by both servers
        row["transfer_ms_per_prompt"] = 1000 * moved["kv_transfer_seconds"] / prompts
    return row


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| set-up | stream ITL p50 | stream ITL p99 | stream TTFT p95 | long TTFT p95 | "
        "output tok/s | transfer per token | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        transfer = (
            f"{r['transfer_ms_per_token']:.3f} ms, {r['transfer_bytes_per_token']:.0f} B"
            if "transfer_ms_per_token" in r
            else "-"
        )
        lines.append(
            f"| {r['setup']} | {r['stream_itl_p50_ms']:.1f} ms | {r['stream_itl_p99_ms']:.1f} ms | "
            f"{r['stream_ttft_p95_s']:.2f} s | {r['long_ttft_p95_s']:.2f} s | "
            f"{r['output_tok_per_s']:.1f} | {transfer} | {r['errors']} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--long", type=int, default=6, help="long prompts")
    ap.add_argument("--long-words", type=int, default=1200)
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between long prompts")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for setup in ("co-located, 2 cores", "2 replicas + router", "PD: 1 prefill + 1 decode"):
            rows.append(bench(setup, args, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    stamp = datetime.date.today().isoformat()
    out = args.out or BENCH / "results" / f"{stamp}-{platform.node()}-pd.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "rows": rows}, indent=2))
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
