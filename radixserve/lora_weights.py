"""LoRA weights on the model's linear layers, and the per-step segments that apply them.

Every adapter gets a slot (slot 0 is the base model: no delta). A linear layer that some adapter
targets holds, per slot, `A [R, in]` and `B [out, R]` with the scaling folded into B; a fused
projection (q/k/v, gate/up) stacks its parts' ranks, each part's B rows placed at the part's
output offset, so one pair of matmuls serves the whole fused layer. A step's tokens run in
segments of consecutive requests on one adapter: `x[seg] A^T B^T` is added to the base output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from .layers import Linear
from .lora import AdapterConfig

PEFT_PREFIX = "base_model.model."


@dataclass
class LoraSegments:
    """This step's runs of tokens on one adapter slot: (start, end, slot), slot > 0 only."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)

    def set(self, slots: list[int], token_counts: list[int]) -> None:
        runs, start = [], 0
        for slot, count in zip(slots, token_counts):
            end = start + count
            if slot and runs and runs[-1][2] == slot and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end, slot)
            elif slot:
                runs.append((start, end, slot))
            start = end
        self.runs = runs


class LinearLora:
    """The adapters' deltas of one linear layer, stacked by slot."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, segments: LoraSegments):
        self.a, self.b, self.segments = a, b, segments  # [slots, R, in], [slots, out, R]

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for start, end, slot in self.segments.runs:
            rows = x[start:end].to(self.a.dtype)
            out[start:end] += ((rows @ self.a[slot].t()) @ self.b[slot].t()).to(out.dtype)
        return out


def attach_adapters(
    model, adapters: list[AdapterConfig], dtype: torch.dtype, device: torch.device
) -> LoraSegments:
    """Load each adapter into slot i + 1 of the linear layers it targets; returns the segments
    object the runner fills before each step. Errors name the adapter and the tensor."""
    modules = dict(model.named_modules())
    deltas: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for slot, adapter in enumerate(adapters, start=1):
        for target, offset, a, b in _adapter_tensors(model, modules, adapter):
            deltas.setdefault(target, []).append((slot, offset, a, b * adapter.scaling))
    segments = LoraSegments()
    slots = len(adapters) + 1
    for target, parts in deltas.items():
        linear: Linear = modules[target]
        ranks = [0] * slots
        for slot, _, a, _ in parts:
            ranks[slot] += a.shape[0]
        a_all = torch.zeros(slots, max(ranks), linear.in_features, dtype=dtype)
        b_all = torch.zeros(slots, linear.out_features, max(ranks), dtype=dtype)
        used = [0] * slots
        for slot, offset, a, b in parts:
            r = a.shape[0]
            a_all[slot, used[slot] : used[slot] + r] = a
            b_all[slot, offset : offset + b.shape[0], used[slot] : used[slot] + r] = b
            used[slot] += r
        linear.lora = LinearLora(a_all.to(device), b_all.to(device), segments)
    return segments


def _adapter_tensors(model, modules: dict, adapter: AdapterConfig) -> list[tuple]:
    """(target module, part offset, A [r, in], B [out_part, r]) of each layer one adapter
    changes."""
    from .models.decoder import fused_target

    tensors = load_file(str(adapter.path / "adapter_model.safetensors"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        stem = name.removeprefix(PEFT_PREFIX)
        for kind in ("lora_A", "lora_B"):
            marker = f".{kind}."
            if marker in stem:
                pairs.setdefault(stem.split(marker)[0], {})[kind] = tensor.float()
                break
        else:
            raise ValueError(f"LoRA adapter {adapter.name!r}: tensor {name!r} is not a LoRA A/B")
    out = []
    for module_name, ab in pairs.items():
        where = f"LoRA adapter {adapter.name!r}: {module_name!r}"
        renamed = model.rename(module_name + ".weight")
        target, shard = fused_target(renamed.removesuffix(".weight")) if renamed else ("", None)
        linear = modules.get(target)
        if not isinstance(linear, Linear):
            raise ValueError(f"{where} is not a linear layer of this model (another base?)")
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{where} lacks lora_A or lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        width = linear.parts[shard] if shard is not None else linear.out_features
        if a.shape != (adapter.rank, linear.in_features) or b.shape != (width, adapter.rank):
            raise ValueError(
                f"{where}: A {tuple(a.shape)}, B {tuple(b.shape)}; this base needs A "
                f"({adapter.rank}, {linear.in_features}), B ({width}, {adapter.rank}) "
                "(an adapter for another base?)"
            )
        out.append((target, model.shard_offset(linear, shard), a, b))
    return out
