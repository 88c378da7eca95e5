"""Prefix reuse on a hybrid model: state snapshots on and off, and snapshot policies compared.

    python bench/hybrid.py [--out results/hybrid.json]

A tiny random Qwen3.5 text checkpoint built with HF's classes in Qwen3.5's ratio of layers
(three Gated DeltaNet layers to one full-attention layer; 8 layers, hidden 256) and of state
size to KV (a request's state takes as much memory as ~1,500 tokens of KV, as in Qwen3.5-9B:
48 MiB over 24 linear layers against the KV of its 8 attention layers), served in float32 by
in-process engines, token ids only. Three workloads, each round one batch:
- `multi_turn`: 8 conversations of 6 turns; each turn adds a 96-token message to the
  conversation so far (its earlier messages and answers), 64-token answers;
- `agent_tree`: 4 agents on one 320-token system prompt, each with its own 64-token task, then
  4 tool rounds that append a 32-token result to the agent's history, 16-token calls;
- `system_prompt`: 2 rounds of 8 requests, each a 1,000-token system prompt shared by all and
  its own 100-token question, 32-token answers.
Reported per workload: the share of prompt tokens read from the cache and output tokens per
second, with SLOTS state snapshot slots and with none (no prefix reuse); then, replaying the
snapshots run's request log (`radixserve replay LOG --snapshot-slots`), the hit rate of
radixserve's snapshot policy, SGLang's chunk-end policy and vLLM's one block-aligned
checkpoint per request, each with SLOTS and 4 x SLOTS slots (equal snapshot memory), and the
KV bound (what a snapshot at every token would give). Last, without the model, the same
replay over synthetic conversations and agents with longer turns: how the policies compare
as a turn grows towards vLLM's block.
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
from radixserve.cli import build_parser, replay_args_from
from radixserve.request_log import read_log
from radixserve.sizing.cache_sim import Trace, TraceRequest
from radixserve.sizing.replay import run_replay
from radixserve.sizing.snapshot_sim import policies, replay_snapshots


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


SLOTS = 16  # state snapshot slots, a realistic pool for Qwen3.5-sized states


def build_checkpoint(folder: Path) -> Path:
    config = hf.Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=128,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = hf.Qwen3_5ForCausalLM(config)
    model.save_pretrained(folder / "qwen3_5")
    return folder / "qwen3_5"


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


def multi_turn(rng: random.Random) -> list[list[list[int]]]:
    """Rounds of prompts: the conversations' turns, each a continuation of the last."""
    return [[tokens(rng, 96) for _ in range(8)] for _ in range(6)]


def agent_tree(rng: random.Random) -> list[list[list[int]]]:
    system = tokens(rng, 320)
    return [[system + tokens(rng, 64) for _ in range(4)]] + [
        [tokens(rng, 32) for _ in range(4)] for _ in range(4)
    ]


def system_prompt(rng: random.Random) -> list[list[list[int]]]:
    """Independent requests (no history): each round's prompts are whole."""
    system = tokens(rng, 1000)
    return [[system + tokens(rng, 100) for _ in range(8)] for _ in range(2)]


# name -> (rounds, whether each round continues the conversations, output tokens)
WORKLOADS = {
    "multi_turn": (multi_turn, True, 64),
    "agent_tree": (agent_tree, True, 16),
    "system_prompt": (system_prompt, False, 32),
}


def run(
    path: Path,
    rounds: list[list[list[int]]],
    continued: bool,
    output: int,
    slots: int,
    log: Path | None,
) -> dict:
    """Each round's new parts appended to each conversation's history where the workload
    continues conversations (the first round's are whole prompts), then the answers too."""
    options = {"log_requests": str(log), "log_requests_level": "full"} if log else {}
    with Engine(
        model=str(path),
        dtype="float32",
        max_total_tokens=65536,
        chunked_prefill_size=512,
        max_mamba_cache_size=slots,
        **options,
    ) as eng:
        history = [[] for _ in rounds[0]]
        prompt = cached = generated = 0
        started = time.perf_counter()
        for parts in rounds:
            prompts = [h + p for h, p in zip(history, parts)] if continued else parts
            results = eng.generate(input_ids=prompts, sampling_params=greedy(output))
            history = [p + r["output_ids"] for p, r in zip(prompts, results)]
            prompt += sum(len(p) for p in prompts)
            cached += sum(r["meta_info"]["cached_tokens"] for r in results)
            generated += sum(len(r["output_ids"]) for r in results)
        elapsed = time.perf_counter() - started
        eng.check_memory()
    return {"hit_rate": cached / prompt, "output_tok_per_s": generated / elapsed}


def replay(log: Path) -> dict:
    """Each policy's hit rate on the log, at SLOTS and 4 x SLOTS snapshot slots, and the KV
    bound."""
    out = log / "replay.json"
    ns = build_parser().parse_args(
        ["replay", str(log), "--snapshot-slots", f"{SLOTS},{4 * SLOTS}", "--json", str(out)]
    )
    run_replay(replay_args_from(ns))
    results = json.loads(out.read_text())["results"]
    rates = {f"{r['policy']}@{r['slots']}": r["hit_rate"] for r in results}
    return rates | {"kv_bound": results[0]["kv_bound"]}


def synthetic(conversations: int, turns: int, first: int, turn: int, answer: int) -> Trace:
    """Conversations whose first prompt (`first` tokens: a shared system prompt and a
    64-token task, or a message) grows by a `turn`-token message and an `answer`-token
    answer each turn, one round of turns after another."""
    rng, requests, clock = random.Random(1), [], 0.0
    shared = tokens(rng, first - 64)
    history = [shared + tokens(rng, 64) for _ in range(conversations)]
    for t in range(turns):
        for c in range(conversations):
            prompt = history[c] if t == 0 else history[c] + tokens(rng, turn)
            out = tokens(rng, answer)
            units = tuple(prompt + out[:-1])
            at = clock + 0.001 * c
            requests.append(
                TraceRequest(at, at, clock + 0.5, units, len(prompt), len(prompt) - 1, len(prompt))
            )
            history[c] = prompt + out
        clock += 1.0
    return Trace(requests, 1)


def sensitivity(block: int, interval: int) -> list[dict]:
    """The policies over synthetic traffic whose turns grow towards vLLM's block."""
    shapes = [("chat", 8, 6, 96, turn, 64) for turn in (64, 128, 256, 512)]
    shapes += [("agents", 4, 5, 384, turn, 16) for turn in (32, 128, 256, 512)]
    rows = []
    for kind, conversations, turns, first, turn, answer in shapes:
        trace = synthetic(conversations, turns, first, turn, answer)
        results = [replay_snapshots(trace, p, SLOTS, 512) for p in policies(block, interval)]
        rows.append(
            {"traffic": kind, "turn_tokens": turn, "answer_tokens": answer}
            | {r.policy: r.hit_rate for r in results}
            | {"kv_bound": results[0].kv_bound}
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = build_checkpoint(Path(folder))
        for name, (workload, continued, output) in WORKLOADS.items():
            rounds = workload(random.Random(0))
            log = Path(folder) / f"log-{name}"
            on = run(path, rounds, continued, output, SLOTS, log)
            off = run(path, rounds, continued, output, 0, None)
            replayed = replay(log)
            rows.append({"workload": name, "snapshots": on, "no_reuse": off, "replay": replayed})
            print(
                f"{name:14s} hit rate {on['hit_rate']:.1%} / {off['hit_rate']:.1%}  "
                f"out tok/s {on['output_tok_per_s']:.1f} / {off['output_tok_per_s']:.1f} "
                f"({on['output_tok_per_s'] / off['output_tok_per_s']:.2f}x)  replay: "
                + ", ".join(f"{k} {v:.1%}" for k, v in replayed.items())
            )
        server = read_log(log)[0][0]
    sweep = sensitivity(server.state_layer_tokens, server.state_interval)
    for row in sweep:
        print(row)
    result = {"slots": SLOTS, "block": server.state_layer_tokens, "rows": rows, "sweep": sweep}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
