"""torch.compile of the decode step (`--enable-torch-compile`), for CPU serving.

Dynamic shapes let one compiled graph serve every batch size and context length, with two
catches: a size of 1 is always specialized, and a size that equals a fixed model dimension
(3 KV heads in SmolLM2) gets tied to it. So start-up runs decode steps of 7, 5 and 1
requests: if 7 is tied, 5 recompiles a general graph, and 1 gets its own; serving then never
stops for a recompile (tests/test_torch_compile.py checks this from a cold compile cache).
Measured (interleaved A/B, bench/decode_step.py shapes): 1.20-1.22x per decode step in bf16
and 1.28-1.38x in fp32 at batch 1/8/32.
"""
from __future__ import annotations

import logging
import time

import torch

from ..attention import AttentionBackend, AttentionInputs

log = logging.getLogger(__name__)


def compile_decode(model, backend: AttentionBackend, req_to_token: torch.Tensor):
    """The compiled `model.forward`, warmed up for every batch shape serving will see."""
    compiled = torch.compile(model.forward, dynamic=True)
    start = time.perf_counter()
    for bs, seq_len in ((7, 13), (5, 11), (1, 13)):
        warm_up(compiled, backend, req_to_token, bs, seq_len)
    log.info("compiled the decode step in %.1f s", time.perf_counter() - start)
    return compiled


@torch.inference_mode()
def warm_up(compiled, backend: AttentionBackend, req_to_token: torch.Tensor, bs: int, seq_len: int) -> None:
    """A decode step of `bs` requests over `seq_len` tokens of the reserved slot 0 (page 0 is
    never allocated)."""
    def fresh(value: int = 0) -> torch.Tensor:  # a new tensor each time: dynamo guards on aliasing
        return torch.full((bs,), value, dtype=torch.long, device=req_to_token.device)

    backend.plan(AttentionInputs(is_decode=True, out_cache_loc=fresh(), rows=fresh(), seq_lens=fresh(seq_len),
                                 extend_lens=fresh(1), req_to_token=req_to_token, max_seq_len=seq_len,
                                 max_extend_len=1))
    compiled(fresh(), fresh(seq_len - 1), backend)
