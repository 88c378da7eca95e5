"""One prepared GPU check (issue: GPU path). Run on a CUDA machine through scripts/gpu_check.sh.

1. Triton kernels vs their references on CUDA (fp32, fp16, bf16).
2. The bundled model through every available backend on the GPU, with and without CUDA graphs,
   with and without n-gram speculative decoding, gives the CPU path's greedy tokens.
3. Decode step time vs batch size for a Llama-3-8B-shaped dummy model per backend, eager and with
   CUDA graphs, against the weight-bandwidth floor (weight bytes / measured copy bandwidth), and
   prefill throughput.
Prints a compact table; writes $OUT/gpu_check.json when OUT is set.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Radix trees store strings by"]


def backends() -> list[str]:
    names = ["torch_native", "triton"]
    if importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    else:
        print("flashinfer is not installed on this machine: its rows are skipped")
    return names


def kernel_tests() -> bool:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            str(ROOT / "tests/test_kernels.py"),
            "-k",
            "not backend",
        ],
        capture_output=True,
        text=True,
    )
    print(run.stdout.strip().splitlines()[-1] if run.stdout else run.stderr[-2000:])
    return run.returncode == 0


def check_model(scratch: Path) -> str | None:
    """The bundled model when its package is here, else a checkpoint of its shape with seeded
    random weights, written once, so that the CPU reference and every GPU run load the same
    weights (a dummy model draws its weights on its own device, and CPU and CUDA generators
    differ)."""
    from radixserve.models.source import find_bundled_gguf

    return None if find_bundled_gguf() else str(random_checkpoint(scratch / "random-smollm2"))


def random_checkpoint(path: Path) -> Path:
    from safetensors.torch import save_file

    from radixserve.models.source import DUMMY_SHAPES

    shape = DUMMY_SHAPES["smollm2-135m"]
    hidden, inter, heads, kv, head_dim = (
        shape[k]
        for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
    )
    generator = torch.Generator().manual_seed(0)

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator) * 0.02

    tensors = {
        "model.embed_tokens.weight": normal(shape["vocab_size"], hidden),
        "lm_head.weight": normal(shape["vocab_size"], hidden),  # untied: outputs repeat less
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(shape["num_layers"]):
        layer = f"model.layers.{i}."
        tensors |= {
            layer + "input_layernorm.weight": torch.ones(hidden),
            layer + "post_attention_layernorm.weight": torch.ones(hidden),
            layer + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            layer + "self_attn.k_proj.weight": normal(kv * head_dim, hidden),
            layer + "self_attn.v_proj.weight": normal(kv * head_dim, hidden),
            layer + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            layer + "mlp.gate_proj.weight": normal(inter, hidden),
            layer + "mlp.up_proj.weight": normal(inter, hidden),
            layer + "mlp.down_proj.weight": normal(hidden, inter),
        }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": shape["rope_theta"],
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


GRAPH_BACKENDS = ("triton", "flashinfer")


def variants(names: list[str]) -> list[tuple[str, bool]]:
    """(backend, CUDA graphs on) pairs to check."""
    return [
        (name, graphs)
        for name in names
        for graphs in (False, True)
        if not graphs or name in GRAPH_BACKENDS
    ]


def greedy(
    model: str | None, backend: str, graphs: bool = False, speculative: bool = False
) -> dict:
    """Greedy tokens through `backend` (and how many steps verified n-gram drafts); the CPU
    reference runs it in a process that sees no GPU."""
    from radixserve import Engine

    prompts = PROMPTS if model is None else None
    kwargs = dict(
        model=model,
        max_total_tokens=4096,
        max_running_requests=8,
        dtype="float32",
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        speculative_algorithm="ngram" if speculative else None,
    )
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(**kwargs) as engine:
        if prompts is None:
            out = engine.generate(
                input_ids=[[1, 2, 3, 4, 5], [7] * 40, list(range(100, 180))], sampling_params=params
            )
        else:
            out = engine.generate(prompts, params)
    return {
        "tokens": [r["output_ids"] for r in out],
        "verify_steps": sum(r["meta_info"].get("spec_verify_ct", 0) for r in out),
    }


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - start)


def decode_table(
    backend: str, graphs: bool, batches: list[int], context: int, floor_s: float
) -> list[dict]:
    from decode_step import decode_batch, make_runner, time_steps

    runner = make_runner(
        "dummy:llama-3-8b",
        max(batches),
        context,
        "bfloat16",
        backend,
        disable_cuda_graph=not graphs,
    )
    assert (runner.graphs is not None) == graphs
    rows = []
    for b in batches:
        ms = time_steps(runner, decode_batch(b, context), 10) * 1000
        rows.append(
            {
                "backend": backend,
                "graphs": graphs,
                "batch": b,
                "step_ms": round(ms, 2),
                "floor_ms": round(floor_s * 1000, 2),
                "vs_floor": round(ms / (floor_s * 1000), 2),
            }
        )
    if not graphs:
        rows.append(prefill_row(runner, backend))
    return rows


def prefill_row(runner, backend: str, batch: int = 4, length: int = 1024) -> dict:
    from decode_step import time_steps

    from radixserve.messages import ForwardBatch, ForwardMode, SamplingBatch

    ids = [11] * (batch * length)
    slots = list(range(1, batch * length + 1))
    fb = ForwardBatch(
        ForwardMode.EXTEND,
        ids,
        list(range(length)) * batch,
        slots,
        list(range(batch)),
        [length] * batch,
        [length] * batch,
        [],
        SamplingBatch.greedy(batch),
        [None] * batch,
    )
    seconds = time_steps(runner, fb, 3)
    return {
        "backend": backend,
        "prefill_tokens": batch * length,
        "prefill_tok_per_s": round(batch * length / seconds),
    }


class Report:
    """Collects results; a failing section is recorded and the rest still run. Saved after
    every section, so a run cut short by its time limit still leaves what it measured."""

    def __init__(self):
        self.data: dict = {"errors": {}}

    def attempt(self, label: str, fn, *args):
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - one broken backend must not hide the others' results
            self.data["errors"][label] = traceback.format_exc()[-3000:]
            print(f"FAILED {label}:\n{self.data['errors'][label]}")
            return None
        finally:
            self.save()

    def save(self) -> None:
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(self.data, indent=2))


def start_cpu_reference(model: str | None) -> subprocess.Popen:
    """The CPU path's greedy tokens, computed in a process that sees no GPU, alongside the GPU
    runs."""
    code = (
        "import json, sys; sys.path.insert(0, 'scripts'); from gpu_check import greedy; "
        f"print(json.dumps(greedy({model!r}, 'torch_native')['tokens']))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": ""},
    )


def cpu_reference(process: subprocess.Popen) -> list[list[int]]:
    out, err = process.communicate(timeout=300)
    if process.returncode:
        raise RuntimeError(err[-2000:])
    return json.loads(out.strip().splitlines()[-1])


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'backend':14s} {'graphs':>6s} {'batch':>5s} {'step ms':>8s} {'floor ms':>8s} "
        f"{'x floor':>7s}"
    )
    for r in rows:
        if "batch" in r:
            print(
                f"{r['backend']:14s} {str(r['graphs']):>6s} {r['batch']:5d} {r['step_ms']:8.2f} "
                f"{r['floor_ms']:8.2f} {r['vs_floor']:7.2f}"
            )
        else:
            print(
                f"{r['backend']:14s} prefill {r['prefill_tokens']} tokens: "
                f"{r['prefill_tok_per_s']} tok/s"
            )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    report = Report()
    data = report.data
    model = check_model(Path(tempfile.mkdtemp(prefix="gpu_check_")))
    data["model"] = (
        "random weights, SmolLM2-135M shape" if model else "bundled SmolLM2-135M-Instruct"
    )
    reference_process = start_cpu_reference(model)
    data["kernels_ok"] = report.attempt("kernels", kernel_tests)
    names = backends()
    outputs = {}
    for name, graphs in variants(names):
        for speculative in (False, True):
            label = f"{name}{'+graphs' if graphs else ''}{'+ngram' if speculative else ''}"
            outputs[label] = report.attempt(
                f"greedy {label}", greedy, model, name, graphs, speculative
            )
    reference = report.attempt("cpu reference", cpu_reference, reference_process)
    data["greedy_matches_cpu"] = {
        label: out is not None and out["tokens"] == reference for label, out in outputs.items()
    }
    data["ngram_verify_steps"] = {
        label: out["verify_steps"]
        for label, out in outputs.items()
        if out is not None and label.endswith("+ngram")
    }
    print("n-gram verify steps:", data["ngram_verify_steps"])
    print("greedy tokens equal to the CPU path:", data["greedy_matches_cpu"])
    bandwidth = copy_bandwidth()
    weights = 8.03e9 * 2
    floor_s = weights / bandwidth
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; Llama-3-8B bf16 weights {weights / 1e9:.1f} "
        "GB; "
        f"floor {floor_s * 1000:.2f} ms/step"
    )
    data["rows"] = []
    for name, graphs in variants(names):
        data["rows"] += (
            report.attempt(
                f"decode {name} graphs={graphs}",
                decode_table,
                name,
                graphs,
                [1, 8, 32, 64],
                1024,
                floor_s,
            )
            or []
        )
        gc.collect()  # free this backend's 16 GB model before the next one loads
        torch.cuda.empty_cache()
    print_rows(data["rows"])
    report.save()
    ok = data["kernels_ok"] and all(data["greedy_matches_cpu"].values()) and not data["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
