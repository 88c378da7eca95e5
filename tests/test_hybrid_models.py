"""Hybrid models (recurrent or convolutional layers beside attention) against HF transformers in
float32: a tiny random checkpoint built with HF's own classes, served, greedy tokens compared,
fresh and resumed from state snapshots in the radix tree, with prompts split across prefill
chunks and batched with other requests' decode steps."""

import json
import subprocess
import sys

import pytest
import test_model_families as families
import torch
import transformers as hf
from server_utils import start_server

from radixserve import Engine
from radixserve.scheduler.speculative import StepCost

PROMPTS = [[5, 17, 42, 99, 3], list(range(100, 180)), [7, 7, 7] + list(range(200, 260))]
NEW_TOKENS = 12
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
GATED_DELTA_NET = dict(
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
NEMOTRON_H_MAMBA = dict(
    head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16
)
ATTENTION_MAMBA = ["full_attention", "linear_attention"]
FAMILIES = {
    "qwen3_5_text": (hf.Qwen3_5TextConfig, hf.Qwen3_5ForCausalLM, GATED_DELTA_NET),
    "qwen3_5_moe_text": (
        hf.Qwen3_5MoeTextConfig,
        hf.Qwen3_5MoeForCausalLM,
        {**GATED_DELTA_NET, **EXPERTS},
    ),
    "lara_mini": (  # window layers turned by the rotary, full ones without a position
        hf.LaraMiniConfig,
        hf.LaraMiniForCausalLM,
        dict(
            GATED_DELTA_NET,
            **EXPERTS,
            layer_types=[
                "linear_attention",
                "sliding_attention",
                "linear_attention",
                "full_attention",
            ],
            sliding_window=16,
            eos_token_id=2,
        ),
    ),
    "qwen3_next": (
        hf.Qwen3NextConfig,
        hf.Qwen3NextForCausalLM,
        {**GATED_DELTA_NET, **EXPERTS, "norm_topk_prob": False},
    ),
    "nemotron_h": (
        hf.NemotronHConfig,
        hf.NemotronHForCausalLM,
        dict(NEMOTRON_H_MAMBA, layers_block_type=["linear_attention", "mlp", *ATTENTION_MAMBA]),
    ),
    "nemotron_h_moe": (  # Nemotron 3: routed squared-ReLU experts in a latent space
        hf.NemotronHConfig,
        hf.NemotronHForCausalLM,
        dict(
            NEMOTRON_H_MAMBA,
            layers_block_type=["linear_attention", "moe", *ATTENTION_MAMBA],
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            moe_latent_size=32,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
        ),
    ),
    "falcon_h1": (
        hf.FalconH1Config,
        hf.FalconH1ForCausalLM,
        dict(
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            embedding_multiplier=2.0,
            lm_head_multiplier=0.5,
            key_multiplier=0.7,
            attention_in_multiplier=1.3,
            attention_out_multiplier=0.8,
            ssm_in_multiplier=1.1,
            ssm_out_multiplier=0.9,
            ssm_multipliers=[1.2, 0.8, 1.1, 0.9, 1.3],
            mlp_multipliers=[1.2, 0.7],
        ),
    ),
    "olmo_hybrid": (  # the released checkpoints' attention: no rotary (no rope_theta)
        hf.OlmoHybridConfig,
        hf.OlmoHybridForCausalLM,
        dict(
            GATED_DELTA_NET,
            rope_parameters={"rope_type": "default", "rope_theta": None},
            pad_token_id=0,
        ),
    ),
    "olmo_hybrid_rope": (
        hf.OlmoHybridConfig,
        hf.OlmoHybridForCausalLM,
        dict(GATED_DELTA_NET, linear_allow_neg_eigval=False, pad_token_id=0),
    ),
    "kimi_linear": (  # KDA beside MLA without rotary, DeepSeek-V3's experts
        hf.KimiLinearConfig,
        hf.KimiLinearForCausalLM,
        dict(
            GATED_DELTA_NET,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            linear_head_dim=16,
            linear_num_heads=4,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            num_local_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "lfm2": (
        hf.Lfm2Config,
        hf.Lfm2ForCausalLM,
        dict(layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3),
    ),
    "granitemoehybrid": (  # Granite 4.0-H
        hf.GraniteMoeHybridConfig,
        hf.GraniteMoeHybridForCausalLM,
        dict(
            layer_types=["mamba", "attention", "mamba", "mamba"],
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=16,
            position_embedding_type="rope",
            embedding_multiplier=2.0,
            attention_multiplier=0.3,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        ),
    ),
    "lfm3": (  # window and full attention layers, each kind its own rotary; gates; sandwich norms
        hf.Lfm3Config,
        hf.Lfm3ForCausalLM,
        dict(
            head_dim=16,
            layer_types=["conv", "sliding_attention", "full_attention", "conv"],
            sliding_window=16,
            conv_L_cache=3,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "bamba": (  # Mamba2 beside attention layers named by attn_layer_indices
        hf.BambaConfig,
        hf.BambaForCausalLM,
        dict(
            head_dim=16,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=16,
        ),
    ),
    "jamba": (  # Mamba (selective scan) layers, an attention layer without rotary, experts
        hf.JambaConfig,
        hf.JambaForCausalLM,
        dict(
            attn_layer_period=4,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=16,
            mamba_dt_rank=8,
        ),
    ),
    "minimax": (  # lightning attention beside full attention, weighted residuals, experts
        hf.MiniMaxConfig,
        hf.MiniMaxForCausalLM,
        dict(
            head_dim=16,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
            ],
            block_size=16,
            num_local_experts=4,
            full_attn_alpha_factor=1.5,
            full_attn_beta_factor=0.8,
            linear_attn_alpha_factor=1.3,
            linear_attn_beta_factor=1.2,
            mlp_alpha_factor=0.9,
            mlp_beta_factor=1.4,
        ),
    ),
    "mamba": (hf.MambaConfig, hf.MambaForCausalLM, dict(state_size=16, time_step_rank=8)),
    "falcon_mamba": (  # Mamba with weightless norms on dt, B and C
        hf.FalconMambaConfig,
        hf.FalconMambaForCausalLM,
        dict(state_size=16, time_step_rank=8, tie_word_embeddings=False),
    ),
    "mamba2": (  # Codestral Mamba's layers
        hf.Mamba2Config,
        hf.Mamba2ForCausalLM,
        dict(num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=16),
    ),
    "lfm2_moe": (
        hf.Lfm2MoeConfig,
        hf.Lfm2MoeForCausalLM,
        dict(
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            conv_L_cache=3,
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            routed_scaling_factor=1.5,
        ),
    ),
}


class FlatStepCost(StepCost):
    """A step costs the same at any row count: drafts are always worth verifying."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def seconds(self, rows: int) -> float:
        return 0.03


def hybrid_engine(path, **options) -> Engine:
    """The checkpoint at `path` in float32, prompts in 32-token chunks, snapshots every 24."""
    return Engine(
        model=str(path),
        max_total_tokens=1024,
        chunked_prefill_size=32,
        dtype="float32",
        mamba_track_interval=24,
        **options,
    )


def build_checkpoint(path, family: str):
    return families.build_checkpoint(path, family, FAMILIES, COMMON)


def hf_greedy(model, ids):
    return families.hf_greedy(model, ids, NEW_TOKENS)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hybrid_family_matches_hf(tmp_path, family):
    model, path = build_checkpoint(tmp_path, family)
    want = [hf_greedy(model, ids) for ids in PROMPTS]
    with hybrid_engine(path) as eng:
        fresh = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in fresh] == want
        assert all(r["meta_info"]["cached_tokens"] == 0 for r in fresh)
        # again: each resumes from the last state snapshot its first run kept where a chunk
        # ended (at 32, 64) or at a multiple of the interval (24, 48, 72)
        cached = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in cached] == want
        assert [r["meta_info"]["cached_tokens"] for r in cached] == [0, 72, 48]
        # the conversation's next turn resumes where the first turn's answer ends
        turn = PROMPTS[1] + want[1] + [11, 12, 13, 14, 15]
        second = eng.generate(input_ids=turn, sampling_params=GREEDY)
        assert second["output_ids"] == hf_greedy(model, turn)
        assert second["meta_info"]["cached_tokens"] == len(PROMPTS[1]) + NEW_TOKENS - 1
        alone = eng.generate(
            input_ids=PROMPTS[1], sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
        )
        assert alone["output_ids"] == want[1]
        eng.check_memory()
    # every prompt token's logprob, across the chunk ends, as HF computes it
    got = torch.tensor([lp for lp, _, _ in alone["meta_info"]["input_token_logprobs"][1:]])
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1]])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(PROMPTS[1][1:])[:, None])
    torch.testing.assert_close(got, expected[:, 0], rtol=1e-4, atol=1e-4)


def test_a_hybrids_window_layers_free_kv_and_keep_it_before_each_snapshot(tmp_path):
    """LFM3's window layers keep their KV apart, freed once it falls behind the window, and the
    tree keeps the window before each state snapshot: a prompt sharing the first 60 tokens of
    an earlier one resumes from the snapshot at 48 (an interval) and leaves one where it
    branched, from which a third branching there resumes; HF's tokens every time."""
    model, path = build_checkpoint(tmp_path, "lfm3")
    branch = PROMPTS[1][:60] + list(range(400, 420))
    again = PROMPTS[1][:60] + list(range(300, 310))
    with hybrid_engine(path) as eng:
        first = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
        second = eng.generate(input_ids=branch, sampling_params=GREEDY)
        third = eng.generate(input_ids=again, sampling_params=GREEDY)
        eng.check_memory()
        window = eng.get_stats().hybrid_memory
    assert window["window_kv_capacity_tokens"] > 0
    assert first["output_ids"] == hf_greedy(model, PROMPTS[1])
    assert second["output_ids"] == hf_greedy(model, branch)
    assert third["output_ids"] == hf_greedy(model, again)
    assert [r["meta_info"]["cached_tokens"] for r in (second, third)] == [48, 60]


def test_a_squeezed_snapshot_pool_evicts_and_stays_exact(tmp_path):
    """Two snapshot slots and a KV pool smaller than the traffic: 50 two-turn conversations as
    two batches all finish equal to HF with nothing leaked (snapshots evicted least recently
    used first, and with the KV they sit on); then conversations one at a time each resume
    their second turn from the snapshot their first turn left."""
    model, path = build_checkpoint(tmp_path, "lfm2")
    firsts = [[300 + i] + list(range(20 + i, 60 + i)) for i in range(50)]
    with Engine(
        model=str(path),
        max_total_tokens=2048,
        chunked_prefill_size=32,
        dtype="float32",
        max_mamba_cache_size=2,
    ) as eng:
        answers = [r["output_ids"] for r in eng.generate(input_ids=firsts, sampling_params=GREEDY)]
        turns = [p + a + [7, 8, 9] for p, a in zip(firsts, answers)]
        seconds = [r["output_ids"] for r in eng.generate(input_ids=turns, sampling_params=GREEDY)]
        eng.check_memory()
        resumed = []
        for first in firsts[:3]:
            answer = eng.generate(input_ids=first, sampling_params=GREEDY)["output_ids"]
            turn = first + answer + [5, 6]
            resumed.append(eng.generate(input_ids=turn, sampling_params=GREEDY)["meta_info"])
        eng.check_memory()
        assert eng.get_stats().num_running == 0
    assert answers == [hf_greedy(model, p) for p in firsts]
    assert seconds == [hf_greedy(model, t) for t in turns]
    assert [m["cached_tokens"] for m in resumed] == [len(firsts[0]) + NEW_TOKENS - 1] * 3


def test_a_long_conversation_resumes_and_its_branches_resume_where_they_branch(tmp_path):
    """A 600-token prompt, then the conversation's next turn: all of the first turn but its
    last answer token (whose state its own decode step has not yet taken in) comes from the
    cache. Two requests leaving that path at token 333, where no snapshot is: the first
    resumes from the last snapshot before it (at 320: LFM2's state is worth 16 tokens of KV,
    so snapshots are kept every 16 while slots are free) and computes the rest in a chunk that
    ends at 333, keeping a snapshot there; the second reads all 333 from the cache. Tokens
    equal HF."""
    model, path = build_checkpoint(tmp_path, "lfm2")
    first = [(7 * i) % 500 + 3 for i in range(600)]
    with Engine(
        model=str(path), max_total_tokens=4096, chunked_prefill_size=256, dtype="float32"
    ) as eng:
        answer = eng.generate(input_ids=first, sampling_params=GREEDY)
        turn = first + answer["output_ids"] + [11, 12, 13]
        second = eng.generate(input_ids=turn, sampling_params=GREEDY)
        branches = [first[:333] + [400, 401, 402], first[:333] + [450, 451]]
        got = [eng.generate(input_ids=p, sampling_params=GREEDY) for p in branches]
        eng.check_memory()
    resumed = second["meta_info"]["cached_tokens"]
    assert resumed == len(first) + NEW_TOKENS - 1
    assert resumed >= 0.9 * (len(first) + NEW_TOKENS)
    assert [g["meta_info"]["cached_tokens"] for g in got] == [320, 333]
    assert answer["output_ids"] == hf_greedy(model, first)
    assert second["output_ids"] == hf_greedy(model, turn)
    assert [g["output_ids"] for g in got] == [hf_greedy(model, p) for p in branches]


@pytest.mark.parametrize(
    "family",
    ["qwen3_5_moe_text", "qwen3_next", "lara_mini", "nemotron_h", "nemotron_h_moe", "falcon_h1"]
    + ["granitemoehybrid", "bamba", "lfm2", "lfm2_moe", "lfm3", "jamba", "falcon_mamba", "mamba2"]
    + ["minimax", "kimi_linear", "olmo_hybrid"],
)
def test_sharded_hybrids_at_tensor_parallel_2_match_hf_and_resume(tmp_path, family):
    """Two ranks, each with half of every Gated DeltaNet's key and value heads, of every
    Mamba2 layer's heads (its groups too where several; Falcon-H1's one group whole on both,
    its norm summed over them) or of every short convolution's channels, of the attention's
    and of the experts': HF's tokens fresh,
    then resumed from state snapshots, whose copies rank 0 sends to rank 1 with the next
    step; a conversation's next turn likewise."""
    model, path = build_checkpoint(tmp_path, family)
    want = [hf_greedy(model, ids) for ids in PROMPTS]
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
        "--mamba-track-interval",
        "24",
    )
    try:
        with server.client() as client:
            rounds = []
            for _ in range(2):
                body = {"input_ids": PROMPTS, "sampling_params": GREEDY}
                rounds.append(client.post("/generate", json=body).json())
            turn = PROMPTS[1] + want[1] + [11, 12, 13]
            body = {"input_ids": turn, "sampling_params": GREEDY}
            second = client.post("/generate", json=body).json()
    finally:
        assert server.stop() == 0, server.log()
    assert [[r["output_ids"] for r in out] for out in rounds] == [want, want]
    assert [r["meta_info"]["cached_tokens"] for r in rounds[1]] == [0, 72, 48]
    assert second["output_ids"] == hf_greedy(model, turn)
    assert second["meta_info"]["cached_tokens"] == len(PROMPTS[1]) + NEW_TOKENS - 1


def test_lora_adapters_on_a_hybrid_match_hf_merged_and_keep_their_own_snapshots(tmp_path):
    """An adapter on the attention and MLP layers of Qwen3.5 (peft, merged into HF's model for
    the answer), batched beside the base: each gets its own tokens, and a prompt the base ran
    resumes from no snapshot of the base's under the adapter, then from its own."""
    from test_lora import write_adapter

    base, path = build_checkpoint(tmp_path, "qwen3_5_text")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    merged = write_adapter(base, tmp_path / "a1", 8, 16, targets, seed=1)
    prompt = PROMPTS[1]
    with Engine(
        model=str(path),
        lora_paths=(f"a1={tmp_path / 'a1'}",),
        max_total_tokens=1024,
        chunked_prefill_size=32,
        dtype="float32",
        mamba_track_interval=24,
    ) as eng:
        alone = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        first = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a1")
        both = eng.generate(
            input_ids=[prompt, prompt], sampling_params=GREEDY, lora_path=[None, "a1"]
        )
        eng.check_memory()
    assert alone["output_ids"] == hf_greedy(base, prompt)
    assert first["output_ids"] == hf_greedy(merged, prompt) != alone["output_ids"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert [r["output_ids"] for r in both] == [alone["output_ids"], first["output_ids"]]
    assert [r["meta_info"]["cached_tokens"] for r in both] == [72, 72]


@pytest.mark.parametrize(
    "option,flag",
    [
        (dict(enable_torch_compile=True), "enable_torch_compile"),
        (
            dict(enable_deterministic_inference=True, mamba_ssm_dtype="bfloat16"),
            "mamba_ssm_dtype other than float32 with enable_deterministic_inference",
        ),
    ],
)
def test_what_hybrid_models_do_not_run_yet_is_refused_by_name(tmp_path, option, flag):
    _, path = build_checkpoint(tmp_path, "lfm2")
    with pytest.raises(ValueError, match=flag):
        Engine(model=str(path), dtype="float32", **option)


def test_speculation_with_a_recurrent_draft_model_or_at_tp_2_is_refused_by_name(tmp_path):
    _, path = build_checkpoint(tmp_path, "lfm2")
    draft = dict(speculative_algorithm="draft", speculative_draft_model=str(path))
    with pytest.raises(ValueError, match="speculative-draft-model .* recurrent layers"):
        Engine(model=str(path), dtype="float32", **draft)
    flags = ["--model", str(path), "--tp-size", "2", "--speculative-algorithm", "ngram"]
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "radixserve: invalid model arguments: speculative_algorithm at tp_size > 1 with "
        "Lfm2ForCausalLM's recurrent layers is not supported yet"
    )


def test_a_hybrid_server_reports_its_snapshots_in_metrics_and_the_dashboard(tmp_path):
    """Over HTTP: the start-up line shows the state pool (a state's bytes and its worth in KV
    tokens); after a conversation's second turn, /metrics and /dashboard/data count the
    snapshots held, the free slots and the prompt tokens resumed from snapshots."""
    _, path = build_checkpoint(tmp_path, "lfm2")
    server = start_server(tmp_path, "--model", str(path), "--max-mamba-cache-size", "8")
    try:
        with server.client() as client:
            first = list(range(20, 90))
            answer = client.post(
                "/generate", json={"input_ids": first, "sampling_params": GREEDY}
            ).json()["output_ids"]
            turn = {"input_ids": first + answer + [5, 6], "sampling_params": GREEDY}
            cached = client.post("/generate", json=turn).json()["meta_info"]["cached_tokens"]
            metrics = client.get("/metrics").text
            data = client.get("/dashboard/data").json()
    finally:
        assert server.stop() == 0, server.log()
    assert cached == len(first) + NEW_TOKENS - 1
    assert "state pool 64 + 8 snapshots x" in server.log()
    held = data["current"]["hybrid_memory"]  # as of the /metrics request before it
    assert 1 <= held["state_snapshots"] <= 8
    assert held["state_snapshots"] + held["state_snapshot_slots_free"] == 8
    assert held["state_resumed_tokens_total"] == cached
    assert f"radixserve:state_resumed_tokens_total {float(cached)}" in metrics
    assert f"radixserve:state_snapshots {float(held['state_snapshots'])}" in metrics


def test_recurrent_states_stored_in_bfloat16_take_half_the_memory(tmp_path, caplog):
    """--mamba-ssm-dtype bfloat16: the scan's states are stored in bf16 (computed in float32),
    running and in snapshots; the state pool line shows the smaller state, the prompt's
    logprobs stay within 1e-3 (absolute and relative) of float32 states' across chunk ends, and
    decoding runs."""
    _, path = build_checkpoint(tmp_path, "nemotron_h")
    got = {}
    for dtype in ("float32", "bfloat16"):
        caplog.clear()
        with caplog.at_level("INFO", logger="radixserve"):
            with Engine(
                model=str(path),
                max_total_tokens=1024,
                chunked_prefill_size=32,
                dtype="float32",
                mamba_ssm_dtype=dtype,
            ) as eng:
                out = eng.generate(
                    input_ids=PROMPTS[1],
                    sampling_params=GREEDY,
                    return_logprob=True,
                    logprob_start_len=0,
                )
        lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
        got[dtype] = (lps, out["output_ids"], caplog.text)
    assert "x 11.00 KiB" in got["float32"][2] and "x 7.00 KiB" in got["bfloat16"][2]
    torch.testing.assert_close(got["bfloat16"][0], got["float32"][0], rtol=1e-3, atol=1e-3)
    assert len(got["bfloat16"][1]) == NEW_TOKENS
    assert got["bfloat16"][1][0] == got["float32"][1][0]


@pytest.mark.parametrize(
    "family", ["qwen3_5_text", "nemotron_h", "lfm2", "mamba", "minimax", "kimi_linear"]
)
def test_ngram_speculation_on_a_hybrid_keeps_the_state_after_the_tokens_kept(tmp_path, family):
    """--speculative-algorithm ngram on a hybrid (Gated DeltaNet, Mamba2, short convolutions,
    Mamba, lightning attention, Kimi Delta Attention): a verified segment runs a token at a
    time and the request keeps the state after the tokens it keeps. A first answer fills the
    n-gram table; the same context asked again drafts the rest of that answer, all accepted,
    but stops at a token in the middle of them, and the conversation's next turn resumes from
    the snapshot where it stopped; with that token banned (`logit_bias`) the same drafts are
    accepted up to it and rejected there. Every answer is HF's."""
    model, path = build_checkpoint(tmp_path, family)
    prompt = list(range(100, 140))
    with hybrid_engine(path, speculative_algorithm="ngram") as eng:
        eng.scheduler.decode.step_cost = FlatStepCost()  # drafts always worth their rows

        def answer(ids, **params):
            params = {"temperature": 0, "max_new_tokens": 16, **params}
            return eng.generate(input_ids=ids, sampling_params=params)

        first = answer(prompt, ignore_eos=True)["output_ids"]
        again = prompt + first[:6]
        stop = next(i for i in range(9, 16) if first[i] not in first[6:i])
        stopped = answer(again, stop_token_ids=[first[stop]])
        turn = again + stopped["output_ids"] + [11, 12, 13]
        second = answer(turn, max_new_tokens=12, ignore_eos=True)
        banned = answer(again, max_new_tokens=10, ignore_eos=True, logit_bias={first[stop]: -100})
        stats = eng.get_stats()
        eng.check_memory()
    assert first == families.hf_greedy(model, prompt, 16)
    assert stopped["output_ids"] == first[6 : stop + 1]
    assert stopped["meta_info"]["spec_verify_ct"] >= 1
    assert second["output_ids"] == families.hf_greedy(model, turn, 12)
    assert second["meta_info"]["cached_tokens"] == len(again) + stop - 6
    assert banned["output_ids"] == hf_greedy_without(model, again, 10, first[stop])
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total


def hf_greedy_without(model, ids: list[int], n: int, banned: int) -> list[int]:
    """HF's greedy tokens with one token never chosen."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            logits[banned] = float("-inf")
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_hybrids_snapshots_go_to_the_host_and_file_tiers_and_survive_a_restart(tmp_path, family):
    """--enable-hierarchical-cache with a file tier: snapshots at block ends (the interval
    rounded up to the tiers' 64-token blocks) follow their KV into the host tier and the files.
    With the device cache flushed a prompt resumes from the host tier's state at 128; a new
    engine over the same files resumes from the disk's; HF's tokens, and on the next turn."""
    model, path = build_checkpoint(tmp_path, family)
    prompt = list(
        range(100, 230)
    )  # 130 tokens: states kept at 64 and 128, resumed close to the end
    want = hf_greedy(model, prompt)
    tiers = dict(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "store"),
    )
    with hybrid_engine(path, **tiers) as eng:
        first = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        assert eng.flush_cache()
        again = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        eng.check_memory()
        eng.scheduler.kv.hicache.storage.flush()
    assert first["output_ids"] == again["output_ids"] == want
    assert again["meta_info"]["cached_tokens"] == 128
    with hybrid_engine(path, **tiers) as eng:
        restarted = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        turn = prompt + want + [11, 12, 13]
        second = eng.generate(input_ids=turn, sampling_params=GREEDY)
        hits = eng.scheduler.snapshot().hicache
        eng.check_memory()
    assert restarted["output_ids"] == want
    assert restarted["meta_info"]["cached_tokens"] == 128
    assert hits["storage_hit_tokens"] >= 128
    assert second["output_ids"] == hf_greedy(model, turn)
    assert second["meta_info"]["cached_tokens"] == len(prompt) + NEW_TOKENS - 1


def test_the_host_tier_keeps_the_most_recently_used_states_within_its_slots(tmp_path):
    """`--hicache-ratio` sizes the host tier's states (here one; the KV sized apart by
    `--hicache-size`): each state backed up pushes out the least recently used. Two prompts,
    then short ones (no whole block, so nothing backed up) until the device has evicted both:
    the second resumes from host memory at its last block's end, the first, whose states were
    pushed out, is computed again, to the same tokens. A flush empties host memory too."""
    _, path = build_checkpoint(tmp_path, "qwen3_5_text")
    first, second = list(range(100, 230)), list(range(300, 430))
    tiers = dict(enable_hierarchical_cache=True, hicache_size=1, hicache_ratio=1e-4)
    with hybrid_engine(path, **tiers) as eng:
        hicache = eng.scheduler.kv.hicache
        assert hicache.states.capacity == 1
        fresh = [eng.generate(input_ids=p, sampling_params=GREEDY) for p in (first, second)]
        for start in range(0, 24 * 40, 40):  # 52 tokens each, 1,248 in all
            short = [(start + i) % 97 + 2 for i in range(40)]
            eng.generate(input_ids=short, sampling_params=GREEDY)
        assert eng.scheduler.kv.cache.match_length(first, None)[0] == 0  # off the device
        again_second = eng.generate(input_ids=second, sampling_params=GREEDY)
        again_first = eng.generate(input_ids=first, sampling_params=GREEDY)
        eng.check_memory()
        assert eng.flush_cache()
        assert not hicache.states.index and not hicache.host.index
    assert again_second["meta_info"]["cached_tokens"] == 128
    assert again_first["meta_info"]["cached_tokens"] == 0
    assert again_first["output_ids"] == fresh[0]["output_ids"]
    assert again_second["output_ids"] == fresh[1]["output_ids"]


def test_hierarchical_cache_with_a_model_that_keeps_no_kv_is_refused(tmp_path):
    _, path = build_checkpoint(tmp_path, "mamba2")
    with pytest.raises(ValueError, match="enable_hierarchical_cache with .* keeps no KV"):
        Engine(model=str(path), dtype="float32", enable_hierarchical_cache=True)


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_hybrids_attention_keeps_fp8_kv_beside_its_states(tmp_path, family):
    """--kv-cache-dtype fp8_e4m3: the attention layers' KV takes a byte an element (a quarter
    of float32's), the recurrent states stay float32; tokens resumed from snapshots equal the
    fresh ones, near HF's (FP8 rounding of K and V may move a late near-tie), and the prompt's
    logprobs move by less than 1% of their size on average from a float32 pool's."""
    model, path = build_checkpoint(tmp_path, family)
    want = hf_greedy(model, PROMPTS[1])
    got = {}
    for kv in ("auto", "fp8_e4m3"):
        with hybrid_engine(path, kv_cache_dtype=kv) as eng:
            runs = [eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY) for _ in range(2)]
            scored = eng.generate(
                input_ids=PROMPTS[1],
                sampling_params=GREEDY,
                return_logprob=True,
                logprob_start_len=0,
            )
            plan = eng.runner.info.memory_plan()
            eng.check_memory()
        assert runs[0]["output_ids"] == runs[1]["output_ids"] == scored["output_ids"]
        assert runs[1]["meta_info"]["cached_tokens"] == 72
        lps = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]]
        got[kv] = (torch.tensor(lps), runs[0]["output_ids"], plan)
    assert got["auto"][1] == want
    assert sum(a == b for a, b in zip(got["fp8_e4m3"][1], want)) >= 6
    assert got["fp8_e4m3"][2].kv_bytes_per_token * 4 == got["auto"][2].kv_bytes_per_token
    moved = (got["fp8_e4m3"][0] - got["auto"][0]).abs().mean()
    assert moved < 0.01 * got["auto"][0].abs().mean()  # 0.2-0.5% measured


def test_the_state_pool_sized_as_a_share_of_the_kv_pool(tmp_path, caplog):
    """--mamba-full-memory-ratio 1: the states take as many bytes as the KV pool (1,024
    tokens x 256 B), 170 LFM2 states of 1.5 KiB: 64 running requests' and 106 snapshots."""
    _, path = build_checkpoint(tmp_path, "lfm2")
    with caplog.at_level("INFO", logger="radixserve"):
        with Engine(
            model=str(path), max_total_tokens=1024, dtype="float32", mamba_full_memory_ratio=1.0
        ) as eng:
            assert len(eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"])
    assert "state pool 64 + 106 snapshots x 1.50 KiB" in caplog.text


def test_a_model_without_attention_keeps_no_kv_and_a_snapshot_every_256_tokens(tmp_path, caplog):
    """Mamba2 (every layer a state, no KV) served with the default sizes: slots that hold no KV,
    a snapshot every 256 tokens (SGLang's default interval); a 300-token prompt served again
    resumes from the one at 256, HF's tokens both times."""
    model, path = build_checkpoint(tmp_path, "mamba2")
    prompt = list(range(100, 400))
    with caplog.at_level("INFO", logger="radixserve"):
        with Engine(model=str(path), dtype="float32") as eng:
            first, again = (eng.generate(input_ids=prompt, sampling_params=GREEDY) for _ in "12")
            eng.check_memory()
    assert first["output_ids"] == again["output_ids"] == hf_greedy(model, prompt)
    assert again["meta_info"]["cached_tokens"] == 256
    assert "KV 0 B a token (float32), 65536 tokens" in caplog.text
    assert "(the model keeps no KV, kept every 256 tokens)" in caplog.text
    with pytest.raises(ValueError, match="mamba_full_memory_ratio .* keeps no KV"):
        Engine(model=str(path), dtype="float32", mamba_full_memory_ratio=0.5)


def test_experts_stacked_in_the_checkpoint_load_like_per_expert_ones(tmp_path):
    """A Qwen3.5-MoE checkpoint with its experts stacked as HF's expert modules hold them
    (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) serves the same tokens
    as the per-expert one HF saves."""
    from safetensors.torch import load_file, save_file

    model, path = build_checkpoint(tmp_path, "qwen3_5_moe_text")
    tensors = load_file(path / "model.safetensors")
    stacked = {}
    for name, tensor in tensors.items():
        head, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            stacked[name] = tensor
            continue
        expert, kind = int(rest.split(".")[0]), rest.split(".")[1]
        stacked.setdefault(f"{head}.mlp.experts.{kind}", {})[expert] = tensor
    for name in [n for n, v in stacked.items() if isinstance(v, dict)]:
        parts = stacked.pop(name)
        stacked[name] = torch.stack([parts[e] for e in sorted(parts)])
    for name in [n for n in stacked if n.endswith(".gate_proj")]:
        up = stacked.pop(name.replace("gate_proj", "up_proj"))
        stacked[name.replace("gate_proj", "gate_up_proj")] = torch.cat([stacked.pop(name), up], 1)
    save_file({n: t.contiguous() for n, t in stacked.items()}, path / "model.safetensors")
    with Engine(model=str(path), max_total_tokens=1024, dtype="float32") as eng:
        got = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    assert got == hf_greedy(model, PROMPTS[1])


def test_nemotron_h_layer_patterns_and_refusals_from_config_json(tmp_path):
    """A Nemotron-H config.json names its layers by `hybrid_override_pattern` (M: Mamba2, *:
    attention, -: MLP, E: experts) as released checkpoints do; a Mamba activation other than
    SiLU is refused in one line naming it."""
    from radixserve.model_config import ModelConfig
    from radixserve.models.config_checks import UnsupportedModel, check_supported

    config = hf.NemotronHConfig(**COMMON, head_dim=16).to_dict()
    config.pop("layers_block_type", None)
    cfg = ModelConfig.from_hf_dict(dict(config, hybrid_override_pattern="M-*M"))
    assert (cfg.num_layers, cfg.num_kv_layers, cfg.state_layers) == (4, 1, 2)
    cfg = ModelConfig.from_hf_dict(dict(config, hybrid_override_pattern="ME*M"))
    assert (cfg.num_layers, cfg.num_kv_layers, cfg.state_layers) == (4, 1, 2)
    check_supported(dict(config, hybrid_override_pattern="ME*M"))
    with pytest.raises(UnsupportedModel, match="mamba_hidden_act"):
        check_supported(dict(config, mamba_hidden_act="gelu"))


def test_kimi_linear_loads_its_releases_config_json(tmp_path):
    """Kimi Linear's releases name their layers in `linear_attn_config` (1-based `kda_layers`,
    the KDA head sizes) and their dense layers by `first_k_dense_replace`, as transformers reads
    them: served from such a config.json, the tokens are HF's."""
    model, path = build_checkpoint(tmp_path, "kimi_linear")
    config = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads"):
        config.pop(key)
    config["linear_attn_config"] = {
        "kda_layers": [1, 3, 4],
        "full_attn_layers": [2],
        "head_dim": 16,
        "num_heads": 4,
        "short_conv_kernel_size": config.pop("linear_conv_kernel_dim"),
    }
    config["first_k_dense_replace"] = 1
    (path / "config.json").write_text(json.dumps(config))
    with Engine(model=str(path), max_total_tokens=1024, dtype="float32") as eng:
        got = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    assert got == hf_greedy(model, PROMPTS[1])


def test_a_config_json_without_a_field_the_family_reads_is_one_line(tmp_path):
    """A field the family's layers read (Kimi Delta Attention's head count) missing from
    config.json ends start-up with one line naming it, not the child's traceback."""
    _, path = build_checkpoint(tmp_path, "kimi_linear")
    config = json.loads((path / "config.json").read_text())
    config.pop("linear_num_heads")
    (path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "radixserve: config.json: the field 'linear_num_heads' is missing"
    ], proc.stderr
