"""Scheduler tests without a model: the fake executor checks every slot mapping."""

import random
import time

import pytest
from fake_executor import EOS, FakeExecutor, reference

from radixserve.config import EngineArgs
from radixserve.messages import FinishReason, ForwardMode, GenerateReq
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from radixserve.validation import check_generate


def make(num_pages=4096, page_size=1, max_running=8, **kw):
    args = EngineArgs(
        page_size=page_size,
        max_running_requests=max_running,
        chunked_prefill_size=kw.pop("chunk", 64),
        **kw,
    )
    ex = FakeExecutor(num_pages, page_size, max_running)
    return Scheduler(args, ex), ex


def request(rid, prompt, params: dict) -> GenerateReq:
    return GenerateReq(rid, prompt, SamplingParams.from_dict(params))


def submit(sched, rid, prompt, max_new=8, **params):
    """Validate as the api does, then queue."""
    req = request(
        rid, prompt, dict(dict(max_new_tokens=max_new, temperature=0, ignore_eos=True), **params)
    )
    check_generate(req, sched.info)
    sched.add_request(req)


def run(sched, max_steps=10_000):
    results = {}
    for _ in range(max_steps):
        for out in sched.step():
            results.setdefault(out.rid, {"ids": [], "out": None})
            results[out.rid]["ids"] += out.new_token_ids
            results[out.rid]["out"] = out
        sched.check_memory()
        if not sched.has_work():
            return results
    raise AssertionError("scheduler did not finish")


def prompts(n, length, seed=0, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(998) for _ in range(shared)]
    return [prefix + [rng.randrange(998) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_outputs_match_reference(page_size, policy):
    sched, _ = make(page_size=page_size, schedule_policy=policy)
    ps = prompts(6, 20, shared=40)
    for i, p in enumerate(ps):
        submit(sched, str(i), p, max_new=10)
    res = run(sched)
    for i, p in enumerate(ps):
        assert res[str(i)]["ids"] == reference(p, 10)
        assert res[str(i)]["out"].finish_reason == FinishReason("length", length=10)


def test_requests_arriving_during_a_chunked_prefix_wait_for_it():
    """A long shared prompt is prefilled in chunks over several steps; requests sharing it that
    arrive meanwhile wait for it to be cached instead of computing its rest again."""
    sched, ex = make(chunk=64)
    ps = prompts(4, 8, shared=300)
    submit(sched, "0", ps[0], max_new=2)
    sched.step()  # the first 64-token chunk of the leader
    for i, p in enumerate(ps[1:], 1):
        submit(sched, str(i), p, max_new=2)
    res = run(sched)
    prompt_work = sum(len(b.input_ids) for b in ex.batches) - 4 * 1  # minus one decode step each
    assert prompt_work == 300 + 4 * 8
    assert sorted(res[str(i)]["out"].cached_tokens for i in range(4)) == [0, 300, 300, 300]


def test_shared_prefix_is_computed_once_in_a_burst():
    sched, ex = make(chunk=512)
    ps = prompts(5, 8, shared=64)
    for i, p in enumerate(ps):
        submit(sched, str(i), p, max_new=2)
    res = run(sched)
    fed = sum(len(b.input_ids) for b in ex.batches)
    assert (
        fed - 5 * 1 == 64 + 5 * 8
    )  # every token fed but one decode step per request is prompt work
    assert sorted(res[str(i)]["out"].cached_tokens for i in range(5)) == [0, 64, 64, 64, 64]


@pytest.mark.parametrize("admit, first_step", [(100, [120]), (256, [120, 120]), (2048, [120] * 4)])
def test_a_burst_of_prompts_completes_one_after_another(admit, first_step):
    """A waiting request joins a step only while its prompt tokens keep the step within
    `prefill_admit_tokens`: each burst prompt gets a step of its own (the earlier ones decoding
    beside it), two fit 256, and with the limit at the budget they share one."""
    sched, ex = make(chunk=512, prefill_admit_tokens=admit)
    ps = prompts(4, 120, seed=3)
    for i, p in enumerate(ps):
        submit(sched, str(i), p, max_new=6)
    res = run(sched)
    assert all(res[str(i)]["ids"] == reference(p, 6) for i, p in enumerate(ps))
    prompt_chunks = [[n for n in b.extend_lens if n > 1] for b in ex.batches]
    assert prompt_chunks[0] == first_step
    if admit == 100:
        assert prompt_chunks[:4] == [[120]] * 4 and ex.batches[3].extend_lens.count(1) == 3


def test_repeated_prompt_hits_cache_and_disabled_cache_does_not():
    for disable, expected in [(False, 40), (True, 0)]:
        sched, _ = make(disable_radix_cache=disable)
        p = prompts(1, 41)[0]
        submit(sched, "a", p)
        run(sched)
        submit(sched, "b", p)
        res = run(sched)
        assert res["b"]["out"].cached_tokens == expected
        assert res["b"]["ids"] == reference(p, 8)


def test_chunked_prefill_keeps_decodes_running():
    sched, ex = make(chunk=16)
    short = prompts(1, 5, seed=1)[0]
    submit(sched, "short", short, max_new=20)
    first = sched.step()[0].new_token_ids
    long_prompt = prompts(1, 100, seed=2)[0]
    submit(sched, "long", long_prompt, max_new=4)
    res = run(sched)
    assert res["long"]["ids"] == reference(long_prompt, 4)
    assert first + res["short"]["ids"] == reference(short, 20)
    chunks = [i for i, b in enumerate(ex.batches) if 16 in b.extend_lens]
    assert len(chunks) >= 6
    # each chunk rides along with the short request's decode
    assert all(
        ex.batches[i].mode == ForwardMode.MIXED and 1 in ex.batches[i].extend_lens
        for i in chunks[:3]
    )


def test_small_pool_retracts_and_still_matches():
    sched, _ = make(num_pages=120, max_running=8, chunk=32)
    ps = prompts(8, 30, seed=3)
    for i, p in enumerate(ps):
        submit(sched, str(i), p, max_new=40)
    res = run(sched)
    for i, p in enumerate(ps):
        assert res[str(i)]["ids"] == reference(p, 40)
    assert sched.stats.retractions_total > 0
    allocator = sched.kv.allocator
    assert allocator.available() + sched.kv.cache.total_size() == allocator.num_slots


def test_eviction_under_pressure_with_pages():
    sched, _ = make(num_pages=40, page_size=4, chunk=32)
    for round_ in range(6):
        p = prompts(1, 50, seed=10 + round_)[0]
        submit(sched, str(round_), p, max_new=6)
        res = run(sched)
        assert res[str(round_)]["ids"] == reference(p, 6)
    assert sched.snapshot().evicted_tokens_total > 0


def test_abort_waiting_and_running_frees_everything():
    sched, _ = make()
    submit(sched, "run", prompts(1, 10)[0], max_new=100)
    sched.step()
    submit(sched, "wait", prompts(1, 10, seed=5)[0], max_new=100)
    sched.abort("run")
    sched.abort("wait")
    res = run(sched)
    assert res["run"]["out"].finish_reason.kind == "abort"
    assert res["wait"]["out"].finish_reason.kind == "abort"
    assert not sched.queues.running and sched.kv.rows.available() == sched.kv.rows.num_rows


def test_stop_tokens_eos_and_min_new_tokens():
    sched, ex = make()
    p = prompts(1, 10, seed=7)[0]
    ref = reference(p, 12)
    submit(sched, "stop", p, max_new=12, stop_token_ids=[ref[3]])
    sched.add_request(request("eos", p, dict(max_new_tokens=5, temperature=0, min_new_tokens=2)))
    res = run(sched)
    assert res["stop"]["ids"] == ref[:4]
    assert res["stop"]["out"].finish_reason == FinishReason("stop", matched=ref[3])
    eos_batch = [b for b in ex.batches if len(b.rows) and b.sampling.suppressed_ids[0] is not None]
    assert eos_batch and EOS in eos_batch[0].sampling.suppressed_ids[0]


def test_bad_requests_raise_clear_errors():
    sched, _ = make()
    with pytest.raises(ValueError, match="empty"):
        submit(sched, "e", [])
    with pytest.raises(ValueError, match="context"):
        submit(sched, "long", [1] * 600)
    with pytest.raises(ValueError, match="vocabulary"):
        submit(sched, "v", [1, 5000])
    with pytest.raises(ValueError, match="stop_token_ids: token id 4096 is outside"):
        submit(sched, "s", [1], stop_token_ids=[4096])
    with pytest.raises(ValueError, match="temperature"):
        submit(sched, "t", [1], temperature=-1)
    with pytest.raises(ValueError, match="unknown"):
        submit(sched, "u", [1], temprature=1)
    assert not sched.has_work()


def test_max_new_tokens_clamped_to_context():
    sched, _ = make()
    p = prompts(1, 500)[0]
    submit(sched, "c", p, max_new=100)
    res = run(sched)
    assert len(res["c"]["ids"]) == 12
    assert res["c"]["out"].finish_reason.kind == "length"


POISON = 666


class FailingExecutor(FakeExecutor):
    """Raises on any step that carries the poison token, as a worker bug would."""

    def forward(self, fb):
        if POISON in fb.input_ids:
            raise RuntimeError("injected worker failure")
        return super().forward(fb)


def test_a_failing_step_aborts_its_requests_and_the_scheduler_goes_on():
    args = EngineArgs(max_running_requests=8, chunked_prefill_size=64)
    sched = Scheduler(args, FailingExecutor(4096, 1, 8))
    healthy = prompts(1, 20, seed=3)[0]
    submit(sched, "healthy", healthy, max_new=6)
    sched.step()  # its prefill ran; now it decodes beside the poisoned prompt
    submit(sched, "poisoned", [1, 2, POISON, 3], max_new=6)
    res = run(sched)
    for rid in ("healthy", "poisoned"):
        reason = res[rid]["out"].finish_reason
        assert reason.kind == "abort" and "injected worker failure" in reason.message, reason
    assert (
        sched.kv.cache.total_size() == 20
    )  # the healthy prompt's KV was cached; nothing of the failed step
    after = prompts(1, 12, seed=4)[0]
    submit(sched, "after", after, max_new=6)
    assert run(sched)["after"]["ids"] == reference(after, 6)
    assert not sched.queues.running and sched.kv.rows.available() == sched.kv.rows.num_rows


def first_output_steps(sched, max_steps=10_000) -> dict[str, int]:
    """The step at which each request produced its first token."""
    first: dict[str, int] = {}
    for step in range(max_steps):
        for out in sched.step():
            first.setdefault(out.rid, step)
        sched.check_memory()
        if not sched.has_work():
            return first
    raise AssertionError("scheduler did not finish")


def first_steps_with_a_late_high_priority(**kw) -> dict[str, int]:
    """One row; five priority-0 requests queue, then one of priority 5 arrives."""
    sched, _ = make(max_running=1, **kw)
    ps = prompts(6, 12, seed=5)
    for i in range(5):
        submit(sched, f"low{i}", ps[i], max_new=6)
    sched.step()  # the first request is admitted; the others wait
    params = SamplingParams.from_dict(dict(max_new_tokens=6, temperature=0, ignore_eos=True))
    sched.add_request(GenerateReq("high", ps[5], params, priority=5))
    return first_output_steps(sched)


def test_a_high_priority_request_overtakes_the_queue():
    first = first_steps_with_a_late_high_priority(enable_priority_scheduling=True)
    assert all(first["high"] < first[f"low{i}"] for i in range(1, 5)), first


def test_without_priority_scheduling_the_queue_keeps_its_order():
    first = first_steps_with_a_late_high_priority(schedule_policy="fcfs")
    assert all(first["high"] > first[f"low{i}"] for i in range(5)), first


def test_retraction_picks_the_lowest_priority_first():
    sched, _ = make(num_pages=100, max_running=4, chunk=32, enable_priority_scheduling=True)
    victims = []
    retract = sched.retraction.retract

    def recording_retract(req):
        victims.append((req.priority, sorted(r.priority for r in sched.queues.running)))
        retract(req)

    sched.retraction.retract = recording_retract
    ps = prompts(4, 10, seed=7)
    for i, priority in enumerate([3, 0, 2, 1]):
        req = request(str(i), ps[i], dict(max_new_tokens=40, temperature=0, ignore_eos=True))
        req.priority = priority
        check_generate(req, sched.info)
        sched.add_request(req)
    res = run(sched)
    assert victims, "the pool was meant to run short"
    assert all(victim == min(running) for victim, running in victims), victims
    for i, p in enumerate(ps):
        assert res[str(i)]["ids"] == reference(p, 40)


def test_the_batching_window_holds_admission_until_it_closes():
    sched, ex = make(batch_wait_ms=80)
    submit(sched, "a", prompts(1, 8, seed=8)[0], max_new=3)
    assert sched.step() == [] and not ex.batches  # held: the window is open
    assert 0 < sched.poll_timeout_s(0.5) <= 0.08
    submit(sched, "b", prompts(1, 8, seed=9)[0], max_new=3)
    time.sleep(0.09)
    sched.step()
    assert ex.batches[0].extend_lens == [8, 8]  # both arrivals started in one step
    run(sched)


def test_a_lone_request_out_of_kv_memory_fails_alone_and_the_loop_goes_on():
    sched, _ = make(num_pages=64)
    taken = sched.kv.allocator.alloc_extend(0, None, 40)  # memory the scheduler cannot reclaim
    submit(sched, "starved", prompts(1, 10, seed=10)[0], max_new=40)
    outputs = []
    while sched.has_work():
        outputs += sched.step()
    end = outputs[-1]
    assert end.rid == "starved" and end.finish_reason.kind == "abort"
    assert "out of KV memory" in end.finish_reason.message
    sched.kv.allocator.free(taken)
    sched.check_memory()
    p = prompts(1, 10, seed=11)[0]
    submit(sched, "next", p, max_new=8)
    assert run(sched)["next"]["ids"] == reference(p, 8)
