"""`opscope` entry point: dispatch to onnx_opscope.commands.<name>, turn user errors into one line."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .commands import COMMANDS
from .errors import OpscopeError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opscope",
        description="Static cost, recorded tensor sketches and exploitable patterns for ONNX models, "
        "on any onnxruntime execution provider.",
        epilog="Run `opscope COMMAND --help` for the options of one command; `opscope demo` shows the "
        "whole loop on a bundled model.",
    )
    parser.add_argument("--version", action="version", version=f"onnx-opscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f".commands.{name}", __package__)
        cmd = module.add_parser(sub)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except OpscopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
