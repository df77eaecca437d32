"""Option groups shared by the commands, each defined once, so a flag means the same thing everywhere.

- `add_shape_arguments`: --shape / --dim (analyze, and every command that feeds a model);
- `add_feed_arguments`: the shapes plus --dist / --data / --range / --value / --seed / --batches;
- `add_runtime_arguments`: --provider / --fallback / --opt-level / --threads;
- `add_site_arguments`, `add_sketch_arguments`: which tensors to tap and what to measure;
- `add_output_argument`, `add_quiet_argument`: -o/--output and -q/--quiet.

Each `*_from_args` turns its group back into the Python API's value (FeedSpec, RuntimeConfig,
Selection, SketchOptions); string parse errors are one OpscopeError line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import onnxruntime as ort

from ..errors import OpscopeError
from ..instrument import PLACEMENTS
from ..run.engine import Engine
from ..run.feeds import DEFAULT_BATCH, DEFAULT_BATCHES, DEFAULT_DIM, DISTRIBUTIONS, FeedSpec, Scalar
from ..run.session import RuntimeConfig
from ..sites import SITE_KINDS, TAPPABLE_OPS, Selection
from ..sketch import ALL_SKETCHES, DEFAULT_SKETCHES, HIST_MODES, SketchOptions
from ..sketch import describe as describe_sketches


def csv_items(items: list[str] | None) -> tuple[str, ...]:
    """Repeatable, comma-separated values: ['a,b', 'c'] -> ('a', 'b', 'c')."""
    return tuple(t.strip() for item in items or [] for t in item.split(",") if t.strip())


# --------------------------------------------------------------------------------------------
# parsers of the option strings


def _split_name(text: str, sep: str, flag: str, form: str) -> tuple[str, str]:
    name, found, rest = text.rpartition(sep)
    if not found or not name:
        raise OpscopeError(f"{flag} {text!r}: expected {form}")
    return name, rest


def _int(token: str, text: str, flag: str, form: str) -> int:
    try:
        return int(token.strip())
    except ValueError:
        raise OpscopeError(
            f"{flag} {text!r}: {token.strip()!r} is not an integer (expected {form})"
        ) from None


def parse_shape(text: str, symbols: bool = False) -> tuple[str, list]:
    """'x:1,3,48,320' -> ('x', [1, 3, 48, 320]); split on the last ':' (names may hold ':'); 'sr:' is a
    scalar. With `symbols` a dim may stay a name ('ids:2,seq', for static analysis)."""
    form = "NAME:D0,D1,... e.g. x:1,3,224,224"
    name, rest = _split_name(text, ":", "--shape", form)
    dims: list = []
    for tok in (t.strip() for t in rest.split(",")) if rest.strip() else ():
        if symbols and tok and not tok.lstrip("-").isdigit():
            dims.append(tok)
            continue
        if not tok.lstrip("-").isdigit() and not symbols:
            raise OpscopeError(
                f"--shape {text!r}: {tok!r} is not a number; to run a model every dim needs a size",
                hint=f"give the size here, or set a symbol everywhere with --dim {tok or 'SYMBOL'}=N",
            )
        d = _int(tok, text, "--shape", form)
        if d < 1:
            raise OpscopeError(f"--shape {text!r}: dims must be positive integers (expected {form})")
        dims.append(d)
    return name, dims


def parse_dim(text: str) -> tuple[str, int]:
    """'batch=4' -> ('batch', 4)."""
    form = "SYMBOL=N e.g. batch=4"
    name, rest = _split_name(text, "=", "--dim", form)
    size = _int(rest, text, "--dim", form)
    if size < 1:
        raise OpscopeError(f"--dim {text!r}: the size must be a positive integer (expected {form})")
    return name.strip(), size


def parse_range(text: str) -> tuple[str, tuple[int, int]]:
    """'ids:0,100' -> ('ids', (0, 100)): integers in [0, 100), the high end excluded."""
    form = "NAME:LO,HI e.g. ids:0,30522 (HI excluded)"
    name, rest = _split_name(text, ":", "--range", form)
    parts = rest.split(",")
    if len(parts) != 2:
        raise OpscopeError(f"--range {text!r}: expected {form}")
    lo, hi = (_int(t, text, "--range", form) for t in parts)
    if hi <= lo:
        raise OpscopeError(f"--range {text!r}: LO must be below HI (HI is excluded)")
    return name, (lo, hi)


def _number(token: str, text: str) -> Scalar:
    t = token.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    raise OpscopeError(f"--value {text!r}: {t!r} is not a number (expected NAME:V or NAME:V0,V1,...)")


def parse_value(text: str) -> tuple[str, Scalar | list[Scalar]]:
    """'sr:16000' -> ('sr', 16000); 'scales:1,2.5' -> ('scales', [1, 2.5]) (a 1-D value)."""
    name, rest = _split_name(text, ":", "--value", "NAME:V or NAME:V0,V1,... e.g. sr:16000")
    if not rest.strip():
        raise OpscopeError(f"--value {text!r}: no value after ':' (expected NAME:V, e.g. sr:16000)")
    parts = [_number(t, text) for t in rest.split(",")]
    return (name, parts[0]) if len(parts) == 1 else (name, parts)


# --------------------------------------------------------------------------------------------
# shapes and feeds


def add_shape_arguments(g: argparse._ArgumentGroup, symbols: bool = False) -> None:
    """--shape and --dim, read back by `shapes_from_args`."""
    sym = " A dim may stay a symbol: ids:2,seq." if symbols else ""
    g.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME:D0,D1,...",
        help=f"the shape of one input, e.g. x:1,3,48,320 (repeatable).{sym} Unknown dims otherwise default "
        f"to {DEFAULT_BATCH} on axis 0 and {DEFAULT_DIM} elsewhere",
    )
    g.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="SYMBOL=N",
        help="the size of a symbolic dim in every input that uses it, e.g. batch=4 (repeatable, or comma-separated: "
        "batch=4,seq=128); unnamed dims are called INPUT_AXIS, e.g. x_0",
    )


def shapes_from_args(
    args: argparse.Namespace, symbols: bool = False
) -> tuple[dict[str, list], dict[str, int]]:
    shapes = dict(parse_shape(t, symbols) for t in args.shape or [])
    dims = dict(parse_dim(t) for t in csv_items(args.dim))
    return shapes, dims


def add_feed_arguments(parser: argparse.ArgumentParser) -> None:
    """The feed options shared by `record`, `parity`, `rewrite` and `analyze --profile`."""
    g = parser.add_argument_group(
        "feeds", "what to feed the model: seeded synthetic data (default) or --data"
    )
    g.add_argument(
        "--dist",
        default="gaussian",
        metavar="NAME",
        help=f"synthetic distribution for float inputs: {', '.join(DISTRIBUTIONS)} (default: gaussian)",
    )
    g.add_argument(
        "--data",
        metavar="PATH",
        help="real inputs instead: an .npz file, a folder of .npz (one batch each), a folder of <input>.npy, or a "
        "folder of batch folders such as onnxruntime's test_data_set_*/input_*.pb",
    )
    add_shape_arguments(g)
    g.add_argument(
        "--range",
        action="append",
        default=[],
        metavar="NAME:LO,HI",
        help="integer input drawn from [LO, HI), HI excluded, e.g. ids:0,30522 (repeatable). Default: the rows "
        "of the table the input indexes, else [0, 16)",
    )
    g.add_argument(
        "--value",
        action="append",
        default=[],
        metavar="NAME:V[,V...]",
        help="fixed value for an input, e.g. sr:16000; a single number fills the input's shape, a comma list is "
        "a 1-D value (repeatable; wins over everything, --data included)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the synthetic data; batch k uses (seed, k) (default: 0)",
    )
    g.add_argument(
        "--batches",
        type=int,
        default=None,
        metavar="N",
        help=f"number of batches (default: {DEFAULT_BATCHES} synthetic, or every batch of --data)",
    )


def feed_spec_from_args(args: argparse.Namespace) -> FeedSpec:
    shapes, dims = shapes_from_args(args)
    return FeedSpec(
        dist=args.dist,
        seed=args.seed,
        shapes=shapes,
        dims=dims,
        ranges=dict(parse_range(t) for t in args.range),
        values=dict(parse_value(t) for t in args.value),
        data=args.data,
        batches=args.batches,
    )


# --------------------------------------------------------------------------------------------
# runtime


def add_runtime_arguments(
    parser: argparse.ArgumentParser,
    what: str = "onnxruntime execution provider and session options",
    opt_level: str = "all",
) -> None:
    """The onnxruntime options shared by `record`, `parity`, `rewrite` and `inject`."""
    g = parser.add_argument_group("runtime", what)
    installed = ", ".join(p.removesuffix("ExecutionProvider").lower() for p in ort.get_available_providers())
    g.add_argument(
        "--provider",
        default="cpu",
        metavar="EP[,EP...]",
        help="execution providers in priority order, short or full names: cpu, cuda, tensorrt, coreml, dml, "
        f"openvino, rocm, migraphx, qnn, webgpu, ... (default: cpu; this install has: {installed})",
    )
    g.add_argument(
        "--fallback",
        action="store_true",
        help="drop unavailable providers with a warning (CPU is kept last) instead of failing",
    )
    g.add_argument(
        "--opt-level",
        default=opt_level,
        metavar="LEVEL",
        help=f"onnxruntime graph optimizations: all, extended, basic or disable (default: {opt_level}). Tapped "
        "tensors block some float fusions, so outputs may move by float rounding unless this is 'disable'",
    )
    g.add_argument(
        "--threads", type=int, default=None, metavar="N", help="intra-op threads (default: onnxruntime's)"
    )


def runtime_config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(
        providers=args.provider or "cpu",
        graph_opt=args.opt_level or "all",
        threads=args.threads,
        fallback=args.fallback,
    )


def add_engine_arguments(parser: argparse.ArgumentParser, what: str = "where the batches run") -> None:
    """Where the work runs: this process, or Ray workers (`run.engine`)."""
    g = parser.add_argument_group("engine", what)
    g.add_argument(
        "--engine",
        default="local",
        metavar="local|ray",
        help="local (default) or ray: batches sharded over Ray workers, one session each "
        "(pip install 'onnx-opscope[ray]'); the same rows either way",
    )
    g.add_argument("--address", default=None, metavar="ADDR",
                   help="the Ray cluster to join, e.g. auto or ray://head:10001 (default: start a local one)")  # fmt: skip
    g.add_argument("--workers", type=int, default=None, metavar="N",
                   help="Ray workers (default: one per CPU of the cluster)")  # fmt: skip


def engine_from_args(args: argparse.Namespace) -> Engine:
    if args.engine != "ray":
        given = [
            flag for flag, v in (("--address", args.address), ("--workers", args.workers)) if v is not None
        ]
        if given:
            raise OpscopeError(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --engine ray")
    return Engine(args.engine, args.address, args.workers)


# --------------------------------------------------------------------------------------------
# sites and sketches


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
        help=f"only these site kinds: {', '.join(SITE_KINDS)} (gemm: MatMul, Gemm, Conv, recurrent and quantized "
        "matmuls; attn: Softmax and fused attention; route: TopK/ArgMax routers; residual: Add of two activations)",
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
        help="only these roles: lhs, rhs, out (MatMul), a, b (Gemm), in, weight (Conv), x, w, r, y (LSTM/GRU/RNN), "
        "lhs_float, out_float (quantized), attn, route, residual_a, residual_b",
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


def selection_from_args(args: argparse.Namespace) -> Selection:
    return Selection(
        op_types=csv_items(args.op),
        names=tuple(args.name),
        roles=csv_items(args.role),
        min_numel=args.min_numel,
        max_sites=args.max_sites,
        kinds=csv_items(args.kind),
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
        f"{', '.join(n for n in ALL_SKETCHES if n not in DEFAULT_SKETCHES)}: +0.05 to +0.7x plain each on CPU, "
        "see BENCHMARKS.md and scripts/bench_floor.py --sketch-costs; the miner's sparse, outlier, heavy-tail and "
        "coherence rules need them)",
    )
    s.add_argument(
        "--hist-mode",
        choices=HIST_MODES,
        default="sampled",
        help="sampled: ~4096 elements in blocks spread over the tensor (cheap, the default); exact: every element "
        "(bin indices in the graph; counted in the graph, or on the host when `record` runs on CPU alone); "
        "host: copy the tensor out and bin it in numpy",
    )
    s.add_argument("--hist-bins", type=int, default=32, metavar="N", help="histogram bins (default 32)")
    s.add_argument(
        "--hist-range",
        default=None,
        metavar="LO,HI",
        help="fixed histogram range instead of x/max|x| over [-1, 1]",
    )
    s.add_argument(
        "--copy-out-max",
        type=int,
        default=None,
        metavar="N",
        help="tensors of at most N elements (at the first batch's shapes) come back whole and are sketched on "
        "the host, all of a batch's in one numpy pass: a tap's nodes cost ~40 us in the graph however small the "
        "tensor (default: 4096 on the CPU provider, off elsewhere; 0: never; at most 4096)",
    )
    s.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="producer",
        help="producer: each tap right after the node making its tensor, so it can be freed early (default); "
        "end: every tap after the original nodes",
    )


def sketches_from_args(args: argparse.Namespace) -> list[str] | None:
    return list(csv_items(args.sketch)) or None


def sketch_options_from_args(args: argparse.Namespace) -> SketchOptions:
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
            hist_mode=args.hist_mode,
            copy_out_max=getattr(args, "copy_out_max", None),
        )
    except ValueError as exc:
        raise OpscopeError(str(exc)) from None


def sketch_epilog() -> str:
    """Every sketch with its set, merge rule and measured cost, for the help of the commands that take --sketch."""
    rows = [f"  {name:<12} {group:<11} {cost}" for name, group, _, _, cost in describe_sketches()]
    return (
        "sketches (--sketch NAME, or a set: default, all; the site kinds' own come with their sites):\n"
        + "\n".join(rows)
    )


def add_tap_arguments(parser: argparse.ArgumentParser) -> None:
    """Which tensors to tap and what to measure on them (inject, record)."""
    add_site_arguments(parser)
    add_sketch_arguments(parser)


# --------------------------------------------------------------------------------------------
# output


def add_output_argument(
    parser: argparse.ArgumentParser, what: str, default: Path | None = None, required: bool = False
) -> None:
    """-o/--output FILE: the file the command writes (`what` says which)."""
    shown = f" (default: {default})" if default is not None else ""
    parser.add_argument(
        "-o", "--output", type=Path, default=default, required=required, metavar="FILE", help=f"{what}{shown}"
    )


DATA_FORMATS = ("table", "json", "csv", "parquet")
"""What a command that prints a table can also write: the table's text, or its rows as data."""


def add_format_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """--format for a command whose result is a table (`output_format` resolves it)."""
    parser.add_argument(
        "--format",
        choices=DATA_FORMATS,
        default=None,
        help=f"{what}: table for the terminal; json, csv, parquet: the data "
        "(default: -o FILE's suffix, .json, .csv or .parquet; else table)",
    )


def output_format(args: argparse.Namespace) -> str:
    """--format, else what -o FILE's suffix names (.parquet / .pq, .csv, .json), else the table: a file
    named .parquet never gets the terminal table's text."""
    if args.format:
        return args.format
    suffix = args.output.suffix.lower().lstrip(".") if args.output is not None else ""
    suffix = "parquet" if suffix == "pq" else suffix
    return suffix if suffix in DATA_FORMATS[1:] else "table"


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print nothing but errors (no progress, no summary): for scripts",
    )
