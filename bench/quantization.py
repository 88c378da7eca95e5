"""Weight and KV quantization on the bundled model: speed, memory and quality against bf16.

    python bench/quantization.py [--out results/quantization.json]

Variants, all computing in bf16: the bf16 checkpoint; `--quantization int8` and `fp8` (online,
one scale per output channel); an AWQ int4 checkpoint (group 64) written here from the bundled
model; and the bf16 weights with `--kv-cache-dtype fp8_e4m3`. For each:
- decode step (ms) at batch 1 and 32, context 256, straight on the model runner;
- output throughput through the engine at concurrency 1 and 32 (short prompts, 64 tokens each);
- the weights a decode step streams and the KV bytes per token;
- quality: the mean KL(bf16 || variant) of the next-token distribution over every position of a
  fixed prompt set, the prompts fed in chunks of 16 so each chunk reads the earlier ones back
  from the KV pool (what FP8 KV changes), and greedy agreement over 32 generated tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from decode_step import decode_batch, make_runner, time_steps, weight_bytes  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.messages import ForwardBatch, ForwardMode, SamplingBatch  # noqa: E402
from radixserve.models.source import resolve_model  # noqa: E402
from radixserve.worker.step_inputs import StepInputs  # noqa: E402

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "Photosynthesis is the process by which green plants turn light into",
    "Dear hiring manager, I am writing to apply for the position of data engineer",
    "The three laws of thermodynamics can be stated briefly as follows. First,",
    "Q: What is the capital of Australia, and why was it chosen?\nA:",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "To configure a reverse proxy with nginx, first install the package, then",
]
CHUNK = 16
NEW_TOKENS = 32


def variants(int4_dir: str, bundled: str) -> dict[str, dict]:
    return {
        "bf16": dict(model=bundled),
        "int8": dict(model=bundled, quantization="int8"),
        "fp8": dict(model=bundled, quantization="fp8"),
        "int4 (AWQ g64)": dict(model=int4_dir),
        "bf16 + FP8 KV": dict(model=bundled, kv_cache_dtype="fp8_e4m3"),
    }


def write_int4_checkpoint(bundled: str, folder: Path) -> str:
    import transformers as hf
    from quant_checkpoints import write_awq

    model = hf.AutoModelForCausalLM.from_pretrained(bundled, torch_dtype=torch.float32)
    write_awq(model, folder, group=64)
    for extra in Path(bundled).iterdir():
        if extra.suffix != ".safetensors" and extra.name != "config.json":
            shutil.copy(extra, folder / extra.name)
    return str(folder)


def prompt_ids(model: str) -> list[list[int]]:
    import transformers as hf

    tokenizer = hf.AutoTokenizer.from_pretrained(model)
    long_tail = " Explain each step in detail, with examples, and say what can go wrong."
    return [tokenizer(t + long_tail * 4)["input_ids"] for t in TEXTS]


def chunked_log_probs(runner, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position of `ids`, fed in chunks of CHUNK tokens."""
    out = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        slots = list(range(1 + start, 1 + start + len(chunk)))
        fb = ForwardBatch(
            ForwardMode.EXTEND,
            chunk,
            list(range(start, start + len(chunk))),
            slots,
            [0],
            [start + len(chunk)],
            [len(chunk)],
            [(0, start, slots)],
            SamplingBatch.greedy(1),
            [None],
        )
        with torch.inference_mode():
            _, hidden = runner.run_model(StepInputs.from_batch(fb, runner.device))
            out.append(torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1))
    return torch.cat(out)


def runner_figures(spec: dict, prompts: list[list[int]]) -> tuple[dict, list[torch.Tensor]]:
    options = {k: v for k, v in spec.items() if k != "model"}
    runner = make_runner(spec["model"], 32, 256, "bfloat16", **options)
    figures = {
        "weights_streamed_mb": round(weight_bytes(runner) / 1e6, 1),
        "kv_bytes_per_token": runner.info.bytes_per_token,
    }
    for batch in (1, 32):
        figures[f"step_ms_b{batch}"] = round(
            time_steps(runner, decode_batch(batch, 256), 10) * 1e3, 2
        )
    log_probs = [chunked_log_probs(runner, ids) for ids in prompts]
    return figures, log_probs


def engine_figures(spec: dict, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    greedy = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    flood = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    figures = {}
    with Engine(dtype="bfloat16", max_total_tokens=16384, **spec) as eng:
        outputs = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=greedy)]
        for concurrency in (1, 32):
            batch = [prompts[i % len(prompts)][:16] + [i] for i in range(concurrency)]
            start = time.perf_counter()
            results = eng.generate(input_ids=batch, sampling_params=flood)
            seconds = time.perf_counter() - start
            made = sum(len(r["output_ids"]) for r in results)
            figures[f"tok_s_c{concurrency}"] = round(made / seconds, 1)
    return figures, outputs


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, int]:
    """(share of the reference's tokens matched before the first difference, prompts identical)."""
    matched = total = identical = 0
    for want, got in zip(reference, outputs):
        same = next(
            (i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got))
        )
        matched, total = matched + same, total + len(want)
        identical += want == got
    return matched / total, identical


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bundled = str(resolve_model(None).weights_dir)
    prompts = prompt_ids(bundled)
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        int4_dir = write_int4_checkpoint(bundled, Path(tmp) / "int4")
        for name, spec in variants(int4_dir, bundled).items():
            figures, log_probs = runner_figures(spec, prompts)
            served, outputs = engine_figures(spec, prompts)
            if reference is None:
                reference = (log_probs, outputs)
            kl = torch.cat(
                [
                    torch.sum(ref.exp() * (ref - got), dim=-1)
                    for ref, got in zip(reference[0], log_probs)
                ]
            )
            share, identical = agreement(reference[1], outputs)
            row = {
                "variant": name,
                **figures,
                **served,
                "mean_kl": float(kl.mean()),
                "greedy_agreement": round(share, 3),
                "prompts_identical": f"{identical}/{len(prompts)}",
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows}, indent=2))


def print_table(rows: list[dict]) -> None:
    print(
        "| variant | weights streamed (MB) | KV bytes/token | step b1 (ms) | step b32 (ms) "
        "| tok/s c1 | tok/s c32 | mean KL vs bf16 | greedy agreement | prompts identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['weights_streamed_mb']} | {r['kv_bytes_per_token']} "
            f"| {r['step_ms_b1']} | {r['step_ms_b32']} | {r['tok_s_c1']} | {r['tok_s_c32']} "
            f"| {r['mean_kl']:.2e} | {r['greedy_agreement']:.3f} | {r['prompts_identical']} |"
        )


if __name__ == "__main__":
    main()
