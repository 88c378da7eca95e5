"""The command line: help texts and offline generation."""
import subprocess
import sys


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_serve_help_documents_every_flag():
    out = run("serve", "--help").stdout
    for flag in ["--model", "--host", "--port", "--dtype", "--max-total-tokens", "--mem-fraction",
                 "--max-running-requests", "--chunked-prefill-size", "--schedule-policy", "--disable-radix-cache",
                 "--page-size", "--attention-backend", "--api-key", "--log-level"]:
        assert flag in out, flag


def test_generate_offline(tokenizer, hf_greedy):
    r = run("generate", "The capital of France is", "--max-new-tokens", "6", "--max-total-tokens", "1024", "--dtype", "float32",
            "--json", "--log-level", "warning")
    assert r.returncode == 0, r.stderr
    import json
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["output_ids"][:5] == hf_greedy(tokenizer.encode("The capital of France is"), 6)[:5]


def test_bad_flags_fail_clearly():
    r = run("serve", "--page-size", "0")
    assert r.returncode == 2 and "page_size" in r.stderr
