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
from .siglip import SiglipLayer

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
UNUSED = ("vision.tower.post_layernorm.", "vision.tower.head.")  # after the features taken


class LlavaTower(nn.Module):
    """CLIP's tower (`clip_vision_model`) or SigLIP's: the hidden states after `depth` blocks."""

    def __init__(self, vc: dict, depth: int):
        super().__init__()
        self.clip = vc.get("model_type", "clip_vision_model") == "clip_vision_model"
        dim, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-5 if self.clip else 1e-6)
        self.size = vc.get("image_size", 224)
        self.patch = vc.get("patch_size", 32 if self.clip else 16)
        patches = (self.size // self.patch) ** 2
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(
            vc.get("num_channels", 3), dim, self.patch, self.patch, bias=not self.clip
        )
        self.embeddings.position_embedding = nn.Embedding(patches + self.clip, dim)
        if self.clip:
            self.embeddings.class_embedding = nn.Parameter(torch.zeros(dim))
            self.pre_layrnorm = nn.LayerNorm(dim, eps=eps)
        act = vc.get("hidden_act", "quick_gelu" if self.clip else "gelu_pytorch_tanh")
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipLayer(dim, vc["num_attention_heads"], vc["intermediate_size"], act, eps)
            for _ in range(vc["num_hidden_layers"])
        )
        self.depth = depth % (len(self.encoder.layers) + 1)  # hidden states 0..layers

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """`[images, 3, size, size]` -> `[images, (class token and) patches, dim]`."""
        conv = self.embeddings.patch_embedding
        x = conv(pixels.to(conv.weight.dtype)).flatten(2).transpose(1, 2)
        if self.clip:
            cls = self.embeddings.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        x = x + self.embeddings.position_embedding.weight
        if self.clip:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers[: self.depth]:
            x = layer(x)
        return x


class LlavaVision(nn.Module):
    def __init__(self, hf: dict, text_hidden: int):
        super().__init__()
        vc = hf["vision_config"]
        self.tower = LlavaTower(vc, int(hf.get("vision_feature_layer", -2)))
        strategy = hf.get("vision_feature_select_strategy", "default")
        self.drop_class = self.tower.clip and strategy == "default"
        bias = hf.get("multimodal_projector_bias", True)
        self.projector = nn.Module()
        self.projector.linear_1 = nn.Linear(vc["hidden_size"], text_hidden, bias=bias)
        self.projector.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(hf.get("projector_hidden_act", "gelu"))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """`[images, 3, size, size]` -> the images' tokens in turn `[images x tokens, hidden]`."""
        x = self.tower(images)
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
