"""Subcommands of `omnibal`: one module each, discovered by cli.py.

A module here defines HELP (one line), `add_arguments(parser)` and `run(args) -> int`.
"""
