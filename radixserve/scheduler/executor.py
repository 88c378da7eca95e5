"""The scheduler's one view of the model: what it asks of the model runner (or of the test
suite's fake one), so the scheduler runs and is tested without a model."""

from __future__ import annotations

from typing import Any, Protocol

from ..lora import AdapterConfig
from ..mem.kv_pool import KVPool
from ..messages import ForwardBatch, ForwardResult
from ..worker_info import WorkerInfo


class Executor(Protocol):
    """What the scheduler needs from the model worker(s); `pool` (the device KV) only with the
    hierarchical cache, which copies blocks in and out of it between steps."""

    info: WorkerInfo
    pool: KVPool
    # a hybrid model's per-request states (`models.recurrent_states.RecurrentStates`), which
    # the scheduler reads and writes by row or slot (PD, the tiers, speculation); None else
    states: Any

    def forward(self, batch: ForwardBatch) -> ForwardResult: ...

    def copy_state(self, src: int, dst: int) -> None: ...

    def vision_figures(self) -> dict: ...

    def update_weights(self, model_path: str) -> None: ...

    def release_memory(self, tags: frozenset[str]) -> None: ...

    def resume_memory(self, tags: frozenset[str]) -> None: ...

    def load_lora(self, adapter: AdapterConfig) -> None: ...

    def unload_lora(self, name: str) -> None: ...
