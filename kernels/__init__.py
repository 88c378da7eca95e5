"""Triton kernels for paged attention, each beside its pure-torch reference.

Importable as `radixserve_kernels`. On a machine without a GPU the kernels run under
Triton's interpreter (`TRITON_INTERPRET=1`, set before the first import), which the
tests use to check them against the references.
"""

from .decode_attention import choose_splits, decode_attention, decode_attention_ref
from .extend_attention import extend_attention, extend_attention_ref
from .kv_indices import build_kv_indices, build_kv_indices_ref
from .store_kv import store_kv, store_kv_ref

__all__ = [
    "choose_splits",
    "store_kv",
    "store_kv_ref",
    "build_kv_indices",
    "build_kv_indices_ref",
    "decode_attention",
    "decode_attention_ref",
    "extend_attention",
    "extend_attention_ref",
]
