"""The LoRA adapters the scheduler serves, by name: loaded at start-up (`--lora-paths`) and at
runtime (`/load_lora_adapter`), unloaded once no queued or running request uses them.

An adapter being unloaded takes no new request (it reads as unknown) while the ones it has
finish; `unload` reports how many still run, and the caller asks again until none do."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..config import EngineArgs
from ..lora import AdapterConfig, lora_spec, parse_lora_path, read_adapter
from .executor import Executor
from .req import Req


class AdapterTable:
    def __init__(self, args: EngineArgs, executor: Executor):
        initial = [read_adapter(*parse_lora_path(item)) for item in args.lora_paths]
        self.spec = lora_spec(args, initial)
        self.executor = executor
        self.adapters: dict[str, AdapterConfig] = {}
        self.unloading: set[str] = set()
        for adapter in initial:
            self._add(adapter)

    @property
    def max_per_batch(self) -> int | None:
        return self.spec.max_loras_per_batch if self.spec is not None else None

    def names(self) -> list[str]:
        return [n for n in self.adapters if n not in self.unloading]

    def lookup(self, name: str | None) -> AdapterConfig | None:
        """The adapter a request names (None: the base model); ValueError when none is
        served by that name."""
        if name is None:
            return None
        if name not in self.adapters or name in self.unloading:
            served = ", ".join(self.names()) or "none"
            raise ValueError(f"lora_path: unknown LoRA adapter {name!r} (served: {served})")
        return self.adapters[name]

    def load(self, name: str, path: str | Path) -> AdapterConfig:
        """Read, check and hand an adapter to the worker; ValueError with the reason."""
        if self.spec is None:
            raise ValueError("LoRA is off: start the server with --enable-lora or --lora-paths")
        return self._add(read_adapter(name, Path(path).expanduser()))

    def _add(self, adapter: AdapterConfig) -> AdapterConfig:
        if adapter.name in self.adapters:
            raise ValueError(f"lora_name: an adapter named {adapter.name!r} is already loaded")
        self.spec.check(adapter)
        self.executor.load_lora(adapter)
        self.adapters[adapter.name] = adapter
        return adapter

    def unload(self, name: str, reqs: Sequence[Req]) -> int:
        """Unload `name` if no request in `reqs` uses it; else stop it taking new requests.
        Returns how many requests still use it (0: unloaded)."""
        if name not in self.adapters:
            raise ValueError(f"lora_name: no adapter named {name!r} is loaded")
        self.unloading.add(name)
        users = sum(1 for r in reqs if r.lora == name)
        if users == 0:
            self.executor.unload_lora(name)
            del self.adapters[name]
            self.unloading.discard(name)
        return users
