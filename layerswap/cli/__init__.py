"""The `layerswap` command line: inspect, merge, push, export-yaml, diff, ask, eval, sweep, search, lm-eval, lens,
app.

Every user error ends with a one-line reason on stderr and exit status 2 (1 for an
incompatible `inspect`), never a traceback. A command's result is its standard output; everything else (progress,
notes, and what vLLM, transformers and their worker processes log or print) goes to stderr (`results_only`), so
`layerswap eval ... > table.md` holds only the table. Each subcommand is one module here, its parser next to
its body: `add_parser(sub)` makes the subparser (and sets ``fn=run``), `run(args)` does the work and
returns the exit status. `COMMANDS` lists them in the order `--help` shows; `options` holds the
option groups and helpers they share.
"""

from __future__ import annotations

import argparse
import os
import sys

from layerswap.core.errors import UserError
from layerswap.cli import app, ask, diff, eval, export_yaml, inspect, lens, lm_eval, merge, push, search, sweep
from layerswap.cli.options import Parser, read_langs

COMMANDS = (inspect, merge, push, export_yaml, diff, ask, eval, sweep, search, lm_eval, lens, app)


def build_parser() -> argparse.ArgumentParser:
    from layerswap.core.version import __version__

    p = Parser(prog="layerswap", description="Layer swapping: merge a math expert and a language expert.")
    p.add_argument("--version", action="version", version=f"layerswap {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def results_only(*, whole_process: bool) -> None:
    """The libraries' logs to stderr: vLLM's logger by its environment variable (read when vLLM is first imported,
    and inherited by its engine processes). With `whole_process` (the `layerswap` command itself) file descriptor 1
    becomes stderr too, for the prints of C++ code and worker processes, while Python's `sys.stdout` keeps the real
    standard output for the command's result."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not whole_process:
        return
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real, "w", buffering=1 if sys.stdout.line_buffering else -1,
                           encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results_only(whole_process=argv is None)  # argv given: called from Python, whose stdout is left alone
    try:
        read_langs(args)  # --lang [CODE=]L, repeated for a family
        return args.fn(args)
    except UserError as e:
        print(f"layerswap {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
