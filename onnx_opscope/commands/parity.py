"""`opscope parity`: original vs rewritten model, or one model on two execution providers.

Thin: parse, call `parity.parity_models` / `parity.parity_providers`, print the report. Exit 0
when every output is within --tol, 1 when not, 2 on a user error (bad file, unknown provider).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data import add_feed_arguments, feed_spec_from_args
from ..errors import OpscopeError
from ..parity import DEFAULT_TOL, parity_models, parity_providers
from ..runtime import add_runtime_arguments, runtime_config_from_args
from .options import add_site_arguments, selection_from_args

EPILOG = """examples:
  opscope parity model.onnx fq.onnx --shape x:1,3,48,320 --tol 0.05   # original vs rewrite
  opscope parity model.onnx --providers cpu,cuda                      # provider vs provider
  opscope parity model.onnx skip.onnx --json parity.json --no-layers
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
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the report as JSON")
    add_site_arguments(p, "which sites the layer-wise comparison taps")
    add_feed_arguments(p)
    add_runtime_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    if (args.other is None) == (args.providers is None):
        raise OpscopeError(
            "give either a second model to compare with, or --providers EP,EP (not both)",
            hint="opscope parity A.onnx B.onnx  |  opscope parity A.onnx --providers cpu,cuda",
        )
    sel = selection_from_args(args)
    feeds, runtime = feed_spec_from_args(args), runtime_config_from_args(args)
    common = dict(tol=args.tol, layer_tol=args.layer_tol, selection=sel, layers=not args.no_layers)
    if args.providers is not None:
        report = parity_providers(args.model, args.providers, feeds, runtime, **common)
    else:
        report = parity_models(args.model, args.other, feeds, runtime, **common)
    print(report.format())
    if args.json:
        args.json.write_text(report.to_json())
    return 0 if report.passed else 1
