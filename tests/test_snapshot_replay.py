"""`radixserve replay --snapshot-slots`: a hybrid model's request log replayed through the
state-snapshot policies. Replaying radixserve's own policy with the server's slots must give
the hit rate the server measured; the others are compared on the same log."""

import json
import subprocess
import sys

import test_hybrid_models as hybrid

from radixserve import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def conversations(engine: Engine) -> None:
    """Two conversations of three turns on one 100-token system prompt, one request at a
    time, then a third conversation branching off the first one's second turn."""
    system = list(range(10, 110))
    histories = {}
    for turn in range(3):
        for c in range(2):
            prompt = histories.get(c, system) + [200 + 10 * c + turn] * 20
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
            histories[c] = prompt + out["output_ids"]
    branch = histories[0][:180] + [300] * 10
    engine.generate(input_ids=branch, sampling_params=GREEDY)


def test_replaying_the_servers_policy_gives_its_measured_hit_rate(tmp_path):
    _, path = hybrid.build_checkpoint(tmp_path, "lfm2")
    log = tmp_path / "log"
    with Engine(
        model=str(path),
        dtype="float32",
        max_total_tokens=4096,
        chunked_prefill_size=64,
        max_mamba_cache_size=6,
        mamba_track_interval=48,
        log_requests=str(log),
        log_requests_level="full",
    ) as eng:
        conversations(eng)
        stats = eng.get_stats()
    measured = stats.cached_tokens_total / stats.prompt_tokens_total
    out = tmp_path / "replay.json"
    done = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "replay", str(log)]
        + ["--snapshot-slots", "6,64", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rates = {
        (r["policy"], r["slots"]): r["hit_rate"] for r in json.loads(out.read_text())["results"]
    }
    assert abs(rates[("radixserve", 6)] - measured) < 1e-9, (rates, measured)
    assert "radixserve" in done.stdout and "block_aligned" in done.stdout
    for slots in (6, 64):
        assert rates[("radixserve", slots)] >= rates[("chunk_end", slots)]
        assert rates[("radixserve", slots)] > rates[("block_aligned", slots)]


def test_snapshot_slots_need_a_hybrid_models_log(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "replay", "--synthetic", "chat"]
        + ["--snapshot-slots", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "--snapshot-slots" in done.stderr and "Traceback" not in done.stderr
