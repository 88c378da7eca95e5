"""KV bytes between two servers' pools, through an existing transfer engine.

The Mooncake transfer engine (`mooncake-transfer-engine-non-cuda`) moves registered CPU memory
over TCP, with peers found by a handshake on their RPC ports (`P2PHANDSHAKE`: no metadata
server); on GPU machines the same calls run over RDMA or NVLink. NIXL (UCX) would be a second
`TransferEngine` here, chosen by `--disaggregation-transfer-backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

INSTALL_HINT = (
    "disaggregation needs the Mooncake transfer engine: pip install "
    "mooncake-transfer-engine-non-cuda (and Debian's libibverbs1)"
)


@dataclass(frozen=True)
class PoolLayout:
    """Where a pool's KV lies: each layer's K and V base address, and the bytes of one slot
    (one token's K, or V, in one layer)."""

    k_addrs: tuple[int, ...]
    v_addrs: tuple[int, ...]
    slot_bytes: int

    @classmethod
    def of(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> PoolLayout:
        slot_bytes = k[0].stride(0) * k[0].element_size()
        return cls(tuple(t.data_ptr() for t in k), tuple(t.data_ptr() for t in v), slot_bytes)

    def problem_with(self, other: PoolLayout) -> str | None:
        """Why KV cannot move from this pool to `other` (None: it can)."""
        if len(self.k_addrs) != len(other.k_addrs) or self.slot_bytes != other.slot_bytes:
            return (
                f"the servers' KV pools differ: {len(self.k_addrs)} layers of "
                f"{self.slot_bytes} bytes a slot here, {len(other.k_addrs)} of "
                f"{other.slot_bytes} there (the same model, dtype and KV dtype are needed)"
            )
        return None


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(source slot, destination slot, count) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def write_list(
    src: PoolLayout, dst: PoolLayout, src_slots: list[int], dst_slots: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """The (source addresses, destination addresses, lengths) that copy the K and V of
    `src_slots` into `dst_slots`, every layer."""
    runs = slot_runs(src_slots, dst_slots)
    size = src.slot_bytes
    sources, targets, lengths = [], [], []
    for src_bases, dst_bases in ((src.k_addrs, dst.k_addrs), (src.v_addrs, dst.v_addrs)):
        for src_base, dst_base in zip(src_bases, dst_bases):
            for s, d, count in runs:
                sources.append(src_base + s * size)
                targets.append(dst_base + d * size)
                lengths.append(count * size)
    return sources, targets, lengths


class TransferEngine(Protocol):
    session: str  # how peers name this engine ("host:port")

    def register(self, tensors: list[torch.Tensor]) -> None: ...

    def write(
        self, peer: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> None: ...


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

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
                raise ValueError("the Mooncake transfer engine could not register the KV pool")

    def write(self, peer: str, sources: list[int], targets: list[int], lengths: list[int]) -> None:
        if self.engine.batch_transfer_sync_write(peer, sources, targets, lengths) != 0:
            raise OSError(f"the Mooncake transfer to {peer} failed")


def make_engine(backend: str, host: str, k: list[torch.Tensor], v: list[torch.Tensor]):
    """The transfer engine `backend` names, with the KV pool registered."""
    if backend != "mooncake":
        raise ValueError(f"disaggregation_transfer_backend {backend!r} is not supported")
    engine = MooncakeEngine(host)
    engine.register([*k, *v])
    return engine
