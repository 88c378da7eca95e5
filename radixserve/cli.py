"""`radixserve serve`, `radixserve router`, `radixserve generate` and `radixserve replay`.

Every flag of `serve`, `router` and the engine is built from its dataclass field in `config`
(`option`: default, help, choices), so each option is defined once."""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from dataclasses import fields

from .config import EVICTION_POLICIES, ROUTER_POLICIES, EngineArgs, ServerArgs
from .router.config import RouterArgs


def _flag_type(cls, name: str):
    """The argparse type of a field annotated `int`, `float | None`, `tuple[str, ...]`, ..."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kind = next(a for a in args if a is not type(None))
    return typing.get_origin(kind) or kind


def _flag_fields(cls, only=None):
    """The fields of `cls` that are flags (those `only` keeps, when given)."""
    return [f for f in fields(cls) if f.metadata.get("flag", True) and (only is None or only(f))]


def add_flags(parser, cls, prefix: str = "", only=None) -> None:
    """One flag per option of the dataclass `cls` (`--<prefix><name>`)."""
    for f in _flag_fields(cls, only):
        kind = _flag_type(cls, f.name)
        help_text = f.metadata["help"]
        if prefix:
            help_text = (
                f"with --dp-size, the {prefix[:-1]}'s --{f.name.replace('_', '-')}: {help_text}"
            )
        kwargs = dict(default=f.default, help=help_text, dest=prefix.replace("-", "_") + f.name)
        if kind is bool:
            kwargs["action"] = "store_true"
        elif f.metadata.get("repeat"):  # `--flag A [B]`, again for each item
            kwargs.update(action="append", nargs="+", default=list(f.default))
        elif kind is tuple:
            kwargs.update(nargs="*", default=list(f.default))
        else:
            kwargs["type"] = kind
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        parser.add_argument("--" + prefix + f.name.replace("_", "-"), **kwargs)


def args_from(ns: argparse.Namespace, cls, prefix: str = "", only=None, **fixed):
    """The dataclass from the flags `add_flags` made, plus the `fixed` fields."""
    values = {}
    for f in _flag_fields(cls, only):
        if f.name in fixed:
            continue
        value = getattr(ns, prefix.replace("-", "_") + f.name)
        if f.metadata.get("repeat"):  # each item's words joined: "URL PORT"
            value = tuple(" ".join(words) for words in value or ())
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values, **fixed)


def _is_tuning(f) -> bool:
    return f.metadata.get("tuning", False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="LLM serving with a radix prefix cache"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    formatter = argparse.ArgumentDefaultsHelpFormatter
    serve = sub.add_parser(
        "serve", help="serve the HTTP API (SGLang native + OpenAI)", formatter_class=formatter
    )
    add_flags(serve, ServerArgs)
    add_flags(serve, RouterArgs, prefix="router-", only=_is_tuning)
    add_flags(serve, EngineArgs)
    router = sub.add_parser(
        "router",
        help="route requests across radixserve (or SGLang) workers",
        formatter_class=formatter,
    )
    add_flags(router, RouterArgs)
    gen = sub.add_parser(
        "generate", help="generate offline, in this process", formatter_class=formatter
    )
    gen.add_argument("prompt", nargs="+", help="prompt(s)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--json", action="store_true", help="print the full results as JSON")
    add_flags(gen, EngineArgs)
    _add_replay_parser(sub)
    plan = sub.add_parser(
        "plan",
        help="the memory a server with these flags would use, and what context x concurrency "
        "fits, from the model's config alone",
        formatter_class=formatter,
    )
    plan.add_argument(
        "--memory", required=True, help="the device's free memory, e.g. 80GiB or 24GB"
    )
    plan.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="device type")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_flags(plan, EngineArgs)
    return parser


def _add_replay_parser(sub) -> None:
    from .sizing.replay import SYNTHETIC

    replay = sub.add_parser(
        "replay",
        help="replay a request log (or synthetic traffic) through the radix cache "
        "at other sizes, eviction policies and replica counts, next to the optimum",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    replay.add_argument(
        "log", nargs="?", default=None, help="folder of `radixserve serve --log-requests DIR`"
    )
    replay.add_argument(
        "--synthetic",
        default=None,
        choices=SYNTHETIC,
        help="generate traffic of this shape instead of reading a log",
    )
    replay.add_argument("--requests", type=int, default=400, help="--synthetic: how many requests")
    replay.add_argument(
        "--cache-tokens",
        default=None,
        help="comma-separated KV pool sizes per replica, e.g. "
        "4k,16k,64k (default: the server's own; 16k for --synthetic)",
    )
    replay.add_argument(
        "--eviction",
        default=None,
        help=f"comma-separated policies from {EVICTION_POLICIES} (default: the server's own)",
    )
    replay.add_argument(
        "--dp", default=None, help="comma-separated replica counts (default: the server's own)"
    )
    replay.add_argument(
        "--router", default="cache_aware", help=f"comma-separated policies from {ROUTER_POLICIES}"
    )
    replay.add_argument(
        "--block-tokens",
        type=int,
        default=1,
        help="replay in blocks of this many tokens, "
        "named by chained hashes: about that many times faster on long logs, matches counted in "
        "whole blocks (a --log-requests-level hashes log is always in blocks of 16)",
    )
    replay.add_argument(
        "--snapshot-slots",
        default=None,
        help="a hybrid model's log: replay its state-snapshot policies (radixserve's, "
        "SGLang's chunk ends, vLLM's one block-aligned checkpoint per request) with each of "
        "these comma-separated numbers of snapshot slots",
    )
    replay.add_argument("--json", default=None, help="write the results here")
    replay.add_argument(
        "--plot", default=None, help="write a plot of hit rate against cache size here (.png)"
    )


def replay_args_from(ns: argparse.Namespace):
    from .sizing.replay import ReplayArgs, parse_tokens

    def listed(flag: str, text: str | None, convert, allowed=None) -> tuple:
        """A comma-separated flag's values; a bad one is refused naming the flag."""
        try:
            values = tuple(convert(v.strip()) for v in text.split(",") if v.strip()) if text else ()
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        bad = [v for v in values if allowed is not None and v not in allowed]
        if bad:
            raise ValueError(f"{flag}: {bad[0]!r} is not one of {allowed}")
        return values

    dp = listed("--dp", ns.dp, int)
    slots = listed("--snapshot-slots", ns.snapshot_slots, int)
    if any(d < 1 for d in dp + slots) or ns.requests < 1 or ns.block_tokens < 1:
        raise ValueError("--dp, --snapshot-slots, --requests and --block-tokens must be >= 1")
    return ReplayArgs(
        ns.log,
        ns.synthetic,
        ns.requests,
        listed("--cache-tokens", ns.cache_tokens, parse_tokens),
        listed("--eviction", ns.eviction, str, EVICTION_POLICIES),
        dp,
        listed("--router", ns.router, str, ROUTER_POLICIES),
        ns.block_tokens,
        ns.json,
        ns.plot,
        slots,
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "replay":
            from .sizing.replay import run_replay

            return run_replay(replay_args_from(ns))
        if ns.command == "router":
            from .router.launch import run_router

            return run_router(args_from(ns, RouterArgs))
        engine_args = args_from(ns, EngineArgs)
        if ns.command == "plan":
            return _plan(ns, engine_args)
        if ns.command == "serve":
            server_args = args_from(ns, ServerArgs, engine=engine_args)
            return _serve(ns, server_args)
        return _generate(ns, engine_args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixserve: {exc}", file=sys.stderr)
        return 2


def _serve(ns: argparse.Namespace, server_args: ServerArgs) -> int:
    if server_args.dp_size == 1:
        from .server.launch import launch_server

        return launch_server(server_args)
    from .router.launch import launch_data_parallel

    fixed = dict(max_request_bytes=server_args.max_request_bytes, log_level=ns.log_level)
    router_args = args_from(ns, RouterArgs, prefix="router-", only=_is_tuning, **fixed)
    return launch_data_parallel(server_args, server_args.dp_size, router_args)


def _plan(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from .memory_plan import parse_bytes
    from .sizing.planning import plan_for, plan_report

    try:
        memory = parse_bytes(ns.memory)
    except ValueError:
        raise ValueError(f"--memory {ns.memory!r}: expected a size such as 80GiB") from None
    plan = plan_for(engine_args, memory, ns.device)
    print(json.dumps(plan.as_dict()) if ns.json else plan_report(plan, memory, engine_args))
    return 0


def _generate(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from .engine import Engine

    with Engine(args=engine_args) as engine:
        params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
        results = engine.generate(list(ns.prompt), params)
    for prompt, result in zip(ns.prompt, results):
        print(json.dumps(result) if ns.json else f"{prompt}{result['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
