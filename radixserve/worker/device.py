"""Which device and dtype a worker runs: `--dtype auto` resolved for the device and the CPU's
instruction set, with the reason the start-up line gives."""

from __future__ import annotations

import torch

# CPU flags (/proc/cpuinfo) of native bf16 dot products, best first: AMX tiles, AVX-512 pairs
CPU_BF16_FLAGS = {"amx_bf16": "AMX-BF16 tiles", "avx512_bf16": "AVX512-BF16 dot products"}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_bf16_flag() -> str | None:
    """The CPU's best native bf16 dot product (a key of CPU_BF16_FLAGS), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return None
    return next((flag for flag in CPU_BF16_FLAGS if flag in flags), None)


def resolve_dtype(
    name: str, device: torch.device, checkpoint: str | None = None
) -> tuple[torch.dtype, str]:
    """The dtype for `--dtype name` and why. `auto`: on GPU the checkpoint's half-precision
    dtype (bf16 for a float32 one); on a CPU with native bf16 dot products (AMX-BF16 or
    AVX512-BF16) bf16, which bench/serving.py measures faster there; float32 on other CPUs,
    where bf16 runs through widened float32 arithmetic and is slower."""
    if name != "auto":
        return getattr(torch, name), "--dtype"
    if device.type == "cuda":
        half = torch.float16 if checkpoint == "float16" else torch.bfloat16
        return half, "auto: half precision on GPU"
    flag = cpu_bf16_flag()
    if flag is not None:
        return torch.bfloat16, f"auto: the CPU has {CPU_BF16_FLAGS[flag]}"
    return torch.float32, "auto: the CPU has no native bf16 dot products"
