"""Markdown tables from a bench/serving.py results file: python bench/report.py RESULTS.json"""

from __future__ import annotations

import json
import sys


def fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def table(results: dict) -> str:
    rows = [r for r in results["rows"] if "workload" in r]
    out = [
        "| system | workload | out tok/s | TTFT p50 s | TTFT p95 s | ITL p50 s | TPOT p50 s | e2e "
        "p95 s "
        "| hit rate | cold start s | errors |",
        "|" + " --- |" * 11,
    ]
    for r in rows:
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%"
        out.append(
            f"| {r['system']} | {r['workload']} | {r['output_tok_per_s']:.1f} | "
            f"{fmt(r['ttft']['p50'])} "
            f"| {fmt(r['ttft']['p95'])} | {fmt(r['itl']['p50'])} | {fmt(r['tpot']['p50'])} "
            f"| {fmt(r['e2e']['p95'])} | {hit} | {r['cold_start']:.1f} | {r['errors']} |"
        )
    return "\n".join(out)


def ratios(results: dict) -> str:
    rows = [r for r in results["rows"] if "workload" in r]
    ours = {r["workload"]: r for r in rows if r["system"] == "radixserve"}
    out = [
        "| workload | peer | radixserve throughput / peer | radixserve TTFT p95 / peer |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        mine = ours.get(r["workload"])
        if r["system"] == "radixserve" or not mine or not r["output_tok_per_s"]:
            continue
        ttft = (mine["ttft"]["p95"] or 0) / r["ttft"]["p95"] if r["ttft"]["p95"] else None
        out.append(
            f"| {r['workload']} | {r['system']} | "
            f"{mine['output_tok_per_s'] / r['output_tok_per_s']:.2f}x "
            f"| {fmt(ttft)} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    print(table(data))
    print()
    print(ratios(data))
