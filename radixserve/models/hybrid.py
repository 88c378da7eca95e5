"""The shape every hybrid family shares: a token mixer per layer that is either attention (KV per
token, numbered among the attention layers for the pool) or a layer that keeps a state per
request (`recurrent.RecurrentStates`, shared by the model's layers), chosen by the config's
`layer_types`."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable

import torch
from torch import nn

from ..attention import AttentionInputs
from ..distributed import TPGroup
from ..model_config import ModelConfig, is_attention_layer, layer_types_of
from .decoder import CausalLM, DecoderLayer
from .recurrent_states import RecurrentStates

SPLIT_CONVOLUTION = re.compile(r"(.*)\.([qkv])_conv1d\.weight")


class HybridCausalLM(CausalLM):
    """A family says how its attention (`make_attention`, given layer i's place in the KV pool
    and i), its stateful mixer (`make_mixer`) and, if it differs from the pre-norm one, its
    layer (`make_decoder_layer`) are built."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        self.states = RecurrentStates()
        super().__init__(cfg, max_positions, tp)

    def make_layer(self, i: int) -> nn.Module:
        if is_attention_layer(layer_types_of(self.hf)[i]):
            mixer = self.make_attention(self.kv_index_of(i), i)
        else:
            mixer = self.make_mixer(i)
        return self.make_decoder_layer(i, mixer)

    def kv_index_of(self, i: int) -> int:
        """Attention layer i's place in the KV pool (among the attention layers)."""
        return sum(is_attention_layer(t) for t in layer_types_of(self.hf)[:i])

    def kv_cache_scales(self) -> list[tuple[float, float]]:
        """The attention layers' FP8 KV scales, in their places in the KV pool."""
        scales = super().kv_cache_scales()
        types = layer_types_of(self.hf)
        return [scales[i] for i, kind in enumerate(types) if is_attention_layer(kind)]

    def state_bytes(self, dtype: torch.dtype) -> int:
        """The bytes of one request's state over all its layers (convolutions in `dtype`,
        recurrent states in float32)."""
        mixers = [m for m in self.modules() if m is not self and hasattr(m, "state_bytes")]
        return sum(m.state_bytes(dtype) for m in mixers)

    def run_mixers_a_token_at_a_time(self) -> None:
        """Deterministic inference: each stateful mixer runs the step's tokens one at a time
        (`one_token_at_a_time`), so its every op sees the same shapes whatever the batch
        around a request and wherever its chunks or cached prefix end (torch's vectorized
        elementwise ops give other bits in a tensor's tail than in its body)."""
        for module in self.modules():
            if module is not self and hasattr(module, "state_bytes"):
                module.forward = one_token_at_a_time(module.forward)

    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        raise NotImplementedError

    def make_mixer(self, i: int) -> nn.Module:
        raise NotImplementedError

    def make_decoder_layer(self, i: int, mixer: nn.Module) -> nn.Module:
        return DecoderLayer(self.cfg, i, self.tp, mixer, self.make_mlp(i))


@dataclass
class OneTokenStep:
    """What a stateful mixer reads of the attention backend: the step's inputs (here, one
    token's)."""

    inputs: AttentionInputs


def one_token_at_a_time(forward):
    """A stateful mixer's `forward(x, ropes, backend)` over the step's tokens one at a time,
    each a one-token segment of its request continuing the state the previous one left."""

    def run(x: torch.Tensor, ropes, backend) -> torch.Tensor:
        inputs, outputs, start = backend.inputs, [], 0
        segments = zip(inputs.extend_lens.tolist(), inputs.prefix_lens.tolist())
        for b, (length, prefix) in enumerate(segments):
            for t in range(start, start + length):
                seen = prefix + t - start + 1
                one = replace(
                    inputs,
                    is_decode=seen > 1,
                    out_cache_loc=inputs.out_cache_loc[t : t + 1],
                    rows=inputs.rows[b : b + 1],
                    seq_lens=inputs.seq_lens.new_tensor([seen]),
                    extend_lens=inputs.extend_lens.new_tensor([1]),
                    max_seq_len=seen,
                    max_extend_len=1,
                )
                outputs.append(forward(x[t : t + 1], ropes, OneTokenStep(one)))
            start += length
        return torch.cat(outputs)

    return run


def joined_convolutions(weights: Iterable[tuple[str, torch.Tensor]]):
    """Checkpoints' separate q, k and v convolutions (`q_conv1d`...: OLMo Hybrid's and Kimi
    Linear's releases) as the one over all three that the layer runs (`conv1d`, q's channels
    first)."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = SPLIT_CONVOLUTION.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, part = match.groups()
        parts = waiting.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == 3:
            yield f"{prefix}.conv1d.weight", torch.cat([parts[p] for p in "qkv"])
            del waiting[prefix]
