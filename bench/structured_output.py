"""Structured output: JSON-schema requests with and without jump-forward decoding.

    python bench/structured_output.py [--requests 16] [--dtype auto] [--out
    bench/results/structured_output.json]

Each request asks for a record with fixed keys; the keys, quotes and separators are forced
by the grammar, so jump-forward appends them without decode steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from radixserve import Engine

SCHEMA = {
    "type": "object",
    "required": ["name", "city", "age", "occupation", "hobby"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "city": {"enum": ["Paris", "Lyon", "Nice", "Lille", "Nantes"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "maxLength": 24},
        "hobby": {"type": "string", "maxLength": 24},
    },
}


def run(jump_forward: bool, prompts: list[str], dtype: str) -> dict:
    params = {"temperature": 0, "max_new_tokens": 96, "json_schema": SCHEMA}
    with Engine(
        dtype=dtype,
        max_total_tokens=8192,
        max_running_requests=16,
        enable_jump_forward=jump_forward,
    ) as eng:
        eng.generate(prompts[0], params)  # warm-up: compiles the grammar
        before = copy.copy(eng.get_stats())
        start = time.perf_counter()
        outs = eng.generate(prompts, params)
        seconds = time.perf_counter() - start
        after = eng.get_stats()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    valid = sum(_valid(o["text"]) for o in outs)
    return {
        "jump_forward": jump_forward,
        "requests": len(prompts),
        "seconds": round(seconds, 2),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / seconds, 1),
        "forward_steps": after.forward_steps - before.forward_steps,
        "forced_tokens": after.jump_forward_tokens_total - before.jump_forward_tokens_total,
        "valid_json": valid,
    }


def _valid(text: str) -> bool:
    try:
        return set(json.loads(text)) == set(SCHEMA["required"])
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prompts = [
        f"Invent person number {i} living in France and describe them as JSON:"
        for i in range(a.requests)
    ]
    rows = [run(jump, prompts, a.dtype) for jump in (False, True)]
    for r in rows:
        print(
            f"jump_forward={r['jump_forward']!s:5s} {r['seconds']:6.2f} s  "
            f"{r['output_tok_per_s']:7.1f} tok/s  "
            f"steps {r['forward_steps']:4d}  forced {r['forced_tokens']:4d}  valid "
            f"{r['valid_json']}/{r['requests']}"
        )
    print(f"speed-up {rows[0]['seconds'] / rows[1]['seconds']:.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
