"""torch.compile of the whole forward (`--enable-torch-compile`), for CPU serving.

Every mode (decode, extend, mixed) goes through one compiled graph with a dynamic token
count. Attention stays one opaque op per layer (`radixserve::attention`), so dynamo never
traces the backend's planning, gathers or masks, while inductor fuses what lies between:
norms, rotary, the SwiGLU activation and the residual adds (vLLM compiles the same way).

Dynamic shapes have two catches: a size of 1 is always specialized, and a size that equals
a fixed model dimension (3 KV heads in SmolLM2) may get tied to it. So start-up runs steps of
7, 5 and 1 tokens: if 7 is tied, 5 compiles a general graph, and 1 gets its own; serving then
never stops for a recompile (tests/test_torch_compile.py checks this from a cold cache).
Compiled artifacts are cached on disk by inductor (`TORCHINDUCTOR_CACHE_DIR`), so a second
start only re-traces.
"""

from __future__ import annotations

import logging
import time

import torch

from ..attention import PLAIN, AttentionBackend, AttentionInputs, LayerAttention

log = logging.getLogger(__name__)

WARM_UP_TOKENS = (7, 5, 1)

# The custom op reaches its backend through this table: an op's arguments can only be
# tensors and plain values. A backend is registered once, when its runner compiles.
_BACKENDS: dict[int, AttentionBackend] = {}


@torch.library.custom_op("radixserve::attention", mutates_args=())
def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, backend: int
) -> torch.Tensor:
    return _BACKENDS[backend].forward(layer, q, k, v)


@_attention.register_fake
def _attention_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, backend: int
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class OpaqueAttention:
    """A backend seen through the custom op: what the compiled model calls per layer."""

    def __init__(self, backend: AttentionBackend):
        self.key = id(backend)
        _BACKENDS[self.key] = backend

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        how: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        return _attention(q, k, v, layer, self.key)


class CompiledForward:
    """`model(input_ids, positions, backend)` through torch.compile, warmed up at start-up."""

    def __init__(self, model, backend: AttentionBackend, req_to_token: torch.Tensor):
        if model.attention_features():
            raise ValueError(
                "--enable-torch-compile runs plain attention only; this model's layers need "
                f"{', '.join(sorted(model.attention_features()))}"
            )
        self.opaque = OpaqueAttention(backend)
        self.compiled = torch.compile(model.forward, dynamic=True)
        start = time.perf_counter()
        for tokens in WARM_UP_TOKENS:
            self._warm_up(backend, req_to_token, tokens)
        log.info("compiled the forward pass in %.1f s", time.perf_counter() - start)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        return self.compiled(input_ids, positions, self.opaque)

    @torch.inference_mode()
    def _warm_up(self, backend: AttentionBackend, req_to_token: torch.Tensor, tokens: int) -> None:
        """A decode step of `tokens` requests over 13 tokens of the reserved slot 0 (page 0 is
        never allocated); the graph depends only on the token count, not on the mode."""

        def fresh(
            value: int = 0,
        ) -> torch.Tensor:  # a new tensor each time: dynamo guards on aliasing
            return torch.full((tokens,), value, dtype=torch.long, device=req_to_token.device)

        backend.plan(
            AttentionInputs(
                is_decode=True,
                out_cache_loc=fresh(),
                rows=fresh(),
                seq_lens=fresh(13),
                extend_lens=fresh(1),
                req_to_token=req_to_token,
                max_seq_len=13,
                max_extend_len=1,
            )
        )
        self(fresh(), fresh(12), backend)
