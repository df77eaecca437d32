"""The `opscope` command line: a thin layer over the Python API, one module per command.

Each command module has `add_parser(subparsers)` and `run(args) -> int`; it parses options
(the groups in `options`, defined once), makes one API call and prints. Errors a user can
cause are one `error:` line (and a `hint:`), with the exit code the OpscopeError carries;
an unknown flag or command gets a did-you-mean. argparse lives here and nowhere else.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings

from .. import __version__
from ..errors import OpscopeError, did_you_mean

COMMANDS = [
    "inject",
    "record",
    "generate",
    "calibrate",
    "analyze",
    "weights",
    "zoo",
    "mine",
    "report",
    "rewrite",
    "parity",
    "demo",
]


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and a did-you-mean for misspelt commands and choices."""

    def error(self, message: str) -> None:  # type: ignore[override]
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
            message += did_you_mean(m.group(1), choices)
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        print(f"hint: `{self.prog} --help` lists the options, with examples", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> Parser:
    parser = Parser(
        prog="opscope",
        description="Static cost, recorded tensor sketches and exploitable patterns for ONNX models, "
        "on any onnxruntime execution provider.",
        epilog="Run `opscope COMMAND --help` for the options of one command, with examples; `opscope demo` shows "
        "the whole loop on a bundled model.",
    )
    parser.add_argument("--version", action="version", version=f"onnx-opscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name in COMMANDS:
        module = importlib.import_module(f".{name}", __name__)
        cmd = module.add_parser(sub)
        cmd.set_defaults(_run=module.run)
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser that parsed the command the user gave, nested subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen(action.choices[name], args)
    return parser


def _unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    chosen = _chosen(parser, args)
    flags = [s for a in chosen._actions for s in a.option_strings]
    first = next((e for e in extra if e.startswith("-")), extra[0])
    hint = did_you_mean(first.split("=")[0], flags) if first.startswith("-") else ""
    chosen.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def one_line_warnings() -> None:
    """Warnings (a provider fallback, a tap left out) as one 'warning: ...' line, never a source excerpt."""
    warnings.formatwarning = lambda msg, *a, **k: f"warning: {msg}\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown(parser, args, extra)
    one_line_warnings()
    try:
        return int(args._run(args) or 0)
    except OpscopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # `record` says what it kept: "kept 37 of 500 batches in t.parquet"
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return 130
