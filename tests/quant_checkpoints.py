"""Tiny random HF Llama checkpoints in the quantized layouts users ship, written here from HF's
own model classes: block FP8 (HF `fp8`), per-channel / per-tensor FP8 (compressed-tensors), AWQ
and GPTQ int4. Each builder returns the checkpoint folder and the HF model holding the
dequantized weights, the oracle the served model must match in float32."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as hf
from safetensors.torch import save_file

CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def random_llama(seed: int = 0) -> hf.LlamaForCausalLM:
    torch.manual_seed(seed)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(**CONFIG))
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.normal_(0, 0.1 if "norm" in name else 0.2)
    return model.eval()


def _quantized_names(model) -> list[str]:
    return [
        name
        for name, _ in model.named_parameters()
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS
    ]


def _save(model, path: Path, tensors: dict, quantization_config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _set_weight(model, name: str, weight: torch.Tensor) -> None:
    with torch.no_grad():
        model.get_parameter(name).copy_(weight)


# ---- FP8 --------------------------------------------------------------------------------------
def fp8_block(path: Path, block=(128, 128), seed: int = 0):
    """HF's `fp8` layout: float8_e4m3fn weights, a `weight_scale_inv` per block."""
    model = random_llama(seed)
    tensors = dict(model.state_dict())
    br, bc = block
    for name in _quantized_names(model):
        w = tensors.pop(name).float()
        rows, cols = w.shape
        nr, nc = -(-rows // br), -(-cols // bc)
        padded = torch.zeros(nr * br, nc * bc)
        padded[:rows, :cols] = w
        amax = padded.view(nr, br, nc, bc).abs().amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        expanded = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
        q = (w / expanded).to(torch.float8_e4m3fn)
        tensors[name] = q
        tensors[name + "_scale_inv"] = scale
        _set_weight(model, name, q.float() * expanded)
    config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }
    return _save(model, path, tensors, config), model


def fp8_compressed(path: Path, strategy: str = "channel", seed: int = 0):
    """compressed-tensors float8 as llm-compressor writes it, per channel or per tensor (with
    a static `input_scale`, which weight-only serving does not need)."""
    model = random_llama(seed)
    tensors = dict(model.state_dict())
    for name in _quantized_names(model):
        w = tensors.pop(name).float()
        if strategy == "channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        else:
            scale = (w.abs().amax() / FP8_MAX).reshape(1)
        q = (w / scale).to(torch.float8_e4m3fn)
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
        if strategy == "tensor":
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.05])
        _set_weight(model, name, q.float() * scale)
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token" if strategy == "channel" else "tensor",
                    "dynamic": strategy == "channel",
                },
            }
        },
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
    return _save(model, path, tensors, config), model


# ---- int4 -------------------------------------------------------------------------------------
def _int4_groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int):
    """Asymmetric 4-bit per (output, group): values [out, in], scales and zeros [groups, out]."""
    rows = w.shape[0]
    scales, zeros = torch.empty(groups, rows), torch.empty(groups, rows)
    for g in range(groups):
        cols = w[:, g_idx == g]
        low, high = cols.amin(dim=1), cols.amax(dim=1)
        scales[g] = ((high - low) / 15).clamp(min=1e-6).half().float()
        zeros[g] = torch.round(-low / scales[g]).clamp(0, 15)
    q = torch.round(w / scales[g_idx].t() + zeros[g_idx].t()).clamp(0, 15).to(torch.int32)
    dequant = (q.float() - zeros[g_idx].t()) * scales[g_idx].t()
    return q, scales, zeros.to(torch.int32), dequant


def _pack_columns(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[r, c] 4-bit values -> [r, c / 8] int32, nibble i holding column 8j + order[i]."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for i, col in enumerate(order):
        words |= values[:, col::8] << (4 * i)
    return words


def awq(path: Path, group: int = 32, seed: int = 0):
    """AutoAWQ's GEMM layout."""
    return write_awq(random_llama(seed), path, group)


def write_awq(model, path: Path, group: int):
    """`model` (an HF Llama-family model, changed in place to its dequantized weights) written
    in AutoAWQ's GEMM layout; returns (path, model)."""
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name in _quantized_names(model):
        w = tensors.pop(name).float()
        cols = w.shape[1]
        g_idx = torch.arange(cols) // group
        q, scales, zeros, dequant = _int4_groups(w, g_idx, cols // group)
        prefix = name.removesuffix("weight")
        tensors[prefix + "qweight"] = _pack_columns(q.t().contiguous(), AWQ_ORDER)
        tensors[prefix + "qzeros"] = _pack_columns(zeros, AWQ_ORDER)
        tensors[prefix + "scales"] = scales.half()
        _set_weight(model, name, dequant)
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    return _save(model, path, tensors, config), model


def gptq(path: Path, group: int = 32, act_order: bool = True, seed: int = 0):
    """GPTQ's layout (`gptq` format: zeros stored minus one), with act-order `g_idx` shared by
    the layers reading the same input."""
    model = random_llama(seed)
    tensors = dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed + 1)
    g_idx_of: dict[int, torch.Tensor] = {}
    for name in _quantized_names(model):
        w = tensors.pop(name).float()
        cols = w.shape[1]
        key = (name.split(".")[2], name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"), cols)
        if key not in g_idx_of:
            g_idx = torch.arange(cols) // group
            if act_order:
                order = torch.randperm(cols, generator=generator)
                g_idx = torch.empty(cols, dtype=torch.long)
                g_idx[order] = torch.arange(cols) // group
            g_idx_of[key] = g_idx
        g_idx = g_idx_of[key]
        q, scales, zeros, dequant = _int4_groups(w, g_idx, cols // group)
        prefix = name.removesuffix("weight")
        tensors[prefix + "qweight"] = _pack_rows(q.t().contiguous())
        tensors[prefix + "qzeros"] = _pack_columns((zeros - 1) & 0xF)  # a zero of 0 wraps to 15
        tensors[prefix + "scales"] = scales.half()
        tensors[prefix + "g_idx"] = g_idx.to(torch.int32)
        _set_weight(model, name, dequant)
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": act_order,
        "sym": False,
        "checkpoint_format": "gptq",
    }
    return _save(model, path, tensors, config), model


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[r, c] 4-bit values -> [r / 8, c] int32, nibble j of word i holding row 8i + j."""
    words = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int32)
    for j in range(8):
        words |= values[j::8] << (4 * j)
    return words


LAYOUTS = {
    "fp8_block": fp8_block,
    "fp8_channel": lambda path: fp8_compressed(path, "channel"),
    "fp8_tensor": lambda path: fp8_compressed(path, "tensor"),
    "awq": awq,
    "gptq": gptq,
}
