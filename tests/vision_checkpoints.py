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
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

MARKERS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
VOCAB = 49280  # SmolLM2's 49152 tokens, the three image tokens, room to spare
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
FAMILIES = {
    "qwen2_5_vl": (
        hf.Qwen2_5_VLConfig,
        hf.Qwen2_5_VLForConditionalGeneration,
        dict(rope_parameters={"rope_type": "default", "type": "mrope", "mrope_section": [2, 3, 3]}),
        dict(patch_size=14, window_size=56, fullatt_block_indexes=[1], hidden_act="silu"),
        14,
    ),
    "qwen3_vl": (
        hf.Qwen3VLConfig,
        hf.Qwen3VLForConditionalGeneration,
        dict(
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            }
        ),
        dict(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        16,
    ),
}
MAX_PIXELS = 56 * 56 * 16  # small images: at most ~64 tokens each


def build_vl_checkpoint(root, family: str, model_dir):
    """(HF model, its folder): weights large enough that greedy choices are not near-ties."""
    config_cls, model_cls, text, vision, patch = FAMILIES[family]
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    start, pad, end = tokenizer.convert_tokens_to_ids(MARKERS)
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = config_cls(
        text_config={**TEXT, **text, **ends},
        vision_config={**VISION, **vision, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        video_token_id=pad + 100,
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
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    pre = {
        "patch_size": patch,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": MAX_PIXELS,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return model, path


def image_processor(path) -> Qwen2VLImageProcessorPil:
    pre = json.loads((path / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessorPil(**pre)


def picture(seed: int, size=(100, 70)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def hf_greedy(model, path, prompt_ids: list[int], images: list[Image.Image], n: int):
    """HF's greedy tokens for a prompt whose image tokens stand one per image."""
    pad = model.config.image_token_id
    out = image_processor(path)(images=images, return_tensors="pt")
    grids = out["image_grid_thw"]
    ids = []
    counts = iter((grids.prod(-1) // 4).tolist())
    for t in prompt_ids:
        ids += [pad] * next(counts) if t == pad else [t]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        gen = model.generate(
            input_ids,
            pixel_values=out["pixel_values"],
            image_grid_thw=grids,
            mm_token_type_ids=(input_ids == pad).int(),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return gen[0, len(ids) :].tolist(), len(ids)
