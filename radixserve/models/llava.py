"""LLaVA (`LlavaForConditionalGeneration`: LLaVA 1.5 and the checkpoints in its layout): each
image at one square size through a CLIP tower (a class embedding before the patches, learned
positions, a layer norm before the blocks) or a SigLIP one, the features of layer
`vision_feature_layer` (the class token's dropped under the `default` strategy) projected by a
two-layer MLP to the language model's width: Llama, Mistral or Qwen2. Plain positions: an
image's tokens are text tokens to the language model."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import TPGroup
from .decoder import swap_prefix
from .llama import LlamaForCausalLM
from .qwen_vision import activation
from .siglip import SiglipTower

# the checkpoint's names for its parts (as transformers loads them, and as it saves them) -> ours
PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision.tower."),
    ("vision_tower.vision_model.", "vision.tower."),
    ("model.vision_tower.", "vision.tower."),
    ("vision_tower.", "vision.tower."),
    ("model.multi_modal_projector.", "vision.projector."),
    ("multi_modal_projector.", "vision.projector."),
)
UNUSED = ("vision.tower.head.",)  # SigLIP's pooling head
# the tower configs' defaults in transformers: CLIP's (with a class token), SigLIP's
TOWER_DEFAULTS = {
    True: {"image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    False: {"image_size": 224, "patch_size": 16},
}


class LlavaVision(nn.Module):
    def __init__(self, hf: dict, text_hidden: int):
        super().__init__()
        vc = hf["vision_config"]
        clip = vc.get("model_type", "clip_vision_model") == "clip_vision_model"
        self.tower = SiglipTower({**TOWER_DEFAULTS[clip], **vc}, class_token=clip)
        # the hidden states taken: 0 the embeddings .. the last block's
        self.depth = int(hf.get("vision_feature_layer", -2)) % (vc["num_hidden_layers"] + 1)
        strategy = hf.get("vision_feature_select_strategy", "default")
        self.drop_class = clip and strategy == "default"
        bias = hf.get("multimodal_projector_bias", True)
        self.projector = nn.Module()
        self.projector.linear_1 = nn.Linear(vc["hidden_size"], text_hidden, bias=bias)
        self.projector.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(hf.get("projector_hidden_act", "gelu"))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """`[images, 3, size, size]` -> the images' tokens in turn `[images x tokens, hidden]`."""
        x = self.tower.hidden_states(images, depth=self.depth)
        x = x[:, 1:] if self.drop_class else x
        pr = self.projector
        return pr.linear_2(self.act(pr.linear_1(x.flatten(0, 1))))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA over Llama, Mistral or Qwen2."""

    def __init__(self, cfg, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.vision = LlavaVision(self.hf, cfg.hidden_size)

    def rename(self, name: str) -> str | None:
        name = swap_prefix(name, PREFIXES)
        return None if name.startswith(UNUSED) else super().rename(name)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids):
        size = self.vision.tower.size
        return self.vision(pixels.view(-1, 3, size, size)), []
