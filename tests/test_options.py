"""Each option is defined once: every CLI flag comes from a dataclass field with the same
default, and every flag-marked field has a flag."""

import argparse
from dataclasses import fields

import pytest

from radixserve.cli import build_parser, main
from radixserve.config import EngineArgs, ServerArgs, option_default
from radixserve.router.config import RouterArgs

# flags of `generate` and `replay` that belong to those commands alone, not to an options class
COMMAND_ONLY = {
    "generate": {"prompt", "max_new_tokens", "temperature", "json"},
    "replay": {
        "log",
        "synthetic",
        "requests",
        "cache_tokens",
        "eviction",
        "dp",
        "router",
        "block_tokens",
        "json",
        "plot",
        "snapshot_slots",
    },
}
CLASSES = {
    "serve": [("", ServerArgs), ("router_", RouterArgs), ("", EngineArgs)],
    "router": [("", RouterArgs)],
    "generate": [("", EngineArgs)],
    "replay": [],
}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def field_of(command: str, dest: str):
    for prefix, cls in CLASSES[command]:
        if not dest.startswith(prefix):
            continue
        for f in fields(cls):
            if f.name == dest[len(prefix) :]:
                return f
    return None


@pytest.mark.parametrize("command", sorted(CLASSES))
def test_every_flag_default_equals_its_field_default(command):
    parser = subcommands()[command]
    for action in parser._actions:
        if action.dest == "help":
            continue
        f = field_of(command, action.dest)
        if f is None:
            assert action.dest in COMMAND_ONLY[command], f"{command} --{action.dest} has no field"
            continue
        default = option_default(f)
        assert action.default == (list(default) if isinstance(default, tuple) else default), (
            f"{command} --{action.dest}: flag default {action.default!r} != field {default!r}"
        )
        choices = f.metadata.get("choices")
        assert tuple(action.choices or ()) == tuple(choices or ()), action.dest


@pytest.mark.parametrize("command", ["serve", "router", "generate"])
def test_every_option_field_has_a_flag(command):
    dests = {a.dest for a in subcommands()[command]._actions}
    for prefix, cls in CLASSES[command]:
        for f in fields(cls):
            tuning = f.metadata.get("tuning", False)
            if not f.metadata.get("flag", True) or (prefix == "router_" and not tuning):
                continue
            assert prefix + f.name in dests, f"{cls.__name__}.{f.name} has no flag in {command}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--dp-size", "0"], "dp_size must be >= 1"),
        (
            ["serve", "--dp-size", "2", "--kv-events-config", '{"endpoint": "tcp://*:5557"}'],
            "kv_events_config with dp_size",
        ),
        (
            [
                "serve",
                "--dp-size",
                "2",
                "--tp-size",
                "2",
                "--nnodes",
                "2",
                "--dist-init-addr",
                "h:1",
            ],
            "dp_size with nnodes",
        ),
        (["serve", "--batch-wait-ms", "-1"], "batch_wait_ms"),
        (["serve", "--port", "70000"], "port must be"),
        (["router", "--worker-urls", "ftp://x"], "must look like http://host:port"),
    ],
)
def test_bad_flags_are_refused_in_one_line_naming_the_option(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_server_args_check_holds_without_the_cli():
    with pytest.raises(ValueError, match="dp_size with nnodes"):
        ServerArgs(dp_size=2, engine=EngineArgs(tp_size=2, nnodes=2, dist_init_addr="h:1"))
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerArgs(tool_call_parser="nonesuch")
