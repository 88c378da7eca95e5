"""The start-up checks of a config.json, free of torch: a family, quantization, rotary,
activation or family setting that is not implemented is refused, naming the field."""

from __future__ import annotations

from ..quant import UnsupportedQuantization, scheme_of
from .registry import PARTIAL_ROTARY, UnsupportedModel, architecture_of, class_name_of

# vision-language architectures over a choice of language models: (name, the text config
# types implemented)
LANGUAGE_MODELS = {
    "InternVLForConditionalGeneration": ("InternVL", ("qwen2", "llama", "qwen3", "qwen3_moe")),
    "Idefics3ForConditionalGeneration": ("Idefics3", ("llama",)),
    "SmolVLMForConditionalGeneration": ("SmolVLM", ("llama",)),
    "LlavaForConditionalGeneration": ("LLaVA", ("llama", "mistral", "qwen2")),
}
V4_SCORES = ("sqrtsoftplus", "sigmoid")  # DeepSeek-V4's router scores
ROPE_TYPES = {"default", "linear", "llama3", "yarn", "proportional", "dynamic"}
ACTIVATIONS = {"silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu2"}
# learned ones, the family's own module
OWN_ACTIVATIONS = {"ApertusForCausalLM": {"xielu"}, "Apertus1p5TextForCausalLM": {"xielu"}}


def check_supported(hf: dict) -> None:
    """Refuse, naming the field, a config.json whose family or settings are not implemented."""
    architecture_of(hf)
    try:
        scheme_of(hf)
    except UnsupportedQuantization as exc:
        raise UnsupportedModel(str(exc)) from None
    ropes = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    by_kind = "full_attention" in ropes or "compress" in ropes  # per layer kind (DeepSeek-V4's)
    for rope in ropes.values() if by_kind else [ropes]:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise UnsupportedModel(
                f"config.json: rope type {kind!r} is not implemented; supported: "
                f"{', '.join(sorted(ROPE_TYPES))}"
            )
        if kind == "dynamic" and not rope.get("alpha"):
            raise UnsupportedModel(
                "config.json: rope type 'dynamic' is implemented with a fixed 'alpha' only "
                "(HunYuan's), not rescaled by the sequence length"
            )
        partial = rope.get("partial_rotary_factor", 1.0) != 1.0
        if partial and not {architecture_of(hf), class_name_of(hf)[1]} & PARTIAL_ROTARY:
            raise UnsupportedModel("config.json: partial_rotary_factor < 1 is not implemented")
    if architecture_of(hf) == "NemotronHForCausalLM":
        _check_nemotron_h(hf)
    if hf.get("model_type") == "deepseek_v4":
        _check_deepseek_v4(hf)
    if architecture_of(hf) in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"):
        _check_gemma4(hf)
    if architecture_of(hf) in LANGUAGE_MODELS:
        _check_language_model(hf, *LANGUAGE_MODELS[architecture_of(hf)])
    if architecture_of(hf) == "InternVLForConditionalGeneration":
        _check_internvl(hf)
    known = ACTIVATIONS | OWN_ACTIVATIONS.get(architecture_of(hf), set())
    for key in ("hidden_act", "hidden_activation", "mlp_hidden_act"):
        if hf.get(key) is not None and hf[key] not in known:
            raise UnsupportedModel(
                f"config.json: {key} {hf[key]!r} is not implemented; supported: "
                f"{', '.join(sorted(known))}"
            )


def _check_language_model(hf: dict, name: str, implemented: tuple[str, ...]) -> None:
    text_type = hf.get("model_type")
    if text_type not in implemented:
        raise UnsupportedModel(
            f"config.json: {name} over a {text_type!r} language model is not implemented; "
            f"supported: {', '.join(implemented)}"
        )


def _check_internvl(hf: dict) -> None:
    """The features InternVL takes of its tower (its patches')."""
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise UnsupportedModel(
            f"config.json: vision_feature_select_strategy {strategy!r} is not implemented; "
            "supported: default"
        )


def _check_gemma4(hf: dict) -> None:
    """Gemma 4's layer kinds: each KV-sharing layer needs an earlier layer of its kind to read."""
    if hf.get("use_bidirectional_attention") == "all":
        raise UnsupportedModel("config.json: use_bidirectional_attention 'all' is not implemented")
    types = hf.get("layer_types")
    if not types or len(types) != hf["num_hidden_layers"] or "full_attention" not in types:
        raise UnsupportedModel(
            "config.json: layer_types must name num_hidden_layers layers, one of them "
            "'full_attention'"
        )
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModel(f"config.json: layer_types {sorted(unknown)} are not Gemma 4's")
    shared = hf.get("num_kv_shared_layers") or 0
    if not 0 <= shared < len(types) or not set(types[len(types) - shared :]) <= set(
        types[: len(types) - shared]
    ):
        raise UnsupportedModel(
            f"config.json: num_kv_shared_layers {shared}: each shared layer needs an earlier "
            "layer of its kind"
        )


def _check_deepseek_v4(hf: dict) -> None:
    if hf.get("scoring_func", V4_SCORES[0]) not in V4_SCORES:
        raise UnsupportedModel(
            f"config.json: scoring_func {hf['scoring_func']!r} is not implemented; "
            f"supported: {', '.join(V4_SCORES)}"
        )
    if hf.get("quantization_config"):
        raise UnsupportedModel(
            "config.json: quantization_config: quantized DeepSeek-V4 checkpoints (the "
            "release's FP8 and FP4 tensors) are not implemented; serve unquantized weights"
        )


def _check_nemotron_h(hf: dict) -> None:
    if hf.get("mamba_hidden_act", "silu") != "silu":
        raise UnsupportedModel(
            f"config.json: mamba_hidden_act {hf['mamba_hidden_act']!r} is not implemented"
        )
