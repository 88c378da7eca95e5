"""How much memory the weights and the KV pool take, and what context x concurrency fits.

The server sizes its pool with `kv_tokens` from the bytes it measured (free device memory after
the weights on GPU, physical memory less the weights on CPU); `radixserve plan` calls the same
function with the weights' bytes counted from the config alone (`planned_weight_bytes`: the model
built on the meta device, each linear layer at its format's bytes), so the two agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# a CPU pool larger than this only costs memory (bench/results/cpu.md)
DEFAULT_CPU_MAX_TOKENS = 65536
GIB = 2**30
# a model without attention keeps a state snapshot every this many tokens by default (SGLang's
# --mamba-track-interval default)
STATE_ONLY_INTERVAL = 256


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's weights and KV pool."""

    weights_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    max_context_len: int
    kv_cache_dtype: str

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def full_context_requests(self) -> int:
        return self.kv_tokens // self.max_context_len

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "kv_bytes": self.kv_bytes,
            "full_context_requests": self.full_context_requests,
        }

    def summary(self) -> str:
        return (
            f"weights {human_bytes(self.weights_bytes)}; KV {self.kv_bytes_per_token} B a token "
            f"({self.kv_cache_dtype}), {self.kv_tokens} tokens ({human_bytes(self.kv_bytes)}); "
            f"fits {self.full_context_requests} requests of the full {self.max_context_len}-token "
            "context"
        )


def kv_pages(
    available_bytes: int,
    per_token: int,
    mem_fraction: float,
    max_total_tokens: int | None,
    device_type: str,
    page_size: int,
    reserved_bytes: int = 0,
) -> int:
    """The pool's pages: `--max-total-tokens`, else `--mem-fraction` of the bytes available
    beside the weights, less `reserved_bytes` for a pool beside it (capped on CPU at
    DEFAULT_CPU_MAX_TOKENS tokens, and that many for a model that keeps no KV)."""
    tokens = max_total_tokens
    if tokens is None and per_token == 0:  # a model without attention: slots hold no KV
        tokens = DEFAULT_CPU_MAX_TOKENS
    if tokens is None:
        budget = int(max(available_bytes, 0) * mem_fraction) - reserved_bytes
        tokens = max(budget, 0) // per_token
        tokens = min(tokens, DEFAULT_CPU_MAX_TOKENS) if device_type == "cpu" else tokens
    return max(tokens // page_size, 1)


def covered_tokens(state_bytes: int, kv_bytes_per_token: int, multiple: int = 16) -> int:
    """The tokens whose KV takes as much memory as one request's state (a hybrid model),
    rounded up to `multiple`: vLLM's block size in its `align` mode, and the interval of
    radixserve's state snapshots by default; 0 for a model that keeps no KV."""
    if kv_bytes_per_token == 0:
        return 0
    tokens = -(-state_bytes // max(kv_bytes_per_token, 1))
    return -(-tokens // multiple) * multiple


def context_problem(plan: MemoryPlan, asked: int | None) -> str | None:
    """Why an explicit `--context-length` cannot fit one request in the pool (None: it fits)."""
    if asked is None or asked <= plan.kv_tokens:
        return None
    need = asked * plan.kv_bytes_per_token
    return (
        f"--context-length {asked}: one request of that length needs {asked} tokens x "
        f"{plan.kv_bytes_per_token} B = {human_bytes(need)} of KV, and the pool holds "
        f"{plan.kv_tokens} tokens ({human_bytes(plan.kv_bytes)}); lower --context-length, or "
        "raise --mem-fraction or --max-total-tokens (--kv-cache-dtype fp8_e4m3 halves a token)"
    )


def parse_bytes(text: str) -> int:
    """`80GiB`, `512MiB`, `24GB`, `1e9` -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    units |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    lowered = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if lowered.endswith(unit):
            return int(float(lowered.removesuffix(unit)) * units[unit])
    return int(float(lowered))
