"""What a model worker tells the scheduler and the API about itself once it has started: its
pool, its dtype, its backend, a hybrid model's state pool, window layers' own KV pool."""

from __future__ import annotations

from dataclasses import dataclass

from .memory_plan import MemoryPlan, human_bytes


@dataclass(frozen=True)
class StatePoolInfo:
    """A hybrid model's per-request states: one slot per request row, then `snapshots` slots
    for snapshots in the radix tree, each `state_bytes`, worth `covered_tokens` tokens of KV;
    prompt chunks end, and a snapshot is kept while a slot is free, every `interval` tokens
    (0: not at intervals). `layer_tokens`: the tokens whose KV in one attention layer takes as
    much memory as one stateful layer's state (vLLM's block size for such a model)."""

    rows: int
    snapshots: int
    state_bytes: int
    covered_tokens: int
    interval: int
    layer_tokens: int = 0

    def summary(self) -> str:
        every = f", kept every {self.interval} tokens" if self.interval else ""
        worth = f"a state is worth {self.covered_tokens} tokens of KV"
        worth = worth if self.covered_tokens else "the model keeps no KV"
        return (
            f"state pool {self.rows} + {self.snapshots} snapshots x "
            f"{human_bytes(self.state_bytes)} = "
            f"{human_bytes((self.rows + self.snapshots) * self.state_bytes)} ({worth}{every})"
        )


@dataclass(frozen=True)
class WindowKVInfo:
    """Sliding-window layers' KV in a pool of its own, freed once past the `window`
    (`mem/window_kv.py`): `slots` of it (slot 0 pads), `bytes_per_token` there."""

    window: int
    slots: int
    layers: int
    bytes_per_token: int

    def summary(self) -> str:
        return (
            f"window KV of {self.layers} layers apart: {self.slots - 1} tokens "
            f"({human_bytes((self.slots - 1) * self.bytes_per_token)}), freed past "
            f"{self.window} tokens"
        )


@dataclass
class WorkerInfo:
    """What the scheduler needs to know about the worker's memory and model."""

    num_pages: int
    page_size: int
    max_context_len: int
    max_running_requests: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    attention_backend: str
    bytes_per_token: int
    weights_bytes: int
    kv_cache_dtype: str
    dtype_reason: str = ""  # why --dtype resolved to `dtype`
    prefix_reuse: bool = True  # False: a hybrid model without state snapshots
    state_pool: StatePoolInfo | None = None  # a hybrid model's states and their snapshots
    window_kv: WindowKVInfo | None = None  # window layers' KV kept apart and freed
    mrope_merge_size: int | None = None  # M-RoPE models: patches a side per image token
    whole_images: bool = False  # an image's tokens attend both ways: steps compute it whole

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def memory_plan(self) -> MemoryPlan:
        return MemoryPlan(
            self.weights_bytes,
            self.bytes_per_token,
            self.num_slots,
            self.max_context_len,
            self.kv_cache_dtype,
        )

    def capacity_line(self) -> str:
        """The start-up log line: the weights, the pool, and how many full-context requests
        fit."""
        return (
            f"memory plan: {self.memory_plan().summary()}; {self.dtype} on {self.device} "
            f"({self.dtype_reason}), "
            f"attention backend {self.attention_backend}"
            + ("" if self.prefix_reuse else "; prefix reuse off (recurrent layers)")
            + (f"; {self.state_pool.summary()}" if self.state_pool else "")
            + (f"; {self.window_kv.summary()}" if self.window_kv else "")
        )
