"""Speculative decoding against plain decoding, on a copy-heavy RAG workload and on one
with no copying, at concurrency 1 and 8.

Two servers from this checkout, one with `--speculative-algorithm ngram` (or, with
`--algorithm draft`, a draft model: `--draft-model PATH`, or the bundled model's first
`--draft-layers` layers, bench/draft_models.py). Each cell (workload, concurrency) runs
`--rounds` rounds; every round sends both servers the same prompts, which no earlier round or
cell has sent (so neither the radix cache nor the n-gram table has seen them), and the server
that goes first alternates between rounds, so drift of this shared machine falls on both.
Greedy, without ignore_eos: outputs are identical either way, which the script checks.
Output throughput = output tokens / wall time, summed over the rounds; accept length =
tokens per verify step, from /metrics.

    .venv/bin/python bench/spec_decode.py          # ~15 minutes on 2 cores
    .venv/bin/python bench/spec_decode.py --algorithm draft --draft-layers 24

Writes bench/results/<date>-<machine>-spec_decode.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
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
from serving import free_port  # noqa: E402

CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Lima",
    "Hanoi",
    "Quebec",
    "Tbilisi",
    "Perth",
    "Accra",
    "Bergen",
    "Cusco",
    "Da Nang",
    "Kraków",
    "Mombasa",
    "Porto",
    "Tromsø",
]
TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "the first snow",
    "a market at dawn",
    "an old violin",
    "a night train",
    "a garden on a roof",
    "a letter never sent",
    "the last bookshop",
    "a fox in the city",
    "a storm at sea",
    "a clockmaker",
    "a kite festival",
    "a quiet library",
    "a desert well",
    "a river ferry",
]


def rag_prompt(rng: random.Random, city: str) -> str:
    """A retrieved passage of facts about a city, and a request to quote what answers the
    question."""
    year, people, river = (
        rng.randint(1200, 1900),
        rng.randint(120, 990),
        rng.choice(["Tagus", "Douro", "Nile", "Volga"]),
    )
    passage = (
        f"{city} was founded in {year} by traders from the coast. Today about {people} thousand "
        "people "
        f"live in {city}, most of them near the old harbour. The city is known for its tiled "
        "houses, its "
        f"fish market and the {river} bridge, which opened in {year + 400}. Every summer {city} "
        "holds a "
        f"music festival that lasts nine days and draws visitors from across the region."
    )
    return (
        f"Context:\n{passage}\n\nRepeat the context above word for word, then stop.\n\nContext:\n"
    )


def story_prompt(topic: str, city: str) -> str:
    return f"Write a short original story about {topic} in {city}. Do not repeat yourself."


def workload(name: str, count: int, first: int, seed: int) -> list[str]:
    """Prompts number `first` .. `first + count - 1` of the workload: distinct numbers, distinct
    prompts."""
    rng = random.Random(f"{seed}-{name}-{first}")
    numbers = range(first, first + count)
    if name == "rag_copy":
        return [rag_prompt(rng, CITIES[i % len(CITIES)]) for i in numbers]
    return [
        story_prompt(TOPICS[i % len(TOPICS)], CITIES[i // len(TOPICS) % len(CITIES)])
        for i in numbers
    ]


async def run(url: str, prompts: list[str], concurrency: int, output_len: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    params = {"temperature": 0, "max_new_tokens": output_len}

    async def one(client: httpx.AsyncClient, prompt: str) -> dict:
        async with gate:
            r = await client.post("/generate", json={"text": prompt, "sampling_params": params})
            r.raise_for_status()
            return r.json()

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(client, p) for p in prompts))
        elapsed = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed,
        "output_ids": [o["output_ids"] for o in outs],
    }


def layer_prefix_draft(layers: int, folder: Path) -> Path:
    from draft_models import layer_prefix_model

    from radixserve.models.source import bundled_model_dir

    return layer_prefix_model(bundled_model_dir(), layers, folder / f"draft-{layers}-layers")


def spec_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    value = lambda name: servers._metric_sum(text, name) or 0.0  # noqa: E731
    return value("radixserve:spec_verify_steps_total"), value(
        "radixserve:spec_accepted_tokens_total"
    )


def measure_cell(
    plain_url: str,
    spec_url: str,
    name: str,
    concurrency: int,
    count: int,
    first: int,
    args: argparse.Namespace,
) -> dict:
    """`args.rounds` rounds of `count` fresh prompts on both servers, the first server
    alternating."""
    warm = workload(name, 1, first, args.seed)
    for url in (plain_url, spec_url):
        asyncio.run(run(url, warm, 1, 4))
    totals = {"plain": [0.0, 0], "spec": [0.0, 0]}
    round_speedups, identical = [], True
    before = spec_counters(spec_url)  # only the speculating server's rounds move its counters
    for round_no in range(args.rounds):
        prompts = workload(name, count, first + 1 + round_no * count, args.seed)
        order = ("plain", "spec") if round_no % 2 == 0 else ("spec", "plain")
        outs = {}
        for system in order:
            url = plain_url if system == "plain" else spec_url
            outs[system] = asyncio.run(run(url, prompts, concurrency, args.output_len))
            totals[system][0] += outs[system]["elapsed_s"]
            totals[system][1] += outs[system]["output_tokens"]
        round_speedups.append(
            round(outs["spec"]["output_tok_per_s"] / outs["plain"]["output_tok_per_s"], 2)
        )
        identical = identical and outs["plain"]["output_ids"] == outs["spec"]["output_ids"]
    after = spec_counters(spec_url)
    steps, accepted = after[0] - before[0], after[1] - before[1]
    plain_rate, spec_rate = (totals[s][1] / totals[s][0] for s in ("plain", "spec"))
    return {
        "workload": name,
        "concurrency": concurrency,
        "requests": count,
        "rounds": args.rounds,
        "plain_tok_s": plain_rate,
        "spec_tok_s": spec_rate,
        "speedup": spec_rate / plain_rate,
        "round_speedups": round_speedups,
        "accept_length": 1 + accepted / steps if steps else None,
        "verify_steps": steps,
        "output_tokens": totals["plain"][1],
        "identical_outputs": identical,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests-c1", type=int, default=6)
    ap.add_argument("--requests-c8", type=int, default=16)
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds per cell, fresh prompts each, the first server alternating",
    )
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--algorithm", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--draft-model", default=None, help="with --algorithm draft: a model folder")
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=24,
        help="with --algorithm draft and no --draft-model: draft with the bundled model's first N "
        "layers",
    )
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-spec-bench-"))
    spec_flags = [
        "--speculative-algorithm",
        args.algorithm,
        "--speculative-num-draft-tokens",
        str(args.draft_tokens),
    ]
    if args.algorithm == "draft":
        spec_flags += [
            "--speculative-draft-model",
            args.draft_model or str(layer_prefix_draft(args.draft_layers, log_dir)),
        ]
    plain = servers.radixserve(free_port(), log_dir, 8, args.kv_tokens, extra=[])
    spec = servers.radixserve(free_port(), log_dir, 8, args.kv_tokens, extra=spec_flags)
    rows = []
    try:
        for name in ("rag_copy", "no_copy"):
            first = 0
            for concurrency, count in ((1, args.requests_c1), (8, args.requests_c8)):
                rows.append(
                    measure_cell(
                        plain.target.base_url,
                        spec.target.base_url,
                        name,
                        concurrency,
                        count,
                        first,
                        args,
                    )
                )
                first += count * args.rounds + 1
                r = rows[-1]
                print(
                    f"  {name:9s} c={concurrency}  plain {r['plain_tok_s']:6.1f} tok/s  "
                    f"{args.algorithm} "
                    f"{r['spec_tok_s']:6.1f} tok/s  {r['speedup']:.2f}x (rounds "
                    f"{r['round_speedups']})  accept "
                    f"length {r['accept_length'] or 0:.2f}  identical {r['identical_outputs']}",
                    flush=True,
                )
    finally:
        plain.stop()
        spec.stop()
    results = {
        "date": str(datetime.date.today()),
        "machine": f"{platform.machine()}-{os.cpu_count()}cpu",
        "args": vars(args),
        "rows": rows,
    }
    stem = (
        BENCH
        / "results"
        / f"{results['date']}-{results['machine']}-spec_decode{'-' + args.tag if args.tag else ''}"
    )
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(
        f"\n| workload | concurrency | plain tok/s | {args.algorithm} tok/s | speed-up | accept "
        "length | same output |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['workload']} | {r['concurrency']} | {r['plain_tok_s']:.1f} | "
            f"{r['spec_tok_s']:.1f} | "
            f"{r['speedup']:.2f}x | {r['accept_length'] or 0:.2f} | {r['identical_outputs']} |"
        )
    print(f"\nwrote {stem.with_suffix('.json')}; logs in {log_dir}")


if __name__ == "__main__":
    main()
