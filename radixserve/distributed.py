"""Tensor parallelism over torch.distributed: gloo on CPU, NCCL on GPU.

Megatron-style sharding of the Llama block: the fused QKV and gate-up projections are split
by output (each rank owns whole attention heads and a slice of the MLP), o_proj and
down_proj by input, and their partial outputs are summed with one all-reduce each.
Embedding, norms and LM head are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import torch

from .model_config import ModelConfig


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (nothing to do on one rank)."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` any rank holds (ranks must agree on pool sizes)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=_collective_device())
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
        return int(tensor.item())

    def send_step(self, packed: torch.Tensor) -> None:
        """Rank 0: broadcast one step's packed model inputs (its size first), or any flat
        tensor a step adds to them."""
        size = torch.tensor([packed.numel()], dtype=torch.long, device=packed.device)
        torch.distributed.broadcast(size, src=0)
        torch.distributed.broadcast(packed, src=0)

    def receive_step(self, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Ranks > 0: wait for rank 0's next step (or what the step adds, in `dtype`)."""
        size = torch.empty(1, dtype=torch.long, device=device)
        torch.distributed.broadcast(size, src=0)
        packed = torch.empty(int(size.item()), dtype=dtype, device=device)
        torch.distributed.broadcast(packed, src=0)
        return packed

    def shard_config(self, cfg: ModelConfig) -> ModelConfig:
        """This rank's slice of the model: its heads and its part of the MLP (a latent KV is
        shared by all heads: every rank keeps it whole)."""
        sharded = ("num_heads", "intermediate_size") + (() if cfg.latent_kv else ("num_kv_heads",))
        for name in sharded:
            if getattr(cfg, name) % self.size:
                raise ValueError(
                    f"tp_size {self.size} does not divide the model's {name} ({getattr(cfg, name)})"
                )
        dims = cfg.kv_layer_dims
        if dims is not None:
            if any(heads % self.size for heads, _ in dims):
                raise ValueError(f"tp_size {self.size} does not divide every layer's KV heads")
            dims = tuple((heads // self.size, dim) for heads, dim in dims)
        return replace(
            cfg,
            num_heads=cfg.num_heads // self.size,
            num_kv_heads=cfg.num_kv_heads if cfg.latent_kv else cfg.num_kv_heads // self.size,
            intermediate_size=cfg.intermediate_size // self.size,
            kv_layer_dims=dims,
        )

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal slice of a checkpoint tensor along `dim`."""
        if self.size == 1:
            return tensor
        return tensor.chunk(self.size, dim=dim)[self.rank]


def _collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.distributed.get_backend() == "nccl"
        else torch.device("cpu")
    )


IDLE_TIMEOUT = timedelta(days=365)  # ranks > 0 wait in a broadcast for as long as the server idles


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the group of `size` model workers at `init_method` (a no-op for one rank)."""
    if size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=IDLE_TIMEOUT
    )
    return TPGroup(rank, size)
