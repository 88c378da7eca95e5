"""Prefix reuse on a hybrid model: state snapshots in the radix tree on and off.

    python bench/hybrid.py [--out results/hybrid.json]

A tiny random Qwen3.5 text checkpoint built with HF's classes in Qwen3.5's ratio of layers
(three Gated DeltaNet layers to one full-attention layer; 8 layers, hidden 256), served in
float32 by in-process engines, token ids only. Two workloads, each round one batch:
- `multi_turn`: 8 conversations of 4 turns; each turn adds 48 new tokens to the conversation so
  far (its earlier prompts and answers), 16 output tokens;
- `agent_tree`: 4 agents on one 320-token system prompt, each with its own 64-token task, then
  3 tool rounds that append 32 tokens to the agent's history, 16 output tokens.
Reported per workload: the share of prompt tokens read from the cache and output tokens per
second, with `--max-mamba-cache-size` left at its default and at 0 (no prefix reuse).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
import transformers as hf

from radixserve import Engine

OUTPUT = 16
GREEDY = {"temperature": 0, "max_new_tokens": OUTPUT, "ignore_eos": True}


def build_checkpoint(folder: Path) -> Path:
    config = hf.Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = hf.Qwen3_5ForCausalLM(config)
    model.save_pretrained(folder / "qwen3_5")
    return folder / "qwen3_5"


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


def multi_turn(rng: random.Random) -> list[list[list[int]]]:
    """Rounds of prompts: the conversations' turns, each a continuation of the last."""
    return [[tokens(rng, 48) for _ in range(8)] for _ in range(4)]


def agent_tree(rng: random.Random) -> list[list[list[int]]]:
    system = tokens(rng, 320)
    return [[system + tokens(rng, 64) for _ in range(4)]] + [
        [tokens(rng, 32) for _ in range(4)] for _ in range(3)
    ]


def run(path: Path, rounds: list[list[list[int]]], snapshots: int | None) -> dict:
    """Each round's new parts appended to each conversation's history (the first round's are
    whole prompts), then the answers appended too."""
    options = {} if snapshots is None else {"max_mamba_cache_size": snapshots}
    with Engine(
        model=str(path),
        dtype="float32",
        max_total_tokens=16384,
        chunked_prefill_size=256,
        **options,
    ) as eng:
        history = [[] for _ in rounds[0]]
        prompt = cached = generated = 0
        started = time.perf_counter()
        for parts in rounds:
            prompts = [h + p for h, p in zip(history, parts)]
            results = eng.generate(input_ids=prompts, sampling_params=GREEDY)
            history = [p + r["output_ids"] for p, r in zip(prompts, results)]
            prompt += sum(len(p) for p in prompts)
            cached += sum(r["meta_info"]["cached_tokens"] for r in results)
            generated += sum(len(r["output_ids"]) for r in results)
        elapsed = time.perf_counter() - started
        eng.check_memory()
    return {"hit_rate": cached / prompt, "output_tok_per_s": generated / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = build_checkpoint(Path(folder))
        for name, workload in (("multi_turn", multi_turn), ("agent_tree", agent_tree)):
            rounds = workload(random.Random(0))
            on, off = run(path, rounds, None), run(path, rounds, 0)
            rows.append({"workload": name, "snapshots": on, "no_reuse": off})
            print(
                f"{name:12s} hit rate {on['hit_rate']:.1%} / {off['hit_rate']:.1%}  "
                f"out tok/s {on['output_tok_per_s']:.1f} / {off['output_tok_per_s']:.1f} "
                f"({on['output_tok_per_s'] / off['output_tok_per_s']:.2f}x)"
            )
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
