"""Vision-language models against HF transformers in float32: tiny random Qwen2-VL, Qwen2.5-VL,
Qwen3-VL (dense and MoE), Gemma 3, Qwen3.5 (hybrid), Gemma 4, Mistral 3, Mistral Small 4,
GLM-4.xV, InternVL and SmolVLM checkpoints built with HF's classes, served, fed images through
/generate and the OpenAI chat route, greedy tokens compared with HF's model fed by HF's image
processor class, fresh and from the radix cache, with prefill chunks (16 tokens) that split
each image's tokens (Gemma 3's and Gemma 4's images, attended both ways, are computed whole:
their chunks end before them instead)."""

import pytest
import transformers as hf
from server_utils import start_server
from vision_checkpoints import (
    IDEFICS3_VISION,
    build_vl_checkpoint,
    chat_twice_as_hf,
    data_url,
    expanded,
    hf_greedy,
    image_processor,
    marker,
    picture,
)

NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
BEFORE, AFTER = list(range(100, 120)), list(range(300, 330))
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "gemma4")


@pytest.fixture(
    scope="module",
    params=[
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "gemma3",
        "qwen3_5",
        "gemma4",
        "pixtral",
        "pixtral_mistral4",
        "glm4v",
        "glm4v_moe",
        "glm46v",
        "internvl",
        "smolvlm",
        "llava",
    ],
)
def served(request, tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp(request.param)
    model, path = build_vl_checkpoint(root, request.param, model_dir)
    server = start_server(
        root, "--model", str(path), "--chunked-prefill-size", "16", "--max-total-tokens", "4096"
    )
    yield model, path, server
    server.stop()


def first_image_token(model, path, ids) -> int:
    out = image_processor(path)(images=[picture(0)], return_tensors="pt")
    return expanded(model, path, ids, out).index(model.config.image_token_id)


def tower_inputs(model, path, image) -> int:
    """What the tower encodes of an image on its own: its tiles and the whole image (SmolVLM),
    else the image."""
    if model.config.model_type not in ("smolvlm", "idefics3"):
        return 1
    return image_processor(path)(images=[image], return_tensors="pt")["pixel_values"].shape[1]


def generate(server, ids, images):
    body = {
        "input_ids": ids,
        "image_data": [data_url(im) for im in images],
        "sampling_params": GREEDY,
    }
    r = server.client().post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_image_matches_hf_fresh_and_cached(served):
    model, path, server = served
    image = picture(1, (200, 150))
    ids = BEFORE + marker(model) + AFTER
    want, prompt_len = hf_greedy(model, path, ids, [image], NEW)
    fresh = generate(server, ids, [image])
    assert fresh["output_ids"] == want
    assert fresh["meta_info"]["prompt_tokens"] == prompt_len  # image tokens count
    again = generate(server, ids, [image])
    assert again["output_ids"] == want
    # the second reads >= 90% of its prompt, image included, from the cache
    assert again["meta_info"]["cached_tokens"] >= 0.9 * prompt_len


def test_two_images_in_one_prompt_match_hf(served):
    model, path, server = served
    images = [picture(2, (120, 90)), picture(3, (90, 160))]
    ids = BEFORE + marker(model) + [400, 401] + marker(model) + AFTER
    want, _ = hf_greedy(model, path, ids, images, NEW)
    assert generate(server, ids, images)["output_ids"] == want
    assert generate(server, ids, images)["output_ids"] == want


def test_an_image_that_ends_the_prompt_matches_hf(served):
    """The first tokens after an image read it most directly (how its tokens attended to each
    other shows there)."""
    model, path, server = served
    image = picture(4, (150, 120))
    ids = BEFORE + marker(model)
    want, _ = hf_greedy(model, path, ids, [image], NEW)
    assert generate(server, ids, [image])["output_ids"] == want


def test_another_image_of_the_same_size_shares_no_kv_from_the_image_on(served):
    model, path, server = served
    ids = BEFORE + [7, 8] + marker(model) + AFTER
    first = generate(server, ids, [picture(4, (200, 150))])
    other = picture(5, (200, 150))
    second = generate(server, ids, [other])
    image_at = first_image_token(model, path, ids)  # the text and tokens before the image
    assert first["meta_info"]["prompt_tokens"] == second["meta_info"]["prompt_tokens"]
    assert second["meta_info"]["cached_tokens"] <= image_at
    if model.config.model_type != "qwen3_5":  # a hybrid resumes from its last state snapshot
        assert second["meta_info"]["cached_tokens"] == image_at
    assert second["output_ids"] == hf_greedy(model, path, ids, [other], NEW)[0]


@pytest.mark.parametrize("count", [1, 2])
def test_chat_route_with_image_parts_in_one_message_answers_as_hf(served, count):
    """One and two images in one user message, through the chat template; the second time
    from the cache."""
    model, path, server = served
    images = [picture(6, (150, 150)), picture(7, (100, 170))][:count]
    tokenizer = hf.AutoTokenizer.from_pretrained(path)
    texts = ["What is in this picture?", " And in this one?"][:count]
    image_text = tokenizer.decode(marker(model))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "".join(image_text + t for t in texts)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    want, prompt_len = hf_greedy(model, path, tokenizer.encode(rendered), images, NEW)
    content = []
    for image, text in zip(images, texts):
        content += [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": text},
        ]
    cached = chat_twice_as_hf(server, content, tokenizer, want, prompt_len)
    if model.config.model_type == "qwen3_5":  # a hybrid resumes at a chunk end's snapshot
        assert cached >= (prompt_len - 1) // 16 * 16
    else:
        assert cached >= 0.9 * prompt_len


def test_a_video_to_a_family_without_videos_is_a_400_naming_the_part(served):
    model, _, server = served
    if model.config.model_type in VIDEO_FAMILIES:
        pytest.skip("Qwen-VL and Gemma 4 take videos (tests/test_video_inputs.py)")
    content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = server.client().post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert "messages[0].content[0]: this model takes no videos" in r.json()["error"]["message"]


def test_a_repeated_image_after_other_text_skips_the_tower_and_metrics_count_it(served):
    """The same picture after a different prefix: its KV is not cached there, its features
    are (the encoder cache); /metrics and the dashboard count image tokens and hits."""
    model, path, server = served
    image = picture(8, (160, 120))
    client = server.client()

    def figures() -> dict:
        return client.get("/get_server_info").json()["stats"]["images"]

    generate(server, [11, 12] + marker(model) + AFTER, [image])
    before = figures()
    ids = [13, 14, 15] + marker(model) + AFTER
    got = generate(server, ids, [image])
    after = figures()
    assert after["images_encoded_total"] == before["images_encoded_total"]
    hits = tower_inputs(model, path, image)
    assert after["encoder_cache_hits_total"] == before["encoder_cache_hits_total"] + hits
    assert got["output_ids"] == hf_greedy(model, path, ids, [image], NEW)[0]
    assert after["image_tokens_total"] > before["image_tokens_total"]
    metrics = client.get("/metrics").text
    assert (
        f"radixserve:encoder_cache_hits_total {float(after['encoder_cache_hits_total'])}" in metrics
    )
    assert "radixserve:image_tokens_cached_total" in metrics


@pytest.mark.parametrize(
    "family", ["qwen2_5_vl", "gemma3", "gemma4", "pixtral", "glm4v", "internvl", "llava"]
)
def test_our_preprocessing_equals_hf_image_processors_bit_for_bit(tmp_path, model_dir, family):
    """The api process decodes, resizes, normalizes and cuts patches in numpy and Pillow (no
    torch there): the same float32 pixels as HF's PIL image processor class, for odd sizes and
    for grey, palette and transparent pictures (over white, as HF puts them)."""
    import io

    import numpy as np
    from PIL import Image

    from radixserve.models.source import resolve_model
    from radixserve.multimodal.media import MediaPolicy, decode_image
    from radixserve.multimodal.processing import preprocess
    from radixserve.multimodal.spec import VisionSpec

    _, path = build_vl_checkpoint(tmp_path, family, model_dir)
    spec = VisionSpec.of(resolve_model(str(path)).config.hf_config, path)
    base = picture(20, (201, 77))
    faded = base.convert("RGBA")
    faded.putalpha(Image.linear_gradient("L").resize(base.size))
    pictures = [base, picture(21, (33, 333)), picture(22, (640, 480)), base.convert("L"),
                base.convert("P"), faded, faded.convert("LA")]  # fmt: skip
    for image in pictures:
        encoded = io.BytesIO()
        image.save(encoded, format="PNG")
        ours = preprocess(decode_image(encoded.getvalue(), MediaPolicy(), "image"), spec).pixels
        theirs = image_processor(path)(images=[Image.open(encoded)], return_tensors="np")
        want = theirs["pixel_values"]
        if family == "gemma4":  # HF pads each image's patches to the budget
            want = want[0, : len(ours)]
        if family == "pixtral":  # HF keeps the image whole: cut it as the tower's convolution does
            height, width = theirs["image_sizes"][0]
            p = spec.patch_size
            cut = want[0].reshape(3, height // p, p, width // p, p).transpose(1, 3, 0, 2, 4)
            want = cut.reshape(-1, 3 * p * p)
        assert np.array_equal(ours.reshape(want.shape), want), image.mode


@pytest.mark.parametrize("split", [True, False])
def test_smolvlm_tiles_equal_hf_image_processor_bit_for_bit(tmp_path, model_dir, split):
    """SmolVLM's (and Idefics3's) three Lanczos resizes, tiles and whole image, with and
    without `do_image_splitting`: the same float32 pixels and rows and columns of tiles as
    HF's PIL image processor, for odd sizes, a tall and a wide picture, grey and palette."""
    import io
    import json

    import numpy as np
    from PIL import Image

    from radixserve.models.source import resolve_model
    from radixserve.multimodal.media import MediaPolicy, decode_image
    from radixserve.multimodal.processing import preprocess
    from radixserve.multimodal.spec import VisionSpec

    _, path = build_vl_checkpoint(tmp_path, "smolvlm", model_dir)
    pre_file = path / "preprocessor_config.json"
    pre = {**json.loads(pre_file.read_text()), "do_image_splitting": split}
    pre_file.write_text(json.dumps(pre))
    spec = VisionSpec.of(resolve_model(str(path)).config.hf_config, path)
    base = picture(20, (201, 77))
    pictures = [base, picture(21, (33, 333)), picture(22, (640, 480)), picture(23, (64, 64)),
                base.convert("L"), base.convert("P")]  # fmt: skip
    for image in pictures:
        encoded = io.BytesIO()
        image.save(encoded, format="PNG")
        ours = preprocess(decode_image(encoded.getvalue(), MediaPolicy(), "image"), spec)
        theirs = image_processor(path)(images=[Image.open(encoded)], return_tensors="np")
        want = theirs["pixel_values"][0]
        got = np.concatenate([part.pixels for part in ours.parts]).reshape(want.shape)
        assert np.array_equal(got, want), image.size
        assert (ours.rows, ours.columns) == (theirs["rows"][0][0], theirs["cols"][0][0])


def test_idefics3_tower_positions_equal_hf_where_rounding_moves_them():
    """HF buckets each patch's fractional place into the position table even at the tower's
    own size, where float32 rounding moves some (19 patches a side): the tower's features
    equal HF's there and where the tiles are larger than the tower's table."""
    import torch
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer

    from radixserve.models.idefics3 import Idefics3Vision

    vision = dict(IDEFICS3_VISION, image_size=76, patch_size=4)
    torch.manual_seed(0)
    theirs = SmolVLMVisionTransformer(hf.SmolVLMVisionConfig(**vision)).eval()
    ours = Idefics3Vision({"vision_config": vision}, 16).eval()
    missing = ours.load_state_dict(theirs.state_dict(), strict=False).missing_keys
    assert missing == ["projection.weight"]
    for side in (76, 96):
        tiles = torch.randn(2, 3, side, side)
        want = theirs(tiles).last_hidden_state
        got = ours.encode(tiles, ours.bucketed_positions(side // 4))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_llava_preprocessing_that_is_not_implemented_is_refused_by_name(tmp_path, model_dir):
    import json

    from radixserve.models.source import resolve_model
    from radixserve.multimodal.spec import VisionSpec

    _, path = build_vl_checkpoint(tmp_path, "llava", model_dir)
    hf_config = resolve_model(str(path)).config.hf_config
    pre_file = path / "preprocessor_config.json"
    pre = json.loads(pre_file.read_text())
    for change, named in ((dict(do_pad=True), "do_pad"), (dict(crop_size={"height": 42}), "42")):
        pre_file.write_text(json.dumps({**pre, **change}))
        with pytest.raises(ValueError, match=named):
            VisionSpec.of(hf_config, path)


def test_every_vision_family_has_a_preprocessing_layout():
    from radixserve.multimodal.processing import LAYOUTS
    from radixserve.multimodal.spec import FAMILIES

    assert set(FAMILIES.values()) == set(LAYOUTS) | {"idefics3"}  # `split_tiles`


def test_the_encoder_cache_keeps_the_recent_features_within_its_bytes():
    """Squeezed to two images' features: the least recently used goes first, a hit counts as a
    use, a set of features larger than the whole cache is not kept, the bytes never exceed
    the bound."""
    import torch

    from radixserve.multimodal.cache import BoundedCache
    from radixserve.worker.vision import ImageFeatures

    def features(tokens: int) -> ImageFeatures:
        return ImageFeatures(torch.zeros(tokens, 16), [torch.zeros(tokens, 16)])

    one = features(4).nbytes
    cache = BoundedCache(2 * one)
    cache.put(1, features(4))
    cache.put(2, features(4))
    assert cache.get(1) is not None  # 1 is now the most recent
    cache.put(3, features(4))  # evicts 2
    assert cache.get(2) is None and cache.get(1) is not None and cache.get(3) is not None
    cache.put(4, features(12))  # larger than the cache: not kept, nothing evicted for it
    assert cache.get(4) is None and cache.get(1) is not None
    assert cache.bytes == 2 * one <= cache.max_bytes


def test_qwen3_vl_moe_experts_load_in_the_hubs_layout_too(tmp_path, model_dir):
    """The hub stores Qwen3-VL-MoE's stacked experts each matrix inputs first (transformers
    saves them outputs first): the same checkpoint in the hub's layout gives the same tokens."""
    import torch
    from safetensors.torch import load_file, save_file

    from radixserve import Engine

    model, path = build_vl_checkpoint(tmp_path, "qwen3_vl_moe", model_dir)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if ".experts." in n]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    ids = BEFORE + AFTER
    with torch.no_grad():
        want = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()
    with Engine(model=str(path), max_total_tokens=1024, dtype="float32") as engine:
        got = engine.generate(input_ids=[ids], sampling_params=GREEDY)[0]["output_ids"]
    assert got == want


@pytest.mark.parametrize(
    "family", ["gemma4", "pixtral", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "internvl"]
)
def test_at_tp_2_images_and_text_match_hf(tmp_path, model_dir, family):
    """`--tp-size 2`: rank 0 runs the tower and sends the other rank each step's image
    features with the step (with Qwen-VL's 3-D positions and DeepStack features, Gemma 4's
    image blocks); a prompt with an image, fresh and cached, and one of text equal HF's."""
    import torch

    model, path = build_vl_checkpoint(tmp_path, family, model_dir)
    image = picture(6, (160, 120))
    with_image = BEFORE + marker(model) + AFTER
    want_image, _ = hf_greedy(model, path, with_image, [image], NEW)
    text = BEFORE + AFTER
    with torch.no_grad():
        want_text = model.generate(
            torch.tensor([text]), max_new_tokens=NEW, do_sample=False, eos_token_id=None
        )[0, len(text) :].tolist()
    server = start_server(
        tmp_path, "--model", str(path), "--tp-size", "2", "--chunked-prefill-size", "16",
        "--max-total-tokens", "2048",
    )  # fmt: skip
    try:
        for _ in range(2):
            assert generate(server, with_image, [image])["output_ids"] == want_image
        body = {"input_ids": text, "sampling_params": GREEDY}
        assert server.client().post("/generate", json=body).json()["output_ids"] == want_text
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize(
    "family", ["internvl_qwen2", "internvl_qwen3_moe", "idefics3", "llava_siglip"]
)
def test_variants_of_tiled_and_llava_families_match_hf(tmp_path, model_dir, family):
    """InternVL 3 (Qwen2) and InternVL 3.5's MoE (Qwen3-MoE): the class picked by the text
    config's type; an image of several tiles and a thumbnail, fresh and cached, equals HF.
    Idefics3, its tower's positions bucketed (7 x 7 under tiles of 8 x 8 patches), alike;
    LLaVA with a SigLIP tower over Qwen2, alike."""
    from radixserve import Engine

    model, path = build_vl_checkpoint(tmp_path, family, model_dir)
    image = picture(12, (230, 100))
    ids = BEFORE + marker(model) + AFTER
    want, _ = hf_greedy(model, path, ids, [image], NEW)
    settings = dict(dtype="float32", chunked_prefill_size=16, max_total_tokens=2048)
    with Engine(model=str(path), **settings) as engine:
        for _ in range(2):
            got = engine.generate(input_ids=ids, image_data=data_url(image), sampling_params=GREEDY)
            assert got["output_ids"] == want
        assert got["meta_info"]["cached_tokens"] > len(ids)


@pytest.mark.parametrize(
    "family, name", [("internvl", "InternVL"), ("smolvlm", "SmolVLM"), ("llava", "LLaVA")]
)
def test_a_language_model_not_implemented_under_a_tower_is_refused_by_name(
    tmp_path, model_dir, family, name
):
    import json

    from radixserve import Engine

    _, path = build_vl_checkpoint(tmp_path, family, model_dir)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["model_type"] = "gpt_oss"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{name} over a 'gpt_oss' language model is not"):
        Engine(model=str(path), dtype="float32")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "glm4v"])
def test_at_ngram_speculative_decoding_images_match_hf(tmp_path, model_dir, family):
    """n-gram speculative decoding with images (the offline Engine, float32, every draft worth
    its rows): the same request twice, the second drafting the first's output from the table
    of finished outputs, so drafts are verified at their M-RoPE positions; both equal HF's.
    A draft stops before an image's tokens (a decoding step has no image features)."""
    from test_speculative import FlatStepCost

    from radixserve import Engine
    from radixserve.scheduler.speculative import NgramDrafter, SpecState

    model, path = build_vl_checkpoint(tmp_path, family, model_dir)
    image = picture(10, (150, 120))
    ids = BEFORE + marker(model) + AFTER
    want, _ = hf_greedy(model, path, ids, [image], 3 * NEW)
    settings = dict(speculative_algorithm="ngram", dtype="float32", chunked_prefill_size=16)
    with Engine(model=str(path), max_total_tokens=4096, **settings) as engine:
        engine.scheduler.decode.step_cost = FlatStepCost()
        params = {**GREEDY, "max_new_tokens": 3 * NEW}
        for _ in range(2):
            got = engine.generate(input_ids=ids, image_data=data_url(image), sampling_params=params)
            assert got["output_ids"] == want
        assert engine.get_stats().spec_accepted_tokens_total > 0
    image_id = (1 << 30) + 7
    tokens = [1, 2, 3, 4, image_id, image_id, 5, 1, 2, 3, 4]
    assert NgramDrafter(8).propose(SpecState(), tokens, 0, 8) == []
    tokens = [1, 2, 3, 4, 9, image_id, 5, 1, 2, 3, 4]
    assert NgramDrafter(8).propose(SpecState(), tokens, 0, 8) == [9]
