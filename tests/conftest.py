import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run interpreted on CPU
except ImportError:
    pass

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: What is the boiling point of water at sea level in Celsius?\nAnswer:",
    (
        "Radix trees store strings by their shared prefixes. Each edge holds a run of symbols, "
        "and a lookup walks down from the root, matching as much as it can. Serving engines use "
        "them "
        "to find the longest cached prompt prefix so that attention keys and values computed for "
        "one "
        "request can be reused by the next. Summarize this in one sentence:"
    ),
]


def private_home(folder) -> dict:
    """Environment for a third-party child (a browser, SGLang) that writes under $HOME:
    keep its config and caches in a test folder instead of the user's home."""
    return dict(
        os.environ,
        HOME=str(folder),
        XDG_CONFIG_HOME=str(folder / "config"),
        XDG_CACHE_HOME=str(folder / "cache"),
    )


@pytest.fixture(scope="session", autouse=True)
def server_socket_folders():
    """The servers and CLI runs the tests start make their private socket folders under one
    short folder (their TMPDIR), removed at the end: a server killed with SIGKILL cannot."""
    root = tempfile.mkdtemp(prefix="radixserve-tests-")
    os.environ["TMPDIR"] = root  # read by the processes the tests start, not by this one
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir():
    from radixserve.models.source import bundled_model_dir

    return bundled_model_dir()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, tokenizer):
    """Greedy continuation by HF transformers, one prompt at a time (no padding)."""
    import torch

    cache = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            with torch.no_grad():
                out = hf_model.generate(
                    torch.tensor([prompt_ids]),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            cache[key] = out[0, len(prompt_ids) :].tolist()
        return cache[key]

    return generate


@pytest.fixture(scope="session")
def engine():
    from radixserve import Engine

    with Engine(
        max_total_tokens=8192, max_running_requests=16, chunked_prefill_size=256, dtype="float32"
    ) as eng:
        yield eng


@pytest.fixture(scope="session")
def draft_model_dir(tmp_path_factory) -> Path:
    """A draft model for speculation tests: the bundled model's first 24 of 30 layers, whose
    drafts agree with the whole model on ~40% of tokens (bench/draft_models.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from draft_models import layer_prefix_model

    from radixserve.models.source import bundled_model_dir

    return layer_prefix_model(bundled_model_dir(), 24, tmp_path_factory.mktemp("draft"))
