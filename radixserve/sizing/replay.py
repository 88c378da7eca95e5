"""`radixserve replay`: what hit rate a request log would get with other cache sizes, eviction
policies and replica counts, next to the offline optimum; a table, JSON and a plot.

    radixserve replay LOG_DIR --cache-tokens 4k,16k,64k --eviction lru,lfu,slru
    radixserve replay --synthetic agent --dp 1,2,4 --router cache_aware,round_robin --plot mrc.png
    radixserve replay LOG_DIR --snapshot-slots 8,256   # a hybrid model's snapshot policies

Without a log, `--synthetic agent|rag|chat` generates traffic of that shape.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ..request_log import ServerRecord, read_log
from .cache_sim import Result, Setting, Trace, TraceRequest, sweep
from .snapshot_sim import policies, replay_snapshots

SYNTHETIC = ("agent", "rag", "chat")


@dataclass(frozen=True)
class ReplayArgs:
    log: str | None
    synthetic: str | None
    requests: int
    cache_tokens: tuple[int, ...]  # empty: the server's own
    eviction: tuple[str, ...]  # empty: the server's own
    dp: tuple[int, ...]  # empty: the server's own
    router: tuple[str, ...]
    block_tokens: int  # replay units: 1 = tokens; more = hashed blocks (faster)
    json_path: str | None
    plot_path: str | None
    snapshot_slots: tuple[int, ...] = ()  # replay state-snapshot policies with these slots


def parse_tokens(text: str) -> int:
    """'4096', '4k' (x1024) or '1m' (x1024^2)."""
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    value = int(float(text[:-1] if scale > 1 else text) * scale)
    if value < 1:
        raise ValueError(f"cache size must be positive, got {text!r}")
    return value


def run_replay(args: ReplayArgs) -> int:
    if (args.log is None) == (args.synthetic is None):
        raise ValueError(
            "give a request log folder (from `radixserve serve --log-requests DIR`) or --synthetic"
        )
    if args.snapshot_slots and args.log is None:
        raise ValueError("--snapshot-slots replays a request log of a hybrid model's server")
    if args.log is not None:
        servers, records = read_log(args.log)
        trace = Trace.from_log(records, servers[0].hash_block)
        own = Setting(servers[0].cache_tokens, servers[0].eviction_policy, len(servers))
        source = f"{args.log}: {len(trace.requests)} requests, level {servers[0].level}"
    else:
        trace = synthetic_trace(args.synthetic, args.requests)
        own = Setting(16384)
        source = f"synthetic {args.synthetic}: {len(trace.requests)} requests"
    if args.snapshot_slots:
        return replay_snapshot_policies(args, servers[0], trace, source)
    trace = trace.in_blocks(args.block_tokens) if args.block_tokens > 1 else trace
    settings = [
        Setting(c, e, d, r)
        for c, e, d, r in itertools.product(
            args.cache_tokens or (own.cache_tokens,),
            args.eviction or (own.eviction,),
            args.dp or (own.dp,),
            args.router,
        )
    ]
    results = sweep(trace, settings)
    measured = trace.measured_hit_rate() if args.log is not None else None
    print(report(source, own, measured, results))
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "source": source,
                    "server": asdict(own),
                    "measured_hit_rate": measured,
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    if args.plot_path:
        plot(results, args.plot_path, source)
    return 0


def replay_snapshot_policies(
    args: ReplayArgs, server: ServerRecord, trace: Trace, source: str
) -> int:
    """Each snapshot policy's hit rate on the log, with each number of snapshot slots."""
    if not server.state_snapshots or server.level != "full":
        raise ValueError(
            "--snapshot-slots needs a log of a hybrid model's server at --log-requests-level full"
        )
    results = [
        replay_snapshots(trace, policy, slots, server.chunk_tokens)
        for slots in args.snapshot_slots
        for policy in policies(server.state_layer_tokens, server.state_interval)
    ]
    lines = [
        source,
        f"server: {server.state_snapshots} snapshot slots, snapshots every "
        f"{server.state_interval} tokens, chunks of {server.chunk_tokens}; `block_aligned` "
        f"blocks of {server.state_layer_tokens} tokens; measured hit rate "
        f"{trace.measured_hit_rate():.1%}",
        f"{'slots':>6} {'policy':>14} {'hit rate':>9} {'KV bound':>9}",
    ]
    lines += [f"{r.slots:>6} {r.policy:>14} {r.hit_rate:>9.1%} {r.kv_bound:>9.1%}" for r in results]
    print("\n".join(lines))
    if args.json_path:
        rows = [dict(asdict(r), hit_rate=r.hit_rate, kv_bound=r.kv_bound) for r in results]
        Path(args.json_path).write_text(json.dumps({"source": source, "results": rows}, indent=2))
    return 0


def report(source: str, own: Setting, measured: float | None, results: list[Result]) -> str:
    lines = [source]
    if measured is not None:
        lines.append(
            f"server: {own.cache_tokens} KV tokens x {own.dp}, {own.eviction}; measured hit rate "
            f"{measured:.1%}"
        )
    lines.append(
        f"{'cache tokens':>12} {'eviction':>8} {'dp':>3} {'router':>12} {'hit rate':>9} "
        f"{'optimum':>8}"
    )
    for r in results:
        s = r.setting
        lines.append(
            f"{s.cache_tokens:>12} {s.eviction:>8} {s.dp:>3} {s.router:>12} {r.hit_rate:>9.1%} "
            f"{r.optimum:>8.1%}"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: str, title: str) -> None:
    """Hit rate against total KV memory: one line per policy (and replica count, router), and
    MIN."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[tuple, list[Result]] = {}
    for r in results:
        lines.setdefault((r.setting.eviction, r.setting.dp, r.setting.router), []).append(r)
    multi_dp = len({key[1:] for key in lines}) > 1
    for (eviction, dp, router), rs in lines.items():
        rs.sort(key=lambda r: r.setting.cache_tokens)
        label = eviction + (f", dp {dp} {router}" if multi_dp else "")
        ax.plot(
            [r.setting.cache_tokens * dp for r in rs],
            [100 * r.hit_rate for r in rs],
            marker="o",
            label=label,
        )
    optimum = sorted({(r.setting.cache_tokens * r.setting.dp, r.optimum) for r in results})
    ax.plot(
        [t for t, _ in optimum], [100 * o for _, o in optimum], "k--", label="optimum (Belady MIN)"
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache tokens (all replicas)")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def synthetic_trace(kind: str, requests: int = 400, seed: int = 0) -> Trace:
    """Traffic of a known shape, in token ids, ~2 requests/s (Poisson), service time growing
    with the output; admitted on arrival.

    agent: 8 agents, each with a 1000-token tool prompt, run 6-step tasks whose context grows
    by each step's output and tool result. rag: a 200-token system prompt, one of 100
    600-token documents (Zipf popularity) and a question. chat: 60 conversations under one
    300-token system prompt; each turn adds the last answer and a new user message."""
    if kind not in SYNTHETIC:
        raise ValueError(f"--synthetic must be one of {SYNTHETIC}, got {kind!r}")
    rng = random.Random(seed)

    def text(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 49152) for _ in range(n))

    prompts = {"agent": _agent_prompts, "rag": _rag_prompts, "chat": _chat_prompts}[kind](rng, text)
    out, now = [], 0.0
    for _ in range(requests):
        prompt, output = next(prompts)
        now += rng.expovariate(2.0)
        out.append(
            TraceRequest(
                now,
                now,
                now + 0.5 + 0.03 * len(output),
                prompt + output[:-1],
                len(prompt),
                len(prompt) - 1,
                len(prompt),
            )
        )
    return Trace(out, 1)


def _agent_prompts(rng: random.Random, text):
    tools = [text(1000) for _ in range(8)]
    tasks: list[list] = []
    while True:
        if len(tasks) < 6:
            tasks.append([tools[rng.randrange(8)] + text(100), 0])
        task = rng.choice(tasks)
        output = text(60)
        yield task[0], output
        task[0] += output + text(150)
        task[1] += 1
        if task[1] == 6:
            tasks.remove(task)


def _rag_prompts(rng: random.Random, text):
    system = text(200)
    documents = [text(600) for _ in range(100)]
    weights = [1 / (i + 1) ** 1.1 for i in range(100)]
    while True:
        yield system + rng.choices(documents, weights)[0] + text(30), text(80)


def _chat_prompts(rng: random.Random, text):
    system = text(300)
    conversations = [system + text(60) for _ in range(60)]
    while True:
        i = rng.randrange(60)
        answer = text(120)
        yield conversations[i], answer
        conversations[i] += answer + text(60)
