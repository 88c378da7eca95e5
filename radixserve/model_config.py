"""The shape and numerics of a model, read from its HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def rope_scaling_of(rope: dict[str, Any]) -> dict[str, Any] | None:
    """A rope entry's scaling (its settings but the base), None for plain rope."""
    if rope.get("rope_type", rope.get("type", "default")) in (None, "default"):
        return None
    return {k: v for k, v in rope.items() if k != "rope_theta"}


EPS_FIELDS = ("rms_norm_eps", "norm_eps", "layer_norm_epsilon", "layer_norm_eps")
ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "indexed_attention", "attention"}
    | {"compressed_sparse_attention", "heavily_compressed_attention"}  # DeepSeek-V4's
)
# layers that keep a state per sequence: convolution, linear attention, SSM (Mamba)
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba"})
HYBRID_LAYER = "hybrid"  # attention and an SSM side by side in one layer (Falcon-H1)
# Nemotron-H's one-letter layer pattern (`hybrid_override_pattern`)
PATTERN_LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# families whose every layer holds several attentions, each with its place in the KV pool
ATTENTIONS_PER_LAYER = {"longcat_flash": 2}
# the context a model without attention (whose config names none) serves by default
STATE_ONLY_CONTEXT = 32768


def is_attention_layer(layer_type: str) -> bool:
    """Whether a `layer_types` entry keeps KV per token."""
    return layer_type in ATTENTION_LAYER_TYPES or layer_type == HYBRID_LAYER


def is_state_layer(layer_type: str) -> bool:
    """Whether a `layer_types` entry keeps a state per sequence."""
    return layer_type in STATE_LAYER_TYPES or layer_type == HYBRID_LAYER


def layer_types_of(cfg: dict[str, Any]) -> list[str] | None:
    """Each layer's kind as the config names it: `layer_types` (`layers_block_type` in
    Nemotron-H's), Nemotron-H's `hybrid_override_pattern`, or `hybrid` for every Falcon-H1
    layer; None where the config does not say (every layer is attention)."""
    if cfg.get("model_type") == "falcon_h1":
        return [HYBRID_LAYER] * cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if types is None and cfg.get("hybrid_override_pattern"):
        types = [PATTERN_LETTERS.get(c, c) for c in cfg["hybrid_override_pattern"]]
    return list(types) if types else None


@dataclass(frozen=True)
class ModelConfig:
    """What every part of the server reads about a model: its shape, its KV layout, its stop
    tokens. A family's own settings (experts, windows, latent ranks) are read by its module
    from `hf_config`, the checkpoint's config.json as loaded.

    `latent_kv`: the pool holds one compressed latent per token (MLA: `head_dim` wide, shared
    by all heads; DeepSeek-V3.2's indexer key rides in the same row) and no separate values.
    `kv_layers`: the layers that keep KV per token where some do not (or where the last layers
    read an earlier layer's KV: Gemma 4), else None. `state_layers`: the layers that keep a
    state per sequence. `kv_layer_dims`: (KV heads, head dim) of each KV layer where they differ
    between layers (Gemma 4's global layers), else None."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    latent_kv: bool = False
    checkpoint_dtype: str | None = None  # config.json's `dtype` (`torch_dtype` before v5)
    kv_layers: int | None = None
    state_layers: int = 0
    kv_layer_dims: tuple[tuple[int, int], ...] | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers with a place in the KV pool."""
        return self.num_layers if self.kv_layers is None else self.kv_layers

    @property
    def keeps_state(self) -> bool:
        """Some layers keep a state per sequence (a hybrid model)."""
        return self.state_layers > 0

    @property
    def value_dim(self) -> int:
        """Width of a value in the KV pool (0: values are read from the latent)."""
        return 0 if self.latent_kv else self.head_dim

    def kv_layer_shapes(self) -> list[tuple[int, int, int]]:
        """(KV heads, key width, value width) of each layer in the KV pool."""
        if self.kv_layer_dims is not None:
            return [(heads, dim, 0 if self.latent_kv else dim) for heads, dim in self.kv_layer_dims]
        return [(self.num_kv_heads, self.head_dim, self.value_dim)] * self.num_kv_layers

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        types = layer_types_of(cfg)
        if types and not any(map(is_attention_layer, types)):
            return cls._without_attention(cfg, types)
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers'
        theta = cfg.get("rope_theta", rope.get("rope_theta"))
        theta = 10000.0 if theta is None else theta  # none: a model without rotary (OLMo Hybrid)
        scaling = rope_scaling_of(rope)
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        latent = cfg.get("kv_lora_rank") is not None
        shared_kv = latent or cfg.get("model_type") == "deepseek_v4"  # one row per token
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=len(types) if types else cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=1 if latent else cfg.get("num_key_value_heads") or heads,
            head_dim=(
                cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + cfg.get("index_head_dim", 0)
                if latent
                else cfg.get("head_dim") or cfg["hidden_size"] // heads
            ),
            rms_norm_eps=eps_of(cfg),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", False)
            or cfg.get("model_type") == "qwen2"
            or (cfg.get("model_type") == "qwen2_moe" and cfg.get("qkv_bias", True)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids_of(cfg),
            architecture=arch,
            model_type=cfg.get("model_type", "llama"),
            latent_kv=shared_kv,
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            kv_layers=(
                ATTENTIONS_PER_LAYER[cfg["model_type"]] * cfg["num_hidden_layers"]
                if cfg.get("model_type") in ATTENTIONS_PER_LAYER
                else kv_layers_of(types, cfg.get("num_kv_shared_layers") or 0)
            ),
            state_layers=sum(map(is_state_layer, types or [])),
            kv_layer_dims=kv_layer_dims_of(cfg, types),
            hf_config=cfg,
        )

    @classmethod
    def _without_attention(cls, cfg: dict[str, Any], types: list[str]) -> "ModelConfig":
        """A model whose every layer keeps a state (Mamba): no heads, no KV layers."""
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=len(types),
            num_heads=0,
            num_kv_heads=0,
            head_dim=0,
            rms_norm_eps=eps_of(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", STATE_ONLY_CONTEXT),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids_of(cfg),
            architecture=(cfg.get("architectures") or ["MambaForCausalLM"])[0],
            model_type=cfg.get("model_type", "mamba"),
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            kv_layers=0,
            state_layers=len(types),
            hf_config=cfg,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))


def eps_of(cfg: dict[str, Any]) -> float:
    """The norms' eps: the first of EPS_FIELDS set (Command A MoE's rms_norm_eps may be null)."""
    return next((cfg[k] for k in EPS_FIELDS if cfg.get(k) is not None), 1e-5)


def eos_ids_of(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def kv_layers_of(layer_types: list[str] | None, shared: int = 0) -> int | None:
    """How many layers keep KV per token, where some do not (`shared`: the last layers read
    an earlier layer's KV); else None."""
    if shared:
        return len(layer_types) - shared
    if not layer_types or all(is_attention_layer(t) for t in layer_types):
        return None
    return sum(is_attention_layer(t) for t in layer_types)


def layer_attention_dims(cfg: dict[str, Any], types: list[str] | None, i: int) -> tuple[int, int]:
    """(KV heads, head dim) of attention layer i: HF's `per_layer_config` overrides, or Gemma 4's
    `global_head_dim` and `num_global_key_value_heads` (with `attention_k_eq_v`) on its
    full-attention layers; else the config's own."""
    heads, dim = own_attention_dims(cfg)
    overrides = (cfg.get("per_layer_config") or {}).get(str(i))
    if overrides is None and types and types[i] == "full_attention":
        overrides = {"head_dim": cfg.get("global_head_dim", dim)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
            overrides["num_key_value_heads"] = cfg["num_global_key_value_heads"]
    overrides = overrides or {}
    return overrides.get("num_key_value_heads", heads), overrides.get("head_dim", dim)


def own_attention_dims(cfg: dict[str, Any]) -> tuple[int, int]:
    """(KV heads, head dim) the config states for every layer."""
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return heads, cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def kv_layer_dims_of(cfg: dict[str, Any], types: list[str] | None):
    """(KV heads, head dim) of each KV layer where layers differ in them (Gemma 4; MiMo-V2-Flash,
    whose window layers keep twice the KV heads), else None."""
    if cfg.get("model_type") == "deepseek_v4":
        return tuple((1, compressed_row_layout(cfg, t)["width"][1]) for t in types or [])
    if cfg.get("model_type") == "mimo_v2_flash":
        heads, dim = own_attention_dims(cfg)
        return tuple((2 * heads if t == "sliding_attention" else heads, dim) for t in types or [])
    if "per_layer_config" not in cfg and "global_head_dim" not in cfg:
        return None
    layers = kv_layers_of(types, cfg.get("num_kv_shared_layers") or 0) or len(types or [])
    dims = tuple(layer_attention_dims(cfg, types, i) for i in range(layers))
    return dims if any(d != own_attention_dims(cfg) for d in dims) else None


def compressed_row_layout(cfg: dict[str, Any], kind: str) -> dict[str, tuple[int, int]]:
    """Where each part of a DeepSeek-V4 layer's pool row lies, `(start, end)`: the token's key,
    then (compressed layers) its compressor's keys and gates, then (`compressed_sparse_attention`)
    its indexer's; `width` spans the row."""
    dim = cfg["head_dim"]
    parts = [("key", dim)]
    if kind == "heavily_compressed_attention":
        parts.append(("compressor", 2 * dim))
    if kind == "compressed_sparse_attention":
        parts += [("compressor", 4 * dim), ("indexer", 4 * cfg["index_head_dim"])]
    layout, start = {}, 0
    for name, size in parts:
        layout[name], start = (start, start + size), start + size
    return layout | {"width": (0, start)}
