"""The config.json a family reads: a multimodal checkpoint's language model config, and field
names some releases spell their own way under transformers' names. Free of torch."""

from __future__ import annotations

# multimodal checkpoints whose language model is served alone (where the family has no vision
# tower here, or the checkpoint none; a request with images is refused as for any text model):
# the family that serves it
TEXT_OF_MULTIMODAL = {
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
    "Apertus1p5ForConditionalGeneration": "Apertus1p5TextForCausalLM",
}
# vision-language checkpoints served whole: the config keys of the top level they keep
VISION_LANGUAGE = {
    "Qwen2_5_VLForConditionalGeneration": {"attention_bias": True},
    "Qwen2VLForConditionalGeneration": {"attention_bias": True},
    "Qwen3VLForConditionalGeneration": {},
    "Qwen3VLMoeForConditionalGeneration": {"norm_topk_prob": True},  # HF always renormalises
    "Gemma3ForConditionalGeneration": {},
    "Gemma4ForConditionalGeneration": {},
    "Mistral3ForConditionalGeneration": {},
    "Glm4vForConditionalGeneration": {},
    "Glm4vMoeForConditionalGeneration": {},
    "Glm46VForConditionalGeneration": {},
    "InternVLForConditionalGeneration": {},
    "Idefics3ForConditionalGeneration": {},
    "SmolVLMForConditionalGeneration": {},
    "LlavaForConditionalGeneration": {},
    "Qwen3_5ForConditionalGeneration": {},
    "Qwen3_5MoeForConditionalGeneration": {},
}
VISION_KEYS = (
    "vision_config",
    "image_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "image_start_token_id",
    "image_end_token_id",
    "video_token_id",
    "image_token_index",
    "boi_token_index",
    "eoi_token_index",
    "mm_tokens_per_image",
    "boi_token_id",
    "eoi_token_id",
    "spatial_merge_size",
    "vision_feature_layer",
    "projector_hidden_act",
    "multimodal_projector_bias",
    "downsample_ratio",
    "vision_feature_select_strategy",
    "scale_factor",
)
# configs that name transformers' fields their own way: model_type -> {their key: HF's}
CONFIG_ALIASES = {
    "longcat_flash": {
        "num_layers": "num_hidden_layers",
        "ffn_hidden_size": "intermediate_size",
        "moe_topk": "num_experts_per_tok",
        "expert_ffn_hidden_size": "moe_intermediate_size",
    },
    "kimi_linear": {
        "num_experts": "n_routed_experts",
        "num_local_experts": "n_routed_experts",
        "num_experts_per_token": "num_experts_per_tok",
        "moe_renormalize": "norm_topk_prob",
        "num_expert_group": "n_group",
        "num_shared_experts": "n_shared_experts",
        "model_max_length": "max_position_embeddings",
    },
}


def with_hf_names(hf: dict) -> dict:
    """`hf` with the fields `CONFIG_ALIASES` renames under transformers' names, and the fields
    transformers derives for a family (`DERIVED`) where config.json lacks them."""
    aliases = CONFIG_ALIASES.get(hf.get("model_type"), {})
    out = {aliases.get(key, key): value for key, value in hf.items()}
    derive = DERIVED.get(hf.get("model_type"))
    return derive(out) if derive else out


def _kimi_linear_fields(hf: dict) -> dict:
    """Kimi Linear's `linear_attn_config` (1-based layer lists, its head sizes) as
    `layer_types` and `linear_*` fields."""
    out, linear = dict(hf), hf.get("linear_attn_config") or {}
    for ours, theirs in (("head_dim", "head_dim"), ("num_heads", "num_heads"),
                         ("conv_kernel_dim", "short_conv_kernel_size")):  # fmt: skip
        if theirs in linear:
            out.setdefault(f"linear_{ours}", linear[theirs])
    if "layer_types" not in out and "kda_layers" in linear:
        kda = set(linear["kda_layers"])
        out["layer_types"] = [
            "linear_attention" if i + 1 in kda else "full_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    return out


def _bamba_fields(hf: dict) -> dict:
    """Bamba's attention layers by `attn_layer_indices` (the rest Mamba2) as `layer_types`; its
    rotary turns half of each head whatever the config says, as transformers has it."""
    attention = set(hf.get("attn_layer_indices") or ())
    types = [
        "full_attention" if i in attention else "mamba" for i in range(hf["num_hidden_layers"])
    ]
    return {**hf, "layer_types": hf.get("layer_types") or types, "partial_rotary_factor": 0.5}


def _jamba_fields(hf: dict) -> dict:
    """Jamba's attention layers every `attn_layer_period` from `attn_layer_offset` (the rest
    Mamba) as `layer_types`, as transformers derives them."""
    period, offset = hf.get("attn_layer_period", 8), hf.get("attn_layer_offset", 4)
    types = [
        "full_attention" if i % period == offset else "mamba"
        for i in range(hf["num_hidden_layers"])
    ]
    return {**hf, "layer_types": hf.get("layer_types") or types}


def _state_space_fields(hf: dict) -> dict:
    """Mamba's, Falcon Mamba's and Mamba2's layers: every one a state layer."""
    return {**hf, "layer_types": hf.get("layer_types") or ["mamba"] * hf["num_hidden_layers"]}


def _gemma_fields(hf: dict) -> dict:
    """Gemma's releases say `hidden_act` "gelu" for the tanh approximation it runs, as
    transformers reads it."""
    act = "gelu_pytorch_tanh" if hf.get("hidden_act") == "gelu" else hf.get("hidden_act")
    return {**hf, "hidden_act": act} if "hidden_act" in hf else hf


# DeepSeek-V4's fields a config.json may leave out, at transformers' defaults
V4_DEFAULTS = dict(
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, sliding_window=128, o_groups=8, o_lora_rank=1024,
    index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6, rope_theta=10000.0,
    compress_rope_theta=160000.0, num_key_value_heads=1, head_dim=512,
)  # fmt: skip
V4_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention",
                  128: "heavily_compressed_attention"}  # fmt: skip


def _deepseek_v4_fields(hf: dict) -> dict:
    """DeepSeek-V4's layer kinds, compression rates, expert routing by layer and its two rotary
    tables, as transformers derives them from a release's fields (`compress_ratios`,
    `num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling`) where config.json lacks them."""
    out = {**V4_DEFAULTS, **hf}
    n = out["num_hidden_layers"]
    rates = dict(out.get("compress_rates") or {"compressed_sparse_attention": 4,
                                               "heavily_compressed_attention": 128})  # fmt: skip
    for legacy, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                         ("compress_rate_hca", "heavily_compressed_attention")):  # fmt: skip
        rates[kind] = out.get(legacy) or rates[kind]
    types = out.get("layer_types")
    if types is None and out.get("compress_ratios") is not None:
        types = [V4_RATIO_KINDS[r] for r in out["compress_ratios"]]
    if types is None:
        mixed = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                 for i in range(max(n - 2, 0))]  # fmt: skip
        types = ["heavily_compressed_attention"] * min(n, 2) + mixed
    hashed = out.get("num_hash_layers", 3)
    mlp_types = out.get("mlp_layer_types") or ["hash_moe"] * min(n, hashed) + ["moe"] * (n - hashed)
    factor = out.get("partial_rotary_factor") or (out.get("qk_rope_head_dim", 64) / out["head_dim"])
    ropes = out.get("rope_parameters") or out.get("rope_scaling") or {}
    if not isinstance(ropes.get("compress"), dict):
        scaling = {k: v for k, v in ropes.items() if k not in ("main", "compress")}
        compress = {"rope_type": "default", **scaling, "rope_theta": out["compress_rope_theta"]}
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        ropes = {"main": {"rope_type": "default", "rope_theta": out["rope_theta"]},
                 "compress": compress}  # fmt: skip
    ropes = {kind: {**rope, "partial_rotary_factor": factor} for kind, rope in ropes.items()}
    return out | dict(compress_rates=rates, layer_types=list(types[:n]),
                      mlp_layer_types=list(mlp_types[:n]), partial_rotary_factor=factor,
                      rope_parameters=ropes)  # fmt: skip


def _hy_v4_fields(hf: dict) -> dict:
    """Hunyuan v4's layers where config.json does not list them, as transformers derives them:
    the first MLP dense, the rest experts; an indexer of its own in layer 0 and every fourth
    from layer 1, the others sharing the previous one's choice."""
    n = hf["num_hidden_layers"]
    indexers = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(n)]
    return {
        "mlp_layer_types": ["dense"] * min(1, n) + ["sparse"] * max(n - 1, 0),
        "layer_types": ["indexed_attention"] * n,
        "indexer_types": indexers,
        "hc_mult": 4, "hc_magnitude": 2.0, "hc_eps": 1e-6, "swiglu_limit": 10.0,
        **{k: v for k, v in hf.items() if v is not None},
    }  # fmt: skip


DERIVED = {
    "hy_v4": _hy_v4_fields,
    "deepseek_v4": _deepseek_v4_fields,
    "kimi_linear": _kimi_linear_fields,
    "bamba": _bamba_fields,
    "jamba": _jamba_fields,
    "mamba": _state_space_fields,
    "falcon_mamba": _state_space_fields,
    "mamba2": _state_space_fields,
    "gemma": _gemma_fields,
}


def language_model_config(hf: dict) -> dict:
    """The config a family reads: a vision-language checkpoint's `text_config` with its
    architecture, its image tokens and vision config, the stop tokens the top level sets and
    its tying (a multimodal checkpoint served as text: its text family's architecture); else
    the config itself."""
    named = (hf.get("architectures") or [None])[0]
    if named in TEXT_OF_MULTIMODAL and not (named in VISION_LANGUAGE and hf.get("vision_config")):
        text, kept = dict(hf["text_config"], architectures=[TEXT_OF_MULTIMODAL[named]]), ()
    elif named in VISION_LANGUAGE:
        text = dict(hf["text_config"], architectures=[named], **VISION_LANGUAGE[named])
        kept = VISION_KEYS
    else:
        return with_hf_names(hf)
    for key in kept + ("eos_token_id", "bos_token_id"):
        if key in hf and key not in text:
            text[key] = hf[key]
    if "tie_word_embeddings" in hf:  # transformers ties the head by the top level's
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text
