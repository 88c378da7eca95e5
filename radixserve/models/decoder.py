"""The parts every decoder family shares: grouped-query attention with a fused QKV projection,
the pre-norm decoder layer, the causal LM around its layers, and loading HF-named tensors
(fused, sharded over tensor-parallel ranks, each one checked against its place).

A family module subclasses `CausalLM` and says how it differs: its layers (`make_layer`), its
checkpoint's names (`rename`), its rotary tables, its embedding scale and logit soft-cap."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from ..attention import PLAIN, AttentionBackend, LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .layers import Linear, RMSNorm, StepImages, SwiGLU
from .rotary import RotaryEmbedding, apply_rotary

# checkpoint leaf -> (our fused module, shard index)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# tensor parallelism: weights split by output rows (heads, MLP columns) or by input columns
SPLIT_BY_OUTPUT = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj"}
SPLIT_BY_OUTPUT |= {"g_proj"}  # an attention output's gates (recipe.GatedOutputAttention)
SPLIT_BY_INPUT = {"o_proj", "down_proj"}

Rope = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    """`cfg` is this rank's shard (its heads); o_proj's partial sums are all-reduced (its bias,
    if any, is added by rank 0 alone). `qk_norm`: a norm over each head's q and k before the
    rotary embedding (Qwen3, Gemma 3), or after it with `norm_after_rope` (HunYuan). `rope`:
    which of the model's rotary tables it uses (None: no rotary embedding, Nemotron-H).
    `temperature`: which of the model's tables scales each query by its position after the
    rotary (`rotary.QueryTemperature`: Llama 4's no-rope layers, Ministral 3), if any."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        tp: TPGroup,
        how: LayerAttention = PLAIN,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: type[RMSNorm] | None = None,
        rope: int | None = 0,
        norm_after_rope: bool = False,
        temperature: int | None = None,
    ):
        super().__init__()
        self.layer, self.cfg, self.tp, self.how, self.rope = layer, cfg, tp, how, rope
        self.norm_after_rope, self.temperature = norm_after_rope, temperature
        self.qkv_proj = Linear(
            cfg.hidden_size,
            cfg.q_size + 2 * cfg.kv_size,
            bias=qkv_bias,
            parts=(cfg.q_size, cfg.kv_size, cfg.kv_size),
        )
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.cpu_ops = None

    def forward(self, x: torch.Tensor, ropes: list[Rope], backend: AttentionBackend):
        return self.tp.all_reduce(self.o_proj(self.attend(x, ropes, backend)[1]))

    def attend(self, x: torch.Tensor, ropes: list[Rope], backend: AttentionBackend):
        """(queries after the rotary embedding, attention output before o_proj)."""
        q, k, v = self.project(x, ropes)
        if self.temperature is not None:
            q = (q.float() * ropes[self.temperature][0]).to(q.dtype)
        return q, backend.forward(self.layer, q, k, v, self.how)

    def project(self, x: torch.Tensor, ropes: list[Rope]):
        """q, k and v `[T, heads, head_dim]`, q and k normed and rotated as the layer does."""
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        if not self.norm_after_rope:
            q, k = self.norm_qk(q, k)
        if self.rope is not None:
            cos, sin = ropes[self.rope]
            q = apply_rotary(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin, self.cpu_ops)
            k = apply_rotary(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin, self.cpu_ops)
        if self.norm_after_rope:
            q, k = self.norm_qk(q, k)
        return q, k, v.view(-1, cfg.num_kv_heads, cfg.head_dim)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as `[T, heads, head_dim]`, each head normed where the layer norms them."""
        cfg = self.cfg
        q, k = q.view(-1, cfg.num_heads, cfg.head_dim), k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, cfg.head_dim)).view(-1, cfg.num_heads, cfg.head_dim)
            k = self.k_norm(k.reshape(-1, cfg.head_dim)).view(-1, cfg.num_kv_heads, cfg.head_dim)
        return q, k


class DecoderLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). `mlp` defaults to SwiGLU."""

    def __init__(
        self, cfg: ModelConfig, layer: int, tp: TPGroup, attention: nn.Module, mlp: nn.Module
    ):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, normed, ropes, backend, next_norm: RMSNorm):
        """`normed` is `input_layernorm(x)`; returns the residual stream after this layer and
        `next_norm` of it (each residual add is fused with the norm that follows it)."""
        x, normed = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(normed, ropes, backend)
        )
        return next_norm.add_and_norm(x, self.tp.all_reduce(self.mlp(normed)))


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """A decoder-only LM: embedding (times `embed_scale`), layers, final norm, LM head (its
    logits soft-capped by `final_softcap`)."""

    embed_scale: float | None = None
    final_softcap: float | None = None
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.cfg = cfg = tp.shard_config(cfg)
        self.hf = cfg.hf_config
        layers = [self.make_layer(i) for i in range(cfg.num_layers)]
        self.model = Model(cfg, layers, self.norm_class(cfg.hidden_size, cfg.rms_norm_eps))
        self.rotaries = nn.ModuleList(self.make_rotaries(max_positions))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.cpu_decoder = None
        self.lora_segments = None  # with LoRA adapters: this step's runs (lora_weights)
        self.kv_scales: dict[str, float] = {}  # an FP8-KV checkpoint's k_scale / v_scale tensors

    # ---- what a family says -------------------------------------------------
    def make_layer(self, i: int) -> nn.Module:
        cfg = self.cfg
        how = LayerAttention(window=layer_window(self.hf, i))
        attention = Attention(cfg, i, self.tp, how, qkv_bias=cfg.qkv_bias)
        return DecoderLayer(cfg, i, self.tp, attention, self.make_mlp(i))

    def make_mlp(self, i: int) -> nn.Module:
        cfg = self.cfg
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, self.hf.get("hidden_act", "silu"))

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        cfg = self.cfg
        return [RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling_dict)]

    def rename(self, name: str) -> str | None:
        """Our name for a checkpoint tensor (None: not used)."""
        return name

    def attention_features(self) -> frozenset[str]:
        """What the layers need of an attention backend (LayerAttention.features)."""
        hows = [
            m.how for m in self.modules() if isinstance(getattr(m, "how", None), LayerAttention)
        ]
        return frozenset().union(*(how.features() for how in hows))

    # ---- forward -----------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        images: StepImages | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states `[T, hidden]` of this step's tokens; `images`: the image
        features that take the place of image tokens (vision-language models)."""
        x = self.embed(input_ids, images)
        per_layer = self.per_layer_inputs(input_ids, x, images)
        ropes = [rotary.cos_sin(positions, x.dtype) for rotary in self.rotaries]
        layers = self.model.layers
        normed = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            extra = () if per_layer is None else (per_layer[:, i],)
            x, normed = layer(x, normed, ropes, backend, self.norm_after(i), *extra)
            if images is not None and i < len(images.deepstack):
                x = x.index_add(0, images.rows, images.deepstack[i].to(x.dtype))
                normed = self.norm_after(i)(x)
        return normed

    def per_layer_inputs(
        self, input_ids: torch.Tensor, embedded: torch.Tensor, images: StepImages | None
    ) -> torch.Tensor | None:
        """`[T, layers, width]`: what each layer takes beside the residual stream (Gemma 4's
        per-layer inputs), or None."""
        return None

    def embed(self, input_ids: torch.Tensor, images: StepImages | None = None) -> torch.Tensor:
        """Token embeddings (times `embed_scale`); image tokens (ids past the vocabulary) take
        their image's features instead."""
        if images is None:
            x = self.model.embed_tokens(input_ids)
        else:
            x = self.model.embed_tokens(input_ids.clamp(max=self.cfg.vocab_size - 1))
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if images is not None:
            x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        return x

    def norm_after(self, i: int) -> RMSNorm:
        """The norm of layer i's output: the next layer's input norm, or the final norm."""
        layers = self.model.layers
        return layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm

    def fuse_cpu_layers(self, backend: AttentionBackend) -> bool:
        return False

    def kv_cache_scales(self) -> list[tuple[float, float]]:
        """Each layer's (k_scale, v_scale) for an FP8 KV cache: the checkpoint's (`k_scale` and
        `v_scale` of `self_attn`, or one `kv_scale`), else 1.0."""
        scales = []
        for i in range(self.cfg.num_layers):
            prefix = f"model.layers.{i}.self_attn."
            both = self.kv_scales.get(prefix + "kv_scale", 1.0)
            scales.append(
                (
                    self.kv_scales.get(prefix + "k_scale", both),
                    self.kv_scales.get(prefix + "v_scale", both),
                )
            )
        return scales

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # ---- loading -----------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors: fused, sliced for this rank, shape-checked; a tied head copies
        the embedding. A tensor with no place, a missing one or a wrong shape is a ValueError
        naming it."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.rename(hf_name)
            if name is None or "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if name.rpartition(".")[2] in KV_SCALE_KINDS:
                value = float(tensor.float().reshape(-1)[0])
                if not math.isfinite(value) or value <= 0:
                    raise ValueError(f"checkpoint tensor {hf_name!r} is {value}: a KV scale > 0")
                self.kv_scales[name] = value
                continue
            try:
                loaded |= self._load_one(name, tensor, modules, params)
            except (RuntimeError, ValueError, IndexError) as exc:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} {tuple(tensor.shape)} does not fit the "
                    f"model: {exc}"
                ) from None
        if self.cfg.tie_word_embeddings:
            self.lm_head.load("weight", self.model.embed_tokens.weight)
        self_checking = [(n, m) for n, m in modules.items() if hasattr(m, "missing_tensors")]
        owned = {f"{n}.{p}" for n, m in self_checking for p, _ in m.named_parameters()}
        missing = sorted(set(params) - loaded - owned)
        for module_name, module in self_checking:
            missing += [checkpoint_name(module_name, m) for m in module.missing_tensors()]
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:5])}")

    def _load_one(self, name: str, tensor: torch.Tensor, modules: dict, params: dict) -> set[str]:
        owner = _checkpoint_owner(name, modules)
        if owner is not None:
            prefix, module = owner
            module.load_checkpoint(name[len(prefix) + 1 :], tensor, self.tp)
            return set()
        module_name, _, kind = name.rpartition(".")
        tensor = self.tp_slice(module_name, kind, tensor)
        target, shard = fused_target(module_name)
        if target not in modules:  # an unfused layer under a fusable name (a plain MLP's up_proj)
            target, shard = module_name, None
        module = modules.get(target)
        if isinstance(module, Linear):
            if kind == "bias" and target.rpartition(".")[2] in SPLIT_BY_INPUT and self.tp.rank:
                tensor = torch.zeros_like(tensor)  # summed over ranks: added once
            module.load(kind, tensor, self.shard_offset(module, shard))
            return set()
        if name not in params:
            raise ValueError("it has no place in the model")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"expected shape {tuple(param.shape)}")
        with torch.no_grad():
            if isinstance(modules.get(module_name), RMSNorm):
                modules[module_name].load_weight(tensor)
            else:
                param.copy_(tensor)
        return {name}

    def tp_slice(self, module_name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor; a vision tower's whole (each rank holds it)."""
        if module_name.startswith(VISION_TOWERS):
            return tensor
        leaf = module_name.rpartition(".")[2]
        if leaf in SPLIT_BY_OUTPUT:
            return self.tp.shard(tensor, 0)
        if leaf in SPLIT_BY_INPUT and kind == "weight":
            return self.tp.shard(tensor, 1)
        if kind == "sinks":
            return self.tp.shard(tensor, 0)
        return tensor

    @staticmethod
    def shard_offset(module: Linear, shard: int | None) -> int:
        """Where part `shard` of a fused projection starts in its output."""
        return sum(module.parts[:shard]) if shard else 0


def swap_prefix(name: str, prefixes) -> str:
    """`name` with the first of its `(old, new)` prefixes that starts it replaced (a
    multimodal checkpoint's names for its parts); unchanged where none does."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


KV_SCALE_KINDS = ("k_scale", "v_scale", "kv_scale")
VISION_TOWERS = ("vision.", "visual.")  # the towers' module names in vision-language models


def layer_window(hf: dict, i: int) -> int | None:
    """Layer i's sliding window as HF applies it: `layer_types` where the config has them, else
    `sliding_window` on every layer (Mistral, Mixtral, Phi-3); Qwen's only with
    `use_sliding_window`."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    if hf.get("model_type", "").startswith("qwen") and not hf.get("use_sliding_window", False):
        return None
    types = hf.get("layer_types")
    if types:
        return window if types[i] == "sliding_attention" else None
    return window


def checkpoint_name(module_name: str, missing) -> str:
    """The checkpoint's name for a part a module still misses: (kind, part) of a Linear, as
    `...q_proj.weight` when fused, or a module's own name for it."""
    if isinstance(missing, str):
        return f"{module_name}.{missing}"
    kind, part = missing
    prefix, _, leaf = module_name.rpartition(".")
    unfused = {(fused, i): name for name, (fused, i) in FUSED_SHARDS.items()}
    return f"{prefix}.{unfused.get((leaf, part), leaf)}.{kind}"


def fused_target(module_name: str) -> tuple[str, int | None]:
    prefix, _, leaf = module_name.rpartition(".")
    if leaf in FUSED_SHARDS:
        fused, shard = FUSED_SHARDS[leaf]
        return f"{prefix}.{fused}", shard
    return module_name, None


def _checkpoint_owner(name: str, modules: dict) -> tuple[str, nn.Module] | None:
    """The closest enclosing module that loads its own tensors (`load_checkpoint`), e.g. a
    block of experts stored as stacked tensors."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        module = modules.get(prefix)
        if module is not None and hasattr(module, "load_checkpoint"):
            return prefix, module
    return None
