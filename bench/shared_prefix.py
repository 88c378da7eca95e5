"""Offline shared-prefix benchmark: radixserve with the radix cache on and off, and HF generate.

    python bench/shared_prefix.py [--groups 4 --per-group 8 --system-len 256 --question-len 32
    --output-len 32]

Prints a table and writes bench/results/shared_prefix-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch
from workloads import SharedPrefixWorkload

from radixserve import Engine


def run_radixserve(prompts, output_len: int, disable_cache: bool) -> dict:
    with Engine(
        max_total_tokens=16384,
        max_running_requests=64,
        chunked_prefill_size=1024,
        disable_radix_cache=disable_cache,
    ) as engine:
        engine.generate(
            input_ids=[prompts[0][:8]], sampling_params={"max_new_tokens": 2}
        )  # warm-up
        engine.flush_cache()
        start = time.perf_counter()
        results = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True},
        )
        elapsed = time.perf_counter() - start
        stats = engine.get_stats()
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results)
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    output = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "system": "radixserve" + (" (no radix cache)" if disable_cache else ""),
        "seconds": elapsed,
        "output_tok_per_s": output / elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_prompt_tokens": prompt - cached,
        "hit_rate": cached / prompt,
        "forward_steps": stats.forward_steps,
        "outputs": [r["output_ids"] for r in results],
    }


def run_hf(model_dir, prompts, output_len: int, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
        outputs += out[:, width:].tolist()
    elapsed = time.perf_counter() - start
    output = sum(len(o) for o in outputs)
    return {
        "system": f"HF transformers generate (static batch {batch})",
        "seconds": elapsed,
        "output_tok_per_s": output / elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "prompt_tokens": sum(map(len, prompts)),
        "cached_tokens": 0,
        "computed_prompt_tokens": sum(map(len, prompts)),
        "hit_rate": 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    from radixserve.models.source import bundled_model_dir
    from radixserve.tokenizer import load_tokenizer

    model_dir = bundled_model_dir()
    workload = SharedPrefixWorkload(
        a.groups, a.per_group, a.system_len, a.question_len, a.output_len
    )
    prompts = workload.prompts(load_tokenizer(model_dir))
    rows = [
        run_radixserve(prompts, a.output_len, False),
        run_radixserve(prompts, a.output_len, True),
    ]
    same = rows[0].pop("outputs") == rows[1].pop("outputs")
    if not a.skip_hf:
        rows.append(run_hf(model_dir, prompts, a.output_len, a.hf_batch))
    base = rows[0]["output_tok_per_s"]
    print(f"workload: {vars(workload)}; greedy outputs identical with/without cache: {same}")
    print(
        f"{'system':44s} {'time s':>7s} {'out tok/s':>9s} {'hit rate':>8s} "
        f"{'computed prompt tok':>20s} {'radix speed-up':>14s}"
    )
    for r in rows:
        print(
            f"{r['system']:44s} {r['seconds']:7.1f} {r['output_tok_per_s']:9.1f} "
            f"{r['hit_rate']:8.2f} "
            f"{r['computed_prompt_tokens']:20d} {base / r['output_tok_per_s']:13.2f}x"
        )
    out = Path(__file__).parent / "results" / f"shared_prefix-{datetime.date.today()}.json"
    out.write_text(
        json.dumps(
            {
                "workload": vars(workload),
                "machine": platform.machine(),
                "cores": torch.get_num_threads(),
                "identical_outputs": same,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
