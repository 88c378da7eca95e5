"""Llama and the families that are Llama with other names or a bias: Qwen2 (qkv bias), Mistral,
Phi-3 (fused checkpoint tensors), Qwen3 (q/k norms per head)."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch
from torch import nn

from ..attention import AttentionBackend, LayerAttention
from ..distributed import TPGroup
from .decoder import Attention, CausalLM, DecoderLayer, layer_window
from .layers import Linear, RMSNorm, StepImages, fused
from .registry import num_labels
from .rotary import QueryTemperature, beta_query_scaling

NO_LORA_RUNS = torch.empty(0, 3, dtype=torch.long)  # a step without adapter rows


class LlamaForCausalLM(CausalLM):
    """On CPU in float32 or bf16 its layers can run as one C++ call (`fuse_cpu_layers`), LoRA
    adapters' deltas included (float32)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        images: StepImages | None = None,
    ) -> torch.Tensor:
        groups = backend.kernel_groups() if fused(self.cpu_decoder) is not None else None
        if not groups or (images is not None and images.deepstack):
            return super().forward(input_ids, positions, backend, images)
        embedded = self.embed(input_ids, images)
        cos, sin = self.rotaries[0].cos_sin(positions, torch.float32)
        normed = self.model.layers[0].input_layernorm(embedded).float()
        x = embedded.float()  # the decoder's residual stream is float32 in either dtype
        inputs = backend.inputs
        runs = self.lora_segments.runs if self.lora_segments is not None else []
        lora_runs = torch.tensor(runs, dtype=torch.long) if runs else NO_LORA_RUNS
        return self.cpu_decoder.forward(
            x, normed, cos, sin, inputs.out_cache_loc, inputs.req_to_token, groups, lora_runs
        )

    def fuse_cpu_layers(self, backend: AttentionBackend) -> bool:
        """Run the decoder layers through one C++ call (`CpuDecoder`,
        radixserve_kernels/cpu_decoder.cpp) in the steps whose attention the backend runs through
        its paged CPU kernels: the same kernels in the same order, without Python between them.
        Needs every linear layer packed for the CPU GEMM (float32 or bf16, with a pool of the
        same dtype), one rank and a backend that offers `kernel_groups`; LoRA needs float32."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        cpu_ops = self.lm_head.cpu_ops
        if (
            cpu_ops is None
            or self.tp.size > 1
            or not hasattr(backend, "kernel_groups")
            or self.attention_features()
            or any(getattr(layer.mlp, "act_name", None) != "silu" for layer in self.model.layers)
            or any(m.weight_packed is None for m in linears)
            or backend.pool.k[0].dtype not in (torch.float32, torch.bfloat16)
            or any(m.weight_packed.dtype != backend.pool.k[0].dtype for m in linears)
            or (self.lora_segments is not None and backend.pool.k[0].dtype != torch.float32)
        ):
            return False
        layers = self.model.layers
        weights, out_features = [], []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias if attn.qkv_proj.bias is not None else torch.empty(0)
            weights += [
                attn.qkv_proj.weight_packed,
                bias.float(),
                attn.o_proj.weight_packed,
                layer.post_attention_layernorm.weight.float(),
                mlp.gate_up_proj.weight_packed,
                mlp.down_proj.weight_packed,
                self.norm_after(i).weight.float(),
            ]
            out_features += [
                m.out_features
                for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
        cfg = self.cfg
        self.cpu_decoder = cpu_ops.CpuDecoder(
            [w.detach() for w in weights],
            out_features,
            backend.pool.k,
            backend.pool.v,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            backend.scale,
        )
        if self.lora_segments is not None:
            self.cpu_decoder.set_lora(self._lora_pairs())
        return True

    def _lora_pairs(self) -> list[torch.Tensor]:
        """Each layer's four GEMMs' adapter A and B (lora_weights.LoraPool), empty where none."""
        pairs, none = [], torch.empty(0)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                pairs += [m.lora.a, m.lora.b] if m.lora is not None else [none, none]
        return pairs


class Phi3ForCausalLM(LlamaForCausalLM):
    """Its checkpoint fuses q/k/v and gate/up; they are split back so that tensor parallelism
    slices them like Llama's."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights):
        rows = self._qkv_rows()
        for name, tensor in split_gate_up(weights):
            if name.endswith("qkv_proj.weight"):
                for part, piece in zip(("q", "k", "v"), tensor.split(rows, dim=0)):
                    yield name.replace("qkv_proj", f"{part}_proj"), piece
            else:
                yield name, tensor

    def _qkv_rows(self) -> list[int]:
        """q, k and v rows of the unsharded checkpoint (`cfg` is this rank's share)."""
        cfg, ranks = self.cfg, self.tp.size
        return [cfg.q_size * ranks, cfg.kv_size * ranks, cfg.kv_size * ranks]


def split_per_head(tensor, heads: int, count: int) -> list:
    """A tensor whose rows hold each head's `count` parts in turn (q, k and v; q and a gate) as
    each part's rows for every head."""
    per_head = tensor.reshape(heads, count, -1, *tensor.shape[1:])
    return [per_head[:, i].reshape(-1, *tensor.shape[1:]) for i in range(count)]


def split_gate_up(weights):
    """A fused `gate_up_proj` as the gate and up projections it joins (so that tensor
    parallelism slices each); other tensors pass through."""
    for name, tensor in weights:
        if name.endswith("gate_up_proj.weight"):
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace("gate_up_proj", "gate_proj"), gate
            yield name.replace("gate_up_proj", "up_proj"), up
        else:
            yield name, tensor


class Qwen3ForCausalLM(CausalLM):
    """Llama with an RMSNorm over each head's q and k."""

    def make_layer(self, i: int) -> nn.Module:
        cfg = self.cfg
        how = LayerAttention(window=layer_window(self.hf, i))
        attention = Attention(cfg, i, self.tp, how, qkv_bias=cfg.qkv_bias, qk_norm=RMSNorm)
        return DecoderLayer(cfg, i, self.tp, attention, self.make_mlp(i))


class ScoreHead:
    """A cross-encoder (HF's `*ForSequenceClassification`): the checkpoint's `score` layer,
    `num_labels` wide and never tied, takes the LM head's place; `compute_logits` of the last
    token's hidden state is the pair's score."""

    def __init__(self, cfg, max_positions: int, tp):
        super().__init__(replace(cfg, tie_word_embeddings=False), max_positions, tp)
        self.lm_head = Linear(self.cfg.hidden_size, num_labels(self.hf))

    def rename(self, name: str) -> str | None:
        return "lm_head.weight" if name == "score.weight" else super().rename(name)


class LlamaForSequenceClassification(ScoreHead, LlamaForCausalLM):
    pass


class Qwen3ForSequenceClassification(ScoreHead, Qwen3ForCausalLM):
    pass


class Ministral3ForCausalLM(LlamaForCausalLM):
    """Ministral 3 (and Mistral 3 language models): Mistral whose queries grow with the position
    past the original context (`rope_parameters.llama_4_scaling_beta`). Within the original
    context the scale is 1, so such steps still run the fused CPU decoder."""

    def __init__(self, cfg, max_positions: int, tp: TPGroup = TPGroup()):
        self.scaling = beta_query_scaling(cfg.hf_config)
        super().__init__(cfg, max_positions, tp)

    def make_layer(self, i: int) -> nn.Module:
        if self.scaling is None:
            return super().make_layer(i)
        cfg = self.cfg
        how = LayerAttention(window=layer_window(self.hf, i))
        attention = Attention(cfg, i, self.tp, how, qkv_bias=cfg.qkv_bias, temperature=1)
        return DecoderLayer(cfg, i, self.tp, attention, self.make_mlp(i))

    def make_rotaries(self, max_positions: int):
        rotaries = super().make_rotaries(max_positions)
        return rotaries if self.scaling is None else [*rotaries, QueryTemperature(*self.scaling)]

    def forward(self, input_ids, positions, backend, images=None):
        scaled = self.scaling is not None and positions.numel()
        if scaled and int(positions.max()) >= self.scaling[0]:
            return CausalLM.forward(self, input_ids, positions, backend, images)
        return super().forward(input_ids, positions, backend, images)
