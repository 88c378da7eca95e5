"""One Llama-family decoder for Llama, Qwen2 (qkv bias) and Mistral, built from shared layers."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary, fused
from ..model_config import ModelConfig

# checkpoint name fragment -> (our fused parameter, shard index)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# tensor parallelism: checkpoint weights split by output rows or by input columns
_SPLIT_BY_OUTPUT = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_SPLIT_BY_INPUT = {"o_proj", "down_proj"}


class Attention(nn.Module):
    """`cfg` is this rank's shard of the model (its heads); o_proj's partial sums are
    all-reduced."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup):
        super().__init__()
        self.layer = layer
        self.cfg = cfg
        self.tp = tp
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.cpu_ops = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin, self.cpu_ops)
        k = apply_rotary(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin, self.cpu_ops)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        return self.tp.all_reduce(self.o_proj(backend.forward(self.layer, q, k, v)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, normed, cos, sin, backend, next_norm: RMSNorm):
        """`normed` is `input_layernorm(x)`; returns the residual stream after this layer and
        `next_norm` of it (each residual add is fused with the norm that follows it)."""
        x, normed = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(normed, cos, sin, backend)
        )
        return next_norm.add_and_norm(x, self.tp.all_reduce(self.mlp(normed)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.cfg = tp.shard_config(cfg)
        cfg = self.cfg
        self.model = LlamaModel(cfg, tp)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling_dict
        )
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.cpu_decoder = None  # see fuse_cpu_layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """Final-normed hidden states `[T, hidden]` of this step's tokens."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        layers = self.model.layers
        normed = layers[0].input_layernorm(x)
        groups = backend.kernel_groups() if fused(self.cpu_decoder) is not None else None
        if groups:
            return self.cpu_decoder.forward(
                x,
                normed,
                cos,
                sin,
                backend.inputs.out_cache_loc,
                backend.inputs.req_to_token,
                groups,
            )
        for i, layer in enumerate(layers):
            x, normed = layer(x, normed, cos, sin, backend, self._norm_after(i))
        return normed

    def _norm_after(self, i: int) -> RMSNorm:
        """The norm of layer i's output: the next layer's input norm, or the final norm."""
        layers = self.model.layers
        return layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm

    def fuse_cpu_layers(self, backend: AttentionBackend) -> bool:
        """Run the decoder layers through one C++ call (`CpuDecoder`,
        radixserve_kernels/cpu_decoder.cpp) in the steps whose attention the backend runs through
        its paged CPU kernels: the same kernels in the same order, without Python between them.
        Needs every linear layer packed for the CPU GEMM (float32), one rank and a backend that
        offers `kernel_groups`."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        cpu_ops = self.lm_head.cpu_ops
        if (
            cpu_ops is None
            or self.tp.size > 1
            or not hasattr(backend, "kernel_groups")
            or any(m.weight_packed is None for m in linears)
        ):
            return False
        layers = self.model.layers
        weights, out_features = [], []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias if attn.qkv_proj.bias is not None else torch.empty(0)
            weights += [
                attn.qkv_proj.weight_packed,
                bias,
                attn.o_proj.weight_packed,
                layer.post_attention_layernorm.weight,
                mlp.gate_up_proj.weight_packed,
                mlp.down_proj.weight_packed,
                self._norm_after(i).weight,
            ]
            out_features += [
                m.out_features
                for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
        cfg = self.cfg
        self.cpu_decoder = cpu_ops.CpuDecoder(
            [w.detach() for w in weights],
            out_features,
            backend.pool.k,
            backend.pool.v,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            backend.scale,
        )
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up; a tied head copies the embedding."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            module_name, _, kind = name.rpartition(".")
            tensor = self._tp_slice(module_name, kind, tensor)
            target, shard = self._fused_target(module_name)
            module = modules.get(target)
            if isinstance(module, Linear):
                module.load(kind, tensor, self._shard_offset(module, shard))
                loaded.add(f"{target}.{'weight_t' if kind == 'weight' else kind}")
            elif name in params:
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
            else:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
        if self.cfg.tie_word_embeddings:
            self.lm_head.load("weight", self.model.embed_tokens.weight)
            loaded.add("lm_head.weight_t")
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"checkpoint is missing {sorted(missing)[:5]}")

    def _tp_slice(self, module_name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        leaf = module_name.rpartition(".")[2]
        if leaf in _SPLIT_BY_OUTPUT:
            return self.tp.shard(tensor, 0)
        if leaf in _SPLIT_BY_INPUT and kind == "weight":
            return self.tp.shard(tensor, 1)
        return tensor

    @staticmethod
    def _fused_target(module_name: str) -> tuple[str, int | None]:
        prefix, _, leaf = module_name.rpartition(".")
        if leaf in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[leaf]
            return f"{prefix}.{fused}", shard
        return module_name, None

    def _shard_offset(self, module: Linear, shard: int | None) -> int:
        if not shard:
            return 0
        cfg = self.cfg
        sizes = (
            [cfg.q_size, cfg.kv_size]
            if module.weight_t.shape[1] == cfg.q_size + 2 * cfg.kv_size
            else [cfg.intermediate_size]
        )
        return sum(sizes[:shard])
