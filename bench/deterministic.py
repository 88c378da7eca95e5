"""The cost of `--enable-deterministic-inference` on the bundled model, per dtype; with
`--hybrid`, on bench/hybrid.py's random Qwen3.5 checkpoint (six Gated DeltaNet layers, two of
attention), whose stateful layers the flag runs a token at a time.

    python bench/deterministic.py [--dtypes float32 bfloat16] [--hybrid] [--out FILE]

Eight client threads keep eight requests in flight (256-token random prompts, nothing shared,
64 output tokens, 32 requests), in-process engines, the radix cache off; then one request of a
1024-token prompt alone (its time to first token: prefill alone). Reported per dtype: output
tokens per second and the prefill time, without and with the flag, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from radixserve import Engine
from radixserve.models.source import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid import build_checkpoint  # noqa: E402
from lora import output_tok_s  # noqa: E402

CONCURRENCY, REQUESTS, PROMPT, OUTPUT, LONG = 8, 32, 256, 64, 1024


def throughput(engine: Engine, vocab: int, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(PROMPT)] for _ in range(REQUESTS)]
    params = {"temperature": 0, "max_new_tokens": OUTPUT, "ignore_eos": True}
    return output_tok_s(
        CONCURRENCY,
        REQUESTS,
        lambda i: engine.generate(input_ids=prompts[i], sampling_params=params),
    )


def prefill_seconds(engine: Engine, vocab: int) -> float:
    rng = random.Random(5)
    prompt = [rng.randrange(vocab) for _ in range(LONG)]
    start = time.perf_counter()
    engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1})
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--hybrid", action="store_true", help="bench/hybrid.py's Qwen3.5 checkpoint")
    a = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="deterministic-")
    bundled = str(build_checkpoint(Path(folder)) if a.hybrid else resolve_model(None).weights_dir)
    vocab = json.loads((Path(bundled) / "config.json").read_text())["vocab_size"]
    rows = []
    for dtype in a.dtypes:
        for deterministic in (False, True):
            options = dict(model=bundled, dtype=dtype, disable_radix_cache=True)
            with Engine(**options, enable_deterministic_inference=deterministic) as engine:
                throughput(engine, vocab, 99)  # warm-up
                tok_s = throughput(engine, vocab, 0)
                prefill = prefill_seconds(engine, vocab)
            rows.append({"dtype": dtype, "deterministic": deterministic, "tok_s": tok_s,
                         "prefill_s": prefill})  # fmt: skip
    print(f"| dtype | deterministic | output tok/s (c={CONCURRENCY}) | {LONG}-token prefill |")
    print("|---|---|---:|---:|")
    for r in rows:
        base = next(b for b in rows if b["dtype"] == r["dtype"] and not b["deterministic"])
        print(
            f"| {r['dtype']} | {'on' if r['deterministic'] else 'off'} | {r['tok_s']:.1f} "
            f"({r['tok_s'] / base['tok_s']:.2f}x) | {r['prefill_s']:.2f} s "
            f"({r['prefill_s'] / base['prefill_s']:.2f}x) |"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
