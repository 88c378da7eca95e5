"""Speculative decoding against plain decoding, on a copy-heavy RAG workload and on one
with no copying, at concurrency 1 and 8.

Two servers from this checkout, one with `--speculative-algorithm ngram` (or, with
`--algorithm draft`, a draft model: `--draft-model PATH`, or the bundled model's first
`--draft-layers` layers, bench/draft_models.py); every workload runs
on both, one after the other, greedy and without ignore_eos (outputs are identical either way,
which the script checks, so both produce the same tokens). Output throughput = output tokens
/ wall time of the workload; accept length = tokens per verify step, from /metrics.

    .venv/bin/python bench/spec_decode.py          # ~8 minutes on 2 cores
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

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quebec", "Tbilisi", "Perth", "Accra", "Bergen",
          "Cusco", "Da Nang", "Kraków", "Mombasa", "Porto", "Tromsø"]
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a market at dawn", "an old violin",
          "a night train", "a garden on a roof", "a letter never sent", "the last bookshop", "a fox in the city",
          "a storm at sea", "a clockmaker", "a kite festival", "a quiet library", "a desert well", "a river ferry"]


def rag_prompt(rng: random.Random, city: str) -> str:
    """A retrieved passage of facts about a city, and a request to quote what answers the question."""
    year, people, river = rng.randint(1200, 1900), rng.randint(120, 990), rng.choice(["Tagus", "Douro", "Nile", "Volga"])
    passage = (f"{city} was founded in {year} by traders from the coast. Today about {people} thousand people "
               f"live in {city}, most of them near the old harbour. The city is known for its tiled houses, its "
               f"fish market and the {river} bridge, which opened in {year + 400}. Every summer {city} holds a "
               f"music festival that lasts nine days and draws visitors from across the region.")
    return (f"Context:\n{passage}\n\nRepeat the context above word for word, then stop.\n\nContext:\n")


def story_prompt(topic: str) -> str:
    return f"Write a short original story about {topic}. Do not repeat yourself."


def workload(name: str, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    if name == "rag_copy":
        return [rag_prompt(rng, CITIES[i % len(CITIES)]) for i in range(count)]
    return [story_prompt(TOPICS[i % len(TOPICS)]) for i in range(count)]


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
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
            "output_ids": [o["output_ids"] for o in outs]}


def layer_prefix_draft(layers: int, folder: Path) -> Path:
    from draft_models import layer_prefix_model
    from radixserve.models.loader import bundled_model_dir

    return layer_prefix_model(bundled_model_dir(), layers, folder / f"draft-{layers}-layers")


def spec_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    value = lambda name: servers._metric_sum(text, name) or 0.0  # noqa: E731
    return value("radixserve:spec_verify_steps_total"), value("radixserve:spec_accepted_tokens_total")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests-c1", type=int, default=6)
    ap.add_argument("--requests-c8", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--algorithm", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--draft-model", default=None, help="with --algorithm draft: a model folder")
    ap.add_argument("--draft-layers", type=int, default=24,
                    help="with --algorithm draft and no --draft-model: draft with the bundled model's first N layers")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-spec-bench-"))
    spec_flags = ["--speculative-algorithm", args.algorithm, "--speculative-num-draft-tokens", str(args.draft_tokens)]
    if args.algorithm == "draft":
        spec_flags += ["--speculative-draft-model", args.draft_model or str(layer_prefix_draft(args.draft_layers, log_dir))]
    plain = servers.radixserve(free_port(), log_dir, 8, args.kv_tokens, extra=[])
    spec = servers.radixserve(free_port(), log_dir, 8, args.kv_tokens, extra=spec_flags)
    rows = []
    try:
        for name in ("rag_copy", "no_copy"):
            for concurrency, count in ((1, args.requests_c1), (8, args.requests_c8)):
                prompts = workload(name, count, args.seed)
                asyncio.run(run(plain.target.base_url, prompts[:1], 1, 4))  # warm both
                asyncio.run(run(spec.target.base_url, prompts[:1], 1, 4))
                base = asyncio.run(run(plain.target.base_url, prompts, concurrency, args.output_len))
                before = spec_counters(spec.target.base_url)
                fast = asyncio.run(run(spec.target.base_url, prompts, concurrency, args.output_len))
                after = spec_counters(spec.target.base_url)
                steps, accepted = after[0] - before[0], after[1] - before[1]
                row = {"workload": name, "concurrency": concurrency, "requests": count,
                       "plain_tok_s": base["output_tok_per_s"], "spec_tok_s": fast["output_tok_per_s"],
                       "speedup": fast["output_tok_per_s"] / base["output_tok_per_s"],
                       "accept_length": 1 + accepted / steps if steps else None, "verify_steps": steps,
                       "output_tokens": base["output_tokens"],
                       "identical_outputs": base["output_ids"] == fast["output_ids"]}
                rows.append(row)
                print(f"  {name:9s} c={concurrency}  plain {row['plain_tok_s']:6.1f} tok/s  {args.algorithm} "
                      f"{row['spec_tok_s']:6.1f} tok/s  {row['speedup']:.2f}x  accept length "
                      f"{row['accept_length'] or 0:.2f}  identical {row['identical_outputs']}", flush=True)
    finally:
        plain.stop()
        spec.stop()
    results = {"date": str(datetime.date.today()), "machine": f"{platform.machine()}-{os.cpu_count()}cpu",
               "args": vars(args), "rows": rows}
    stem = BENCH / "results" / f"{results['date']}-{results['machine']}-spec_decode{'-' + args.tag if args.tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(f"\n| workload | concurrency | plain tok/s | {args.algorithm} tok/s | speed-up | accept length | same output |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workload']} | {r['concurrency']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['accept_length'] or 0:.2f} | {r['identical_outputs']} |")
    print(f"\nwrote {stem.with_suffix('.json')}; logs in {log_dir}")


if __name__ == "__main__":
    main()
