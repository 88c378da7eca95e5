"""Images through every route of a served Qwen2.5-VL checkpoint: the OpenAI (chat and
Responses) and anthropic SDKs unchanged; images fetched from an allowed host (redirects only
to allowed hosts) and read from an allowed folder; and a corpus of hostile images and URLs,
each a 4xx naming the part, while the server stays healthy, keeps its answers and serves a text
request beside them."""

import base64
import http.server
import io
import statistics
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from PIL import Image
from server_utils import start_server
from vision_checkpoints import build_vl_checkpoint, data_url, hf_greedy, picture

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
BIG = 9 << 20  # over the server's 8 MiB limit


class Pictures(http.server.BaseHTTPRequestHandler):
    """A local image host: a good image, a redirect to it and one off the allowed list, a 404,
    text, an oversized body and a stalled reply."""

    def do_GET(self):
        if self.path == "/ok.png":
            self._send(200, png_bytes(picture(11, (120, 90))), "image/png")
        elif self.path == "/to-ok":
            self._redirect("/ok.png")
        elif self.path == "/to-elsewhere":
            self._redirect("http://example.invalid/ok.png")
        elif self.path == "/text":
            self._send(200, b"hello, not an image", "text/plain")
        elif self.path == "/huge":
            self._send(200, b"\0" * BIG, "image/png")
        elif self.path == "/slow":
            time.sleep(3)
            self._send(200, png_bytes(picture(11)), "image/png")
        else:
            self._send(404, b"no", "text/plain")

    def _send(self, status, body, kind):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where):
        self.send_response(302)
        self.send_header("Location", where)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("images")
    model, path = build_vl_checkpoint(root, "qwen2_5_vl", model_dir)
    folder = root / "pictures"
    folder.mkdir()
    picture(12, (100, 100)).save(folder / "local.png")
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pictures)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    server = start_server(
        root,
        "--model", str(path),
        "--chunked-prefill-size", "16",
        "--max-total-tokens", "4096",
        "--allowed-media-domains", "127.0.0.1",
        "--allowed-local-media-path", str(folder),
        "--limit-mm-per-prompt", '{"image": 3}',
        "--media-fetch-timeout", "1",
    )  # fmt: skip
    yield model, path, server, f"http://127.0.0.1:{host.server_port}", folder
    server.stop()
    host.shutdown()
    host.server_close()


def png_bytes(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **kw)
    return buf.getvalue()


def encoded(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def chat(client, url: str, **part_extra):
    content = [
        {"type": "image_url", "image_url": {"url": url, **part_extra}},
        {"type": "text", "text": "Describe it."},
    ]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    return client.post("/v1/chat/completions", json=body)


# ---- the SDKs, unchanged ------------------------------------------------------------------


def test_openai_sdk_chat_and_responses_send_images(setup):
    _, _, server, _, _ = setup
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    url = data_url(picture(13, (140, 100)))
    reply = sdk.chat.completions.create(
        model="m",
        max_tokens=6,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                ],
            }
        ],
    )
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 20
    response = sdk.responses.create(
        model="m",
        max_output_tokens=6,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                ],
            }
        ],
    )
    assert response.output_text and response.usage.input_tokens == reply.usage.prompt_tokens


def test_anthropic_sdk_sends_base64_and_url_images(setup):
    _, _, server, host, _ = setup
    sdk = anthropic.Anthropic(base_url=server.url, api_key="none")
    data = base64.b64encode(png_bytes(picture(14, (100, 130)))).decode()
    for source in (
        {"type": "base64", "media_type": "image/png", "data": data},
        {"type": "url", "url": f"{host}/ok.png"},
    ):
        message = sdk.messages.create(
            model="m",
            max_tokens=6,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": source},
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
        )
        assert message.content[0].text and message.usage.input_tokens > 20


def test_allowed_hosts_and_folders_serve_the_same_image_as_its_bytes(setup):
    """Fetched, redirected within the allowed host, read from the allowed folder: the same
    picture gives the same tokens as its data URL."""
    model, path, server, host, folder = setup
    client = server.client()
    ok = png_bytes(picture(11, (120, 90)))
    want = chat(client, encoded(ok)).json()["choices"][0]["message"]["content"]
    for url in (f"{host}/ok.png", f"{host}/to-ok"):
        assert chat(client, url).json()["choices"][0]["message"]["content"] == want
    local = chat(client, f"file://{folder / 'local.png'}")
    assert local.status_code == 200, local.text


# ---- hostile input ------------------------------------------------------------------------


def bomb_png(width: int, height: int) -> bytes:
    """A small PNG whose header claims a huge size."""
    raw = png_bytes(Image.new("RGB", (8, 8)))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    fixed = struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return raw[:8] + fixed + raw[8 + 25 :]


def hostile_urls(host: str, folder) -> dict[str, str]:
    png = png_bytes(picture(15, (64, 64)))
    gif = io.BytesIO()
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    cmyk = io.BytesIO()
    Image.new("CMYK", (32, 32)).save(cmyk, format="JPEG")
    deep = io.BytesIO()
    Image.new("I;16", (32, 32)).save(deep, format="PNG")
    floats = io.BytesIO()
    Image.new("F", (32, 32)).save(floats, format="TIFF")
    jpeg = io.BytesIO()
    picture(16, (64, 64)).save(jpeg, format="JPEG")
    return {
        "not base64": "data:image/png;base64,!!!not-base64!!!",
        "text as base64": encoded(b"hello world, I am text"),
        "empty data": "data:image/png;base64,",
        "truncated png": encoded(png[: len(png) // 2]),
        "truncated jpeg": encoded(jpeg.getvalue()[:200], "image/jpeg"),
        "garbled png": encoded(png[:40] + bytes(200) + png[240:]),
        "bomb header": encoded(bomb_png(60000, 60000)),
        "1x1": encoded(png_bytes(Image.new("RGB", (1, 1)))),
        "100000x1": encoded(png_bytes(Image.new("RGB", (100000, 1)))),
        "3x900": encoded(png_bytes(Image.new("RGB", (3, 900)))),
        "animated gif": encoded(gif.getvalue(), "image/gif"),
        "cmyk jpeg": encoded(cmyk.getvalue(), "image/jpeg"),
        "16-bit png": encoded(deep.getvalue()),
        "float tiff": encoded(floats.getvalue(), "image/tiff"),
        "svg": encoded(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"),
        "text media type": "data:text/plain;base64," + base64.b64encode(png).decode(),
        "data url without comma": "data:image/png;base64",
        "host not allowed": "http://example.com/cat.png",
        "loopback by name": "http://localhost/ok.png",
        "private address": "http://10.0.0.1/ok.png",
        "link-local metadata": "http://169.254.169.254/latest/meta-data",
        "ftp scheme": "ftp://127.0.0.1/ok.png",
        "javascript scheme": "javascript:alert(1)",
        "gopher scheme": "gopher://127.0.0.1/ok.png",
        "file outside folder": "file:///etc/passwd",
        "file traversal": f"file://{folder}/../../etc/passwd",
        "missing file": f"file://{folder}/nothing.png",
        "404": f"{host}/missing.png",
        "redirect off the list": f"{host}/to-elsewhere",
        "fetched text": f"{host}/text",
        "fetched oversized": f"{host}/huge",
        "fetch timeout": f"{host}/slow",
        "empty url": "",
    }


def test_hostile_images_are_4xx_naming_the_part_and_the_server_keeps_serving(setup):
    model, path, server, host, folder = setup
    client = server.client()
    image = picture(17, (120, 120))
    marker = [model.config.vision_start_token_id, model.config.image_token_id,
              model.config.vision_end_token_id]  # fmt: skip
    ids = list(range(100, 110)) + marker + [5, 6]
    want, _ = hf_greedy(model, path, ids, [image], 6)

    def text_latency() -> float:
        start = time.perf_counter()
        r = client.post("/generate", json={"input_ids": [1, 2, 3, 4], "sampling_params": GREEDY})
        assert r.status_code == 200
        return time.perf_counter() - start

    alone = statistics.median(text_latency() for _ in range(5))
    corpus = hostile_urls(host, folder)
    assert len(corpus) >= 30
    bad_bodies = other_hostile_bodies(marker)

    corpus_client = server.client()  # made here: an httpx client's SSL set-up takes the GIL

    def send(item):
        name, url = item
        return name, chat(corpus_client, url)

    with ThreadPoolExecutor(4) as pool:
        replies = pool.map(send, corpus.items())
        beside = [text_latency() for _ in range(5)]
        replies = list(replies)
    for name, reply in replies:
        assert 400 <= reply.status_code < 500, (name, reply.status_code, reply.text)
        if reply.status_code == 400:
            assert "messages[0].content[0]" in reply.json()["error"]["message"], (name, reply.text)
    for name, (route, body) in bad_bodies.items():
        reply = client.post(route, json=body)
        assert 400 <= reply.status_code < 500, (name, reply.status_code, reply.text)
    assert statistics.median(beside) < 3 * alone + 0.02, (alone, beside)
    assert client.get("/health").status_code == 200
    body = {"input_ids": ids, "image_data": data_url(image), "sampling_params": GREEDY}
    assert client.post("/generate", json=body).json()["output_ids"] == want


def other_hostile_bodies(marker: list[int]) -> dict[str, tuple[str, dict]]:
    png = data_url(picture(18, (64, 64)))
    four = [{"type": "image_url", "image_url": {"url": png}}] * 4
    return {
        "too many images": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": four}], "max_tokens": 2},
        ),
        "url not a string": (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}
                ]
            },
        ),
        "bad detail": (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": png, "detail": "ultra"}}
                        ],
                    }
                ]
            },
        ),
        "responses file_id": (
            "/v1/responses",
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}
                ]
            },
        ),
        "anthropic file source": (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "id": "f"}}],
                    }
                ],
            },
        ),
        "anthropic bad base64": (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "%%",
                                },
                            }
                        ],
                    }
                ],
            },
        ),
        "generate without a marker": (
            "/generate",
            {"input_ids": [1, 2, 3], "image_data": png, "sampling_params": GREEDY},
        ),
        "generate marker without image": (
            "/generate",
            {"input_ids": [1, 2] + marker, "sampling_params": GREEDY},
        ),
        "generate batch with images": (
            "/generate",
            {"input_ids": [[1] + marker, [2] + marker], "image_data": png},
        ),
        "prompt logprobs with an image": (
            "/generate",
            {
                "input_ids": [1, 2] + marker,
                "image_data": png,
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        ),
        "image ids forged": (
            "/generate",
            {"input_ids": [1, 2, (1 << 30) + 5], "sampling_params": GREEDY},
        ),
        "oversized body": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * BIG}]},
        ),
    }
