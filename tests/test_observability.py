"""Prometheus metrics and the live dashboard, against a real server (and a real browser)."""

import os
import re
import shutil
import time

import pytest
from conftest import PROMPTS, private_home
from server_utils import start_server

KEY = "dash-key"
CHROMIUM = os.environ.get("RADIXSERVE_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("obs"), "--max-total-tokens", "4096", api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^radixserve:{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.M)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


def repeated_prefix_workload(client) -> list[dict]:
    results = []
    for suffix in [" First question?", " Second question?", " Third question?"]:
        r = client.post(
            "/generate",
            json={
                "text": PROMPTS[4] + suffix,
                "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            },
        )
        results.append(r.json())
    return results


def test_metrics_match_reported_cached_tokens(server):
    with server.client() as c:
        before = c.get("/metrics").text
        results = repeated_prefix_workload(c)
        after = c.get("/metrics").text
        info = c.get("/get_server_info").json()["stats"]
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results)
    assert cached > 0
    assert metric(after, "cached_tokens_total") - metric(before, "cached_tokens_total") == cached
    assert metric(after, "prompt_tokens_total") - metric(before, "prompt_tokens_total") == prompt
    assert (
        metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total") == 12
    )
    rate = metric(after, "cache_hit_rate")
    assert rate == pytest.approx(
        metric(after, "cached_tokens_total") / metric(after, "prompt_tokens_total")
    )
    assert rate == pytest.approx(info["cache_hit_rate"])
    assert metric(after, "requests_total", '{finish_reason="length"}') >= 3
    assert metric(after, "kv_capacity_tokens") == 4096
    assert metric(after, "kv_free_tokens") + metric(after, "kv_cached_tokens") == 4096
    assert metric(after, "time_to_first_token_seconds_count") >= 3
    assert metric(after, "inter_token_latency_seconds_count") >= 9


def test_dashboard_data_lists_prefixes(server):
    with server.client() as c:
        repeated_prefix_workload(c)
        data = c.get("/dashboard/data").json()
    assert data["current"]["cache_hit_rate"] > 0
    assert data["top_prefixes"] and data["top_prefixes"][0]["tokens"] > 50
    assert data["top_prefixes"][0]["tiers"] == ["device"]
    assert "Radix trees" in "".join(p["preview"] for p in data["top_prefixes"])
    assert data["ttft"]["count"] >= 3


def test_dashboard_in_a_real_browser(server, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (install Debian's chromium; .ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with server.client() as c:
        repeated_prefix_workload(c)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            env=private_home(tmp_path),
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--disable-sync",
            ],
        )
        page = browser.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server.url}/dashboard#key={KEY}")
        page.wait_for_function(
            "Number(document.getElementById('updates').textContent) >= 2", timeout=15000
        )
        hit = page.text_content("#hit-rate")
        assert hit.endswith("%") and float(hit[:-1]) > 0
        first = int(page.text_content("#updates"))
        with server.client() as c:
            repeated_prefix_workload(c)
        page.wait_for_function(
            f"Number(document.getElementById('updates').textContent) > {first + 1}", timeout=15000
        )
        assert "Radix trees" in page.text_content("#prefixes")
        assert page.text_content("#est-2x").endswith("%")  # what twice the KV memory would give
        if os.environ.get("RADIXSERVE_SCREENSHOT"):
            time.sleep(2)
            page.screenshot(path=os.environ["RADIXSERVE_SCREENSHOT"], full_page=True)
        browser.close()
    assert not errors, errors
