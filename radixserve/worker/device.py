"""Which device and dtype a worker runs: `--dtype auto` resolved for the device and the CPU's
instruction set, with the reason the start-up line gives."""

from __future__ import annotations

import torch

# CPU flags (/proc/cpuinfo) of native bf16 dot products, best first: AMX tiles, AVX-512 pairs
CPU_BF16_FLAGS = {"amx_bf16": "AMX-BF16 tiles", "avx512_bf16": "AVX512-BF16 dot products"}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_auto_dtype(cpuinfo: str) -> tuple[torch.dtype, str]:
    """`--dtype auto` on a CPU (its /proc/cpuinfo text), by what bench/serving.py measured
    (bench/results/serving.md): bf16 with AMX-BF16, and with AVX512-BF16 on AMD (Zen 4: 1.6x
    float32's output throughput); float32 on an Intel CPU with AVX512-BF16 but no AMX, whose
    bf16 dot product issues at a quarter of the float32 FMA's rate (half its products: bf16
    prefill is slower there), and on CPUs without native bf16."""
    flags = set(cpuinfo.split())
    flag = next((flag for flag in CPU_BF16_FLAGS if flag in flags), None)
    if flag is None:
        return torch.float32, "auto: the CPU has no native bf16 dot products"
    if flag == "avx512_bf16" and "GenuineIntel" in flags:
        return torch.float32, "auto: AVX512-BF16 without AMX on Intel is slower than float32"
    return torch.bfloat16, f"auto: the CPU has {CPU_BF16_FLAGS[flag]}"


def resolve_dtype(
    name: str, device: torch.device, checkpoint: str | None = None
) -> tuple[torch.dtype, str]:
    """The dtype for `--dtype name` and why. `auto`: on GPU the checkpoint's half-precision
    dtype (bf16 for a float32 one); on a CPU, `cpu_auto_dtype`."""
    if name != "auto":
        return getattr(torch, name), "--dtype"
    if device.type == "cuda":
        half = torch.float16 if checkpoint == "float16" else torch.bfloat16
        return half, "auto: half precision on GPU"
    return cpu_auto_dtype(read_cpuinfo())
