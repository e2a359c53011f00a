"""The `omnibal` command: one subcommand per module in megatron_omnibal.commands.

Subcommands are discovered, not listed here, and a subcommand's module (which may import
torch or megatron) is imported only when it runs, so `omnibal balance` starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_omnibal import __version__, commands


def _command_names() -> list[str]:
    """Command names: module names with '-' for '_' (compare_hf -> compare-hf)."""
    return sorted(
        m.name.replace("_", "-") for m in pkgutil.iter_modules(commands.__path__) if not m.ispkg
    )


def _module(name: str) -> str:
    return f"{commands.__name__}.{name.replace('-', '_')}"


def _help_line(name: str) -> str:
    """A module's HELP, read from its source so that listing commands imports nothing heavy."""
    spec = importlib.util.find_spec(_module(name))
    source = Path(spec.origin).read_text() if spec and spec.origin else ""
    for line in source.splitlines():
        if line.startswith("HELP = "):
            return line.split("=", 1)[1].strip().strip("\"'")
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = _command_names()
    top = argparse.ArgumentParser(
        prog="omnibal",
        description="Balanced data, model partition and recompute for VLM training.",
        epilog="commands:\n" + "\n".join(f"  {n:<11} {_help_line(n)}" for n in names),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=f"omnibal {__version__}")
    top.add_argument("command", choices=names, metavar="COMMAND")
    if not argv or argv[0].startswith("-"):
        top.parse_args(argv or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        top.error(f"unknown command '{name}' (choose from {', '.join(names)})")
    module = importlib.import_module(_module(name))
    parser = argparse.ArgumentParser(prog=f"omnibal {name}", description=module.HELP)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"omnibal {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
