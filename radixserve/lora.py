"""LoRA adapters in peft's format, read and checked without torch.

An adapter is a folder with `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
optionally `use_rslora`) and `adapter_model.safetensors`. `--lora-paths NAME=PATH` names each;
`/load_lora_adapter` adds more at runtime; a request picks one by name. Every adapter fits the
pool's `LoraSpec` (a rank and the modules it was built for). The KV an adapter computes lives
in a radix namespace of its own (`cache_namespace`), keyed by the adapter's files, so no other
adapter, and not the base model, ever reuses it, while a reload of the same files still does.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NAMESPACE_MARK = "\x00lora:"


@dataclass(frozen=True)
class AdapterConfig:
    name: str
    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    fingerprint: str = ""  # a hash of the adapter's two files

    @property
    def scaling(self) -> float:
        """What B A is multiplied by: alpha / r (alpha / sqrt(r) with rsLoRA), as peft does."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def lora_id(self) -> int:
        """The adapter as KV events name it (`BlockStored.lora_id`): a 60-bit int of its files'
        hash."""
        return lora_id_of(self.fingerprint)


@dataclass(frozen=True)
class LoraSpec:
    """What the adapter pool is built for: every adapter's rank is at most `max_rank` and its
    modules are among `target_modules`; one step mixes at most `max_loras_per_batch`."""

    max_rank: int
    target_modules: tuple[str, ...]
    max_loras_per_batch: int

    def check(self, adapter: AdapterConfig) -> None:
        where = f"LoRA adapter {adapter.name!r} ({adapter.path})"
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"{where}: rank {adapter.rank} is over --max-lora-rank {self.max_rank}"
            )
        outside = sorted(set(adapter.target_modules) - set(self.target_modules))
        if outside:
            raise ValueError(
                f"{where}: targets {outside}, outside --lora-target-modules "
                f"{list(self.target_modules)}"
            )


def parse_lora_path(item: str) -> tuple[str, Path]:
    """`NAME=PATH`, or a bare `PATH` named after its folder."""
    name, sep, path = item.partition("=")
    if not sep:
        name, path = Path(item).name, item
    if not name or not path:
        raise ValueError(f"--lora-paths {item!r}: expected NAME=PATH")
    return name, Path(path).expanduser()


def expand_targets(modules: tuple[str, ...]) -> tuple[str, ...]:
    """`--lora-target-modules`, with `all` standing for every module LoRA can target here."""
    return LORA_MODULES if "all" in modules else tuple(m for m in LORA_MODULES if m in modules)


def lora_spec(args, initial: list[AdapterConfig] | None = None) -> LoraSpec | None:
    """The pool's spec from the flags and the start-up adapters (None: LoRA is off). The rank
    and the modules default to what the start-up adapters need; without `initial`, their
    configs are read here (unhashed: the spec needs no fingerprint)."""
    if not args.enable_lora and not args.lora_paths:
        return None
    if initial is None:
        initial = [
            read_adapter(*parse_lora_path(item), fingerprint=False) for item in args.lora_paths
        ]
    rank = args.max_lora_rank or max(a.rank for a in initial)
    targets = expand_targets(tuple(args.lora_target_modules)) or expand_targets(
        tuple(m for a in initial for m in a.target_modules)
    )
    spec = LoraSpec(rank, targets, args.max_loras_per_batch)
    for adapter in initial:
        spec.check(adapter)
    return spec


def read_adapter(name: str, path: Path, fingerprint: bool = True) -> AdapterConfig:
    """The adapter's config, or a ValueError naming the adapter and what is wrong;
    `fingerprint`: hash its files too (what its cache namespace and KV events need)."""
    where = f"LoRA adapter {name!r} ({path})"
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
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
        files_fingerprint(config_file, weights_file) if fingerprint else "",
    )


def files_fingerprint(*files: Path) -> str:
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def lora_id_of(fingerprint: str) -> int:
    return int(fingerprint[:15], 16)


def cache_namespace(cache_salt: str | None, adapter: AdapterConfig | None) -> str | None:
    """The radix namespace of a request: its salt, and its adapter's files when it has one."""
    if adapter is None:
        return cache_salt
    return f"{cache_salt or ''}{NAMESPACE_MARK}{adapter.fingerprint}"


def namespace_lora_id(namespace: str | None) -> int | None:
    """The `lora_id` of the adapter a radix namespace belongs to (None: the base model)."""
    if namespace is None or NAMESPACE_MARK not in namespace:
        return None
    return lora_id_of(namespace.rpartition(NAMESPACE_MARK)[2])
