"""The config.json a family reads: a multimodal checkpoint's language model config, and field
names some releases spell their own way under transformers' names. Free of torch."""

from __future__ import annotations

# multimodal checkpoints whose language model is served alone (where the family has no vision
# tower here, or the checkpoint none; a request with images is refused as for any text model):
# the family that serves it
TEXT_OF_MULTIMODAL = {
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
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
    "Qwen3_5ForConditionalGeneration": {},
    "Qwen3_5MoeForConditionalGeneration": {},
}
VISION_KEYS = (
    "vision_config",
    "image_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
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
)
# configs that name transformers' fields their own way: model_type -> {their key: HF's}
CONFIG_ALIASES = {
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


DERIVED = {
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
