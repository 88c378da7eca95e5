"""Images and videos in: time to first token of a one-image (and a one-video) request, fresh and
from the cache, and the vision tower's time per image.

    python bench/vision.py [--out results/vision.json] [--runs 3]

A random Qwen2.5-VL checkpoint built with HF's classes: the vision tower at Qwen2.5-VL-3B's
shape (32 blocks of width 1280, windowed attention with 4 full blocks, the 2x2 merger), the
language model at SmolLM2-135M's (30 layers of width 576), SmolLM2's tokenizer, served by
`radixserve serve` at its default dtype. Each run sends one chat request for one token with a
448x448 PNG (a data URL; 256 image tokens) and a short question, and reports its latency:
- `fresh`: a picture the server has not seen: download and decode, preprocess, the tower,
  the prompt's prefill;
- `cached`: the same request again: the prompt, image included, is read from the radix cache;
- `encoder_cache`: the same picture after a new question: its KV is not cached there (the
  prompts part before it), its features are (the encoder cache): no tower run, the prefill of
  the image's tokens and the rest.
The tower's time per image is the server's own (`radixserve:encoder_seconds_total` over
`radixserve:images_encoded_total`). Then the same for a video: an 8-second 448x448 MP4 at 30
frames a second, 16 frames sampled (2 a second), 8 frame pairs of 256 tokens:
- `video_fresh`: decode (PyAV), sample, preprocess, the tower over 8 frame pairs, the prefill;
- `video_cached`: the same request again;
- `video_followup`: a second turn about the same video (the first turn and its answer before
  the new question): the video's KV read from the radix cache.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import av
import httpx
import numpy as np
import torch
import transformers as hf
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_utils import start_server  # noqa: E402

from radixserve.models.source import bundled_model_dir  # noqa: E402

MARKERS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
SIDE = 448  # pixels: 32 x 32 patches of 14, 256 tokens after the 2 x 2 merge
VIDEO_SECONDS, VIDEO_FPS = 8, 30


def build_checkpoint(folder: Path) -> Path:
    tokenizer = hf.AutoTokenizer.from_pretrained(bundled_model_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    start, pad, end, video = tokenizer.convert_tokens_to_ids(MARKERS)
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = hf.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=49280,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "type": "mrope", "mrope_section": [16, 8, 8]},
            **ends,
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=576,
            fullatt_block_indexes=[7, 15, 23, 31],
            window_size=112,
        ),
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        video_token_id=video,
        **ends,
    )
    torch.manual_seed(0)
    model = hf.Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    path = folder / "qwen2_5_vl-bench"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    pre = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
           "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return path


def picture(seed: int) -> str:
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray((rng.random((8, 8, 3)) * 255).astype("uint8")).resize((SIDE, SIDE))
    buf = io.BytesIO()
    coarse.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def video(seed: int) -> str:
    """An MP4 (H.264) of smoothly moving colour blobs, as a data URL."""
    rng = np.random.default_rng(seed)
    coarse = (rng.random((8, 16, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = SIDE, SIDE, "yuv420p"
        for i in range(VIDEO_SECONDS * VIDEO_FPS):
            window = np.roll(coarse, i // 10, axis=1)[:, :8]
            frame = np.asarray(Image.fromarray(window).resize((SIDE, SIDE)))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def turn(url: str, question: str, kind: str = "image_url", text_first=False) -> dict:
    """A user turn of one image (or video) part and a question."""
    content = [{"type": kind, kind: {"url": url}}, {"type": "text", "text": question}]
    return {"role": "user", "content": content[::-1] if text_first else content}


def first_token_s(client: httpx.Client, messages: list[dict]) -> float:
    """The time of a request for one token: its time to first token."""
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - start


def video_rows(client: httpx.Client, runs: int) -> dict[str, list[float]]:
    rows = {"video_fresh": [], "video_cached": [], "video_followup": []}
    for run in range(runs):
        first = turn(video(run), "What happens in this video?", "video_url")
        rows["video_fresh"].append(first_token_s(client, [first]))
        rows["video_cached"].append(first_token_s(client, [first]))
        answer = {"role": "assistant", "content": "Colours drift to the left."}
        rows["video_followup"].append(
            first_token_s(client, [first, answer, {"role": "user", "content": "And then?"}])
        )
    return rows


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"radixserve:{name} "):
            return float(line.split()[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vision.json"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = build_checkpoint(folder)
        server = start_server(folder, "--model", str(path), "--dtype", "auto")
        try:
            client = server.client(timeout=600)
            first_token_s(client, [turn(picture(999), "Warm up.")])
            rows = {"fresh": [], "cached": [], "encoder_cache": []}
            for run in range(args.runs):
                url = picture(run)
                ask = [turn(url, "What is in this picture?")]
                rows["fresh"].append(first_token_s(client, ask))
                rows["cached"].append(first_token_s(client, ask))
                other = turn(url, f"Question {run}: describe the colours of", text_first=True)
                rows["encoder_cache"].append(first_token_s(client, [other]))
            images = metric(client, "images_encoded_total")
            tower = metric(client, "encoder_seconds_total") / images
            rows |= video_rows(client, args.runs)
            dtype = client.get("/get_server_info").json()["worker"]["dtype"]
        finally:
            server.stop()
    result = {
        "model": "random Qwen2.5-VL: 3B's vision tower, SmolLM2-135M's language model",
        "dtype": dtype,
        "image": f"{SIDE}x{SIDE} PNG, 256 image tokens",
        "video": f"{VIDEO_SECONDS} s of {SIDE}x{SIDE} H.264 at {VIDEO_FPS} fps: 16 frames "
        "sampled, 2,048 video tokens",
        "runs": args.runs,
        "ttft_s": {k: statistics.median(v) for k, v in rows.items()},
        "ttft_runs_s": rows,
        "tower_s_per_image": tower,
        "cpu": cpu_name(),
    }
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            flags = Path("/proc/cpuinfo").read_text()
            amx = "amx_bf16" in flags
            return line.split(":", 1)[1].strip() + (" (AMX-BF16)" if amx else "")
    return "unknown"


if __name__ == "__main__":
    main()
