"""`opscope report`: the findings of a sketch table with plots, as HTML or Markdown (`onnx_opscope.report`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis import DEVICES
from ..files import check_writable
from ..findings import config_with
from ..reporting import report
from .mine import set_epilog
from .options import add_output_argument, add_quiet_argument

EPILOG = """examples:
  opscope report sketches.parquet -o report.html
  opscope report sketches.parquet --findings findings.json --costs costs.json -o report.html
  opscope report sketches.parquet -o report.md        # PNGs go to report_files/
  opscope report sketches.parquet --all --device h100 # every tensor; the roofline of an H100
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="HTML or Markdown report of a sketch table's findings, with plots",
        description="A summary of what to do next (the three actions with the largest estimated saving, each "
        "with the command that checks or applies it), the findings ranked by impact (the non-actionable ones "
        "counted, --all lists them), sections for attention, experts and residual blocks when the table has "
        "them, a histogram heatmap, per-channel max|x| of the top outlier sites, the findings by impact and a "
        "roofline (attainable FLOP/s against FLOP/byte; symbolic or missing costs are evaluated at the "
        "recorded shapes). HTML is one self-contained file (images embedded, nothing fetched); Markdown writes "
        "its PNGs to <stem>_files/ beside it.",
        epilog=EPILOG + "\n" + set_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("table", help="sketch table written by `opscope record` (.parquet or .csv)")
    add_output_argument(p, "the report, .html or .md", default=Path("report.html"))
    p.add_argument(
        "--findings", metavar="FILE", help="findings saved by `opscope mine -o` (default: mine now)"
    )
    p.add_argument("--costs", metavar="FILE",
                   help="`opscope analyze` output (.json/.csv/.parquet) for FLOP shares and the roofline; "
                   "default: the table's own .sites.csv")  # fmt: skip
    p.add_argument("--weights", metavar="PLAN.json",
                   help="add the weights section: the plan JSON of `opscope weights --plan`")  # fmt: skip
    p.add_argument("--all", action="store_true", dest="show_all",
                   help="also list the dense, too-small and nothing-to-do findings (hidden by default, counted)")  # fmt: skip
    p.add_argument("--device", choices=sorted(DEVICES), default=None,
                   help="the roofline's device preset (default: the one --costs was analyzed for, else cpu)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change a threshold when mining now, e.g. density_max=0.4 (repeatable; listed below)")  # fmt: skip
    add_quiet_argument(p)
    return p


def run(args: argparse.Namespace) -> int:
    check_writable(args.output, inputs=[args.table, args.findings, args.costs, args.weights])
    path = report(
        args.table,
        args.output,
        findings=args.findings,
        costs=args.costs,
        config=config_with(overrides=args.set),
        weights=args.weights,
        show_all=args.show_all,
        device=args.device,
    )
    if not args.quiet:
        print(f"wrote {path}")
    return 0
