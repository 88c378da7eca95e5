"""Gemma 4 (text): Gemma 3's layer (norms around both sublayers, tanh-GELU gates, embeddings
scaled by sqrt(hidden), q and k normed per head, sliding local layers), and what Gemma 4 adds:

- global layers with a head dim and KV heads of their own (`global_head_dim`,
  `num_global_key_value_heads`): the KV pool keeps each layer's shape;
- on global layers, keys that are also the values (`attention_k_eq_v`); values RMS-normed
  without a weight; scores unscaled (the q norm sets their size);
- a proportional rotary on global layers: the first `partial_rotary_factor` of each head's
  angles turn, over the whole head;
- the last `num_kv_shared_layers` layers read the KV the last earlier layer of their kind
  stored this step and store none of their own (with `use_double_wide_mlp`, their MLPs are
  twice as wide);
- per-layer inputs (PLE): a second embedding of each token, one slice per layer, mixed with a
  projection of the token's embedding, gated into each layer's output;
- a learnt scalar on each layer's output, and (`enable_moe_block`) routed experts beside the
  MLP, each with its own norms.

A multimodal checkpoint (`Gemma4ForConditionalGeneration`) is served with its vision tower
(`gemma4_vl`), or as its language model where it has none; audio towers are not loaded."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..attention import AttentionBackend, LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig, layer_attention_dims, rope_scaling_of
from .decoder import Attention, CausalLM, Rope
from .gemma import attend_whole_images
from .layers import Linear, RMSNorm, StepImages, SwiGLU, activation
from .moe import Experts, unstack_experts
from .recipe import UnweightedNorm
from .rotary import RotaryEmbedding, apply_rotary

SLIDING, FULL = 0, 1  # the rotary table of each kind of layer
NOT_TEXT = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)


class Gemma4Attention(Attention):
    """A layer that computes and stores its own KV; `keeps_step_kv`: it also keeps this step's
    K and V for the shared layers that read them."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, how, rope: int, k_eq_v: bool):
        super().__init__(cfg, layer, tp, how, qk_norm=RMSNorm, rope=rope)
        self.k_eq_v = k_eq_v
        if k_eq_v:
            parts = (cfg.q_size, cfg.kv_size)
            self.qkv_proj = Linear(cfg.hidden_size, sum(parts), parts=parts)
        self.v_norm = UnweightedNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.keeps_step_kv = False
        self.step_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.image_blocks: list | None = None  # gemma4_vl's, where images attend both ways

    def forward(self, x: torch.Tensor, ropes: list[Rope], backend: AttentionBackend):
        q, out = self.attend(x, ropes, backend)
        if self.image_blocks is not None:
            out = attend_whole_images(
                q, out, backend, self.layer, self.cfg, self.how, self.image_blocks
            )
        return self.tp.all_reduce(self.o_proj(out))

    def project(self, x: torch.Tensor, ropes: list[Rope]):
        cfg = self.cfg
        sizes = [cfg.q_size, cfg.kv_size] + ([] if self.k_eq_v else [cfg.kv_size])
        q, k, *v = self.qkv_proj(x).split(sizes, dim=-1)
        v = self.v_norm((v[0] if v else k).reshape(-1, cfg.num_kv_heads, cfg.head_dim))
        q, k = self.norm_qk(q, k)
        cos, sin = ropes[self.rope]
        q, k = apply_rotary(q, cos, sin, self.cpu_ops), apply_rotary(k, cos, sin, self.cpu_ops)
        if self.keeps_step_kv:
            self.step_kv = (k, v)
        return q, k, v


class Gemma4SharedAttention(nn.Module):
    """A layer with queries only: it attends over the KV `source` stored (its layer in the pool;
    storing the same rows again leaves them as they are)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, how, rope: int, source: Gemma4Attention):
        super().__init__()
        self.cfg, self.tp, self.how, self.rope, self.layer = cfg, tp, how, rope, source.layer
        self.q_proj = Linear(cfg.hidden_size, cfg.q_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.sources = [source]  # a list: the source is another layer's module, not a part
        source.keeps_step_kv = True
        self.cpu_ops = None

    def forward(self, x: torch.Tensor, ropes: list[Rope], backend: AttentionBackend):
        cfg = self.cfg
        q = self.q_norm(self.q_proj(x).view(-1, cfg.head_dim))
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        q = apply_rotary(q, *ropes[self.rope], self.cpu_ops)
        k, v = self.sources[0].step_kv
        return self.tp.all_reduce(self.o_proj(backend.forward(self.layer, q, k, v, self.how)))


class Gemma4Router(nn.Module):
    """Softmax over the experts of a projection of the unweighted-normed, scaled input; the top
    k renormalised, each then times its expert's learnt scale."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.norm = UnweightedNorm(hidden, eps)
        self.proj = Linear(hidden, num_experts)
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.top_k, self.root = top_k, hidden**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(self.norm(x) * self.scale * self.root)
        weights, experts = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, attention: nn.Module, mlp: SwiGLU, hf: dict):
        super().__init__()
        self.tp, eps, size = tp, cfg.rms_norm_eps, cfg.hidden_size
        names = ["input_layernorm", "post_attention_layernorm"]
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if hf.get("enable_moe_block"):
            names += ["post_feedforward_layernorm_1", "pre_feedforward_layernorm_2"]
            names += ["post_feedforward_layernorm_2"]
            experts = hf["num_experts"]
            self.router = Gemma4Router(size, experts, hf["top_k_experts"], eps)
            act = hf.get("hidden_activation", "gelu_pytorch_tanh")
            self.experts = Experts(experts, size, hf["moe_intermediate_size"], tp, act)
        for name in names:
            self.add_module(name, RMSNorm(size, eps))
        self.self_attn, self.mlp = attention, mlp
        ple = hf.get("hidden_size_per_layer_input") or 0
        if ple:
            self.act = activation(hf.get("hidden_activation", "gelu_pytorch_tanh"))
            self.per_layer_input_gate = Linear(size, ple)
            self.per_layer_projection = Linear(ple, size)
            self.post_per_layer_input_norm = RMSNorm(size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x, normed, ropes, backend, next_norm, per_layer_input=None):
        x = x + self.post_attention_layernorm(self.self_attn(normed, ropes, backend))
        h = self.tp.all_reduce(self.mlp(self.pre_feedforward_layernorm(x)))
        if hasattr(self, "experts"):
            weights, chosen = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, chosen)
            routed = self.tp.all_reduce(routed)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            gate = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        x = x * self.layer_scalar.to(x.dtype)
        return x, next_norm(x)


class Gemma4ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        hf = cfg.hf_config
        self.embed_scale = cfg.hidden_size**0.5
        self.final_softcap = hf.get("final_logit_softcapping")
        self.types = hf["layer_types"]
        self.first_shared = len(self.types) - (hf.get("num_kv_shared_layers") or 0)
        self.ple = hf.get("hidden_size_per_layer_input") or 0
        self.built: list[Gemma4Layer] = []  # make_layer's layers so far: a shared one's source
        super().__init__(cfg, max_positions, tp)
        if self.ple:
            width, vocab = cfg.num_layers * self.ple, hf["vocab_size_per_layer_input"]
            self.model.embed_tokens_per_layer = nn.Embedding(vocab, width)
            self.model.per_layer_model_projection = Linear(cfg.hidden_size, width)
            self.model.per_layer_projection_norm = RMSNorm(self.ple, cfg.rms_norm_eps)

    def kv_source(self, i: int) -> int:
        """The pool layer layer i reads: its own, or for a shared layer the last layer of its
        kind before the shared ones."""
        if i < self.first_shared:
            return i
        return max(j for j in range(self.first_shared) if self.types[j] == self.types[i])

    def make_layer(self, i: int) -> nn.Module:
        cfg, hf, tp = self.cfg, self.hf, self.tp
        kv = self.kv_source(i)
        if cfg.kv_layer_dims is not None:
            heads, dim = cfg.kv_layer_dims[kv]
            cfg = replace(cfg, num_kv_heads=heads, head_dim=dim)
        sliding = self.types[i] == "sliding_attention"
        how = LayerAttention(scale=1.0, window=hf.get("sliding_window") if sliding else None)
        rope = SLIDING if sliding else FULL
        if i < self.first_shared:
            k_eq_v = bool(hf.get("attention_k_eq_v")) and not sliding
            attention = Gemma4Attention(cfg, kv, tp, how, rope, k_eq_v)
        else:
            source = self.built[kv].self_attn
            attention = Gemma4SharedAttention(cfg, tp, how, rope, source)
        wide = 2 if hf.get("use_double_wide_mlp") and i >= self.first_shared else 1
        act = hf.get("hidden_activation", "gelu_pytorch_tanh")
        mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size * wide, act)
        layer = Gemma4Layer(cfg, tp, attention, mlp, hf)
        self.built.append(layer)
        return layer

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        ropes, head_dim = self.hf["rope_parameters"], self.cfg.head_dim
        full_dim = layer_attention_dims(self.hf, self.types, self.types.index("full_attention"))[1]
        tables = []
        for kind, dim in (("sliding_attention", head_dim), ("full_attention", full_dim)):
            rope = ropes.get(kind) or {}
            theta = float(rope.get("rope_theta", 1e4))
            tables.append(RotaryEmbedding(dim, max_positions, theta, rope_scaling_of(rope)))
        return tables

    def per_layer_inputs(
        self, input_ids: torch.Tensor, embeds: torch.Tensor, images: StepImages | None
    ) -> torch.Tensor | None:
        """`[T, layers, ple]`: each token's own per-layer embedding (times sqrt(ple); an image
        token's is the pad token's) and a normed projection of its embedding, summed and scaled
        by 1/sqrt(2)."""
        if not self.ple:
            return None
        if images is not None:
            input_ids = input_ids.index_fill(0, images.rows, int(self.hf.get("pad_token_id") or 0))
        model, shape = self.model, (-1, self.cfg.num_layers, self.ple)
        own = model.embed_tokens_per_layer(input_ids).view(shape)
        own = own * torch.tensor(self.ple**0.5, dtype=own.dtype)
        mixed = model.per_layer_model_projection(embeds) * self.cfg.hidden_size**-0.5
        mixed = model.per_layer_projection_norm(mixed.view(-1, self.ple)).view(shape)
        return (mixed + own) * 2**-0.5

    def rename(self, name: str) -> str | None:
        """A multimodal checkpoint's language model (`model.language_model.`); its towers and
        their projections are not served."""
        if name.startswith(NOT_TEXT):
            return None
        return name.replace("model.language_model.", "model.", 1)

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))
