"""Per-layer K and V storage, indexed by slot. Owned by the model worker."""

from __future__ import annotations

import torch

from .huge_pages import anonymous_zeros


class KVPool:
    """K/V tensors `[num_slots, kv_heads, head_dim]` and `[num_slots, kv_heads, value_dim]` per
    layer (`value_dim` 0: a latent pool, whose values are read from the keys).

    Zero-initialised so that padded gathers (slot 0) and stale table entries
    only ever read finite values, which masking then removes exactly.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        value_dim: int | None = None,
    ):
        device = torch.device(device)
        value_shape = (num_slots, kv_heads, head_dim if value_dim is None else value_dim)
        self.k = [_zeros((num_slots, kv_heads, head_dim), dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(value_shape, dtype, device) for _ in range(num_layers)]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    @staticmethod
    def bytes_per_token(
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        value_dim: int | None = None,
    ) -> int:
        width = head_dim + (head_dim if value_dim is None else value_dim)
        return num_layers * kv_heads * width * torch.empty((), dtype=dtype).element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU from an anonymous mapping in huge pages (`huge_pages.anonymous_zeros`)."""
    if device.type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    return anonymous_zeros(shape, dtype)
