"""Per-layer K and V storage, indexed by slot. Owned by the model worker.

An FP8 pool (`--kv-cache-dtype fp8_e4m3`) holds float8_e4m3fn bits in uint8 tensors (so that the
tiers copy them as bytes): a key is stored as k / k_scale and read back as stored * k_scale, with
one scale per layer for keys and one for values."""

from __future__ import annotations

import torch

from .huge_pages import anonymous_zeros, populate_in_background, release_pages


class KVPool:
    """K/V tensors `[num_slots, kv_heads, key_width]` and `[num_slots, kv_heads, value_width]`
    per layer, each layer's shape its own (`shapes`: (kv_heads, key width, value width) per
    layer; value width 0: a latent pool, whose values are read from the keys).

    Zero-initialised so that padded gathers (slot 0) and stale table entries
    only ever read finite values, which masking then removes exactly. On CPU its pages are
    faulted in by a background thread (`populate_in_background`), not by the first requests.
    """

    FP8 = torch.uint8  # the storage dtype of an FP8 pool

    def __init__(
        self,
        num_slots: int,
        shapes: list[tuple[int, int, int]],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.device = device = torch.device(device)
        self.dtype = dtype  # storage dtype (uint8 for FP8)
        self.k = [_zeros((num_slots, heads, width), dtype, device) for heads, width, _ in shapes]
        self.v = [_zeros((num_slots, heads, width), dtype, device) for heads, _, width in shapes]
        self.is_fp8 = dtype == self.FP8
        if device.type == "cpu" and num_slots > 0:
            populate_in_background(self.k + self.v)
        self.k_scale = [1.0] * len(shapes)
        self.v_scale = [1.0] * len(shapes)

    @property
    def key_widths(self) -> set[int]:
        """The layers' key widths (more than one: layers of different head dims)."""
        return {k.shape[-1] for k in self.k}

    def set_scales(self, scales: list[tuple[float, float]]) -> None:
        """Per-layer (k_scale, v_scale) of an FP8 pool."""
        self.k_scale = [k for k, _ in scales]
        self.v_scale = [v for _, v in scales]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.is_fp8:
            k, v = to_fp8(k, self.k_scale[layer]), to_fp8(v, self.v_scale[layer])
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Rows gathered from this pool's tensors in the compute dtype."""
        if not self.is_fp8:
            return rows
        return (rows.view(torch.float8_e4m3fn).to(torch.float32) * scale).to(dtype)

    def release_pages(self) -> None:
        """Give the pool's memory back to the system (CPU only): its addresses stay, reading as
        zeros."""
        if self.device.type != "cpu":
            raise ValueError("releasing the KV cache is implemented on CPU only")
        for tensor in self.k + self.v:
            release_pages(tensor)

    @staticmethod
    def bytes_per_token(shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> int:
        """Bytes one token takes in a pool of these layer `shapes`."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(heads * (key + value) for heads, key, value in shapes) * size


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool tensors' dtype for `--kv-cache-dtype`."""
    return KVPool.FP8 if kv_cache_dtype == "fp8_e4m3" else model_dtype


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as float8_e4m3fn bits (saturated at +-448, the largest finite value)."""
    scaled = (x.float() / scale).clamp(-448.0, 448.0)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU from an anonymous mapping in huge pages (`huge_pages.anonymous_zeros`)."""
    if device.type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    return anonymous_zeros(shape, dtype)
