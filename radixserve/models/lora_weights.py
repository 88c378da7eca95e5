"""The adapter pool: LoRA deltas on the model's linear layers, a fixed number of slots, and the
per-step segments that apply them.

Slot 0 is the base model (no delta); slots 1..`max_loras_per_batch` hold adapters. Each linear
layer the spec targets keeps `A [slots, R, in]` and `B [slots, out, R]`, the scaling folded into
B. A fused projection (q/k/v, gate/up) gives each targeted part a rank block of `max_rank`
columns, its B rows at the part's output offset, so one pair of matmuls serves the whole fused
layer. Every loaded adapter's tensors wait on the host in that layout; a step's adapters are
copied into slots first, evicting the least recently used ones the step does not need. A step's
tokens run in segments of consecutive requests on one slot: `x[seg] A^T B^T` is added to the
base output (SGMV-style; `kernels.lora_sgmv` on GPUs).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from ..lora import AdapterConfig, LoraSpec
from .layers import Linear

PEFT_PREFIX = "base_model.model."
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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
    """The adapters' deltas of one linear layer, stacked by slot; `parts`: the checkpoint
    modules that have a rank block here, in block order."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, parts: tuple[str, ...], segments):
        self.a, self.b, self.parts, self.segments = a, b, parts, segments

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        runs = self.segments.runs
        if not runs:
            return out
        if x.is_cuda:
            from radixserve_kernels import lora_sgmv

            return lora_sgmv(x, self.a, self.b, runs, out)
        for start, end, slot in runs:
            rows = x[start:end].to(self.a.dtype)
            out[start:end] += ((rows @ self.a[slot].t()) @ self.b[slot].t()).to(out.dtype)
        return out


@dataclass
class HostAdapter:
    """One loaded adapter in the pool's layout: per pooled layer, A and B for one slot."""

    config: AdapterConfig
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoraPool:
    def __init__(self, model, spec: LoraSpec, dtype: torch.dtype, device: torch.device):
        self.spec, self.model = spec, model
        self.segments = LoraSegments()
        self.layers: dict[str, LinearLora] = {}
        slots = spec.max_loras_per_batch + 1
        for name, module in model.named_modules():
            if not isinstance(module, Linear):
                continue
            leaf = name.rpartition(".")[2]
            parts = tuple(p for p in FUSED_PARTS.get(leaf, (leaf,)) if p in spec.target_modules)
            if not parts:
                continue
            rank = spec.max_rank * len(parts)
            a = torch.zeros(slots, rank, module.in_features, dtype=dtype, device=device)
            b = torch.zeros(slots, module.out_features, rank, dtype=dtype, device=device)
            module.lora = self.layers[name] = LinearLora(a, b, parts, self.segments)
        lacking = sorted(
            set(spec.target_modules) - {p for layer in self.layers.values() for p in layer.parts}
        )
        if lacking:
            raise ValueError(f"--lora-target-modules {lacking}: this model has no such layers")
        model.lora_segments = self.segments
        self.host: dict[str, HostAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.free_slots = list(range(slots - 1, 0, -1))

    def attach(self, model) -> None:
        """Apply the pool to `model` instead (new weights of the same shapes)."""
        modules = dict(model.named_modules())
        for name, layer in self.layers.items():
            modules[name].lora = layer
        model.lora_segments = self.segments
        self.model = model

    # ---- adapters in and out ------------------------------------------------
    def add(self, adapter: AdapterConfig) -> None:
        """Read the adapter onto the host; a ValueError names the adapter and the tensor when it
        does not fit this base."""
        self.spec.check(adapter)
        tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        modules = dict(self.model.named_modules())
        for target, part, offset, a, b in _adapter_tensors(self.model, modules, adapter):
            layer = self.layers.get(target)
            if layer is None or part not in layer.parts:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r}: {part} of {target!r} is not among "
                    f"--lora-target-modules {list(self.spec.target_modules)}"
                )
            if target not in tensors:
                tensors[target] = (
                    torch.zeros_like(layer.a[0], device="cpu"),
                    torch.zeros_like(layer.b[0], device="cpu"),
                )
            a_all, b_all = tensors[target]
            block = layer.parts.index(part) * self.spec.max_rank
            r = a.shape[0]
            a_all[block : block + r] = a
            b_all[offset : offset + b.shape[0], block : block + r] = b * adapter.scaling
        self.host[adapter.name] = HostAdapter(adapter, tensors)

    def remove(self, name: str) -> None:
        del self.host[name]
        slot = self.resident.pop(name, None)
        if slot is not None:
            self.free_slots.append(slot)

    # ---- a step ---------------------------------------------------------------
    def prepare_step(self, names: list[str | None], token_counts: list[int]) -> None:
        """Put the step's adapters in slots (the scheduler admits at most max_loras_per_batch
        of them) and set the segments."""
        needed = {n for n in names if n is not None}
        slots = [0 if n is None else self._slot(n, needed) for n in names]
        self.segments.set(slots, token_counts)

    def _slot(self, name: str, needed: set[str]) -> int:
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        if not self.free_slots:
            victim = next(n for n in self.resident if n not in needed)
            self.free_slots.append(self.resident.pop(victim))
        slot = self.free_slots.pop()
        tensors = self.host[name].tensors
        for target, layer in self.layers.items():
            if target in tensors:
                layer.a[slot].copy_(tensors[target][0])
                layer.b[slot].copy_(tensors[target][1])
            else:
                layer.a[slot].zero_()
                layer.b[slot].zero_()
        self.resident[name] = slot
        return slot


def _adapter_tensors(model, modules: dict, adapter: AdapterConfig) -> list[tuple]:
    """(pooled layer, checkpoint module, output offset, A [r, in], B [out_part, r]) of each
    layer one adapter changes."""
    from .decoder import fused_target

    try:
        tensors = load_file(str(adapter.path / "adapter_model.safetensors"))
    except Exception as exc:  # noqa: BLE001 - a broken file is a bad adapter, named
        raise ValueError(f"LoRA adapter {adapter.name!r}: cannot read its safetensors ({exc})")
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
        part = module_name.rpartition(".")[2]
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            raise ValueError(f"{where}: lora_A or lora_B holds NaN or inf")
        out.append((target, part, model.shard_offset(linear, shard), a, b))
    return out
