"""Every supported family against HF transformers in float32: a tiny random checkpoint built
with HF's own config and model classes, served, greedy tokens compared fresh and from the radix
cache, with prompts longer than the sliding window and chunks that split them."""

import json
import subprocess
import sys

import pytest
import torch
import transformers as hf
from server_utils import start_server

from radixserve import Engine
from radixserve.models.config_checks import UnsupportedModel, check_supported
from radixserve.models.registry import ARCHITECTURES

WINDOW = 16
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
INDEX_TOPK = 24  # DeepSeek-V3.2: each query attends to its 24 best tokens once it sees more
MLA_MOE = dict(  # DeepSeek's latent attention over routed experts, tiny
    MOE,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
)
BETA_SCALED_YARN = dict(  # queries scaled up past an original context of 32 tokens
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    beta_fast=32.0,
    beta_slow=1.0,
    original_max_position_embeddings=32,
    llama_4_scaling_beta=3.0,
)
SLIDING_THEN_FULL = ["sliding_attention", "sliding_attention", "full_attention"]
GEMMA4 = dict(
    head_dim=16,
    global_head_dim=32,
    num_key_value_heads=4,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    sliding_window=WINDOW,
    final_logit_softcapping=30.0,
    pad_token_id=0,
)
DEEPSEEK_V4 = dict(  # a window of 16, entries of 8 tokens (HCA) and 4 (CSA, its best 3 each)
    MOE,
    num_hidden_layers=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    sliding_window=WINDOW,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,  # few all-zero (ReLU) index scores: ties at the top-k are arbitrary
    index_head_dim=16,
    index_topk=3,
    n_routed_experts=8,
    hc_mult=3,  # a 2 x 2 doubly-stochastic mix would be symmetric
    swiglu_limit=1.0,  # the experts clamp
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=[
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"],
    compress_rope_theta=40000.0,  # with YaRN past 32 tokens, on the compressed layers only
    rope_parameters=dict(
        rope_type="yarn",
        factor=4.0,
        original_max_position_embeddings=32,
        beta_fast=32,
        beta_slow=1,
    ),  # fmt: skip
    pad_token_id=0,
)
MIMO_ROPE = {  # a rotary base per layer kind, over a third of each head
    kind: dict(rope_type="default", rope_theta=theta, partial_rotary_factor=0.334)
    for kind, theta in (("full_attention", 5e5), ("sliding_attention", 1e4))
}
GRANITE_MUP = dict(
    embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=2.0
)
FAMILIES = {
    "llama": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(rope_scaling=LLAMA3_ROPE)),
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM, dict(head_dim=16)),
    "qwen3_moe": (
        hf.Qwen3MoeConfig,
        hf.Qwen3MoeForCausalLM,
        dict(MOE, head_dim=16, num_experts=4, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "qwen2_moe": (
        hf.Qwen2MoeConfig,
        hf.Qwen2MoeForCausalLM,
        dict(
            MOE,
            num_experts=4,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            shared_expert_intermediate_size=48,
        ),
    ),  # fmt: skip
    "mixtral": (
        hf.MixtralConfig,
        hf.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    "gemma2": (hf.Gemma2Config, hf.Gemma2ForCausalLM, dict(head_dim=16, sliding_window=WINDOW)),
    "vaultgemma": (  # Gemma 2 without the norms after each sublayer
        hf.VaultGemmaConfig,
        hf.VaultGemmaForCausalLM,
        dict(head_dim=16, sliding_window=WINDOW),
    ),
    "gemma3_text": (
        hf.Gemma3TextConfig,
        hf.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "ministral": (
        hf.MinistralConfig,
        hf.MinistralForCausalLM,
        dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    ),
    "ministral3": (  # queries scaled up past an original context of 32 tokens
        hf.Ministral3Config,
        hf.Ministral3ForCausalLM,
        dict(head_dim=16, rope_parameters=dict(BETA_SCALED_YARN)),
    ),
    "apertus": (hf.ApertusConfig, hf.ApertusForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    "apertus1p5_text": (  # its head pruned to the first 400 ids
        hf.Apertus1p5TextConfig,
        hf.Apertus1p5TextForCausalLM,
        dict(rope_parameters=LLAMA3_ROPE, output_vocab_size=400),
    ),
    "hunyuan_v1_dense": (
        hf.HunYuanDenseV1Config,
        hf.HunYuanDenseV1ForCausalLM,
        dict(
            head_dim=16,
            rope_parameters=dict(rope_type="dynamic", alpha=50.0, factor=1.0, rope_theta=1e4),
        ),
    ),
    "hunyuan_v1_moe": (
        hf.HunYuanMoEV1Config,
        hf.HunYuanMoEV1ForCausalLM,
        dict(head_dim=16, num_experts=4, moe_topk=2, intermediate_size=32),
    ),
    "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM, dict(pad_token_id=0)),
    "minicpm3": (  # DeepSeek-V2's MLA with a rotate-half rotary, µP scales, dense MLPs
        hf.MiniCPM3Config,
        hf.MiniCPM3ForCausalLM,
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            scale_emb=3.0,
            scale_depth=1.4,
            dim_model_base=32,
        ),
    ),
    "axk1": (  # DeepSeek-V3 with its MoE blocks' outputs normed
        hf.AXK1Config,
        hf.AXK1ForCausalLM,
        dict(MLA_MOE, mlp_layer_types=["dense", "sparse", "sparse"], n_group=4, topk_group=2),
    ),
    "deepseek_v3": (
        hf.DeepseekV3Config,
        hf.DeepseekV3ForCausalLM,
        dict(
            MLA_MOE,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
        ),
    ),
    "gpt_oss": (
        hf.GptOssConfig,
        hf.GptOssForCausalLM,
        dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    ),
    "smollm3": (
        hf.SmolLM3Config,
        hf.SmolLM3ForCausalLM,
        dict(no_rope_layers=[1, 0, 1], pad_token_id=0),
    ),
    "granite": (
        hf.GraniteConfig,
        hf.GraniteForCausalLM,
        dict(
            embedding_multiplier=2.0,
            attention_multiplier=0.3,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            attention_bias=True,
        ),
    ),
    "granitemoe": (
        hf.GraniteMoeConfig,
        hf.GraniteMoeForCausalLM,
        dict(GRANITE_MUP, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    "granitemoeshared": (
        hf.GraniteMoeSharedConfig,
        hf.GraniteMoeSharedForCausalLM,
        dict(
            GRANITE_MUP,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            shared_intermediate_size=48,
        ),
    ),  # fmt: skip
    "hyperclovax": (  # Granite's multipliers, logits multiplied, norms after each sublayer too
        hf.HyperCLOVAXConfig,
        hf.HyperCLOVAXForCausalLM,
        dict(GRANITE_MUP, head_dim=16),
    ),
    "granite_swa": (  # windows, a sink logit per head, a rotary base per layer (0: none)
        hf.GraniteSWAConfig,
        hf.GraniteSWAForCausalLM,
        dict(
            GRANITE_MUP,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            layer_rope_theta=[1e4, 5e5, 0],
        ),
    ),  # fmt: skip
    "granitemoe_swa": (
        hf.GraniteMoeSWAConfig,
        hf.GraniteMoeSWAForCausalLM,
        dict(
            GRANITE_MUP,
            sliding_window=WINDOW,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            layer_rope_theta=[0, 1e4, 1e4],
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            shared_intermediate_size=48,
        ),
    ),  # fmt: skip
    "granite4_dense": (  # Granite 4.0's dense models: attention only, no experts
        hf.GraniteMoeHybridConfig,
        hf.GraniteMoeHybridForCausalLM,
        dict(
            GRANITE_MUP,
            layer_types=["attention"] * 3,
            num_local_experts=0,
            shared_intermediate_size=96,
            position_embedding_type="rope",
        ),
    ),  # fmt: skip
    "seed_oss": (
        hf.SeedOssConfig,
        hf.SeedOssForCausalLM,
        dict(head_dim=16, attention_bias=True, attention_out_bias=True, mlp_bias=True),
    ),
    "ernie4_5": (hf.Ernie4_5Config, hf.Ernie4_5ForCausalLM, dict(head_dim=16, use_bias=True)),
    "ernie4_5_moe": (
        hf.Ernie4_5_MoeConfig,
        hf.Ernie4_5_MoeForCausalLM,
        dict(
            head_dim=16,
            use_bias=True,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            pad_token_id=0,
        ),
    ),  # fmt: skip
    "olmo": (hf.OlmoConfig, hf.OlmoForCausalLM, dict(clip_qkv=1.0)),  # weightless LayerNorms
    "olmo2": (hf.Olmo2Config, hf.Olmo2ForCausalLM, {}),
    "olmo3": (
        hf.Olmo3Config,
        hf.Olmo3ForCausalLM,
        dict(sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    ),
    "exaone4": (
        hf.Exaone4Config,
        hf.Exaone4ForCausalLM,
        dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    ),
    "glm4": (
        hf.Glm4Config,
        hf.Glm4ForCausalLM,
        dict(head_dim=16, attention_bias=True, pad_token_id=0),
    ),
    "gemma": (hf.GemmaConfig, hf.GemmaForCausalLM, dict(head_dim=32, pad_token_id=0)),
    "glm": (hf.GlmConfig, hf.GlmForCausalLM, dict(head_dim=16, pad_token_id=0)),
    "helium": (hf.HeliumConfig, hf.HeliumForCausalLM, dict(head_dim=16, attention_bias=True)),
    "arcee": (hf.ArceeConfig, hf.ArceeForCausalLM, dict(rope_scaling=LLAMA3_ROPE)),
    "cwm": (  # Meta's Code World Model: Llama with windows by layer_types
        hf.CwmConfig,
        hf.CwmForCausalLM,
        dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, eos_token_id=2),
    ),
    "phi": (hf.PhiConfig, hf.PhiForCausalLM, dict(partial_rotary_factor=0.5)),
    "starcoder2": (
        hf.Starcoder2Config,
        hf.Starcoder2ForCausalLM,
        dict(sliding_window=WINDOW, bos_token_id=1, eos_token_id=2),
    ),
    "nemotron": (
        hf.NemotronConfig,
        hf.NemotronForCausalLM,
        dict(head_dim=16, bos_token_id=1, eos_token_id=2),
    ),
    "flex_olmo": (
        hf.FlexOlmoConfig,
        hf.FlexOlmoForCausalLM,
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            norm_topk_prob=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "stablelm": (hf.StableLmConfig, hf.StableLmForCausalLM, dict(use_qkv_bias=True)),
    "stablelm_parallel": (
        hf.StableLmConfig,
        hf.StableLmForCausalLM,
        dict(use_parallel_residual=True, partial_rotary_factor=0.5),
    ),
    "jais2": (hf.Jais2Config, hf.Jais2ForCausalLM, dict(bos_token_id=1, eos_token_id=2)),
    "gpt_neox": (  # Pythia: q, k, v fused head by head, two norms side by side, exact GELU
        hf.GPTNeoXConfig,
        hf.GPTNeoXForCausalLM,
        dict(
            num_key_value_heads=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.25,
            },
        ),
    ),
    "gpt_neox_sequential": (
        hf.GPTNeoXConfig,
        hf.GPTNeoXForCausalLM,
        dict(num_key_value_heads=4, use_parallel_residual=False, hidden_act="gelu_new"),
    ),
    "youtu": (  # DeepSeek-V3's MLA over dense MLPs
        hf.YoutuConfig,
        hf.YoutuForCausalLM,
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "mellum": (  # Qwen3-MoE's layers with windows and a rotary per layer kind, dense or sparse
        hf.MellumConfig,
        hf.MellumForCausalLM,
        dict(
            MOE,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            mlp_layer_types=["dense", "sparse", "sparse"],
            num_experts=8,
            rope_parameters={
                "full_attention": dict(rope_type="default", rope_theta=5e5),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
            },
        ),
    ),
    "olmoe": (
        hf.OlmoeConfig,
        hf.OlmoeForCausalLM,
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            norm_topk_prob=True,
            clip_qkv=1.0,
        ),
    ),
    "minicpm5_moe": (  # each head's query and gate in one projection, gated output
        hf.MiniCPM5MoeConfig,
        hf.MiniCPM5MoeForCausalLM,
        dict(
            MOE,
            head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            mlp_layer_types=["dense", "sparse", "sparse"],
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "glm4_moe": (
        hf.Glm4MoeConfig,
        hf.Glm4MoeForCausalLM,
        dict(
            MOE,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            pad_token_id=0,
        ),
    ),
    "solar_open": (  # GLM-4.5's MoE block in every layer under plain GQA
        hf.SolarOpenConfig,
        hf.SolarOpenForCausalLM,
        dict(
            MOE,
            head_dim=16,
            attention_bias=True,
            n_routed_experts=8,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            pad_token_id=0,
        ),
    ),  # fmt: skip
    "exaone_moe": (
        hf.ExaoneMoeConfig,
        hf.ExaoneMoeForCausalLM,
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            mlp_layer_types=["dense", "sparse", "sparse"],
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_shared_experts=1,
            n_group=2,
            topk_group=1,
        ),
    ),  # fmt: skip
    "kolibri1": (  # EXAONE 4's attention, GLM-4's norms, experts by logit + bias
        hf.Kolibri1Config,
        hf.Kolibri1ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    "flint": (  # sinks, the rotary on window layers only, sigmoid experts + a shared MLP
        hf.FlintConfig,
        hf.FlintForCausalLM,
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_only_layers=[0],
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    "afmoe": (
        hf.AfmoeConfig,
        hf.AfmoeForCausalLM,
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_shared_experts=1,
            route_scale=1.5,
            mup_enabled=True,
        ),
    ),  # fmt: skip
    "hy_v3": (
        hf.HYV3Config,
        hf.HYV3ForCausalLM,
        dict(
            MOE,
            head_dim=16,
            mlp_layer_types=["dense", "sparse", "sparse"],
            num_experts=8,
            num_shared_experts=1,
            router_scaling_factor=1.7,
        ),
    ),  # fmt: skip
    "dots1": (
        hf.Dots1Config,
        hf.Dots1ForCausalLM,
        dict(
            MOE,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
        ),
    ),  # fmt: skip
    "laguna": (  # a query-head count per layer, a softplus gate per head, capped router logits
        hf.LagunaConfig,
        hf.LagunaForCausalLM,
        dict(
            MOE,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            num_attention_heads_per_layer=[4, 2, 6],
            rope_parameters={
                "full_attention": dict(
                    rope_type="default", rope_theta=5e5, partial_rotary_factor=0.5
                ),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
            },
            num_experts=8,
            shared_expert_intermediate_size=48,
            moe_routed_scaling_factor=1.5,
            moe_router_logit_softcapping=2.0,
        ),
    ),  # fmt: skip
    "laguna_per_element": (  # a gate per channel
        hf.LagunaConfig,
        hf.LagunaForCausalLM,
        dict(
            MOE,
            head_dim=16,
            num_experts=8,
            shared_expert_intermediate_size=48,
            gating="per-element",
        ),
    ),  # fmt: skip
    "mimo_v2_flash": (  # window layers: twice the KV heads, sinks; values narrower than keys
        hf.MiMoV2FlashConfig,
        hf.MiMoV2FlashForCausalLM,
        dict(
            MOE,
            head_dim=24,
            v_head_dim=16,
            num_key_value_heads=1,
            sliding_window=WINDOW,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            attention_value_scale=0.7,
            rope_parameters=MIMO_ROPE,
        ),
    ),  # fmt: skip
    "minimax_m2": (
        hf.MiniMaxM2Config,
        hf.MiniMaxM2ForCausalLM,
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5},
        ),
    ),
    "mistral4": (  # softmax groups ranked by their best two; queries scaled past 32 tokens
        hf.Mistral4Config,
        hf.Mistral4ForCausalLM,
        dict(
            MLA_MOE,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            pad_token_id=0,
            rope_parameters=dict(BETA_SCALED_YARN, mscale_all_dim=1.0, mscale=1.0),
        ),
    ),
    "deepseek_v2": (
        hf.DeepseekV2Config,
        hf.DeepseekV2ForCausalLM,
        dict(
            MLA_MOE,
            q_lora_rank=None,
            head_dim=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.0,
        ),
    ),
    "phimoe": (
        hf.PhimoeConfig,
        hf.PhimoeForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, attention_bias=True),
    ),
    "cohere": (  # Command R+: per-head q/k LayerNorms with their own weights
        hf.CohereConfig,
        hf.CohereForCausalLM,
        dict(
            head_dim=16,
            logit_scale=0.5,
            use_qk_norm=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "cohere_r": (  # Command R, Aya: no q/k norms
        hf.CohereConfig,
        hf.CohereForCausalLM,
        dict(logit_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    ),
    "cohere2": (
        hf.Cohere2Config,
        hf.Cohere2ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            logit_scale=0.5,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "cohere2_moe": (  # a dense prefix rotated in every layer, sigmoid experts, averaged shared
        hf.Cohere2MoeConfig,
        hf.Cohere2MoeForCausalLM,
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            prefix_dense_intermediate_size=96,
            intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            expert_selection_fn="sigmoid",
            logit_scale=0.5,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "cohere2_moe_rms": (  # an RMS norm, softmax experts, shared ones summed
        hf.Cohere2MoeConfig,
        hf.Cohere2MoeForCausalLM,
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            mlp_layer_types=["sparse"] * 3,
            intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            shared_expert_combination_strategy="sum",
            rms_norm_eps=1e-6,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "llama4_text": (
        hf.Llama4TextConfig,
        hf.Llama4ForCausalLM,
        dict(
            head_dim=16,
            num_hidden_layers=4,
            intermediate_size=32,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=1,
            moe_layers=[1, 3],
            no_rope_layers=[1, 1, 1, 0],
            layer_types=["chunked_attention"] * 3 + ["full_attention"],
            attention_chunk_size=WINDOW,
            floor_scale=8,
            attn_scale=0.5,
            pad_token_id=0,
        ),
    ),
    "gemma4_text": (  # global layers of their own head dim, k = v, shared KV, per-layer inputs
        hf.Gemma4TextConfig,
        hf.Gemma4ForCausalLM,
        dict(
            GEMMA4,
            num_hidden_layers=6,
            layer_types=["sliding_attention", "full_attention"] * 3,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=512,
        ),
    ),
    "gemma4_moe": (  # routed experts beside each MLP
        hf.Gemma4TextConfig,
        hf.Gemma4ForCausalLM,
        dict(
            GEMMA4,
            layer_types=SLIDING_THEN_FULL,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    ),
    "glm4_moe_lite": (
        hf.Glm4MoeLiteConfig,
        hf.Glm4MoeLiteForCausalLM,
        dict(
            MLA_MOE,
            n_shared_experts=1,
            mlp_layer_types=["dense", "sparse", "sparse"],
            routed_scaling_factor=1.8,
            pad_token_id=0,
        ),
    ),
    "deepseek_v32": (
        hf.DeepseekV32Config,
        hf.DeepseekV32ForCausalLM,
        dict(
            MLA_MOE,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=INDEX_TOPK,
            pad_token_id=0,
        ),
    ),
    "deepseek_v4": (hf.DeepseekV4Config, hf.DeepseekV4ForCausalLM, DEEPSEEK_V4),
    "hy_v4": (
        hf.HYV4Config,
        hf.HYV4ForCausalLM,
        dict(
            MLA_MOE,
            num_hidden_layers=4,
            n_group=2,
            topk_group=1,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=INDEX_TOPK,
            indexer_types=["full", "shared", "full", "shared"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            hc_mult=3,
            hc_magnitude=1.5,
            swiglu_limit=1.0,  # the experts clamp
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    "longcat_flash": (
        hf.LongcatFlashConfig,
        hf.LongcatFlashForCausalLM,
        dict(  # two layers of two attentions each; 4 identity experts beside 8
            num_hidden_layers=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            expert_ffn_hidden_size=32,
            n_routed_experts=8,
            zero_expert_num=4,
            moe_topk=3,
            pad_token_id=0,
        ),
    ),
    "glm_moe_dsa": (
        hf.GlmMoeDsaConfig,
        hf.GlmMoeDsaForCausalLM,
        dict(
            MLA_MOE,
            head_dim=8,
            first_k_dense_replace=1,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=INDEX_TOPK,
            indexer_types=["full", "shared", "full"],
            pad_token_id=0,
        ),
    ),
}
PROMPTS = [[5, 17, 42, 99, 3], list(range(100, 180)), [7, 7, 7] + list(range(200, 260))]
NEW_TOKENS = 12


# buffers computed from the config
UNSCALED = ("rotary", "pos_emb", "embed_scale", "mup_vector", "slope_rate", "_decay")


def build_checkpoint(path, family: str, families: dict = FAMILIES, common: dict = COMMON):
    """A tiny random HF model of `family` (one of `families`, on `common` sizes), with weights
    large enough that greedy choices are far from ties, saved as a checkpoint."""
    config_cls, model_cls, extra = families[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**common, **extra}))
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                tensor.uniform_(0, 0.1)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's experts by token id: k distinct
                experts = model.config.n_routed_experts
                tensor.copy_(torch.rand(tensor.shape[0], experts).argsort(-1)[:, : tensor.shape[1]])
            elif "norm" in name and name.endswith("weight"):  # scores and logits far from flat
                tensor.normal_(1.0, 0.2)
            elif tensor.is_floating_point() and not any(k in name for k in UNSCALED):
                tensor.normal_(0, 0.1 if "norm" in name else 0.2)
    model.eval()
    model.save_pretrained(path / family)
    return model, path / family


def hf_greedy(model, ids, n):
    """HF's greedy tokens, each from a whole forward over the sequence so far: the model as
    defined, not its cached decode path (LFM2's drifts from its own forward)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def served_twice(path) -> list[list[list[int]]]:
    """Greedy tokens of PROMPTS, fresh and then again from the radix cache."""
    rounds = []
    with Engine(
        model=str(path), max_total_tokens=1024, chunked_prefill_size=32, dtype="float32"
    ) as eng:
        for _ in range(2):
            results = eng.generate(
                input_ids=PROMPTS,
                sampling_params={
                    "temperature": 0,
                    "max_new_tokens": NEW_TOKENS,
                    "ignore_eos": True,
                },
            )
            rounds.append([r["output_ids"] for r in results])
        eng.check_memory()
    assert all(r["meta_info"]["cached_tokens"] >= 32 for r in results[1:])  # the second round
    return rounds


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_hf(tmp_path, family):
    model, path = build_checkpoint(tmp_path, family)
    assert json.loads((path / "config.json").read_text())["architectures"][0] in ARCHITECTURES
    want = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    fresh, cached = served_twice(path)
    assert fresh == want
    assert cached == want


@pytest.mark.parametrize(
    "family",
    ["mistral4", "laguna", "granite_swa", "granitemoe_swa", "mellum", "hyperclovax", "minicpm3"]
    + ["deepseek_v4", "hy_v4", "longcat_flash"],
)
def test_prompt_logprobs_match_hf(tmp_path, family):
    """Every prompt token's logprob across chunk ends, as HF computes it: for features the tiny
    model's greedy tokens hardly see (Mistral 4's query scaling past its 32-token original
    context; Laguna's capped router logits and rotary per layer kind)."""
    model, path = build_checkpoint(tmp_path, family)
    ids = PROMPTS[1]
    with Engine(
        model=str(path), max_total_tokens=1024, chunked_prefill_size=32, dtype="float32"
    ) as eng:
        out = eng.generate(
            input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
        )
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
        "deepseek_v3",
        "phi3",
        "gemma3_text",
        "olmoe",
        "glm4_moe",
        "minimax_m2",
        "deepseek_v2",
        "mistral4",
        "olmo2",
        "glm4",
        "phimoe",
        "cohere2",
        "cohere",
        "gpt_neox",
        "minicpm5_moe",
        "axk1",
        "kolibri1",
        "flint",
        "minicpm3",
        "phi",
        "starcoder2",
        "nemotron",
        "jais2",
        "helium",
        "glm",
        "gemma",
        "hyperclovax",
        "flex_olmo",
        "youtu",
        "vaultgemma",
        "olmo",
        "llama4_text",
        "gemma4_text",
        "gemma4_moe",
        "glm4_moe_lite",
        "deepseek_v32",
        "glm_moe_dsa",
        "hy_v4",
        "longcat_flash",
        "ministral3",
        "apertus",
        "qwen2_moe",
        "ernie4_5_moe",
        "hunyuan_v1_moe",
        "exaone_moe",
        "afmoe",
        "granitemoeshared",
        "laguna",
        "hy_v3",
        "granite_swa",
        "cohere2_moe",
        "dots1",
        "mellum",
        "granitemoe_swa",
        "stablelm_parallel",
    ],
)
def test_tensor_parallel_matches_hf(tmp_path, family):
    """Two ranks: experts sharded by their width, MLA by heads over a latent every rank keeps,
    Phi-3's and GLM-4's fused tensors split before they are sliced, windows and sinks by
    heads, a q/k norm over all heads summed over the ranks (OLMo 2, OLMoE, MiniMax-M2)."""
    model, path = build_checkpoint(tmp_path, family)
    want = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    server = start_server(
        tmp_path,
        "--model",
        str(path),
        "--tp-size",
        "2",
        "--chunked-prefill-size",
        "32",
        "--max-total-tokens",
        "1024",
    )
    try:
        with server.client() as client:
            for _ in range(2):
                body = {"input_ids": PROMPTS, "sampling_params": GREEDY}
                out = client.post("/generate", json=body).json()
                assert [r["output_ids"] for r in out] == want
        assert out[1]["meta_info"]["cached_tokens"] >= 32
    finally:
        assert server.stop() == 0, server.log()


GEMMA4_WHOLE = dict(
    text_config={**COMMON, **FAMILIES["gemma4_text"][2]},
    vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=16,
        num_attention_heads=2, num_key_value_heads=2,
    ),
    audio_config=None, image_token_id=500, boi_token_id=501, eoi_token_id=502,
    video_token_id=503,
)  # fmt: skip
LLAMA4_WHOLE = dict(
    text_config={**COMMON, **FAMILIES["llama4_text"][2]},
    vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=64, patch_size=16, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=32,
    ),
)  # fmt: skip
APERTUS1P5_WHOLE = dict(  # visual codes 410..441, audio codes 442..473 of the vocabulary
    text_config={**COMMON, **FAMILIES["apertus1p5_text"][2]},
    vision_config=dict(
        codebook_size=32, embed_dim=32, latent_channels=32, base_channels=32,
        channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[], resolution=32,
    ),
    audio_config=dict(model_type="wavtokenizer_encoder", codebook_size=32),
    image_token_id=401, audio_token_id=402, image_token_offset=410, audio_token_offset=442,
)  # fmt: skip
MULTIMODAL = {
    "gemma4": (hf.Gemma4Config, hf.Gemma4ForConditionalGeneration, GEMMA4_WHOLE),
    "gemma4_no_tower": (
        hf.Gemma4Config,
        hf.Gemma4ForConditionalGeneration,
        dict(GEMMA4_WHOLE, vision_config=None),
    ),
    "llama4": (hf.Llama4Config, hf.Llama4ForConditionalGeneration, LLAMA4_WHOLE),
    "apertus1p5": (hf.Apertus1p5Config, hf.Apertus1p5ForConditionalGeneration, APERTUS1P5_WHOLE),
}


@pytest.mark.parametrize("family", list(MULTIMODAL))
def test_multimodal_checkpoints_answer_text_as_hf(tmp_path, family):
    """Gemma 4, Llama 4 and Apertus 1.5 ship as `...ForConditionalGeneration`: Gemma 4 served
    with its vision tower (images: tests/test_vision_models.py) or as its language model where
    the checkpoint has none, Llama 4 as its language model (tower and projector skipped),
    Apertus 1.5 as its language model (image and audio tokenizers skipped; its head pruned);
    HF's whole model fed text alone gives the same greedy tokens, fresh and from the cache."""
    model, path = build_checkpoint(tmp_path, family, MULTIMODAL, {})
    want = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    fresh, cached = served_twice(path)
    assert fresh == want
    assert cached == want


def test_a_pruned_head_never_gives_the_ids_it_pruned(tmp_path):
    """Apertus 1.5's head keeps the first 400 of 512 ids: an id past it, biased all the way up,
    still never comes, and penalties over prompt ids past it run; greedy stays HF's."""
    model, path = build_checkpoint(tmp_path, "apertus1p5_text")
    ids = [450, 451, 452] + PROMPTS[1]
    want = hf_greedy(model, ids, NEW_TOKENS)
    params = {**GREEDY, "logit_bias": {"450": 100.0}}
    with Engine(model=str(path), max_total_tokens=1024, dtype="float32") as eng:
        assert eng.generate(input_ids=ids, sampling_params=params)["output_ids"] == want
        params = {**GREEDY, "repetition_penalty": 1.3, "max_new_tokens": 4}
        out = eng.generate(input_ids=ids, sampling_params=params)["output_ids"]
    assert len(out) == 4 and max(out) < 400


def test_gemma4_refuses_what_its_pool_of_two_head_dims_does_not_run_with(tmp_path):
    """LoRA and disaggregation assume one head dim in every layer: refused at start-up, named."""
    _, path = build_checkpoint(tmp_path, "gemma4_moe")
    for option, name in (
        (dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"]), "enable_lora"),
        (dict(disaggregation_mode="prefill"), "disaggregation_mode"),
    ):
        with pytest.raises(ValueError, match=f"{name}.*two KV shapes"):
            Engine(model=str(path), dtype="float32", max_total_tokens=256, **option)


def test_laguna_refuses_what_its_layers_of_several_head_counts_do_not_run_with(tmp_path):
    """LoRA's slots and FlashInfer's plan assume one query-head count in every layer: refused at
    start-up, named; a router weight on the experts' input ends start-up in one line naming
    the field."""
    from radixserve.attention import resolve_backend_name

    _, path = build_checkpoint(tmp_path, "laguna")
    lora = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match="enable_lora.*several head counts"):
        Engine(model=str(path), dtype="float32", max_total_tokens=256, **lora)
    with pytest.raises(ValueError, match="flashinfer.*head_counts"):
        resolve_backend_name("flashinfer", "cuda", frozenset({"head_counts"}))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps(dict(config, moe_apply_router_weight_on_input=True))
    )
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0
    assert len(lines) == 1 and "moe_apply_router_weight_on_input" in lines[0], proc.stderr


def test_deepseek_v4_refuses_what_its_compressed_attention_does_not_run_with(tmp_path):
    """Options its rows (the compressors' inputs beside each key, layers of three widths) and
    its per-request torch attention do not run with yet: refused at start-up, named."""
    _, path = build_checkpoint(tmp_path, "deepseek_v4")
    for option, name in (
        (dict(speculative_algorithm="ngram"), "speculative_algorithm"),
        (dict(enable_hierarchical_cache=True), "enable_hierarchical_cache"),
        (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype"),
        (dict(disaggregation_mode="prefill"), "disaggregation_mode"),
        (dict(enable_deterministic_inference=True), "enable_deterministic_inference"),
    ):
        with pytest.raises(ValueError, match=name):
            Engine(model=str(path), dtype="float32", max_total_tokens=256, **option)
    serve = [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(path)]
    proc = subprocess.run(serve + ["--tp-size", "2"], capture_output=True, text=True, timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0
    assert len(lines) == 1 and "tp_size" in lines[0], proc.stderr
    config = json.loads((path / "config.json").read_text())
    for change, named in (
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ):
        with pytest.raises(UnsupportedModel, match=named):
            check_supported(config | change)


def test_deepseek_v4_release_config_reads_as_transformers_reads_it():
    """A release's config.json names the layers by `compress_ratios` (0, 4, 128, with the
    predictor's layer past the end), the hash-routed layers by `num_hash_layers`, the rotary
    share by `qk_rope_head_dim` and YaRN by a flat `rope_scaling`: read as transformers does."""
    from radixserve.models.checkpoint_config import language_model_config

    release = dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=512,
        hidden_size=64, num_hidden_layers=5, num_attention_heads=4, head_dim=32,
        q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        compress_ratios=[0, 4, 128, 4, 128, 4], num_hash_layers=2, qk_rope_head_dim=8,
        rope_scaling=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=64,
                          beta_fast=32, beta_slow=1),
    )  # fmt: skip
    theirs = hf.DeepseekV4Config(**{k: v for k, v in release.items() if k != "architectures"})
    ours = language_model_config(release)
    for field in ("layer_types", "mlp_layer_types", "partial_rotary_factor", "compress_rates"):
        assert ours[field] == getattr(theirs, field), field
    for kind in ("main", "compress"):
        want = {k: v for k, v in theirs.rope_parameters[kind].items() if v is not None}
        assert {k: v for k, v in ours["rope_parameters"][kind].items() if v is not None} == want


def test_hy_v4_config_without_layer_lists_reads_as_transformers_reads_it():
    """Hunyuan 4's layer kinds, MLP kinds and shared indexers where config.json leaves them
    out, and its hyper-connection defaults, as transformers derives them."""
    from radixserve.models.checkpoint_config import language_model_config

    bare = dict(
        model_type="hy_v4", vocab_size=512, hidden_size=64, num_hidden_layers=7,
        num_attention_heads=4,
    )  # fmt: skip
    theirs = hf.HYV4Config(**{k: v for k, v in bare.items() if k != "model_type"})
    ours = language_model_config(bare)
    for field in ("layer_types", "mlp_layer_types", "indexer_types", "hc_mult", "hc_magnitude"):
        assert ours[field] == getattr(theirs, field), field
    assert (ours["hc_eps"], ours["swiglu_limit"]) == (theirs.hc_eps, theirs.swiglu_limit)


def test_gemma4_hub_config_gives_the_same_pool_as_transformers_own(tmp_path):
    """Gemma 4's configs on the hub name the global layers' shape by `global_head_dim` and
    `num_global_key_value_heads`; transformers 5 saves it as `per_layer_config`: the same pool
    from either."""
    from radixserve.model_config import ModelConfig

    _, path = build_checkpoint(tmp_path, "gemma4_text")
    saved = json.loads((path / "config.json").read_text())
    hub = {k: v for k, v in saved.items() if k != "per_layer_config"}
    hub |= dict(global_head_dim=32, num_global_key_value_heads=2)
    want = [(4, 16), (2, 32), (4, 16), (2, 32)]  # the four layers that store KV
    assert ModelConfig.from_hf_dict(saved).kv_layer_dims == tuple(want)
    assert ModelConfig.from_hf_dict(hub).kv_layer_dims == tuple(want)
    assert ModelConfig.from_hf_dict(dict(hub, attention_k_eq_v=False)).kv_layer_dims == (
        (4, 16),
        (4, 32),
        (4, 16),
        (4, 32),
    )  # without k = v the global layers keep num_key_value_heads, as HF reads it


@pytest.mark.parametrize(
    "change,named",
    [
        (
            dict(
                num_kv_shared_layers=1, layer_types=["full_attention"] * 2 + ["sliding_attention"]
            ),
            "num_kv_shared_layers",
        ),
        (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
        (dict(layer_types=["full_attention"] * 2), "layer_types"),
        (
            dict(layer_types=["full_attention", "chunked_attention", "full_attention"]),
            "layer_types",
        ),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    ],
)
def test_a_gemma4_config_that_cannot_run_is_refused_naming_the_field(tmp_path, change, named):
    from radixserve.models.source import read_config

    config = {
        **COMMON,
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "layer_types": SLIDING_THEN_FULL,
        **change,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        read_config(tmp_path)


def test_gemma_releases_gelu_is_the_tanh_approximation(tmp_path):
    """Gemma's releases say `hidden_act` "gelu" for the tanh GELU they run (as transformers reads
    it): such a config.json serves HF's tokens rather than being refused."""
    model, path = build_checkpoint(tmp_path, "gemma")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, hidden_act="gelu")))
    with Engine(model=str(path), max_total_tokens=1024, dtype="float32") as eng:
        got = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    assert got == hf_greedy(model, PROMPTS[1], NEW_TOKENS)


def test_hunyuan_ntk_alpha_rotary_is_hfs():
    """HunYuan's `dynamic` rope with a fixed `alpha` (its base stretched once) gives HF's
    frequencies; the tiny model's greedy tokens hardly depend on them, so they are compared."""
    from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense as hunyuan

    from radixserve.model_config import ModelConfig
    from radixserve.models.rotary import rope_inv_freq

    config = hf.HunYuanDenseV1Config(**{**COMMON, **FAMILIES["hunyuan_v1_dense"][2]})
    want = hunyuan.HunYuanDenseV1RotaryEmbedding(config).inv_freq
    ours = ModelConfig.from_hf_dict(config.to_dict())
    got, _ = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling_dict)
    torch.testing.assert_close(got.float(), want.float())


def test_unsupported_architecture_is_one_line(tmp_path):
    model_dir = tmp_path / "rwkv"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({"architectures": ["RwkvForCausalLM"], "model_type": "rwkv"})
    )
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "RwkvForCausalLM" in lines[0] and "Qwen3ForCausalLM" in lines[0]


def test_bad_checkpoints_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = build_checkpoint(tmp_path, "qwen3")
    weights = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.k_norm.weight"
    for broken, expected in [
        ({k: v for k, v in weights.items() if k != name}, name),
        ({**weights, "model.layers.0.extra.weight": torch.zeros(3)}, "model.layers.0.extra"),
        ({**weights, name: torch.zeros(5)}, name),
    ]:
        save_file(broken, str(path / "model.safetensors"))
        with pytest.raises(ValueError, match=expected.replace(".", r"\.")):
            Engine(model=str(path), max_total_tokens=256, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope type 'longrope'"):
        Engine(model=str(path), max_total_tokens=256, dtype="float32")


def test_sharded_bf16_checkpoint_with_an_index(tmp_path):
    """Several safetensors files and their index, saved in bf16, served in float32: the same
    greedy tokens as HF loading that checkpoint in float32."""
    model, path = build_checkpoint(tmp_path, "qwen3")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    sharded = tmp_path / "sharded"
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    reference = hf.AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    want = [hf_greedy(reference, ids, NEW_TOKENS) for ids in PROMPTS]
    fresh, cached = served_twice(sharded)
    assert fresh == want and cached == want


def test_serve_refuses_a_broken_checkpoint_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = build_checkpoint(tmp_path, "qwen3_moe")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    missing = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert lines == [f"radixserve: checkpoint is missing tensors: {missing}"]


def tiered_engine(path, store) -> Engine:
    """A small pool over the host tier and a file tier in `store`."""
    return Engine(
        model=str(path),
        max_total_tokens=256,
        chunked_prefill_size=32,
        dtype="float32",
        page_size=16,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(store),
    )


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4_text"])
def test_unusual_pools_go_through_the_host_and_file_tiers(tmp_path, family):
    """MLA's pool holds latents (no values), Gemma 4's layers of two head dims: HiCache backs
    them up, writes them to its files and loads them back after the device cache is flushed,
    with the same greedy tokens."""
    model, path = build_checkpoint(tmp_path, family)
    prompt = list(range(100, 180))
    with tiered_engine(path, tmp_path / "store") as eng:
        first = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        assert eng.flush_cache()
        again = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        eng.check_memory()
    assert first["output_ids"] == again["output_ids"] == hf_greedy(model, prompt, NEW_TOKENS)
    assert again["meta_info"]["cached_tokens"] >= 64


def test_salted_latents_reload_for_their_salt_only(tmp_path):
    """A salt keys its blocks in the host and file tiers too: after a flush, the same salt loads
    its prefix back, another salt computes it anew."""
    model, path = build_checkpoint(tmp_path, "deepseek_v3")
    prompt = list(range(100, 180))
    with tiered_engine(path, tmp_path / "store") as eng:
        eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="a")
        assert eng.flush_cache()
        other = eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="b")
        same = eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="a")
        eng.check_memory()
    assert other["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["cached_tokens"] >= 64
    assert other["output_ids"] == same["output_ids"] == hf_greedy(model, prompt, NEW_TOKENS)


def test_sparse_attention_reads_its_index_keys_back_from_the_disk_tier(tmp_path):
    """DeepSeek-V3.2: a prompt longer than `index_topk` gives HF's tokens fresh, from the
    device cache, and in a new engine from the HiCache disk tier (the indexer's keys ride in
    the latent's pool rows, so they come back with it)."""
    model, path = build_checkpoint(tmp_path, "deepseek_v32")
    prompt = list(range(300, 500))  # 200 tokens: three 64-token blocks, far past the top-k
    want = hf_greedy(model, prompt, NEW_TOKENS)
    tiers = dict(
        model=str(path),
        dtype="float32",
        max_total_tokens=1024,
        chunked_prefill_size=64,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "kv"),
    )
    with Engine(**tiers) as eng:
        for cached in (0, len(prompt) - 1):
            out = eng.generate(input_ids=prompt, sampling_params=GREEDY)
            assert out["output_ids"] == want
            assert out["meta_info"]["cached_tokens"] >= cached
        eng.scheduler.kv.hicache.storage.flush()
    with Engine(**tiers) as eng:
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens"] >= 3 * 64
        assert eng.scheduler.snapshot().hicache["storage_hit_tokens"] >= 3 * 64
