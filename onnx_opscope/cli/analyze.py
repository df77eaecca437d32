"""`opscope analyze`: static per-op cost, roofline and roll-ups of a model (`onnx_opscope.analyze`); with
`--motifs`, its repeated chains and cones instead (`onnx_opscope.find_motifs`); with `--profile`, measured
time per node on the provider and optimization level given, against the measured roofline
(`onnx_opscope.profile_nodes`); with `--decoder`, a decoder's prefill and decode step per token
(`analysis.decoder.per_token`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from ..analysis import DEVICES, Motifs, Report, analyze
from ..analysis.decoder import DEFAULT_PAST, DEFAULT_SEQ, TokenCosts, per_token, print_token_costs
from ..analysis.motifs import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_LEN,
    DEFAULT_MIN_COUNT,
    DEFAULT_MIN_LEN,
    find_motifs,
    print_motifs,
)
from ..errors import OpscopeError
from ..files import atomic_path, check_writable
from ..run.session import resolve_providers
from .options import (
    add_format_argument,
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    add_shape_arguments,
    output_format,
    runtime_config_from_args,
    shapes_from_args,
)

EPILOG = """examples:
  opscope analyze model.onnx                                  # symbols stay symbols
  opscope analyze model.onnx --dim batch=4 --dim seq=128      # give input symbols values
  opscope analyze model.onnx --shape x:1,3,224,224 --device h100 --top 20
  opscope analyze model.onnx --format json -o costs.json      # for `opscope mine/report --costs`
  opscope analyze model.onnx --profile --shape x:1,3,640,640  # + measured time per node, op kind, verdicts
  opscope analyze model.onnx --profile --opt-level disable --provider cuda --roofline-plot roof.png
  opscope analyze lm.onnx --profile --regions --dim batch=1 --dim seq=64  # + attention / MLP time by skipping
  opscope analyze model.onnx --motifs                         # repeated chains and cones (fusion candidates)
  opscope analyze model.onnx --motifs --format parquet -o motifs.parquet
  opscope analyze lm.onnx --decoder --seq 512 --past 1024     # prefill vs decode step per token, KV bytes
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "analyze",
        help="where the work of a model goes, without running it",
        description="Per-op FLOPs, bytes (weights / graph I/O / intermediates), arithmetic intensity and roofline "
        "class, with roll-ups by op kind, GEMM shape, traffic, boundedness and fusion. Symbolic dims stay symbols "
        "(costs become expressions) unless --shape / --dim give them values. External weights are never read.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="path to an .onnx file")
    add_shape_arguments(p.add_argument_group("shapes", "input shapes and symbol values"), symbols=True)
    p.add_argument("--device", default="cpu", help=f"roofline preset: {', '.join(DEVICES)} (default cpu)")
    p.add_argument("--ridge", type=float, metavar="FLOP_PER_BYTE", help="override the device's ridge point")
    p.add_argument(
        "--top", type=int, default=15, metavar="N", help="rows in the top-ops, GEMM and motif tables"
    )
    add_format_argument(p, "the report")
    add_output_argument(p, "write to FILE instead of stdout")
    add_quiet_argument(p)
    add_profile_arguments(p)
    add_motif_arguments(p)
    add_decoder_arguments(p)
    p.add_argument(
        "--no-symbolic",
        action="store_true",
        help="skip onnxruntime's symbolic shape inference (onnx inference + fallback only)",
    )
    return p


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """--profile and its knobs (`profile_nodes`'s arguments), with the shared runtime group."""
    g = p.add_argument_group("measured time (--profile)")
    g.add_argument(
        "--profile",
        action="store_true",
        help="also run the model with a seeded synthetic feed under onnxruntime's profiler: time per node (fused "
        "kernels mapped back to the nodes they replaced), per op kind and region, against a measured roofline",
    )
    g.add_argument("--runs", type=int, default=3, help="profiled runs after one warm-up (default 3)")
    g.add_argument(
        "--regions",
        action="store_true",
        help="with --profile: also time the model with its attention blocks, its MLP blocks and both skipped "
        "(the skip rewrite): attention, MLP, other time and the slack",
    )
    g.add_argument(
        "--roofline-plot",
        type=Path,
        metavar="PNG",
        help="with --profile: draw the measured nodes on the measured roofline to this PNG",
    )
    add_runtime_arguments(p, "onnxruntime options of --profile (the provider and level you ship with)")


def add_motif_arguments(p: argparse.ArgumentParser) -> None:
    """--motifs and its knobs (`find_motifs`'s arguments)."""
    g = p.add_argument_group("repeated sub-graphs (--motifs)")
    g.add_argument(
        "--motifs",
        action="store_true",
        help="show the repeated chains (op n-grams along single-consumer paths) and dataflow cones (input "
        "trees), with hints and FLOP / byte shares, instead of the per-op costs",
    )
    g.add_argument(
        "--motif-min-len", type=int, default=DEFAULT_MIN_LEN, metavar="N", help="shortest chain (default 2)"
    )
    g.add_argument(
        "--motif-max-len", type=int, default=DEFAULT_MAX_LEN, metavar="N", help="longest chain (default 6)"
    )
    g.add_argument(
        "--motif-min-count",
        type=int,
        default=DEFAULT_MIN_COUNT,
        metavar="N",
        help="keep patterns seen at least N times (default 2)",
    )
    g.add_argument(
        "--cone-depth",
        type=int,
        default=DEFAULT_MAX_DEPTH,
        metavar="D",
        help="cones of depth 2..D (default 6)",
    )


def add_decoder_arguments(p: argparse.ArgumentParser) -> None:
    """--decoder and the lengths it prices (`per_token`'s arguments)."""
    g = p.add_argument_group("decoder per token (--decoder)")
    g.add_argument(
        "--decoder",
        action="store_true",
        help="price a KV-cache decoder's two phases instead: the prefill as a polynomial in its length and a "
        "decode step in the past's, per token, with the KV-cache bytes per token and each phase's roofline class",
    )
    g.add_argument("--seq", type=int, metavar="N", help=f"prefill length (default {DEFAULT_SEQ})")
    g.add_argument(
        "--past", type=int, metavar="N", help=f"cached positions of the decode step (default {DEFAULT_PAST})"
    )
    g.add_argument("--batch", type=int, metavar="N", help="sequences per step (default 1)")


def run(args: argparse.Namespace) -> int:
    args.format = output_format(args)
    if args.format == "parquet" and not args.output:
        raise OpscopeError("--format parquet needs -o FILE")
    if args.decoder:
        return _decoder(args)
    lengths = [
        f for f, v in (("--seq", args.seq), ("--past", args.past), ("--batch", args.batch)) if v is not None
    ]
    if lengths:
        raise OpscopeError(f"the decoder lengths {', '.join(lengths)} need --decoder")
    if args.motifs and args.profile:
        raise OpscopeError("--motifs and --profile are separate views", hint="run the command once for each")
    given = {
        "--regions": args.regions, "--roofline-plot": args.roofline_plot, "--provider": args.provider != "cpu",
        "--opt-level": args.opt_level != "all", "--threads": args.threads is not None, "--fallback": args.fallback,
    }  # fmt: skip
    needs = [flag for flag, on in given.items() if on]
    if needs and not args.profile:
        raise OpscopeError(f"{', '.join(needs)} only apply to measured runs: add --profile")
    runtime = runtime_config_from_args(args)  # checks the provider and level before any work
    if args.profile:
        resolve_providers(runtime.providers, fallback=runtime.fallback)
    if args.roofline_plot:
        check_writable(args.roofline_plot, inputs=[args.model])
    if args.output:
        check_writable(args.output, inputs=[args.model])
    shapes, dims = shapes_from_args(args, symbols=True)
    if args.motifs:
        return _motifs(args, shapes, dims)
    report = analyze(
        args.model,
        shapes,
        dims,
        device=args.device,
        ridge=args.ridge,
        symbolic=False if args.no_symbolic else "auto",
        profile=args.profile,
        profile_runs=args.runs,
        runtime=runtime,
        regions=args.regions,
    )
    if args.roofline_plot:
        _write_plot(args.roofline_plot, report.node_profile, args.quiet)
    if args.format == "table":
        from ..analysis.table import print_report

        return _emit(args, report, _with_profile(print_report) if args.profile else print_report)
    return _emit(args, report, None)


def _with_profile(print_report: Callable[..., None]) -> Callable[..., None]:
    """The cost tables, then the measured profile's."""
    from ..analysis.profile_table import print_profile

    def both(report: Report, top: int, file=None) -> None:
        print_report(report, top=top, file=file)
        print_profile(report.node_profile, top=top, file=file)

    return both


def _write_plot(path: Path, prof, quiet: bool) -> None:
    from ..reporting.plots import Missing, plot_measured_roofline

    plot = plot_measured_roofline(prof)
    if isinstance(plot, Missing):
        raise OpscopeError(f"--roofline-plot: {plot.reason}")
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(plot.png)
    if not quiet:
        print(f"wrote {path}", file=sys.stderr)


def _motifs(args: argparse.Namespace, shapes: dict, dims: dict) -> int:
    motifs = find_motifs(
        args.model,
        shapes,
        dims,
        min_len=args.motif_min_len,
        max_len=args.motif_max_len,
        min_count=args.motif_min_count,
        max_depth=args.cone_depth,
        symbolic=False if args.no_symbolic else "auto",
    )
    return _emit(args, motifs, print_motifs)


def _decoder(args: argparse.Namespace) -> int:
    others = [
        f for f, on in (("--motifs", args.motifs), ("--profile", args.profile), ("--shape", args.shape)) if on
    ]
    if others:
        raise OpscopeError(
            f"--decoder sets the input shapes itself and is a view of its own: drop {', '.join(others)}",
            hint="--seq / --past / --batch give the lengths, --dim any other symbol",
        )
    if args.output:
        check_writable(args.output, inputs=[args.model])
    _, dims = shapes_from_args(args, symbols=True)
    lengths = {
        k: v for k, v in (("seq", args.seq), ("past", args.past), ("batch", args.batch)) if v is not None
    }
    costs = per_token(
        args.model, **lengths, dims=dims, device=args.device, ridge=args.ridge, symbolic=not args.no_symbolic
    )
    return _emit(args, costs, lambda c, top, file=None: print_token_costs(c, file=file))


def _emit(
    args: argparse.Namespace, result: Report | Motifs | TokenCosts, print_table: Callable[..., None] | None
) -> int:
    """The result (a cost Report, Motifs or TokenCosts) as --format asks, to -o FILE or stdout."""
    if args.format == "table":
        if args.output:
            with atomic_path(args.output) as tmp, open(tmp, "w") as f:
                print_table(result, top=args.top, file=f)
        elif not args.quiet:
            print_table(result, top=args.top)
    elif args.output:
        result.write(args.output, args.format)
    elif args.format == "json":
        sys.stdout.write(result.to_json() + "\n")
    else:  # csv to stdout
        import pyarrow as pa
        import pyarrow.csv as pacsv

        sink = pa.BufferOutputStream()
        pacsv.write_csv(result.to_arrow(), sink)
        sys.stdout.write(sink.getvalue().to_pybytes().decode())
    if args.output and not args.quiet:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
