"""`opscope report`: the findings of a sketch table with plots, as self-contained HTML or Markdown.

Thin: parse the options, call `onnx_opscope.report.write_report`, print where it went.
"""

from __future__ import annotations

import argparse

from ..mine import config_with
from ..report import write_report


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="HTML or Markdown report of a sketch table's findings, with plots",
        description="Ranked findings, their signals, a histogram heatmap, per-channel max|x| of the top "
        "outlier sites, density and score per site, and a roofline scatter when --costs gives the analyzer's "
        "per-op costs. HTML is one self-contained file (images embedded, nothing fetched); Markdown writes "
        "its PNGs to <stem>_files/ beside it.",
    )
    p.add_argument("table", help="sketch table written by `opscope record` (.parquet or .csv)")
    p.add_argument("-o", "--output", default="report.html", metavar="FILE",
                   help="report path, .html or .md (default report.html)")  # fmt: skip
    p.add_argument(
        "--findings", metavar="FILE", help="findings saved by `opscope mine --json` (default: mine now)"
    )
    p.add_argument("--costs", metavar="FILE",
                   help="`opscope analyze` output (.json/.csv/.parquet) for FLOP shares and the roofline; "
                   "default: the table's own .sites.csv")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change a threshold when mining now, e.g. density_max=0.4 (repeatable)")  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    path = write_report(
        args.table, args.findings, args.output, costs=args.costs, config=config_with(overrides=args.set)
    )
    print(f"wrote {path}")
    return 0
