"""`opscope parity`: original vs rewritten model, or one model on two execution providers.

Thin: parse, call `onnx_opscope.parity`, print the report. Exit 0
when every output is within --tol, 1 when not, 2 on a user error (bad file, unknown provider).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compare import DEFAULT_TOL
from ..files import check_writable, write_text
from ..run import parity
from .options import (
    add_feed_arguments,
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    add_site_arguments,
    feed_spec_from_args,
    runtime_config_from_args,
    selection_from_args,
)

EPILOG = """examples:
  opscope parity model.onnx fq.onnx --shape x:1,3,48,320 --tol 0.05   # original vs rewrite
  opscope parity model.onnx --providers cpu,cuda                      # provider vs provider
  opscope parity model.onnx skip.onnx -o parity.json --no-layers
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "parity",
        help="compare a model with its rewrite, or one model on two execution providers, layer by layer",
        description="Run both sides on the same feeds; compare the outputs (max abs, max rel = max|a-b| / "
        "max|a|, cosine, top-1 agreement when an output looks like logits) and, through the same in-graph "
        "sketches on both sides (constant memory), name the first site in execution order whose "
        "statistics diverge beyond the layer tolerance.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="the reference .onnx model (A)")
    p.add_argument(
        "other", type=Path, nargs="?", help="the model to compare with A (B), e.g. a rewrite of it"
    )
    p.add_argument(
        "--providers",
        metavar="EP,EP",
        help="instead of B: run A on these two execution providers, the first as the reference",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=DEFAULT_TOL,
        help=f"max relative error allowed on every output (default {DEFAULT_TOL:g})",
    )
    p.add_argument(
        "--layer-tol", type=float, default=None, help="divergence allowed per statistic (default: --tol)"
    )
    p.add_argument("--no-layers", action="store_true", help="compare the outputs only")
    add_output_argument(p, "also write the report as JSON")
    add_quiet_argument(p)
    add_site_arguments(p, "which sites the layer-wise comparison taps")
    add_feed_arguments(p)
    add_runtime_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    if args.output:
        check_writable(args.output, inputs=[args.model, args.other])
    report = parity(
        args.model,
        args.other,
        providers=args.providers,
        feeds=feed_spec_from_args(args),
        runtime=runtime_config_from_args(args),
        tol=args.tol,
        layer_tol=args.layer_tol,
        selection=selection_from_args(args),
        layers=not args.no_layers,
    )
    if not args.quiet:
        print(report.format())
    if args.output:
        write_text(args.output, report.to_json())
    return 0 if report.passed else 1
