"""radixserve's CPU kernels, built on first use: paged decode and extend attention
(`cpu_attention.cpp`), fused RMSNorm, SwiGLU activation and rotary embedding
(`cpu_fused_ops.cpp`), the float32 and bf16 GEMM against packed weights (AMX tiles where the
CPU has AMX-BF16; `cpu_linear.cpp`) and the
decoder layers' loop over them in one call (`cpu_decoder.cpp`), the FP8 weight GEMM
(`cpu_quant.cpp`), hybrid models' recurrent decode steps in place on the requests' states
(`cpu_recurrent.cpp`), and sparse latent attention over each query's selected rows (DSA,
`cpu_sparse_attention.cpp`).

torch's cpp_extension compiles it with the machine's C++ compiler (-O3 -march=native, then
the flags in RADIXSERVE_KERNEL_CFLAGS, e.g. `-mno-amx-tile -mno-amx-bf16` to build for a CPU
without AMX) into radixserve's cache folder (~45 s once per machine, done by
scripts/setup.sh; later starts load the cached library, and a changed source or flag
rebuilds). Where no compiler or ninja is found,
`load()` returns None and callers keep their pure-torch path (bench/results/cpu.md has the
kernels' figures against it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)
SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_attention.cpp",
        "cpu_fused_ops.cpp",
        "cpu_linear.cpp",
        "cpu_decoder.cpp",
        "cpu_quant.cpp",
        "cpu_recurrent.cpp",
        "cpu_sparse_attention.cpp",
        "cpu_module.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_simd.h",
        "cpu_parallel.h",
        "cpu_layer_ops.h",
        "cpu_bindings.h",
        "cpu_quant.h",
        "cpu_amx.h",
    )
]


def cpu_flags() -> bytes:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    return next((line for line in text.splitlines() if line.startswith("flags")), "").encode()


def headers_flag() -> str:
    """A define that carries the headers' hash and the CPU's flags: torch rebuilds when a
    source or a build flag changes, but it does not look into included headers, and
    `-march=native` reads the same on a machine whose CPU lacks what the cached build uses
    (AMX, AVX-512)."""
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in HEADERS) + cpu_flags()).hexdigest()[:16]
    return f"-DRADIXSERVE_HEADERS={digest}"


@contextlib.contextmanager
def exclusive_build(build: Path):
    """Holds an flock on `build/build.lock` for one build-or-load. torch's own guard is a `lock`
    file that a process killed mid-build leaves behind, and every later start then waits on it
    forever; the kernel frees an flock when its holder dies, so under ours any `lock` is stale."""
    with open(build / "build.lock", "w") as handle:  # closing it releases the flock
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


def build_dir() -> Path:
    """Where the kernels are built and cached: `cpu_kernels` in radixserve's cache folder."""
    return (
        Path(os.environ.get("RADIXSERVE_CACHE_DIR", Path.home() / ".cache" / "radixserve"))
        / "cpu_kernels"
    )


@lru_cache(maxsize=1)
def load():
    """The compiled module (`paged_decode_attention`, `paged_extend_attention`, `rms_norm`,
    `silu_and_mul`, `rotary_`,
    `pack_linear_weight`, `packed_linear`, `CpuDecoder`, ...), or None if it cannot be built."""
    from torch.utils import cpp_extension

    os.environ["PATH"] = (
        f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # venv's ninja
    )
    build = build_dir()
    build.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_build(build):
            return cpp_extension.load(
                name="radixserve_cpu_ops",
                sources=[str(p) for p in SOURCES],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp", headers_flag()]
                + os.environ.get("RADIXSERVE_KERNEL_CFLAGS", "").split(),
                build_directory=str(build),
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja, a failed build
        log.warning("CPU kernels unavailable (%s); using the pure-torch path", exc)
        return None
