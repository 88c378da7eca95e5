"""Drive a real Scheduler over a model runner in-process and collect what every request produced."""

from radixserve.config import EngineArgs
from radixserve.messages import GenerateReq
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler


def greedy_run(args: EngineArgs, runner, prompts: list[list[int]], max_new_tokens: list[int]):
    """Greedy outputs (ids and logprobs by request id "0", "1", ...); the capacity invariant is
    checked after every step."""
    sched = Scheduler(args, runner)
    for i, (prompt, n) in enumerate(zip(prompts, max_new_tokens)):
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        sched.add_request(GenerateReq(str(i), prompt, params, return_logprob=True))
    tokens, logprobs = {}, {}
    while sched.has_work():
        for out in sched.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            logprobs.setdefault(out.rid, []).extend(lp[0] for lp in out.output_logprobs or [])
        sched.check_memory()
    return tokens, logprobs
