"""vLLM's own benchmark client (`vllm bench serve`, from bench/peers/setup_peers.sh vllm) against
a fresh radixserve server, without `--model` (it reads the model and its tokenizer folder from
/v1/models): its mean time to first token beside the server's own (the
`radixserve:time_to_first_token_seconds` histogram over the same requests).

    python bench/vllm_client.py [--input-len 512] [--output-len 16] [--num-prompts 8]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_utils import start_server  # noqa: E402

VLLM = Path(__file__).resolve().parent / ".peers" / "vllm" / "bin" / "vllm"


def server_ttft(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's time-to-first-token histogram."""
    text = httpx.get(f"{url}/metrics").text
    total = float(re.search(r"time_to_first_token_seconds_sum (\S+)", text).group(1))
    count = float(re.search(r"time_to_first_token_seconds_count (\S+)", text).group(1))
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        server = start_server(Path(work), "--max-total-tokens", "16384")
        try:
            before = server_ttft(server.url)
            subprocess.run(
                [str(VLLM), "bench", "serve", "--backend", "openai", "--base-url", server.url]
                + ["--endpoint", "/v1/completions", "--dataset-name", "random"]
                + ["--random-input-len", str(args.input_len)]
                + ["--random-output-len", str(args.output_len)]
                + ["--num-prompts", str(args.num_prompts), "--max-concurrency", "1"]
                + ["--ignore-eos", "--save-result", "--result-dir", work]
                + ["--result-filename", "result.json"],
                check=True,
                capture_output=True,
            )
            after = server_ttft(server.url)
        finally:
            server.stop()
        result = json.loads((Path(work) / "result.json").read_text())
    requests = after[1] - before[1]
    print(
        json.dumps(
            {
                "client_mean_ttft_ms": round(result["mean_ttft_ms"], 1),
                "server_mean_ttft_ms": round(1000 * (after[0] - before[0]) / requests, 1),
                "server_requests": requests,
                "completed": result["completed"],
                "mean_tpot_ms": round(result["mean_tpot_ms"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
