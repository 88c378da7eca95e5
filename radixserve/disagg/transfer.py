"""KV bytes between two servers, through an existing transfer engine.

The Mooncake transfer engine (`mooncake-transfer-engine-non-cuda`) moves registered CPU memory
over TCP, with peers found by a handshake on their RPC ports (`P2PHANDSHAKE`: no metadata
server); on GPU machines the same calls run over RDMA or NVLink. NIXL (UCX) would be a second
`TransferEngine` here, chosen by `--disaggregation-transfer-backend`.

A prompt's KV moves as one write: the prefill server gathers the rows the decode server lacks
into one buffer, writes it into a landing buffer the decode server registered for that
request, and the decode server copies it into its pool. Over TCP the engine costs ~40 us per
write entry and rejects batches past ~2,000 of them, while a token's slots are scattered over
the pool (page size 1): a write per slot run would cost more than the prompt (bench/results/pd.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

INSTALL_HINT = (
    "disaggregation needs the Mooncake transfer engine: pip install "
    "mooncake-transfer-engine-non-cuda (and Debian's libibverbs1)"
)


@dataclass(frozen=True)
class PoolShape:
    """What must match between the two servers' KV pools: the layers, and the bytes of one
    slot (one token's K, or V, in one layer)."""

    layers: int
    slot_bytes: int

    @classmethod
    def of(cls, k: list[torch.Tensor]) -> PoolShape:
        """(A model without attention keeps no KV: 0 layers.)"""
        return cls(len(k), k[0].stride(0) * k[0].element_size() if k else 0)

    def problem_with(self, other: PoolShape) -> str | None:
        """Why KV cannot move between this pool and `other` (None: it can)."""
        if self != other:
            return (
                f"the servers' KV pools differ: {self.layers} layers of {self.slot_bytes} bytes "
                f"a slot here, {other.layers} of {other.slot_bytes} there (the same model, "
                "dtype and KV dtype are needed)"
            )
        return None

    def bytes_for(self, tokens: int) -> int:
        return self.layers * 2 * tokens * self.slot_bytes


def _slot_bytes(t: torch.Tensor) -> torch.Tensor:
    """A pool tensor as raw rows, one per slot."""
    return t.view(torch.uint8).view(t.shape[0], -1)


def gather_kv(k: list[torch.Tensor], v: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    """The K and V rows of `slots`, every layer, in one buffer [layers, 2, tokens, slot bytes]:
    what moves in one transfer (a write per slot costs the engine ~40 us on TCP)."""
    index = torch.tensor(slots, dtype=torch.long)
    rows = [_slot_bytes(t).index_select(0, index) for pair in zip(k, v) for t in pair]
    return torch.stack(rows).view(len(k), 2, len(slots), -1)


def scatter_kv(
    k: list[torch.Tensor], v: list[torch.Tensor], slots: list[int], landed: torch.Tensor
) -> None:
    """Put a `gather_kv` buffer into `slots` of this pool."""
    index = torch.tensor(slots, dtype=torch.long)
    rows = landed.view(len(k), 2, len(slots), -1)
    for layer, (kt, vt) in enumerate(zip(k, v)):
        _slot_bytes(kt).index_copy_(0, index, rows[layer, 0])
        _slot_bytes(vt).index_copy_(0, index, rows[layer, 1])


@dataclass(frozen=True)
class RowStates:
    """A hybrid model's per-request states (`models.recurrent.RecurrentStates`), which move
    with the KV: `size` bytes a request, written after its KV rows in the same buffer."""

    states: Any
    size: int


class TransferEngine(Protocol):
    session: str  # how peers name this engine ("host:port")

    def register(self, t: torch.Tensor) -> None: ...

    def unregister(self, t: torch.Tensor) -> None: ...

    def write(self, peer: str, source: torch.Tensor, target: int) -> None: ...


class MooncakeEngine:
    """One Mooncake transfer engine on `host`, over TCP (writes are synchronous)."""

    def __init__(self, host: str):
        try:
            from mooncake.engine import TransferEngine as Mooncake
        except ImportError as exc:
            raise ValueError(f"{INSTALL_HINT} ({exc})") from None
        self.engine = Mooncake()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise ValueError(f"the Mooncake transfer engine could not start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, t: torch.Tensor) -> None:
        if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
            raise OSError("the Mooncake transfer engine could not register a KV buffer")

    def unregister(self, t: torch.Tensor) -> None:
        self.engine.unregister_memory(t.data_ptr())

    def write(self, peer: str, source: torch.Tensor, target: int) -> None:
        size = source.numel() * source.element_size()
        if self.engine.transfer_sync_write(peer, source.data_ptr(), target, size) != 0:
            raise OSError(f"the Mooncake transfer to {peer} failed")


def make_engine(backend: str, host: str) -> TransferEngine:
    """The transfer engine `backend` names."""
    if backend != "mooncake":
        raise ValueError(f"disaggregation_transfer_backend {backend!r} is not supported")
    return MooncakeEngine(host)
