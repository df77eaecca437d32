"""`opscope analyze`: static per-op cost, roofline and roll-ups of a model (optionally profiled).

Thin: parse the options, call `onnx_opscope.costs.analyze`, print. The `--shape` / `--dim`
parsers live in `onnx_opscope.shapes` for now (parse_shape_args, parse_dim_args) so that
other commands can share them until a common options module exists.
"""

from __future__ import annotations

import argparse
import sys

from ..costs import analyze
from ..errors import OpscopeError
from ..roofline import DEVICES
from ..shapes import parse_dim_args, parse_shape_args

FORMATS = ("table", "json", "csv", "parquet")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "analyze",
        help="where the work of a model goes, without running it",
        description="Per-op FLOPs, bytes (weights / graph I/O / intermediates), arithmetic intensity and "
        "roofline class, with roll-ups by op kind, GEMM shape, traffic, boundedness and fusion. Symbolic "
        "dims stay symbols (costs become expressions) unless --shape / --dim give them values.",
    )
    p.add_argument("model", help="path to an .onnx file (external weights are never read)")
    p.add_argument(
        "--shape",
        action="append",
        metavar="NAME:D0,D1,...",
        help="fix an input's shape, e.g. x:1,3,224,224 (repeatable)",
    )
    p.add_argument(
        "--dim",
        action="append",
        metavar="SYMBOL=VALUE",
        help="fix a symbolic input dim everywhere, e.g. batch=4 (repeatable); unnamed dims are "
        "called INPUT_AXIS, e.g. x_0",
    )
    p.add_argument("--device", default="cpu", help=f"roofline preset: {', '.join(DEVICES)} (default cpu)")
    p.add_argument("--ridge", type=float, metavar="FLOP_PER_BYTE", help="override the device's ridge point")
    p.add_argument("--top", type=int, default=15, metavar="N", help="rows in the top-ops and GEMM tables")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also run the model on onnxruntime CPU with a seeded synthetic feed and show "
        "measured time share per op kind",
    )
    p.add_argument("--runs", type=int, default=3, help="profiled runs after one warm-up (default 3)")
    p.add_argument(
        "--no-symbolic",
        action="store_true",
        help="skip onnxruntime's symbolic shape inference (onnx inference + fallback only)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    if args.format == "parquet" and not args.output:
        raise OpscopeError("--format parquet needs -o FILE")
    report = analyze(
        args.model,
        parse_shape_args(args.shape),
        parse_dim_args(args.dim),
        device=args.device,
        ridge=args.ridge,
        symbolic=False if args.no_symbolic else "auto",
        profile=args.profile,
        profile_runs=args.runs,
    )
    if args.format == "table":
        from ..costs_table import print_report

        if args.output:
            with open(args.output, "w") as f:
                print_report(report, top=args.top, file=f)
        else:
            print_report(report, top=args.top)
    elif args.output:
        report.write(args.output, args.format)
    elif args.format == "json":
        sys.stdout.write(report.to_json() + "\n")
    else:  # csv to stdout
        import pyarrow as pa
        import pyarrow.csv as pacsv

        sink = pa.BufferOutputStream()
        pacsv.write_csv(report.to_arrow(), sink)
        sys.stdout.write(sink.getvalue().to_pybytes().decode())
    return 0
