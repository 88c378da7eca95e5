"""Multi-LoRA throughput on the bundled model: base only against adapters mixed in one batch.

    python bench/lora.py [--dtype float32] [--out results/lora.json]

Four random rank-16 adapters on every linear layer (q, k, v, o, gate, up, down), written here in
peft's format. Eight client threads keep eight requests in flight (128-token random prompts,
64 output tokens, nothing shared), 32 requests per run, in-process engines:
- `no LoRA`: the server as started without adapters;
- `LoRA server, base only`: the same traffic on a server with the four adapters loaded;
- `1 adapter` and `4 adapters mixed`: every request on one adapter, or round-robin on four.
Reported: output tokens per second and the ratio to `no LoRA`.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixserve import Engine
from radixserve.models.source import resolve_model

CONCURRENCY, REQUESTS, PROMPT, OUTPUT, RANK = 8, 32, 128, 64, 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(config: dict, path: Path, seed: int) -> None:
    """A peft LoRA folder for a llama-shaped base described by `config`."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (inp, out) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(RANK, inp, generator=gen) / inp**0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": TARGETS}
    (path / "adapter_config.json").write_text(json.dumps(adapter))


def run(engine: Engine, adapters: list[str | None], vocab: int, seed: int) -> float:
    """Output tokens per second of REQUESTS requests, CONCURRENCY in flight, request i on
    adapter i mod len(adapters)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(PROMPT)] for _ in range(REQUESTS)]
    params = {"temperature": 0, "max_new_tokens": OUTPUT, "ignore_eos": True}
    return output_tok_s(
        CONCURRENCY,
        len(prompts),
        lambda i: engine.generate(
            input_ids=prompts[i], sampling_params=params, lora_path=adapters[i % len(adapters)]
        ),
    )


def output_tok_s(concurrency: int, requests: int, generate) -> float:
    """Output tokens per second of `generate(i)` for i in range(requests), `concurrency`
    client threads taking the next one as they finish."""
    lock, made, next_index = threading.Lock(), [0], [0]

    def client():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= requests:
                return
            out = generate(i)
            with lock:
                made[0] += len(out["output_ids"])

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made[0] / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bundled = resolve_model(None).weights_dir
    config = json.loads((Path(bundled) / "config.json").read_text())
    common = dict(model=str(bundled), dtype=a.dtype, disable_radix_cache=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"ad{i}" for i in range(4)]
        for i, name in enumerate(names):
            write_adapter(config, Path(tmp) / name, i)
        paths = tuple(f"{n}={Path(tmp) / n}" for n in names)
        with Engine(**common) as eng:
            run(eng, [None], config["vocab_size"], 99)  # warm-up
            rows.append(("no LoRA", run(eng, [None], config["vocab_size"], 0)))
        with Engine(**common, lora_paths=paths) as eng:
            run(eng, names, config["vocab_size"], 99)
            for label, adapters in [
                ("LoRA server, base only", [None]),
                ("1 adapter", names[:1]),
                ("4 adapters mixed", names),
            ]:
                rows.append((label, run(eng, adapters, config["vocab_size"], 0)))
    base = rows[0][1]
    print(f"| run (dtype {a.dtype}, c={CONCURRENCY}) | output tok/s | vs no LoRA |")
    print("|---|---:|---:|")
    for label, tok_s in rows:
        print(f"| {label} | {tok_s:.1f} | {tok_s / base:.2f}x |")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(rows), indent=1))


if __name__ == "__main__":
    main()
