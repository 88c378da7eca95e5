"""Tiny random vision-language checkpoints built with HF's own classes (SmolLM2's tokenizer
with the image tokens added), the images of the tests, and HF's greedy tokens for them: the
pixels from HF's own image processor class, the prompt expanded as HF's processor does."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import torch
import transformers as hf
from PIL import Image
from test_model_families import BETA_SCALED_YARN, MLA_MOE
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

MARKERS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
VOCAB = 49280  # SmolLM2's 49152 tokens, the image and video tokens, room to spare
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
QWEN3_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
QWEN3_VISION = dict(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
FAMILIES = {
    "qwen2_5_vl": (
        hf.Qwen2_5_VLConfig,
        hf.Qwen2_5_VLForConditionalGeneration,
        dict(rope_parameters={"rope_type": "default", "type": "mrope", "mrope_section": [2, 3, 3]}),
        dict(patch_size=14, window_size=56, fullatt_block_indexes=[1], hidden_act="silu"),
        14,
    ),
    "qwen2_vl": (
        hf.Qwen2VLConfig,
        hf.Qwen2VLForConditionalGeneration,
        dict(rope_parameters={"rope_type": "default", "type": "mrope", "mrope_section": [2, 3, 3]}),
        dict(embed_dim=32, hidden_size=64, mlp_ratio=2, patch_size=14),
        14,
    ),
    "qwen3_vl": (
        hf.Qwen3VLConfig,
        hf.Qwen3VLForConditionalGeneration,
        dict(rope_parameters=QWEN3_MROPE),
        QWEN3_VISION,
        16,
    ),
    "qwen3_vl_moe": (
        hf.Qwen3VLMoeConfig,
        hf.Qwen3VLMoeForConditionalGeneration,
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            rope_parameters=QWEN3_MROPE,
        ),
        QWEN3_VISION,
        16,
    ),
    "qwen3_5": (
        hf.Qwen3_5Config,
        hf.Qwen3_5ForConditionalGeneration,
        dict(
            head_dim=32,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
                "partial_rotary_factor": 0.25,
            },
        ),
        dict(patch_size=16, num_position_embeddings=64),
        16,
    ),
}
MAX_PIXELS = 56 * 56 * 16  # small images: at most ~64 tokens each
GEMMA_MARKERS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_TEXT = dict(
    TEXT,
    sliding_window=24,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=16,
)
GEMMA_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    image_size=64, patch_size=8,
)  # fmt: skip
GEMMA_PRE = {
    "image_processor_type": "Gemma3ImageProcessor",
    "size": {"height": 64, "width": 64},
    "resample": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_pan_and_scan": False,
}
GEMMA4_MARKERS = ["<|image|>", "<|image>", "<image|>", "<|video|>"]  # image, start, end, video
GEMMA4_TEXT = dict(
    TEXT,
    num_hidden_layers=6,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    sliding_window=24,
    layer_types=["sliding_attention", "full_attention"]
    + ["sliding_attention"] * 3
    + ["full_attention"],
    num_kv_shared_layers=3,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    use_bidirectional_attention="vision",
    final_logit_softcapping=30.0,
    pad_token_id=0,
)
GEMMA4_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, patch_size=8, pooling_kernel_size=2,
    position_embedding_size=256, use_clipped_linears=True, standardize=True,
)  # fmt: skip
GEMMA4_PRE = {
    "image_processor_type": "Gemma4ImageProcessor",
    "patch_size": 8,
    "pooling_kernel_size": 2,
    "max_soft_tokens": 70,
}
PIXTRAL_MARKERS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
PIXTRAL_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    patch_size=8, image_size=256, hidden_act="silu",
)  # fmt: skip
PIXTRAL_PRE = {
    "image_processor_type": "PixtralImageProcessor",
    "patch_size": 8,  # the tower's; the processor cuts at patch x spatial_merge_size
    "size": {"longest_edge": 128},
}
GLM4V_MARKERS = ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>"]
GLM4V_TEXT = dict(
    TEXT,
    rope_parameters={
        "rope_type": "default",
        "mrope_section": [2, 1, 1],
        "partial_rotary_factor": 0.5,
    },
)
GLM4V_MOE_TEXT = dict(
    GLM4V_TEXT,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
GLM4V_CLASSES = {
    "glm4v": (hf.Glm4vConfig, hf.Glm4vForConditionalGeneration),
    "glm4v_moe": (hf.Glm4vMoeConfig, hf.Glm4vMoeForConditionalGeneration),
    "glm46v": (hf.Glm46VConfig, hf.Glm46VForConditionalGeneration),
}
GLM4V_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
    image_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
)  # fmt: skip
GLM4V_PRE = {
    "image_processor_type": "Glm4vImageProcessor",
    "size": {"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * MAX_PIXELS},  # two frames
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
}
INTERNVL_MARKERS = ["<img>", "</img>", "<IMG_CONTEXT>"]
INTERNVL_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    image_size=112, patch_size=14, use_qk_norm=True, norm_type="rms_norm", use_mean_pooling=False,
)  # fmt: skip
INTERNVL_PRE = {
    "image_processor_type": "GotOcr2ImageProcessor",
    "crop_to_patches": True,
    "min_patches": 1,
    "max_patches": 4,
    "size": {"height": 112, "width": 112},
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
}
IDEFICS3_MARKERS = ["<fake_token_around_image>", "<image>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
IDEFICS3_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    image_size=64, patch_size=8,
)  # fmt: skip
IDEFICS3_PRE = {  # tiles of 64 pixels, each 16 tokens (8 x 8 patches shuffled 2 x 2)
    "image_processor_type": "SmolVLMImageProcessor",
    "size": {"longest_edge": 128},
    "max_image_size": {"longest_edge": 64},
}
IDEFICS3_CLASSES = {  # the checkpoints of the tests: (config, model, its tower's settings)
    "smolvlm": (hf.SmolVLMConfig, hf.SmolVLMForConditionalGeneration, {}),
    # a tower of 7 x 7 positions under tiles of 8 x 8 patches: positions bucketed
    "idefics3": (hf.Idefics3Config, hf.Idefics3ForConditionalGeneration, {"image_size": 56}),
}
LLAVA_VISION = dict(  # CLIP: 4 x 4 patches of 14 pixels, a class token
    model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32,
)  # fmt: skip
LLAVA_PRE = {
    "image_processor_type": "LlavaImageProcessor",
    "size": {"shortest_edge": 56},
    "crop_size": {"height": 56, "width": 56},
}
CLIP_BOUNDS = {"input_min": -2.0, "input_max": 2.0, "output_min": -3.0, "output_max": 3.0}


def build_vl_checkpoint(root, family: str, model_dir):
    """(HF model, its folder): weights large enough that greedy choices are not near-ties."""
    if family == "gemma3":
        return build_gemma3_checkpoint(root, model_dir)
    if family == "gemma4":
        return build_gemma4_checkpoint(root, model_dir)
    if family.startswith("pixtral"):
        return build_pixtral_checkpoint(root, model_dir, family)
    if family in GLM4V_CLASSES:
        return build_glm4v_checkpoint(root, model_dir, family)
    if family.startswith("internvl"):
        return build_internvl_checkpoint(root, model_dir, family)
    if family in IDEFICS3_CLASSES:
        return build_idefics3_checkpoint(root, model_dir, family)
    if family.startswith("llava"):
        return build_llava_checkpoint(root, model_dir, family)
    config_cls, model_cls, text, vision, patch = FAMILIES[family]
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    start, pad, end, video = tokenizer.convert_tokens_to_ids(MARKERS)
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = config_cls(
        text_config={**TEXT, **text, **ends},
        vision_config={**VISION, **vision, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        video_token_id=video,
        **ends,
    )
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.normal_(1.0, 0.1)
            else:
                tensor.normal_(0, 0.2)
    model.eval()
    path = root / family
    save(model, tokenizer, path)
    pre = {
        "patch_size": patch,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": MAX_PIXELS,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    if patch == 16:  # Qwen3-VL's video processor reads its own config (`size`: all frames)
        video = {**pre, "size": {"shortest_edge": 4096, "longest_edge": 200_000}}
        video.update(image_mean=[0.5] * 3, image_std=[0.5] * 3)
        (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    return model, path


def build_gemma3_checkpoint(root, model_dir):
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_MARKERS})
    boi, eoi, soft = tokenizer.convert_tokens_to_ids(GEMMA_MARKERS)
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = hf.Gemma3Config(
        text_config={**GEMMA_TEXT, **ends, "pad_token_id": 0},
        vision_config=GEMMA_VISION,
        mm_tokens_per_image=16,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=soft,
        **ends,
    )
    return built(
        root, "gemma3", hf.Gemma3ForConditionalGeneration, config, tokenizer, GEMMA_PRE, gemma3_init
    )


def gemma3_init(name: str, tensor: torch.Tensor) -> None:
    if "embed_tokens" in name:  # scaled by sqrt(hidden) in the model
        tensor.normal_(0, 0.05)
    else:
        tensor.normal_(0, 0.1 if "norm" in name else 0.2)


def build_gemma4_checkpoint(root, model_dir):
    """Gemma 4: images attended both ways on the sliding layers, KV-sharing layers, per-layer
    inputs, a tower with clipped linears and standardized outputs."""
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA4_MARKERS})
    image, boi, eoi, video = tokenizer.convert_tokens_to_ids(GEMMA4_MARKERS)
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = hf.Gemma4Config(
        text_config={**GEMMA4_TEXT, **ends},
        vision_config=GEMMA4_VISION,
        audio_config=None,
        image_token_id=image,
        boi_token_id=boi,
        eoi_token_id=eoi,
        video_token_id=video,
        **ends,
    )
    model_cls = hf.Gemma4ForConditionalGeneration
    return built(root, "gemma4", model_cls, config, tokenizer, GEMMA4_PRE, gemma4_init, True)


def gemma4_init(name: str, tensor: torch.Tensor) -> None:
    leaf = name.rpartition(".")[2]
    if leaf in CLIP_BOUNDS:
        tensor.fill_(CLIP_BOUNDS[leaf])
    elif "rotary" in name or "embed_scale" in name or not tensor.is_floating_point():
        return
    elif "norm" in name or "scalar" in name or leaf == "std_scale":
        tensor.normal_(1.0, 0.1)
    else:
        tensor.normal_(0, 0.05 if "embed_tokens" in name else 0.2)


MISTRAL4_TEXT = dict(  # Mistral Small 4's language model: latent attention, grouped experts
    MLA_MOE,
    model_type="mistral4",
    rope_parameters=dict(BETA_SCALED_YARN),
    head_dim=24,  # qk_nope_head_dim + qk_rope_head_dim
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
)


def build_pixtral_checkpoint(root, model_dir, name: str = "pixtral"):
    """Mistral 3: the Pixtral tower, 2x2 patch merging, a Ministral 3 language model (queries
    scaled up past an original context of 32 tokens, as Ministral 3's releases configure it
    at 16k); as `pixtral_mistral4`, Mistral Small 4's (Mistral 4's, scaled alike)."""
    text = MISTRAL4_TEXT if name == "pixtral_mistral4" else {"model_type": "ministral3"}
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": PIXTRAL_MARKERS})
    image = tokenizer.convert_tokens_to_ids(PIXTRAL_MARKERS[0])
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = hf.Mistral3Config(
        text_config={
            **TEXT,
            **ends,
            "rope_parameters": dict(BETA_SCALED_YARN),
            **text,
        },
        vision_config=PIXTRAL_VISION,
        image_token_index=image,
        spatial_merge_size=2,
        **ends,
    )
    model_cls = hf.Mistral3ForConditionalGeneration
    return built(root, name, model_cls, config, tokenizer, PIXTRAL_PRE, norm_around_one)


def build_glm4v_checkpoint(root, model_dir, name: str = "glm4v"):
    """GLM-4.1V: GLM-4's language model with M-RoPE over half of each head, its tower with
    bicubically resampled learned positions and a merging convolution; as `glm4v_moe`,
    GLM-4.5V's (GLM-4.5's MoE language model); as `glm46v`, GLM-4.6V's (its own config class,
    over GLM-4.5's MoE)."""
    moe = name in ("glm4v_moe", "glm46v")
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": GLM4V_MARKERS})
    start, image, end = tokenizer.convert_tokens_to_ids(GLM4V_MARKERS)
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text = dict(GLM4V_MOE_TEXT, model_type="glm4v_moe_text") if moe else GLM4V_TEXT
    config_cls, model_cls = GLM4V_CLASSES[name]
    config = config_cls(
        text_config={**text, **ends},
        vision_config=GLM4V_VISION,
        image_token_id=image,
        image_start_token_id=start,
        image_end_token_id=end,
        **ends,
    )
    return built(root, name, model_cls, config, tokenizer, GLM4V_PRE, norm_around_one)


INTERNVL_LANGUAGE_MODELS = {  # the language model under each InternVL checkpoint of the tests
    "internvl": {"model_type": "qwen3"},
    "internvl_qwen2": {"model_type": "qwen2"},
    "internvl_qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
    },
}


def build_internvl_checkpoint(root, model_dir, name: str = "internvl"):
    """InternVL 3.5: InternViT (q/k norms, RMSNorms, a final norm) over tiles of 112 pixels (up
    to four and a thumbnail), 2x2 pixel shuffle, a Qwen3 language model; as `internvl_qwen2`
    and `internvl_qwen3_moe`, over those."""
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": INTERNVL_MARKERS})
    context = tokenizer.convert_tokens_to_ids(INTERNVL_MARKERS[2])
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = hf.InternVLConfig(
        text_config={**TEXT, **ends, **INTERNVL_LANGUAGE_MODELS[name]},
        vision_config=INTERNVL_VISION,
        image_token_id=context,
        image_seq_length=16,
        tie_word_embeddings=False,
        **ends,
    )
    model_cls = hf.InternVLForConditionalGeneration
    return built(root, name, model_cls, config, tokenizer, INTERNVL_PRE, norm_around_one)


def build_idefics3_checkpoint(root, model_dir, name: str = "smolvlm"):
    """SmolVLM (as `idefics3`, Idefics3): SigLIP over tiles of 64 pixels (an image scaled to
    128 on its longer side, cut into two by two or one by two tiles and the whole image), 2x2
    pixel shuffle, a Llama language model."""
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_MARKERS})
    config_cls, model_cls, vision = IDEFICS3_CLASSES[name]
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = config_cls(
        text_config={**TEXT, **ends, "model_type": "llama"},
        vision_config={**IDEFICS3_VISION, **vision},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        **ends,
    )
    return built(root, name, model_cls, config, tokenizer, IDEFICS3_PRE, norm_around_one)


def build_llava_checkpoint(root, model_dir, name: str = "llava"):
    """LLaVA 1.5's layout: CLIP (its second-to-last layer's patches), a two-layer projector, a
    Llama language model; as `llava_siglip`, a SigLIP tower (its last layer's patches, all
    kept) over Qwen2."""
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    siglip = name == "llava_siglip"
    vision = dict(LLAVA_VISION, model_type="siglip_vision_model") if siglip else LLAVA_VISION
    config = hf.LlavaConfig(
        text_config={**TEXT, **ends, "model_type": "qwen2" if siglip else "llama"},
        vision_config={k: v for k, v in vision.items() if not (siglip and k == "projection_dim")},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        **(dict(vision_feature_layer=-1, vision_feature_select_strategy="full") if siglip else {}),
        **ends,
    )
    model_cls = hf.LlavaForConditionalGeneration
    return built(root, name, model_cls, config, tokenizer, LLAVA_PRE, norm_around_one)


def norm_around_one(name: str, tensor: torch.Tensor) -> None:
    tensor.normal_(1.0, 0.1) if "norm" in name else tensor.normal_(0, 0.2)


def built(root, name, model_cls, config, tokenizer, pre: dict, init, buffers: bool = False):
    """(HF model of `config` with each parameter, and with `buffers` each buffer, set by
    `init(name, tensor)`; its folder, saved with the tokenizer and `pre` as its preprocessor
    config)."""
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        tensors = [*model.named_parameters(), *(model.named_buffers() if buffers else [])]
        for tensor_name, tensor in tensors:
            init(tensor_name, tensor)
    model.eval()
    path = root / name
    save(model, tokenizer, path)
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return model, path


def save(model, tokenizer, path) -> None:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def image_processor(path):
    pre = json.loads((path / "preprocessor_config.json").read_text())
    kind = pre.pop("image_processor_type", None)
    if kind == "Gemma3ImageProcessor":
        return Gemma3ImageProcessorPil(**pre)
    if kind == "Gemma4ImageProcessor":
        return Gemma4ImageProcessorPil(**pre)
    if kind == "GotOcr2ImageProcessor":
        return GotOcr2ImageProcessorPil(**pre)
    if kind == "Glm4vImageProcessor":
        return Glm4vImageProcessorPil(**pre)
    if kind == "LlavaImageProcessor":
        return LlavaImageProcessorPil(**pre)
    if kind == "SmolVLMImageProcessor":  # with each image's rows and columns of tiles
        return SmolVLMImageProcessorPil(**pre, return_row_col_info=True)
    if kind == "PixtralImageProcessor":  # as PixtralProcessor calls it: patches of merged size
        merged = (
            pre.pop("patch_size")
            * json.loads((path / "config.json").read_text())["spatial_merge_size"]
        )
        return PixtralImageProcessorPil(**pre, patch_size={"height": merged, "width": merged})
    return Qwen2VLImageProcessorPil(**pre)


def marker(model) -> list[int]:
    """The ids a prompt holds for one image."""
    c = model.config
    if c.model_type == "gemma3":
        return [c.boi_token_index]
    if c.model_type in ("gemma4", "mistral3", "internvl", "smolvlm", "idefics3", "llava"):
        return [c.image_token_id]
    if c.model_type in GLM4V_CLASSES:
        return [c.image_start_token_id, c.image_token_id, c.image_end_token_id]
    return [c.vision_start_token_id, c.image_token_id, c.vision_end_token_id]


def picture(seed: int, size=(100, 70)) -> Image.Image:
    """Random colour blobs (a 4x4 grid of random colours, smoothly resized) with fine noise:
    pictures that differ at every scale."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray((rng.random((4, 4, 3)) * 255).astype("uint8")).resize(size, 2)
    noise = rng.normal(0, 20, (size[1], size[0], 3))
    return Image.fromarray(np.clip(np.asarray(coarse) + noise, 0, 255).astype("uint8"))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def hf_greedy(model, path, prompt_ids: list[int], images: list[Image.Image], n: int):
    """HF's greedy tokens for a prompt that marks each image, expanded as HF's processor does
    (Gemma 3: two newlines, its start token, its tokens, its end token, two newlines), and
    the expanded prompt's length."""
    out = image_processor(path)(images=images, return_tensors="pt")
    ids, extra = expanded(model, path, prompt_ids, out), {}
    input_ids = torch.tensor([ids])
    image = model.config.image_token_id
    if model.config.model_type == "gemma3":
        extra["token_type_ids"] = (input_ids == image).long()
    elif model.config.model_type == "gemma4":
        extra["image_position_ids"] = out["image_position_ids"]
        extra["mm_token_type_ids"] = (input_ids == image).long()
    elif model.config.model_type == "mistral3":
        extra["image_sizes"] = out["image_sizes"]
    elif model.config.model_type in IDEFICS3_CLASSES:
        extra["pixel_attention_mask"] = out["pixel_attention_mask"]
    elif model.config.model_type not in ("internvl", "llava"):  # the pixels alone
        extra["image_grid_thw"] = out["image_grid_thw"]
        extra["mm_token_type_ids"] = (input_ids == image).int()
    with torch.no_grad():
        gen = model.generate(
            input_ids,
            pixel_values=out["pixel_values"],
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **extra,
        )
    return gen[0, len(ids) :].tolist(), len(ids)


def expanded(model, path, prompt_ids: list[int], out) -> list[int]:
    c = model.config
    if c.model_type == "gemma3":
        newlines = hf.AutoTokenizer.from_pretrained(path).encode("\n\n", add_special_tokens=False)
        image = newlines + [c.boi_token_index] + [c.image_token_id] * c.mm_tokens_per_image
        counts, place, after = None, c.boi_token_index, [c.eoi_token_index] + newlines
    elif c.model_type == "gemma4":
        counts = iter([int(n) for n in out["num_soft_tokens_per_image"]])
        return gemma4_expanded(c, prompt_ids, counts)
    elif c.model_type == "mistral3":
        return pixtral_expanded(c, path, prompt_ids, iter(out["image_sizes"].tolist()))
    elif c.model_type == "internvl":
        return internvl_expanded(c, path, prompt_ids, iter(out["num_patches"].tolist()))
    elif c.model_type in IDEFICS3_CLASSES:
        return idefics3_expanded(c, path, prompt_ids, out)
    elif c.model_type == "llava":  # a token a patch (the class token dropped, or none)
        vc = c.vision_config
        counts, place, after = None, c.image_token_id, []
        image = [place] * (vc.image_size // vc.patch_size) ** 2
    else:
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        place, after = c.image_token_id, []
    ids = []
    for t in prompt_ids:
        if t != place:
            ids.append(t)
        elif counts is None:
            ids += image + after
        else:
            ids += [place] * next(counts)
    return ids


def gemma4_expanded(c, prompt_ids: list[int], counts) -> list[int]:
    """Each image token as its start token, its tokens and its end token."""
    ids = []
    for t in prompt_ids:
        ids += (
            [c.boi_token_id, *[t] * next(counts), c.eoi_token_id] if t == c.image_token_id else [t]
        )
    return ids


def internvl_expanded(c, path, prompt_ids: list[int], tiles) -> list[int]:
    """Each image token as InternVLProcessor writes it: `<img>`, the tokens of every tile,
    `</img>`."""
    start, end = hf.AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(INTERNVL_MARKERS[:2])
    ids = []
    for t in prompt_ids:
        ids += (
            [start, *[t] * (c.image_seq_length * next(tiles)), end]
            if t == c.image_token_id
            else [t]
        )
    return ids


def idefics3_expanded(c, path, prompt_ids: list[int], out) -> list[int]:
    """Each image token as SmolVLM's (and Idefics3's) processor writes it: its tiles' text from
    `get_image_prompt_string`, tokenized."""
    tokenizer = hf.AutoTokenizer.from_pretrained(path)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    per_tile = (pre["max_image_size"]["longest_edge"] // c.vision_config.patch_size // 2) ** 2
    sizes = iter(zip(out["rows"][0], out["cols"][0]))
    ids = []
    for t in prompt_ids:
        if t != c.image_token_id:
            ids.append(t)
            continue
        text = get_image_prompt_string(*next(sizes), per_tile, *IDEFICS3_MARKERS[:3])
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids


def pixtral_expanded(c, path, prompt_ids: list[int], sizes) -> list[int]:
    """Each image token as PixtralProcessor writes it: rows of image tokens, each ended by a
    row break, the last by the image end."""
    breaks, end = hf.AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(PIXTRAL_MARKERS[1:])
    side = c.vision_config.patch_size * c.spatial_merge_size
    ids = []
    for t in prompt_ids:
        if t != c.image_token_id:
            ids.append(t)
            continue
        height, width = next(sizes)
        span = ([t] * (width // side) + [breaks]) * (height // side)
        ids += span[:-1] + [end]
    return ids


def chat_twice_as_hf(server, content: list[dict], tokenizer, want: list[int], prompt_len: int):
    """One user message of `content` through the chat route twice (the second from the cache),
    each answer HF's greedy text of `prompt_len` prompt tokens; the second's cached tokens."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": len(want),
        "temperature": 0,
        "ignore_eos": True,
    }
    for _ in range(2):
        r = server.client().post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        text = tokenizer.decode(want, skip_special_tokens=True)
        assert r.json()["choices"][0]["message"]["content"] == text
        assert r.json()["usage"]["prompt_tokens"] == prompt_len
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
