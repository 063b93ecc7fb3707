"""`pdserve COMMAND ...`: the command table and the dispatch to one command's module.

Nothing here imports a command's code: `pdserve up` loads the launcher, not the router, the
engine or the benchmarks. A command module exposes `main(argv) -> int` (exit status: 0, 1 for a
failure while running, 2 for a bad flag or value with one line naming it). Commands of other
installed distributions are found through the `pdserve.commands` entry point group; the entry
point names a module with `HELP` (one line) and `main`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Protocol, cast

ENTRY_POINT_GROUP = "pdserve.commands"


@dataclass(frozen=True, slots=True)
class Command:
    """A command: the module that runs it and its line in `pdserve --help`."""

    module: str
    help: str


class CommandModule(Protocol):
    """What a command's module provides."""

    def main(self, argv: Sequence[str]) -> int: ...


BUILTIN: dict[str, Command] = {
    "up": Command("pdserve.cli.up", "start a router and workers on loopback; Ctrl-C stops all"),
    "generate": Command("pdserve.cli.generate", "complete one prompt with the local engine"),
    "worker": Command("pdserve.worker.main", "run one worker process"),
    "router": Command("pdserve.router.main", "run the OpenAI-compatible router"),
    "status": Command("pdserve.cli.status", "router, mode and workers of a running cluster"),
    "top": Command("pdserve.cli.top", "live view of workers, blocks, load and request latencies"),
    "trace": Command("pdserve.cli.trace", "one request's timeline as a waterfall"),
    "drain": Command("pdserve.cli.drain", "drain a worker (finish held work, then exit)"),
    "advise": Command(
        "pdserve.advise.command",
        "colocated or split, and which P:D ratio: goodput curves on your workload",
    ),
}


def commands() -> dict[str, Command]:
    """Every command: the built-in ones, then those other distributions register."""
    table = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in table:
            table[ep.name] = Command(ep.value, "")
    return table


def _help_line(command: Command) -> str:
    if command.help:
        return command.help
    try:  # a plugin's module is light by contract (its heavy imports are inside `main`)
        return str(getattr(importlib.import_module(command.module), "HELP", ""))
    except ImportError as exc:
        return f"(unavailable: {exc})"


def usage(table: dict[str, Command]) -> str:
    """The top-level help: one line per command."""
    width = max(len(name) for name in table)
    lines = [
        "usage: pdserve COMMAND [flags]  (pdserve COMMAND --help: that command's flags)",
        "",
        "LLM serving with disaggregated prefill and decode, built to survive the split.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {_help_line(cmd)}" for name, cmd in table.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdserve` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    table = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(table), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    command = table.get(name)
    if command is None:
        print(
            f"pdserve: error: unknown command {name!r} (choose from {', '.join(table)})",
            file=sys.stderr,
        )
        return 2
    module = cast(CommandModule, importlib.import_module(command.module))
    # `pdserve worker -- FLAGS` (an older spelling): the "--" is not the process's flag.
    return module.main(rest[1:] if rest[:1] == ["--"] else rest)
