"""The batching window (`--batch-wait-ms`): throughput and TTFT with Poisson arrivals at
concurrency 1, 4 and 16, for a few window lengths, on one server start per window.

    .venv/bin/python bench/batch_window.py [--windows 0 5 20] [--requests-per-slot 4]

Each concurrency c sends 4c + 4 distinct requests (a ~120-token prompt, 32 output tokens)
arriving as a Poisson process at c requests per second, at most c in flight. Writes
bench/results/batch_window.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import servers  # noqa: E402
from loadgen import Session, Stage, run_workload  # noqa: E402

WORDS = "river stone lamp orchard signal copper harbor meadow lantern quartz".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(count: int, seed: int) -> list[Session]:
    """Distinct prompts (no shared prefix beyond a few tokens), so the window's effect is
    not hidden by cache hits."""
    sessions = []
    for i in range(count):
        words = " ".join(WORDS[(i * 7 + j * (seed + 3)) % len(WORDS)] for j in range(90))
        text = f"Request {seed}-{i}. Summarize in one sentence: {words}"
        sessions.append(Session([Stage([text], 32)]))
    return sessions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=float, nargs="+", default=[0, 5, 20])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-slot", type=int, default=4)
    parser.add_argument("--out", default=str(BENCH / "results" / "batch_window.json"))
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="batch-window-"))
    rows = []
    for window in args.windows:
        extra = ["--batch-wait-ms", str(window), "--dtype", "float32"]
        server = servers.radixserve(free_port(), log_dir, max(args.concurrency), 16384, extra=extra)
        try:
            for c in args.concurrency:
                count = args.requests_per_slot * c + 4
                sessions = prompts(count, seed=int(window * 10) + c)
                result = asyncio.run(run_workload(server.target, sessions, c, request_rate=c))
                row = dict(window_ms=window, concurrency=c, **result)
                rows.append(row)
                print(
                    f"window {window:4.0f} ms  c={c:2d}  {result['output_tok_per_s']:6.1f} tok/s  "
                    f"TTFT p50 {result['ttft']['p50']:.3f} s  p95 {result['ttft']['p95']:.3f} s  "
                    f"errors {result['errors']}",
                    flush=True,
                )
        finally:
            server.stop()
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n| window ms | concurrency | out tok/s | TTFT p50 s | TTFT p95 s | e2e p50 s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['window_ms']:.0f} | {r['concurrency']} | {r['output_tok_per_s']:.1f} | "
            f"{r['ttft']['p50']:.3f} | {r['ttft']['p95']:.3f} | {r['e2e']['p50']:.2f} |"
        )


if __name__ == "__main__":
    main()
