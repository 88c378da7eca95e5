"""radixserve's kernels: Triton kernels for paged attention on GPUs, each beside its
pure-torch reference, and the C++ CPU kernels (`cpu_ops`).

Importing the package imports no Triton: the Triton kernels load on first use
(`radixserve_kernels.decode_attention`, ...), so a CPU install without triton loads the CPU
kernels. On a machine without a GPU the Triton kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, set before the first use), which the tests use to check them against
the references.
"""

from __future__ import annotations

import importlib
import sys

# each public Triton-side name and the module that defines it
_TRITON_NAMES = {
    "choose_splits": "decode_attention",
    "decode_attention": "decode_attention",
    "decode_attention_ref": "decode_attention",
    "extend_attention": "extend_attention",
    "extend_attention_ref": "extend_attention",
    "build_kv_indices": "kv_indices",
    "build_kv_indices_ref": "kv_indices",
    "store_kv": "store_kv",
    "store_kv_ref": "store_kv",
    "lora_sgmv": "lora_sgmv",
    "lora_sgmv_ref": "lora_sgmv",
    "fused_moe": "fused_moe",
    "fused_moe_ref": "fused_moe",
    "align_pairs": "fused_moe",
    "fp8_linear": "fp8_linear",
    "fp8_linear_ref": "fp8_linear",
    "sparse_latent_attention": "sparse_mla",
    "sparse_latent_attention_ref": "sparse_mla",
}

__all__ = sorted(_TRITON_NAMES)


def __getattr__(name: str):
    module = _TRITON_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'radixserve_kernels' has no attribute {name!r}")
    importlib.import_module(f".{module}", __name__)
    # importing a submodule binds its name on the package (decode_attention, store_kv, ...):
    # rebind the names of every loaded submodule, so a function is never shadowed by its module
    for public, home in _TRITON_NAMES.items():
        if (loaded := sys.modules.get(f"{__name__}.{home}")) is not None:
            globals()[public] = getattr(loaded, public)
    return globals()[name]
