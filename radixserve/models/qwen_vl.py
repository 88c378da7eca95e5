"""Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5: the Qwen2, Qwen3, Qwen3-MoE and Qwen3.5
language models with M-RoPE (each rotary frequency turned by the time, row or column position
of its section) and their vision towers (`qwen_vision`). Image tokens take the tower's
features (`CausalLM.embed`); Qwen3-VL's DeepStack features are added after its first layers
(`CausalLM.forward`)."""

from __future__ import annotations

import torch

from ..distributed import TPGroup
from .llama import LlamaForCausalLM, Qwen3ForCausalLM
from .moe import unstack_experts
from .qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM
from .qwen_vision import Qwen2VisionTower, Qwen3VisionTower, Qwen25VisionTower
from .rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary tables read at 3-D positions `[3, T]` (time, height, width): frequency j takes
    the axis `axis[j]` gives it, in consecutive sections (Qwen2.5-VL) or interleaved ones
    (Qwen3-VL: t h w t h w ..., the rest time). 1-D positions (a step of text only, where all
    three axes agree) read the table as usual."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling, mrope: dict):
        super().__init__(head_dim, max_positions, theta, scaling)
        section = mrope["mrope_section"]
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        if mrope.get("mrope_interleaved"):
            for a in (1, 2):
                axis[a : section[a] * 3 : 3] = a
        else:
            axis[section[0] : section[0] + section[1]] = 1
            axis[section[0] + section[1] : sum(section)] = 2
        self.register_buffer("axis", axis, persistent=False)
        self.register_buffer("freq", torch.arange(head_dim // 2), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        at = positions[self.axis].T  # [T, head_dim/2]: each frequency's position
        return (
            self.cos[at, self.freq].unsqueeze(1).to(dtype),
            self.sin[at, self.freq].unsqueeze(1).to(dtype),
        )


class VisionLanguage:
    """What both families add to their language model: the tower under `visual`, M-RoPE, and
    the checkpoint's names (`model.language_model.` and `model.visual.`, or the older
    `model.` and `visual.`)."""

    tower_class: type

    def __init__(self, cfg, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.visual = self.tower_class(self.hf["vision_config"])

    def make_rotaries(self, max_positions: int):
        cfg = self.cfg
        mrope = self.hf.get("rope_parameters") or self.hf.get("rope_scaling")
        width = int(cfg.head_dim * mrope.get("partial_rotary_factor", 1.0))
        rotary = MRotaryEmbedding(
            width, max_positions, cfg.rope_theta, cfg.rope_scaling_dict, mrope
        )
        return [rotary]

    def rename(self, name: str) -> str | None:
        if name.startswith(("model.visual.", "visual.")):
            return name.removeprefix("model.")
        return super().rename(name.replace("model.language_model.", "model.", 1))

    @property
    def mrope_merge_size(self) -> int:
        return self.visual.merge

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        """Each image's tokens `[tokens, hidden]` in order, and the DeepStack features alike."""
        return self.visual(pixels, grids)


class Qwen2_5_VLForConditionalGeneration(VisionLanguage, LlamaForCausalLM):
    tower_class = Qwen25VisionTower


class Qwen2VLForConditionalGeneration(VisionLanguage, LlamaForCausalLM):
    """Qwen2-VL: Qwen2.5-VL's positions and language model, its own tower (MLP layers named
    `fc1`, `fc2` in the checkpoint)."""

    tower_class = Qwen2VisionTower

    def rename(self, name: str) -> str | None:
        if "visual." in name:
            name = name.replace(".mlp.fc1.", ".mlp.linear_fc1.")
            name = name.replace(".mlp.fc2.", ".mlp.linear_fc2.")
        return super().rename(name)


class Qwen3VLForConditionalGeneration(VisionLanguage, Qwen3ForCausalLM):
    tower_class = Qwen3VisionTower


class Qwen3VLMoeForConditionalGeneration(VisionLanguage, Qwen3MoeForCausalLM):
    """Qwen3-VL's tower over Qwen3-MoE. Its experts come stacked, `gate_up_proj` and
    `down_proj` per layer, as the hub stores them (each expert's matrix inputs first) or as
    transformers saves them (outputs first): told apart by shape, as transformers does."""

    tower_class = Qwen3VisionTower

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(self.outputs_first(weights)))

    def outputs_first(self, weights):
        inter, hidden = self.hf["moe_intermediate_size"], self.cfg.hidden_size
        rows = {"gate_up_proj": 2 * inter, "down_proj": hidden}
        for name, tensor in weights:
            leaf = name.rpartition(".")[2]
            if ".experts." in name and leaf in rows and tensor.dim() == 3:
                if tensor.shape[1] != rows[leaf]:
                    tensor = tensor.transpose(1, 2)
            yield name, tensor


class Qwen3_5ForConditionalGeneration(VisionLanguage, Qwen3_5ForCausalLM):
    """Qwen3.5's hybrid language model with Qwen3-VL's tower (without DeepStack)."""

    tower_class = Qwen3VisionTower


class Qwen3_5MoeForConditionalGeneration(VisionLanguage, Qwen3_5MoeForCausalLM):
    tower_class = Qwen3VisionTower
