"""What a served model does not run with yet, by option name: the start-up refusals of options
that a family's layers (recurrent states, images, layers of several shapes) do not support.
Free of torch, as `registry` is."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .checkpoint_config import VISION_LANGUAGE

if TYPE_CHECKING:
    from ..config import EngineArgs
    from ..model_config import ModelConfig


def model_problems(cfg: ModelConfig, args: EngineArgs):
    """What the served model does not run with yet, by option name."""
    yield from _recurrent_problems(cfg, args)
    yield from _vision_problems(cfg, args)
    yield from _layer_shape_problems(cfg, args)
    yield from _compressed_attention_problems(cfg, args)


def _compressed_attention_problems(cfg: ModelConfig, args: EngineArgs):
    """What DeepSeek-V4's compressed attention (its rows computed from in torch, one request
    at a time) does not run with yet."""
    if cfg.model_type != "deepseek_v4":
        return
    for name, on in (
        ("tp_size", args.tp_size > 1 and cfg.architecture not in SHARDED_HYBRIDS),
        ("speculative_algorithm", args.speculative_algorithm is not None),
        ("enable_hierarchical_cache", args.enable_hierarchical_cache),
        ("enable_torch_compile", args.enable_torch_compile),
        ("kv_cache_dtype", args.kv_cache_dtype != "auto"),
    ):
        if on:
            yield f"{name} with {cfg.architecture}'s compressed attention is not supported yet"


def _layer_shape_problems(cfg: ModelConfig, args: EngineArgs):
    """What a model whose layers differ in KV heads or head dim (Gemma 4, MiMo-V2-Flash), or in
    query heads (Laguna), does not run with yet."""
    lora = ("lora_paths / enable_lora", args.enable_lora or bool(args.lora_paths))
    if len(set(cfg.hf_config.get("num_attention_heads_per_layer") or ())) > 1 and lora[1]:
        yield f"{lora[0]} with {cfg.architecture}'s layers of several head counts is not supported"
    if cfg.kv_layer_dims is None:
        return
    for name, on in (("disaggregation_mode", args.disaggregation_mode != "null"), lora):
        if on:
            yield f"{name} with {cfg.architecture}'s layers of two KV shapes is not supported yet"


def _vision_problems(cfg: ModelConfig, args: EngineArgs):
    if cfg.architecture not in VISION_LANGUAGE:
        return
    for name, on in (
        ("speculative_algorithm draft", args.speculative_algorithm == "draft"),
        ("enable_torch_compile", args.enable_torch_compile),
    ):
        if on:
            yield f"{name} with {cfg.architecture}'s images is not supported yet"


# hybrids whose recurrent layers shard over tensor-parallel ranks (Gated DeltaNet's heads,
# Mamba's channels, Mamba2's heads and groups, short convolutions' channels, lightning
# attention's and Kimi Delta Attention's heads)
SHARDED_HYBRIDS = frozenset(
    {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "LaraMiniForCausalLM"}
    | {"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"}
    | {"NemotronHForCausalLM", "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM"}
    | {"BambaForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM"}
    | {"JambaForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM"}
    | {"MiniMaxForCausalLM", "KimiLinearForCausalLM", "OlmoHybridForCausalLM"}
)


def _recurrent_problems(cfg: ModelConfig, args: EngineArgs):
    """What a hybrid model (layers that keep a state per sequence) does not run with yet, by
    option name; nothing for other models."""
    if not cfg.keeps_state:
        return
    spec = args.speculative_algorithm is not None
    tiers = args.enable_hierarchical_cache
    for name, on in (
        ("tp_size", args.tp_size > 1 and cfg.architecture not in SHARDED_HYBRIDS),
        ("speculative_algorithm at tp_size > 1", spec and args.tp_size > 1),
        ("enable_hierarchical_cache at tp_size > 1", tiers and args.tp_size > 1),
        ("enable_torch_compile", args.enable_torch_compile),
    ):
        if on:
            yield f"{name} with {cfg.architecture}'s recurrent layers is not supported yet"
    if cfg.num_kv_layers == 0 and args.mamba_full_memory_ratio is not None:
        yield (
            f"mamba_full_memory_ratio with {cfg.architecture}, which keeps no KV to size its "
            "states against; use max_mamba_cache_size"
        )
    if cfg.num_kv_layers == 0 and tiers:
        yield f"enable_hierarchical_cache with {cfg.architecture}, which keeps no KV"
