"""Quantized checkpoints, online FP8, the FP8 KV cache and the memory plan.

The oracle for a checkpoint layout is HF float32 on its dequantized weights (`quant_checkpoints`
writes both); greedy tokens are compared fresh and from the radix cache, with a chunk size that
splits the longer prompts."""

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from quant_checkpoints import FP8_MAX, LAYOUTS, fp8_block, random_llama
from safetensors.torch import load_file, save_file
from server_utils import start_server
from test_model_families import hf_greedy

from radixserve import Engine
from radixserve.models.loader import planned_weight_bytes
from radixserve.models.source import resolve_model
from radixserve.quant.weights import quantize_fp8

PROMPTS = [[5, 17, 42, 99, 3], list(range(100, 180)), [7, 7, 7] + list(range(200, 260))]
NEW_TOKENS = 12
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
PHYSICAL_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def served_twice(path, **options) -> tuple[list, list, Engine]:
    """Greedy tokens of PROMPTS fresh, then from the radix cache, and the engine's info."""
    rounds = []
    with Engine(
        model=str(path), max_total_tokens=1024, chunked_prefill_size=32, dtype="float32", **options
    ) as eng:
        for _ in range(2):
            results = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            rounds.append([r["output_ids"] for r in results])
        eng.check_memory()
        info = eng.runner.info
    assert all(r["meta_info"]["cached_tokens"] >= 32 for r in results[1:])
    return rounds[0], rounds[1], info


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_quantized_layout_matches_hf_on_the_dequantized_weights(tmp_path, layout):
    path, model = LAYOUTS[layout](tmp_path / layout)
    want = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    fresh, cached, info = served_twice(path)
    assert fresh == want
    assert cached == want
    planned = planned_weight_bytes(resolve_model(str(path)), torch.float32, 512, None)
    assert abs(planned - info.weights_bytes) <= 0.02 * info.weights_bytes


def test_online_fp8_matches_hf_on_the_same_rounding(tmp_path):
    """`--quantization fp8`: one scale per output channel, so HF on those FP8 values (widened
    back to float32) is the oracle."""
    model = random_llama()
    model.save_pretrained(tmp_path / "float")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("proj.weight", "lm_head.weight")):  # every linear layer
                param.copy_(_fp8_round_trip(param))
    want = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    fresh, cached, info = served_twice(tmp_path / "float", quantization="fp8")
    assert fresh == want and cached == want
    float_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert info.weights_bytes < 0.6 * float_bytes


def _fp8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    scales = (weight.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    assert torch.equal(quantize_fp8(weight).scales, scales)
    return (weight / scales).to(torch.float8_e4m3fn).float() * scales


SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w.pop(SCALE), f"checkpoint is missing tensors: {SCALE}"),
        (lambda w: w[SCALE].fill_(float("nan")), f"{SCALE!r} holds NaN"),
        (lambda w: w[SCALE].zero_(), f"{SCALE!r} holds zero"),
        (
            lambda w: w.update({SCALE: w[SCALE][:, :1].contiguous()}),
            f"{SCALE!r} \\(2, 1\\): blocks of 64x64 over \\[128, 256\\] need \\[2, 4\\]",
        ),
    ],
)
def test_a_broken_fp8_checkpoint_names_the_tensor(tmp_path, change, message):
    path, _ = fp8_block(tmp_path / "fp8", block=(64, 64))
    weights = load_file(path / "model.safetensors")
    change(weights)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        Engine(model=str(path), max_total_tokens=256, dtype="float32")


def test_an_int4_group_that_does_not_divide_the_input_names_the_tensor(tmp_path):
    path, _ = LAYOUTS["awq"](tmp_path / "awq")
    _edit_config(path, group_size=48)
    with pytest.raises(ValueError, match="q_proj.qweight'.*group_size 48 does not divide .* 128"):
        Engine(model=str(path), max_total_tokens=256, dtype="float32")


def _edit_config(path, **quantization) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (path / "config.json").write_text(json.dumps(config))


def _serve_error(*args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    return proc.stderr.strip().splitlines()


def test_serve_refuses_what_it_cannot_run_in_one_line(tmp_path):
    path, _ = fp8_block(tmp_path / "fp8")
    (line,) = _serve_error("--model", str(path), "--quantization", "int8")
    assert "--quantization int8" in line and "already quantized (fp8_block)" in line
    _edit_config(path, quant_method="bitsandbytes")
    (line,) = _serve_error("--model", str(path))
    assert "quant_method 'bitsandbytes' is not implemented" in line
    gptq, _ = LAYOUTS["gptq"](tmp_path / "gptq")
    weights = load_file(gptq / "model.safetensors")
    del weights["model.layers.0.self_attn.o_proj.scales"]
    save_file(weights, str(gptq / "model.safetensors"))
    assert _serve_error("--model", str(gptq), "--dtype", "float32") == [
        "radixserve: checkpoint is missing tensors: model.layers.0.self_attn.o_proj.scales"
    ]


def test_a_context_that_cannot_fit_one_request_is_refused(tmp_path):
    model = random_llama()
    model.save_pretrained(tmp_path / "llama")
    lines = _serve_error(
        "--model",
        str(tmp_path / "llama"),
        "--dtype",
        "float32",  # 1024 B a token whatever `auto` picks on this CPU
        "--max-total-tokens",
        "256",
        "--context-length",
        "512",
    )
    assert lines[-1] == (
        "radixserve: --context-length 512: one request of that length needs 512 tokens x 1024 B "
        "= 512.00 KiB of KV, and the pool holds 256 tokens (256.00 KiB); lower "
        "--context-length, or raise --mem-fraction or --max-total-tokens (--kv-cache-dtype "
        "fp8_e4m3 halves a token)"
    )


def test_fp8_kv_goes_through_the_radix_cache_and_both_tiers(tmp_path):
    """An FP8 pool's pages go to the host and file tiers and come back with the same tokens;
    a pool of another KV dtype does not read those files (the dtype is in the block hash)."""
    model = random_llama()
    model.save_pretrained(tmp_path / "llama")
    prompt = list(range(100, 180))

    def tiered(kv_cache_dtype: str) -> Engine:
        return Engine(
            model=str(tmp_path / "llama"),
            max_total_tokens=256,
            chunked_prefill_size=32,
            dtype="float32",
            page_size=16,
            kv_cache_dtype=kv_cache_dtype,
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            hicache_storage_dir=str(tmp_path / "store"),
        )

    with tiered("fp8_e4m3") as eng:
        first = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        again = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        assert eng.flush_cache()
        reloaded = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        eng.check_memory()
    assert first["output_ids"] == again["output_ids"] == reloaded["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= 64
    assert reloaded["meta_info"]["cached_tokens"] >= 64
    agree = sum(a == b for a, b in zip(first["output_ids"], hf_greedy(model, prompt, 12)))
    assert agree >= 6  # FP8 rounding of K and V may move a late near-tie
    with tiered("auto") as eng:
        other = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    assert other["meta_info"]["cached_tokens"] == 0


def _kv_server(tmp_path, model_dir, kv_cache_dtype: str):
    flags = ["--dtype", "bfloat16", "--mem-fraction", "0.01", "--kv-cache-dtype", kv_cache_dtype]
    return start_server(tmp_path, "--model", str(model_dir), *flags), flags


def _planned(model_dir, flags) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "plan", "--model", str(model_dir), *flags]
        + ["--memory", str(PHYSICAL_BYTES), "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(proc.stdout)


def test_fp8_kv_doubles_the_pool_and_the_plan_matches_the_server(tmp_path, model_dir):
    """The bundled model in bf16 at the same --mem-fraction: an FP8 pool holds twice the
    tokens, and `radixserve plan` predicts both servers' weights and pools within 2%."""
    plans = {}
    for kv in ("auto", "fp8_e4m3"):
        server, flags = _kv_server(tmp_path, model_dir, kv)
        try:
            with server.client(timeout=120) as client:
                plans[kv] = client.get("/get_server_info").json()["memory_plan"]
                if kv == "fp8_e4m3":
                    _check_fp8_greedy(client)
        finally:
            assert server.stop() == 0, server.log()
        assert "memory plan: weights" in server.log()
        planned = _planned(model_dir, flags)
        for key in ("weights_bytes", "kv_tokens", "kv_bytes_per_token"):
            assert abs(planned[key] - plans[kv][key]) <= 0.02 * plans[kv][key], (key, planned)
    assert plans["auto"]["kv_cache_dtype"] == "bfloat16"
    assert plans["fp8_e4m3"]["kv_cache_dtype"] == "fp8_e4m3"
    assert plans["fp8_e4m3"]["kv_bytes_per_token"] * 2 == plans["auto"]["kv_bytes_per_token"]
    assert plans["fp8_e4m3"]["kv_tokens"] >= 1.9 * plans["auto"]["kv_tokens"]
    fp8 = plans["fp8_e4m3"]
    assert fp8["full_context_requests"] == fp8["kv_tokens"] // fp8["max_context_len"]


def _check_fp8_greedy(client: httpx.Client) -> None:
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    first = client.post("/generate", json=body).json()
    again = client.post("/generate", json=body).json()
    assert first["output_ids"] == again["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0
    assert "Paris" in first["text"]
