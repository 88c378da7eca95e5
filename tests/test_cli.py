"""The command line: help texts and offline generation."""

import subprocess
import sys


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "radixserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_serve_help_documents_every_flag():
    out = run("serve", "--help").stdout
    for flag in [
        "--model",
        "--host",
        "--port",
        "--dtype",
        "--max-total-tokens",
        "--mem-fraction",
        "--max-running-requests",
        "--chunked-prefill-size",
        "--schedule-policy",
        "--disable-radix-cache",
        "--page-size",
        "--attention-backend",
        "--api-key",
        "--log-level",
    ]:
        assert flag in out, flag


def test_generate_offline(tokenizer, hf_greedy):
    r = run(
        "generate",
        "The capital of France is",
        "--max-new-tokens",
        "6",
        "--max-total-tokens",
        "1024",
        "--dtype",
        "float32",
        "--json",
        "--log-level",
        "warning",
    )
    assert r.returncode == 0, r.stderr
    import json

    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert (
        result["output_ids"][:5] == hf_greedy(tokenizer.encode("The capital of France is"), 6)[:5]
    )


def test_bad_flags_fail_clearly():
    r = run("serve", "--page-size", "0")
    assert r.returncode == 2 and "page_size" in r.stderr


def test_generate_refuses_a_model_in_one_line():
    r = run("generate", "--model", "/nonexistent/model", "hi", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "'/nonexistent/model' is not a model directory" in lines[0]


def test_refused_combinations_name_what_is_wrong():
    for args, words in [
        (
            [
                "serve",
                "--dp-size",
                "2",
                "--nnodes",
                "2",
                "--tp-size",
                "2",
                "--dist-init-addr",
                "h:1",
            ],
            "dp_size with nnodes",
        ),
        (
            ["serve", "--dp-size", "2", "--kv-events-config", '{"endpoint": "tcp://*:5557"}'],
            "--router-kv-events",
        ),
        (["serve", "--dp-size", "0"], "dp_size must be >= 1"),
        (["serve", "--enable-hierarchical-cache", "--tp-size", "3"], "tp_size 1"),
        (
            ["serve", "--hicache-storage-backend", "file", "--hicache-storage-dir", "/tmp/x"],
            "enable_hierarchical_cache",
        ),
        (["serve", "--nnodes", "2", "--tp-size", "2"], "dist_init_addr"),
        (["router", "--policy", "round_robin", "--kv-events"], "cache_aware"),
        (["router", "--worker-urls", "localhost:1"], "http://host:port"),
        (
            ["serve", "--log-requests", f"{__file__}/log"],
            "log_requests: cannot create",
        ),  # under a file
        (["replay", "--synthetic", "rag", "--cache-tokens", "4k,lots"], "--cache-tokens"),
        (["replay", "--synthetic", "rag", "--dp", "two"], "--dp"),
        (["serve", "--speculative-algorithm", "draft"], "speculative_draft_model go together"),
        (
            [
                "serve",
                "--speculative-algorithm",
                "draft",
                "--speculative-draft-model",
                "/nonexistent/draft",
            ],
            "'/nonexistent/draft' is not a model directory",
        ),
        (
            [
                "serve",
                "--speculative-algorithm",
                "draft",
                "--speculative-draft-model",
                "dummy:llama-3-8b",
            ],
            "a draft model needs the same tokenizer",
        ),
    ]:
        r = run(*args, timeout=60)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr)


def test_dtype_auto_follows_the_cpus_measured_bf16_speed():
    """bf16 where bench/serving.py measured it faster (AMX-BF16; AVX512-BF16 on AMD), float32 on
    Intel's AVX512-BF16 without AMX and on CPUs without native bf16, each with its reason."""
    import torch

    from radixserve.worker.device import cpu_auto_dtype

    def cpu(vendor: str, *flags: str) -> str:
        return f"vendor_id\t: {vendor}\nflags\t\t: fpu sse avx2 avx512f {' '.join(flags)}\n"

    cases = [
        (cpu("GenuineIntel", "avx512_bf16", "amx_tile", "amx_bf16"), torch.bfloat16, "AMX"),
        (cpu("AuthenticAMD", "avx512_bf16"), torch.bfloat16, "AVX512-BF16"),
        (cpu("GenuineIntel", "avx512_bf16"), torch.float32, "Intel"),
        (cpu("AuthenticAMD"), torch.float32, "no native bf16"),
        ("", torch.float32, "no native bf16"),
    ]
    for cpuinfo, dtype, reason in cases:
        got, why = cpu_auto_dtype(cpuinfo)
        assert (got, reason in why) == (dtype, True), (cpuinfo, got, why)
