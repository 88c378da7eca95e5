"""A batch of multi-call programs (multi-turn chat + tree of thought) with the radix cache on and
off.

    python bench/lang_programs.py [--programs 8 --threads 8]

Prints programs/s and the prompt-token hit rate; writes bench/results/lang_programs-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from radixserve import Engine
from radixserve.lang import EngineBackend, assistant, function, gen, system, user

CONTEXT = (
    "You are the support assistant of a bakery. Opening hours: 7am to 6pm, closed on Mondays. "
    "We sell sourdough, rye, baguettes, croissants and seasonal cakes. Orders over 20 euros ship "
    "free within the city. Gluten-free bread is baked on Thursdays only. "
) * 3


@function
def support_chat(s, customer):
    s += system(CONTEXT)
    for turn in [
        "Hello, are you open on Monday?",
        f"I am {customer}; can I order a cake?",
        "Is it gluten-free?",
    ]:
        s += user(turn)
        s += assistant(gen(max_tokens=16, temperature=0))


@function
def tree_of_thought(s, customer):
    s += system(CONTEXT)
    s += user(f"{customer} wants a gift idea from our shop.")
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += assistant(gen("idea", max_tokens=16, temperature=0.7, seed=i))
    forks.join()


def run(programs: int, threads: int, disable_cache: bool) -> dict:
    with Engine(
        max_total_tokens=16384, max_running_requests=32, disable_radix_cache=disable_cache
    ) as engine:
        backend = EngineBackend(engine)
        args = [{"customer": f"customer {i}"} for i in range(programs)]
        start = time.perf_counter()
        states = support_chat.run_batch(args, backend=backend, num_threads=threads)
        states += tree_of_thought.run_batch(args, backend=backend, num_threads=threads)
        elapsed = time.perf_counter() - start
    errors = [s.error for s in states if s.error]
    prompt = sum(s.report.prompt_tokens for s in states)
    cached = sum(s.report.cached_tokens for s in states)
    return {
        "radix_cache": not disable_cache,
        "programs": len(states),
        "seconds": elapsed,
        "programs_per_s": len(states) / elapsed,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "errors": len(errors),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    rows = [run(a.programs, a.threads, False), run(a.programs, a.threads, True)]
    for r in rows:
        print(
            f"radix cache {'on ' if r['radix_cache'] else 'off'}: {r['programs']} programs in "
            f"{r['seconds']:.1f} s "
            f"({r['programs_per_s']:.2f}/s), hit rate {100 * r['hit_rate']:.0f}%, errors "
            f"{r['errors']}"
        )
    print(f"speed-up from the radix cache: {rows[1]['seconds'] / rows[0]['seconds']:.2f}x")
    out = Path(__file__).parent / "results" / f"lang_programs-{datetime.date.today()}.json"
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
