"""Which module serves a checkpoint, chosen by `config.architectures` (then `model_type`).
Free of torch: the api process checks a model (`config_checks`) before it starts the others."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .checkpoint_config import TEXT_OF_MULTIMODAL

if TYPE_CHECKING:
    from ..model_config import ModelConfig

# architecture -> (module under radixserve.models, class)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Ministral3ForCausalLM": ("llama", "Ministral3ForCausalLM"),
    "MinistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "CwmForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("llama", "Phi3ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen3_moe", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "GemmaForCausalLM": ("dense_families", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "VaultGemmaForCausalLM": ("gemma", "VaultGemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "AXK1ForCausalLM": ("deepseek_v3", "AXK1ForCausalLM"),
    "MiniCPM3ForCausalLM": ("deepseek_v3", "MiniCPM3ForCausalLM"),
    "Mistral4ForCausalLM": ("deepseek_v3", "Mistral4ForCausalLM"),
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("lfm2", "Lfm2MoeForCausalLM"),
    "Lfm3ForCausalLM": ("lfm2", "Lfm3ForCausalLM"),
    "JambaForCausalLM": ("jamba", "JambaForCausalLM"),
    "MiniMaxForCausalLM": ("minimax", "MiniMaxForCausalLM"),
    "MambaForCausalLM": ("state_space", "MambaForCausalLM"),
    "FalconMambaForCausalLM": ("state_space", "MambaForCausalLM"),
    "Mamba2ForCausalLM": ("state_space", "Mamba2ForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "OlmoHybridForCausalLM": ("olmo_hybrid", "OlmoHybridForCausalLM"),
    "KimiLinearForCausalLM": ("kimi_linear", "KimiLinearForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granite_hybrid", "GraniteMoeHybridForCausalLM"),
    "GraniteMoeForCausalLM": ("granite_hybrid", "GraniteMoeHybridForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("granite_hybrid", "GraniteMoeHybridForCausalLM"),
    "GraniteSWAForCausalLM": ("granite_swa", "GraniteSWAForCausalLM"),
    "BambaForCausalLM": ("granite_hybrid", "BambaForCausalLM"),
    "GraniteMoeSWAForCausalLM": ("granite_swa", "GraniteMoeSWAForCausalLM"),
    "SmolLM3ForCausalLM": ("dense_families", "SmolLM3ForCausalLM"),
    "GraniteForCausalLM": ("dense_families", "GraniteForCausalLM"),
    "HyperCLOVAXForCausalLM": ("dense_families", "HyperCLOVAXForCausalLM"),
    "SeedOssForCausalLM": ("dense_families", "SeedOssForCausalLM"),
    "Ernie4_5ForCausalLM": ("dense_families", "Ernie4_5ForCausalLM"),
    "Olmo2ForCausalLM": ("dense_families", "Olmo2ForCausalLM"),
    "OlmoForCausalLM": ("dense_families", "OlmoForCausalLM"),
    "Olmo3ForCausalLM": ("dense_families", "Olmo2ForCausalLM"),
    "Exaone4ForCausalLM": ("dense_families", "Exaone4ForCausalLM"),
    "Glm4ForCausalLM": ("dense_families", "Glm4ForCausalLM"),
    "GlmForCausalLM": ("dense_families", "GlmForCausalLM"),
    "HeliumForCausalLM": ("dense_families", "HeliumForCausalLM"),
    "ArceeForCausalLM": ("dense_families", "ArceeForCausalLM"),
    "PhiForCausalLM": ("classic_families", "PhiForCausalLM"),
    "Starcoder2ForCausalLM": ("classic_families", "Starcoder2ForCausalLM"),
    "NemotronForCausalLM": ("classic_families", "NemotronForCausalLM"),
    "StableLmForCausalLM": ("classic_families", "StableLmForCausalLM"),
    "GPTNeoXForCausalLM": ("classic_families", "GPTNeoXForCausalLM"),
    "Jais2ForCausalLM": ("classic_families", "Jais2ForCausalLM"),
    "YoutuForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "OlmoeForCausalLM": ("moe_families", "OlmoeForCausalLM"),
    "FlexOlmoForCausalLM": ("moe_families", "FlexOlmoForCausalLM"),
    "MellumForCausalLM": ("kind_moe_families", "MellumForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("moe_families", "Ernie4_5_MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("moe_families", "Glm4MoeForCausalLM"),
    "MiniCPM5MoeForCausalLM": ("moe_families", "MiniCPM5MoeForCausalLM"),
    "SolarOpenForCausalLM": ("moe_families", "Glm4MoeForCausalLM"),
    "ExaoneMoeForCausalLM": ("kind_moe_families", "ExaoneMoeForCausalLM"),
    "Kolibri1ForCausalLM": ("kind_moe_families", "Kolibri1ForCausalLM"),
    "FlintForCausalLM": ("kind_moe_families", "FlintForCausalLM"),
    "AfmoeForCausalLM": ("kind_moe_families", "AfmoeForCausalLM"),
    "MiMoV2FlashForCausalLM": ("mimo_v2_flash", "MiMoV2FlashForCausalLM"),
    "MiniMaxM2ForCausalLM": ("moe_families", "MiniMaxM2ForCausalLM"),
    "DeepseekV2ForCausalLM": ("moe_families", "DeepseekV2ForCausalLM"),
    "PhimoeForCausalLM": ("moe_families", "PhimoeForCausalLM"),
    "Cohere2ForCausalLM": ("dense_families", "Cohere2ForCausalLM"),
    "CohereForCausalLM": ("dense_families", "CohereForCausalLM"),
    "Cohere2MoeForCausalLM": ("kind_moe_families", "Cohere2MoeForCausalLM"),
    "ApertusForCausalLM": ("dense_families", "ApertusForCausalLM"),
    "Apertus1p5TextForCausalLM": ("dense_families", "Apertus1p5ForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("dense_families", "HunYuanDenseV1ForCausalLM"),
    "HunYuanMoEV1ForCausalLM": ("moe_families", "HunYuanMoEV1ForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("moe_families", "Glm4MoeLiteForCausalLM"),
    "HYV3ForCausalLM": ("moe_families", "HYV3ForCausalLM"),
    "Dots1ForCausalLM": ("moe_families", "Dots1ForCausalLM"),
    "LagunaForCausalLM": ("laguna", "LagunaForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("deepseek_v32", "DeepseekV32ForCausalLM"),
    "DeepseekV4ForCausalLM": ("deepseek_v4", "DeepseekV4ForCausalLM"),
    "HYV4ForCausalLM": ("hy_v4", "HYV4ForCausalLM"),
    "LongcatFlashForCausalLM": ("longcat_flash", "LongcatFlashForCausalLM"),
    "LaraMiniForCausalLM": ("lara_mini", "LaraMiniForCausalLM"),
    # vision-language: the language model and its vision tower
    "Qwen2_5_VLForConditionalGeneration": ("qwen_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_vl", "Gemma3ForConditionalGeneration"),
    "Gemma4ForConditionalGeneration": ("gemma4_vl", "Gemma4ForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("pixtral", "Mistral3ForConditionalGeneration"),
    "Glm4vForConditionalGeneration": ("glm4v", "Glm4vForConditionalGeneration"),
    "Glm4vMoeForConditionalGeneration": ("glm4v", "Glm4vMoeForConditionalGeneration"),
    "Glm46VForConditionalGeneration": ("glm4v", "Glm4vForConditionalGeneration"),
    "InternVLForConditionalGeneration": ("internvl", "InternVLForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": ("qwen_vl", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen_vl", "Qwen3_5MoeForConditionalGeneration"),
    # cross-encoders (served with --is-embedding for /v1/rerank and /v1/score)
    "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("llama", "Qwen3ForSequenceClassification"),
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "ministral": "MinistralForCausalLM",
    "cwm": "CwmForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "vaultgemma": "VaultGemmaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "axk1": "AXK1ForCausalLM",
    "minicpm3": "MiniCPM3ForCausalLM",
    "mistral4": "Mistral4ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "jamba": "JambaForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "bamba": "BambaForCausalLM",
    "granitemoe_swa": "GraniteMoeSWAForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "hyperclovax": "HyperCLOVAXForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo": "OlmoForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm": "GlmForCausalLM",
    "helium": "HeliumForCausalLM",
    "arcee": "ArceeForCausalLM",
    "phi": "PhiForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "jais2": "Jais2ForCausalLM",
    "youtu": "YoutuForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "flex_olmo": "FlexOlmoForCausalLM",
    "mellum": "MellumForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minicpm5_moe": "MiniCPM5MoeForCausalLM",
    "solar_open": "SolarOpenForCausalLM",
    "exaone_moe": "ExaoneMoeForCausalLM",
    "kolibri1": "Kolibri1ForCausalLM",
    "flint": "FlintForCausalLM",
    "afmoe": "AfmoeForCausalLM",
    "mimo_v2_flash": "MiMoV2FlashForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2_moe": "Cohere2MoeForCausalLM",
    "apertus": "ApertusForCausalLM",
    "apertus1p5_text": "Apertus1p5TextForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "hy_v3": "HYV3ForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "laguna": "LagunaForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "hy_v4": "HYV4ForCausalLM",
    "longcat_flash": "LongcatFlashForCausalLM",
    "lara_mini": "LaraMiniForCausalLM",
}
# vision-language checkpoints whose language model's family picks another class of the
# architecture's module: (architecture, text model_type) -> class
BY_TEXT_MODEL = {
    ("Mistral3ForConditionalGeneration", "mistral4"): "Mistral4VisionForConditionalGeneration",
    ("Glm46VForConditionalGeneration", "glm4v_moe_text"): "Glm4vMoeForConditionalGeneration",
    ("InternVLForConditionalGeneration", "qwen3"): "InternVLQwen3ForConditionalGeneration",
    ("InternVLForConditionalGeneration", "qwen3_moe"): "InternVLQwen3MoeForConditionalGeneration",
}
# architectures (or the classes BY_TEXT_MODEL names) that rotate part of each head
PARTIAL_ROTARY = {
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Glm4ForCausalLM",
    "GlmForCausalLM",
    "Glm4vForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration",
    "Glm46VForConditionalGeneration",
    "PhiForCausalLM",
    "GPTNeoXForCausalLM",
    "NemotronForCausalLM",
    "StableLmForCausalLM",
    "Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM",
    "MiMoV2FlashForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "LagunaForCausalLM",
    "Lfm3ForCausalLM",
    "BambaForCausalLM",
    "Mistral4ForCausalLM",  # MLA: the factor names the share its `qk_rope_head_dim` turns
    "Mistral4VisionForConditionalGeneration",
    "DeepseekV4ForCausalLM",
}


class UnsupportedModel(ValueError):
    """A checkpoint no family here can run; the message is the one-line start-up error."""


def architecture_of(hf: dict) -> str:
    """The registered architecture that serves a config.json, or UnsupportedModel naming it."""
    named = (hf.get("architectures") or [None])[0]
    if named in ARCHITECTURES:
        return named
    if named is None and hf.get("model_type", "llama") in MODEL_TYPES:
        return MODEL_TYPES[hf.get("model_type", "llama")]
    raise UnsupportedModel(
        f"unsupported model architecture {named!r} (model_type {hf.get('model_type')!r}); "
        f"supported: {', '.join(sorted({*ARCHITECTURES, *TEXT_OF_MULTIMODAL}))}"
    )


def is_classifier(hf: dict) -> bool:
    """A sequence-classification checkpoint: a `score` head over the last token, no LM head."""
    return architecture_of(hf).endswith("ForSequenceClassification")


def num_labels(hf: dict) -> int:
    """A classifier's outputs, as HF counts them (`id2label`, else `num_labels`, else 2)."""
    return len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))


def class_name_of(hf: dict) -> tuple[str, str]:
    """(module under radixserve.models, class) serving a config.json."""
    architecture = architecture_of(hf)
    module, cls = ARCHITECTURES[architecture]
    return module, BY_TEXT_MODEL.get((architecture, hf.get("model_type")), cls)


def model_class(cfg: ModelConfig):
    """The class serving `cfg` (a dummy shape, with no config.json, is a Llama)."""
    module, cls = class_name_of(cfg.hf_config) if cfg.hf_config else ARCHITECTURES[cfg.architecture]
    return getattr(importlib.import_module(f"radixserve.models.{module}"), cls)
