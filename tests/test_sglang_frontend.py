"""SGLang's own frontend language (the `sglang` PyPI package) works against radixserve unchanged."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import private_home
from server_utils import start_server

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = Path(os.environ.get("RADIXSERVE_SGLANG_PATH", ROOT / ".sglang-frontend"))


def sglang_env(home: Path) -> dict:
    return dict(private_home(home), PYTHONPATH=str(FRONTEND))


def sglang_available(home: Path) -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "from sglang import RuntimeEndpoint"],
        env=sglang_env(home),
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not sglang_available(tmp_path_factory.mktemp("sgl-home")):
        pytest.skip(
            f"the sglang frontend is not installed in {FRONTEND} "
            "(scripts/install_sglang_frontend.sh)"
        )
    srv = start_server(tmp_path_factory.mktemp("sgl"), "--max-total-tokens", "8192")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_sglang_programs_run_unchanged(server, tmp_path):
    env = sglang_env(tmp_path)
    run = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "sglang_program.py"), server.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    qa = out["qa"]
    assert qa["verdict"] in ("yes", "no")
    prompt = qa["text"].split("Answer:")[0] + "Answer:"
    direct = httpx.post(
        f"{server.url}/generate",
        json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
    ).json()
    assert direct["text"] == qa["answer"]
    assert out["tree"]["text"].count("Chosen: ") == 1
    assert [b["text"].split("\n")[0] for b in out["batch"]] == [
        "Question: 2+2?",
        "Question: Color of the sky?",
        "Question: Largest ocean?",
    ]
    assert re.fullmatch(r"1[89][0-9]{2}", out["year"])  # SGLang's regex-constrained gen
    stats = httpx.get(f"{server.url}/get_server_info").json()["stats"]
    assert stats["cached_tokens_total"] > 100  # select and fork hit the radix cache
