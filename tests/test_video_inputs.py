"""Videos in, against HF transformers in float32: tiny random Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
Qwen3.5 (hybrid) checkpoints built with HF's classes, served, fed an MP4 through /generate
(`video_data`) and the OpenAI chat route (`video_url` parts), greedy tokens compared with HF's
model, fresh and from the radix cache, with prefill chunks (16 tokens) that split a video's tokens.

HF's side: the file decoded by HF's own PyAV reader, the frames HF's video processor samples
(its formulas below: that class needs torchvision, which does not load beside this torch),
each frame through HF's PIL image processor class, the frames of each pair put together in HF's
video patch order (frame pair, merge block, patch, then channel, frame, pixel), the prompt
expanded as HF's processors do (Qwen3-VL: each pair after its time), `second_per_grid_ts` from
the sampled frame rate (Qwen2.5-VL). Sizes are picked so that the last time position of a
video stays under its largest row or column one, where transformers 5 and Qwen's reference
(which radixserve follows) place the text after a video alike."""

import base64
import functools
import http.server
import json
import math
import threading

import av
import numpy as np
import pytest
import torch
import transformers as hf
from PIL import Image
from server_utils import start_server
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata, read_video_pyav
from vision_checkpoints import build_vl_checkpoint, chat_twice_as_hf, image_processor, picture

NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
BEFORE, AFTER = list(range(100, 120)), list(range(300, 330))
FPS = 4  # the test videos' frame rate; 2 frames a second are sampled
TIMESTAMPED = ("qwen3_vl", "qwen3_5")  # model types whose frame pairs follow their times


def video_file(folder, seed: int, frames: int, size: tuple[int, int], rate: int = FPS):
    """An MP4 of `frames` different pictures (H.264) and its path."""
    path = folder / f"video-{seed}-{frames}-{size[0]}x{size[1]}-{rate}.mp4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            image = np.asarray(picture(seed * 100 + i, size))
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def data_url(path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def hf_sampled(metadata: VideoMetadata, timestamps: bool, **_) -> np.ndarray:
    """The frames HF's video processors sample at 2 frames a second (min 4, max 768)."""
    total, wanted = metadata.total_num_frames, metadata.total_num_frames / metadata.fps * 2
    if timestamps:  # Qwen3VLVideoProcessor.sample_frames
        count = min(max(int(wanted), 4), 768, total)
        return np.linspace(0, total - 1, count).round().astype(int)
    most = math.floor(min(768, total) / 2) * 2  # Qwen2VLVideoProcessor.sample_frames
    count = math.floor(min(max(wanted, 4), most, total) / 2) * 2
    return torch.arange(0, total, total / count).int().numpy()


def frame_processor(path):
    """HF's PIL image processor for the frames: the checkpoint's, with the mean and std of its
    video preprocessor config where it has one (Qwen3-VL's)."""
    processor = image_processor(path)
    video_config = path / "video_preprocessor_config.json"
    if video_config.is_file():
        video = json.loads(video_config.read_text())
        processor.image_mean, processor.image_std = video["image_mean"], video["image_std"]
    return processor


def hf_video_inputs(model, path, video_path):
    """HF's pixel_values_videos and video_grid_thw, the sampled frames' indices and the video's
    frame rate."""
    timestamps = model.config.model_type in TIMESTAMPED
    frames, meta = read_video_pyav(
        str(video_path), lambda metadata, **_: hf_sampled(metadata, timestamps)
    )
    out = frame_processor(path)(images=[Image.fromarray(f) for f in frames], return_tensors="pt")
    grid = out["image_grid_thw"][0]
    per_frame = out["pixel_values"].view(len(frames), int(grid.prod()), 3, 2, -1)[:, :, :, 0]
    pairs = per_frame.view(len(frames) // 2, 2, *per_frame.shape[1:]).permute(0, 2, 3, 1, 4)
    pixels = pairs.reshape(len(frames) // 2 * int(grid.prod()), -1)
    thw = torch.tensor([[len(frames) // 2, int(grid[1]), int(grid[2])]])
    return pixels, thw, list(meta.frames_indices), meta.fps


def hf_gemma4_video(model, path, ids: list[int], video_path):
    """Gemma 4: 32 frames evenly (every frame of a shorter video: HF's processor refuses one),
    each through HF's PIL image processor, the video token expanded as Gemma4Processor does
    (`00:01 <start><video>...<end>`, the frames apart by a space), tokenized whole."""
    c = model.config

    def evenly(metadata: VideoMetadata, **_) -> np.ndarray:
        count = min(32, metadata.total_num_frames)
        return np.arange(count, dtype=int) * metadata.total_num_frames // count

    frames, meta = read_video_pyav(str(video_path), evenly)
    out = image_processor(path)(images=[Image.fromarray(f) for f in frames], return_tensors="pt")
    tokenizer = hf.AutoTokenizer.from_pretrained(path)
    boi, eoi, video = tokenizer.convert_ids_to_tokens(
        [c.boi_token_id, c.eoi_token_id, c.video_token_id]
    )
    tokens = int(out["num_soft_tokens_per_image"][0])
    clock = [f"{int(s // 60):02d}:{int(s % 60):02d}" for s in meta.timestamps]
    text = " ".join(f"{t} {boi}{video * tokens}{eoi}" for t in clock)
    at = ids.index(c.video_token_id)
    full = ids[:at] + tokenizer.encode(text, add_special_tokens=False) + ids[at + 1 :]
    inputs = dict(
        pixel_values_videos=out["pixel_values"],
        video_position_ids=out["image_position_ids"],
        num_frames_per_video=torch.tensor([len(frames)]),
    )
    return full, inputs


def hf_greedy_video(model, path, ids: list[int], video_path):
    """HF's greedy tokens for `ids` holding one video marker, and the expanded prompt's length."""
    c = model.config
    if c.model_type == "gemma4":
        full, inputs = hf_gemma4_video(model, path, ids, video_path)
        return hf_generate(model, full, inputs)
    pixels, thw, indices, fps = hf_video_inputs(model, path, video_path)
    pairs, per_pair = int(thw[0, 0]), int(thw[0, 1] * thw[0, 2]) // 4
    at = ids.index(c.video_token_id)
    extra = {}
    if c.model_type in TIMESTAMPED:
        tokenizer = hf.AutoTokenizer.from_pretrained(path)
        times = Qwen3VLProcessor._calculate_timestamps(None, indices, fps, 2)
        span = []
        for seconds in times:
            span += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
            span += [c.vision_start_token_id] + [c.video_token_id] * per_pair
            span += [c.vision_end_token_id]
        full = ids[: at - 1] + span + ids[at + 2 :]
    else:
        full = ids[:at] + [c.video_token_id] * (pairs * per_pair) + ids[at + 1 :]
        if c.model_type == "qwen2_5_vl":
            sampled_fps = len(indices) / int(av.open(str(video_path)).streams.video[0].frames) * fps
            extra["second_per_grid_ts"] = torch.tensor([2 / sampled_fps])
    return hf_generate(model, full, dict(pixel_values_videos=pixels, video_grid_thw=thw, **extra))


def hf_generate(model, full: list[int], inputs: dict):
    """HF's greedy tokens after the expanded prompt `full`, and its length."""
    input_ids = torch.tensor([full])
    with torch.no_grad():
        gen = model.generate(
            input_ids,
            mm_token_type_ids=(input_ids == model.config.video_token_id).int() * 2,
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **inputs,
        )
    return gen[0, len(full) :].tolist(), len(full)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma4"])
def served(request, tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp(request.param)
    model, path = build_vl_checkpoint(root, request.param, model_dir)
    files = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), files)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    server = start_server(
        root,
        "--model", str(path), "--chunked-prefill-size", "16", "--max-total-tokens", "4096",
        "--limit-mm-per-prompt", '{"image": 2, "video": 1}', "--max-video-frames", "40",
        "--context-length", "1024",
        "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(root),
    )  # fmt: skip
    yield model, path, server, root, f"http://127.0.0.1:{host.server_port}"
    server.stop()
    host.shutdown()
    host.server_close()


def least_cached(model, prompt_len: int) -> float:
    """The prompt tokens a repeated request reads from the cache at least (a hybrid resumes
    from the state snapshot at its last chunk's end)."""
    if model.config.model_type == "qwen3_5":
        return (prompt_len - 1) // 16 * 16
    return 0.9 * prompt_len


def video_marker(model) -> list[int]:
    c = model.config
    if c.model_type == "gemma4":
        return [c.video_token_id]
    return [c.vision_start_token_id, c.video_token_id, c.vision_end_token_id]


def frame_size(model) -> tuple[int, int]:
    """(width, height): Qwen2-VL, Qwen2.5-VL: 5 x 4 merged patches (Qwen2.5-VL's time positions
    reach 4); Qwen3-VL, Qwen3.5: 4 x 3; Gemma 4 (resized to its token budget): 64 x 48."""
    kind = model.config.model_type
    return (64, 48) if kind == "gemma4" else (128, 96) if kind in TIMESTAMPED else (140, 112)


def generate(server, ids, videos, images=()):
    body = {"input_ids": ids, "video_data": videos, "sampling_params": GREEDY}
    if images:
        body["image_data"] = list(images)
    r = server.client().post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_video_matches_hf_fresh_and_cached(served):
    model, path, server, root, _ = served
    video = video_file(root, 1, 8, frame_size(model))
    ids = BEFORE + video_marker(model) + AFTER
    want, prompt_len = hf_greedy_video(model, path, ids, video)
    fresh = generate(server, ids, [data_url(video)])
    assert fresh["output_ids"] == want
    assert fresh["meta_info"]["prompt_tokens"] == prompt_len
    again = generate(server, ids, [data_url(video)])
    assert again["output_ids"] == want
    assert again["meta_info"]["cached_tokens"] >= least_cached(model, prompt_len)


def test_a_video_that_ends_the_prompt_matches_hf(served):
    model, path, server, root, _ = served
    video = video_file(root, 2, 8, frame_size(model))
    ids = BEFORE + video_marker(model)
    want, _ = hf_greedy_video(model, path, ids, video)
    assert generate(server, ids, [data_url(video)])["output_ids"] == want


def chat_about_video(server, model, path, video, question: str) -> tuple[int, int]:
    """A chat message of the video and a question, twice through `server` (a server or a
    router), each answer HF's; (the second's cached tokens, the prompt's length)."""
    tokenizer = hf.AutoTokenizer.from_pretrained(path)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": tokenizer.decode(video_marker(model)) + question}],
        tokenize=False,
        add_generation_prompt=True,
    )
    want, prompt_len = hf_greedy_video(model, path, tokenizer.encode(rendered), video)
    content = [
        {"type": "video_url", "video_url": {"url": data_url(video)}},
        {"type": "text", "text": question},
    ]
    return chat_twice_as_hf(server, content, tokenizer, want, prompt_len), prompt_len


def test_chat_route_with_a_video_part_answers_as_hf(served):
    model, path, server, root, _ = served
    video = video_file(root, 3, 8, frame_size(model))
    cached, prompt_len = chat_about_video(server, model, path, video, "What happens?")
    assert cached >= least_cached(model, prompt_len)


def test_bad_videos_are_400s_naming_the_part_and_the_server_answers_after(served):
    model, path, server, root, _ = served
    good = video_file(root, 4, 8, frame_size(model))
    long = video_file(root, 5, 44, (32, 32))
    raw = good.read_bytes()
    ids = BEFORE + video_marker(model) + AFTER
    bad = {
        "not a video": "data:video/mp4;base64," + base64.b64encode(b"hello" * 50).decode(),
        "truncated": "data:video/mp4;base64," + base64.b64encode(raw[: len(raw) // 3]).decode(),
        "an image's media type": "data:image/png;base64," + base64.b64encode(raw).decode(),
        "too many frames": data_url(long),
        "not base64": "data:video/mp4;base64,@@@",
    }
    client = server.client()
    for name, url in bad.items():
        body = {"input_ids": ids, "video_data": [url], "sampling_params": GREEDY}
        r = client.post("/generate", json=body)
        assert r.status_code == 400, (name, r.text)
        assert "video_data[0]" in r.json()["error"]["message"], (name, r.text)
    if model.config.model_type not in TIMESTAMPED:  # Qwen3-VL's budget bounds all frames
        wide = video_file(root, 7, 40, (224, 224), rate=1)  # 40 frames sampled (Gemma 4: 32)
        body = {"input_ids": ids, "video_data": [data_url(wide)], "sampling_params": GREEDY}
        r = client.post("/generate", json=body)
        assert r.status_code == 400
        tokens = 2048 if model.config.model_type == "gemma4" else 1280  # 32 x 64, 20 x 64
        assert f"video_data[0]: the video would be {tokens} prompt tokens" in r.text
    two = {"input_ids": ids, "video_data": [data_url(good)] * 2, "sampling_params": GREEDY}
    r = client.post("/generate", json=two)
    assert r.status_code == 400 and "at most 1 videos" in r.text
    unmarked = {"input_ids": BEFORE, "video_data": [data_url(good)], "sampling_params": GREEDY}
    r = client.post("/generate", json=unmarked)
    assert r.status_code == 400 and "0 video placeholders for 1 videos" in r.text
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
    assert r.status_code == 400 and "video placeholder" in r.text
    want, _ = hf_greedy_video(model, path, ids, good)
    assert generate(server, ids, [data_url(good)])["output_ids"] == want


def test_a_video_from_an_allowed_host_or_folder_is_the_same_video(served):
    """Fetched over http or read from the allowed folder: the same tokens as its data URL,
    its whole prompt from the cache the second and third time."""
    model, path, server, root, site = served
    video = video_file(root, 6, 8, frame_size(model))
    ids = BEFORE + video_marker(model) + AFTER
    want = generate(server, ids, [data_url(video)])
    for url in (f"{site}/{video.name}", f"file://{video}"):
        got = generate(server, ids, [url])
        assert got["output_ids"] == want["output_ids"]
        meta = got["meta_info"]
        assert meta["cached_tokens"] >= least_cached(model, meta["prompt_tokens"])
    r = server.client().post(
        "/generate", json={"input_ids": ids, "video_data": [f"{site}/missing.mp4"]}
    )
    assert r.status_code == 400 and "video_data[0]: fetching the video gave HTTP 404" in r.text


@pytest.mark.parametrize("cache_bytes", [0, 1 << 30])
def test_the_processor_cache_keeps_a_sent_again_video_within_its_bytes(
    tmp_path, model_dir, cache_bytes
):
    """The same bytes sent again (the next turn of a chat) give what they gave, not decoded
    again, while the cache has room; with no room every request decodes its video."""
    import asyncio

    from radixserve.models.source import resolve_model
    from radixserve.multimodal.inputs import MediaPart
    from radixserve.multimodal.media import MediaPolicy
    from radixserve.multimodal.spec import VisionSpec
    from radixserve.server.images import ImageInputs
    from radixserve.tokenizer import load_tokenizer_or_none

    _, path = build_vl_checkpoint(tmp_path, "qwen2_5_vl", model_dir)
    spec = VisionSpec.of(resolve_model(str(path)).config.hf_config, path)
    limits = {"image": 1, "video": 1}
    inputs = ImageInputs(
        spec, MediaPolicy(), limits, load_tokenizer_or_none(path), 4096, cache_bytes
    )
    one, other = (data_url(video_file(tmp_path, s, 8, (140, 112))) for s in (1, 2))

    async def prepared(url):
        (video,) = await inputs.prepare([MediaPart(url, "video_data[0]", kind="video")])
        return video

    async def run():
        first, again, different = [await prepared(u) for u in (one, one, other)]
        assert (again is first) == (cache_bytes > 0)
        assert again.parts[0].digest == first.parts[0].digest != different.parts[0].digest
        assert inputs.processed.bytes == (first.nbytes + different.nbytes if cache_bytes else 0)

    asyncio.run(run())
    inputs.close()


def test_the_offline_engine_takes_images_and_videos_as_hf(tmp_path, model_dir):
    """`Engine.generate(image_data=..., video_data=...)`: a video by path, an image as a data
    URL, in one prompt; HF's greedy tokens for each; a batch with media and an http URL are
    refused naming the field."""
    from vision_checkpoints import data_url as image_url
    from vision_checkpoints import hf_greedy, marker

    from radixserve import Engine

    model, path = build_vl_checkpoint(tmp_path, "qwen2_5_vl", model_dir)
    video = video_file(tmp_path, 8, 8, frame_size(model))
    image = picture(9, (120, 90))
    engine = Engine(model=str(path), chunked_prefill_size=16, max_total_tokens=4096)
    try:
        ids = BEFORE + marker(model) + AFTER
        got = engine.generate(input_ids=ids, image_data=image_url(image), sampling_params=GREEDY)
        assert got["output_ids"] == hf_greedy(model, path, ids, [image], NEW)[0]
        ids = BEFORE + video_marker(model) + AFTER
        got = engine.generate(input_ids=ids, video_data=[str(video)], sampling_params=GREEDY)
        assert got["output_ids"] == hf_greedy_video(model, path, ids, video)[0]
        raw = video.read_bytes()
        again = engine.generate(input_ids=ids, video_data=raw, sampling_params=GREEDY)
        assert again["output_ids"] == got["output_ids"]
        assert again["meta_info"]["cached_tokens"] >= 0.9 * again["meta_info"]["prompt_tokens"]
        with pytest.raises(ValueError, match="one prompt, not a batch"):
            engine.generate(input_ids=[ids, ids], video_data=[str(video)])
        with pytest.raises(ValueError, match=r"video_data\[0\]: the offline Engine does not fetch"):
            engine.generate(input_ids=ids, video_data="http://127.0.0.1/v.mp4")
    finally:
        engine.shutdown()
