"""The `omnibal` command: one subcommand per module in megatron_omnibal.commands.

Subcommands are discovered, not listed here, and a subcommand's module (which may import
torch or megatron) is imported only when it runs, so `omnibal balance` starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
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
    """Run one command; its exit status: 0 done, 1 the work failed, 2 a usage error (argparse's,
    or a ValueError naming the flag or the input at fault), 130 interrupted (Ctrl-C), 141 stdout
    closed early (`omnibal balance ... | head`)."""
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
    if not argv:
        top.print_help(sys.stderr)
        return 2
    if argv[0].startswith("-"):
        top.parse_args(argv)  # --help and --version exit 0 here, anything else with 2
        top.error("give a command first")
    name, rest = argv[0], argv[1:]
    if name not in names:
        top.error(f"unknown command '{name}' (choose from {', '.join(names)})")
    try:
        module = importlib.import_module(_module(name))
        parser = argparse.ArgumentParser(prog=f"omnibal {name}", description=module.HELP)
        module.add_arguments(parser)
        args = parser.parse_args(rest)
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at interpreter exit
        return code
    except KeyboardInterrupt:
        # on a line of its own: a progress bar may have been cut off mid-line
        print(f"\nomnibal {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return 141
    except (ValueError, FileNotFoundError) as exc:
        print(f"omnibal {name}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"omnibal {name}: error: {exc}", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """After a reader closed our stdout: send what is still buffered to /dev/null, so that the
    interpreter's final flush does not fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (captured output): nothing will be flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
