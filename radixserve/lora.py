"""LoRA adapters in peft's format, read and checked without torch.

An adapter is a folder with `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
optionally `use_rslora`) and `adapter_model.safetensors`. `--lora-paths NAME=PATH` names each; a
request picks one by name. The KV an adapter computes lives in its own radix namespace
(`cache_namespace`), so no other adapter, and not the base model, ever reuses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    name: str
    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """What B A is multiplied by: alpha / r (alpha / sqrt(r) with rsLoRA), as peft does."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def parse_lora_path(item: str) -> tuple[str, Path]:
    """`NAME=PATH`, or a bare `PATH` named after its folder."""
    name, sep, path = item.partition("=")
    if not sep:
        name, path = Path(item).name, item
    if not name or not path:
        raise ValueError(f"--lora-paths {item!r}: expected NAME=PATH")
    return name, Path(path).expanduser()


def read_adapter(name: str, path: Path, max_rank: int | None) -> AdapterConfig:
    """The adapter's config, or a ValueError naming the adapter and what is wrong."""
    where = f"LoRA adapter {name!r} ({path})"
    config_file = path / "adapter_config.json"
    if not config_file.is_file() or not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"{where}: expected adapter_config.json and adapter_model.safetensors")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: adapter_config.json is not JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config['peft_type']!r}; only LORA is served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):
        raise ValueError(f"{where}: target_modules as a regex is not supported; list them")
    unknown = sorted(set(targets) - set(LORA_MODULES))
    if unknown:
        raise ValueError(
            f"{where}: target_modules {unknown} are not LoRA targets here; "
            f"supported: {', '.join(LORA_MODULES)}"
        )
    for field in ("modules_to_save", "layers_to_transform"):
        if config.get(field):
            raise ValueError(f"{where}: {field} is not supported")
    return AdapterConfig(
        name,
        path,
        rank,
        float(config.get("lora_alpha", rank)),
        tuple(targets),
        bool(config.get("use_rslora", False)),
    )


def cache_namespace(cache_salt: str | None, adapter: str | None) -> str | None:
    """The radix namespace of a request: its salt, and its adapter when it has one."""
    if adapter is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{adapter}"
