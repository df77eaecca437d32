"""Option groups shared by the commands that tap a model (inject, record, parity), spelled once."""

from __future__ import annotations

import argparse
import warnings

from ..errors import OpscopeError
from ..inference_taps import SITE_KINDS
from ..inject import PLACEMENTS
from ..sites import TAPPABLE_OPS, Selection
from ..sketches import ALL_SKETCHES, DEFAULT_SKETCHES, HIST_MODES, SketchOptions


def _csv(items: list[str]) -> tuple[str, ...]:
    return tuple(t.strip() for item in items for t in item.split(",") if t.strip())


def add_tap_arguments(parser: argparse.ArgumentParser) -> None:
    """--op/--name/--role/--min-numel/--max-sites (which tensors) and --sketch/--hist-* (what to measure)."""
    add_site_arguments(parser)
    add_sketch_arguments(parser)


def add_site_arguments(parser: argparse.ArgumentParser, title: str = "which tensors to tap") -> None:
    """--op/--kind/--name/--role/--min-numel/--max-sites, read back by `selection_from_args`."""
    g = parser.add_argument_group("sites", f"{title} (default: every site, subgraphs included)")
    g.add_argument(
        "--op",
        action="append",
        default=[],
        metavar="OP[,OP]",
        help=f"only these op types: {', '.join(TAPPABLE_OPS)}",
    )
    g.add_argument(
        "--kind",
        action="append",
        default=[],
        metavar="KIND[,KIND]",
        help=f"only these site kinds: {', '.join(SITE_KINDS)} (gemm: MatMul, Gemm, Conv, recurrent and "
        "quantized matmuls; attn: Softmax and fused attention; route: TopK/ArgMax routers; residual: Add of "
        "two activations)",
    )
    g.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="GLOB",
        help="only sites whose node name or site id matches, e.g. 'encoder/*/MatMul*' (repeatable)",
    )
    g.add_argument(
        "--role",
        action="append",
        default=[],
        metavar="ROLE[,ROLE]",
        help="only these roles: lhs, rhs, out (MatMul), a, b (Gemm), in, weight (Conv), x, w, r, y "
        "(LSTM/GRU/RNN), lhs_float, out_float (quantized)",
    )
    g.add_argument(
        "--min-numel",
        type=int,
        default=0,
        metavar="N",
        help="skip tensors known to hold fewer than N elements",
    )
    g.add_argument(
        "--max-sites", type=int, default=None, metavar="N", help="keep the first N sites in execution order"
    )


def add_sketch_arguments(parser: argparse.ArgumentParser) -> None:
    """--sketch/--hist-*/--placement, read back by `sketches_from_args` and `sketch_options_from_args`."""
    s = parser.add_argument_group("sketches", "what to measure on each tapped tensor")
    s.add_argument(
        "--sketch",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help=f"sketches to compute, or a set: 'default' ({', '.join(DEFAULT_SKETCHES)}) or 'all' (adds "
        f"{', '.join(n for n in ALL_SKETCHES if n not in DEFAULT_SKETCHES)}: +0.05 to +0.5x plain each on "
        "CPU, see BENCHMARKS.md; the miner's sparse, outlier, heavy-tail and coherence rules need them)",
    )
    s.add_argument(
        "--hist-mode",
        choices=HIST_MODES,
        default=None,
        help="sampled: histogram of ~4096 elements in evenly spaced whole rows (cheap, the default); "
        "exact: every element (bin indices in the graph; counted in the graph, or on the host when "
        "`record` runs on CPU alone); host: copy the tensor out and bin it in numpy",
    )
    s.add_argument("--hist-bins", type=int, default=32, metavar="N", help="histogram bins (default 32)")
    s.add_argument(
        "--hist-range",
        default=None,
        metavar="LO,HI",
        help="fixed histogram range instead of x/max|x| over [-1, 1]",
    )
    s.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="producer",
        help="producer: each tap right after the node making its tensor, so it can be freed early "
        "(default); end: every tap after the original nodes",
    )


def selection_from_args(args: argparse.Namespace) -> Selection:
    return Selection(
        op_types=_csv(args.op),
        names=tuple(args.name),
        roles=_csv(args.role),
        min_numel=args.min_numel,
        max_sites=args.max_sites,
        kinds=_csv(getattr(args, "kind", [])),
    )


def sketch_options_from_args(args: argparse.Namespace, provider: str = "cpu") -> SketchOptions:
    hist_range = None
    if args.hist_range:
        try:
            lo, hi = (float(v) for v in args.hist_range.split(","))
        except ValueError:
            raise OpscopeError(f"--hist-range {args.hist_range!r}: expected LO,HI, e.g. -8,8") from None
        hist_range = (lo, hi)
    if args.hist_bins < 1:
        raise OpscopeError(f"--hist-bins {args.hist_bins}: expected at least 1")
    try:
        return SketchOptions(
            hist_bins=args.hist_bins,
            hist_range=hist_range,
            hist_mode=args.hist_mode or default_hist_mode(provider),
        )
    except ValueError as exc:
        raise OpscopeError(str(exc)) from None


def default_hist_mode(provider: str) -> str:
    """Sampled everywhere: measured cheapest on CPU (see README); no GPU was measured to justify otherwise."""
    return "sampled"


def sketches_from_args(args: argparse.Namespace) -> list[str] | None:
    return list(_csv(args.sketch)) or None


def one_line_warnings() -> None:
    """Warnings (e.g. provider fallback) as one 'warning: ...' line, never a source excerpt."""
    warnings.formatwarning = lambda msg, *a, **k: f"warning: {msg}\n"
