"""A mixture-of-experts decode step against its floor: the bytes of the parameters the step
actually reads (attention, routers, LM head, and the experts its tokens were routed to) over the
measured memory read bandwidth.

    python bench/moe_decode.py [--layers 4] [--experts 32] [--batch 1 4 16]

The model is Qwen3-30B-A3B's layer shape (hidden 2048, 8 of E experts of width 768, 32 query and
4 KV heads) with fewer layers and experts, random weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from decode_step import decode_batch, read_bandwidth, sync, time_steps

from radixserve.config import EngineArgs
from radixserve.model_config import ModelConfig
from radixserve.models.layers import Linear
from radixserve.models.moe import Experts
from radixserve.models.source import ModelSource
from radixserve.worker.model_runner import ModelRunner


def qwen3_moe_config(layers: int, experts: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    }


class ExpertCounter:
    """Which experts each MoE layer ran in the last step (a forward hook per Experts)."""

    def __init__(self, model: torch.nn.Module):
        self.blocks = [m for m in model.modules() if isinstance(m, Experts)]
        self.chosen: dict[int, int] = {}
        for i, block in enumerate(self.blocks):
            block.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def record(module, args, output):
            self.chosen[i] = int(torch.unique(args[2]).numel())

        return record

    def expert_bytes(self) -> int:
        return matrix_bytes(self.blocks[0][0]) * sum(self.chosen.values())


def matrix_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weight matrices of a module's linear layers (packed or not)."""
    total = 0
    for m in module.modules():
        if isinstance(m, (Linear, torch.nn.Linear)):
            tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
            total += sum(t.numel() * t.element_size() for t in tensors if t.dim() > 1)
    return total


def dense_bytes(model: torch.nn.Module) -> int:
    """Attention, routers, LM head: read whole every step (every expert's weights excluded)."""
    experts = sum(matrix_bytes(m) for m in model.modules() if isinstance(m, Experts))
    return matrix_bytes(model) - experts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    config = ModelConfig.from_hf_dict(qwen3_moe_config(a.layers, a.experts))
    slots = max(a.batch) * (a.context + 1) + 8
    runner = ModelRunner(
        ModelSource("qwen3-moe-bench", config, None, None),
        EngineArgs(max_total_tokens=slots, max_running_requests=max(a.batch), dtype=a.dtype),
    )
    counter = ExpertCounter(runner.model)
    dense = dense_bytes(runner.model)
    rows = []
    for b in a.batch:
        before = read_bandwidth(runner.device)
        batch = decode_batch(b, a.context)
        batch.input_ids = [100 + 37 * i for i in range(b)]  # tokens that route apart
        ms = time_steps(runner, batch, a.steps) * 1000
        bandwidth = max(before, read_bandwidth(runner.device))
        sync(runner)
        active = dense + counter.expert_bytes()
        floor_ms = active / bandwidth * 1000
        rows.append(
            {
                "batch": b,
                "experts_run": sum(counter.chosen.values()),
                "active_mb": round(active / 1e6),
                "step_ms": round(ms, 2),
                "floor_ms": round(floor_ms, 2),
                "x_floor": round(ms / floor_ms, 2),
                "bandwidth_gb_s": round(bandwidth / 1e9, 1),
            }
        )
        print(
            f"batch {b:3d}  experts run {rows[-1]['experts_run']:4d}  active "
            f"{active / 1e6:6.0f} MB  step {ms:7.2f} ms  floor {floor_ms:6.2f} ms "
            f"({bandwidth / 1e9:.1f} GB/s)  {ms / floor_ms:4.2f}x the floor"
        )
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
