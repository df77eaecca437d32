"""`opscope record`: run batches through the tapped model and write the sketch table."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..errors import OpscopeError
from ..run import record
from .options import (
    add_engine_arguments,
    add_feed_arguments,
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    add_tap_arguments,
    engine_from_args,
    feed_spec_from_args,
    runtime_config_from_args,
    selection_from_args,
    sketch_epilog,
    sketch_options_from_args,
    sketches_from_args,
)

EPILOG = """\
exit codes: 0 done, 2 bad input (file, option, feed, provider, unwritable output), 3 parity gate
failed, 130 interrupted (Ctrl-C or kill: the finished batches are kept, and run.json says so).

examples:
  opscope record model.onnx -o run.parquet
  opscope record model.onnx --dist sparse90 --batches 8 --op MatMul -o sparse.parquet
  opscope record ppocrv4_rec.onnx --shape x:1,3,48,320 --provider cuda,cpu -o rec.parquet
  opscope record silero_vad.onnx --shape input:1,512 --shape state:2,1,128 --value sr:16000 -o vad.csv
  opscope record model.onnx --data batches/ -o real.parquet      # .npz / .npy / test_data_set_*

The table is tidy (one row per sketch element): run_id, step, provider, dist, M, K, N, numel,
site, op_type, role, stat, idx, value.  A .parquet table is a folder of one part per batch
(plus _SUCCESS when the run finished), readable at any moment, a killed run's too:
pandas.read_parquet(path), polars.read_parquet(path), DuckDB read_parquet('path/*.parquet'),
onnx_opscope.read_table(path). A run that fails before its first batch leaves an earlier table
at the path as it was.
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "record",
        help="record sketches of the hot tensors over batches of synthetic or real data",
        description="Inject sketches, check on the first batch that the model's own outputs did not move "
        "(parity gate), run every batch on the chosen execution provider and append the decoded "
        "sketches to a tidy table, batch by batch. Beside the table: <stem>.sites.csv (site, M, K, N, "
        "flops) and <stem>.run.json (providers, optimization level, threads, feeds, parity).",
        epilog=EPILOG + "\n" + sketch_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="the .onnx model")
    add_output_argument(p, "the table to write: .parquet or .csv", default=Path("sketches.parquet"))
    p.add_argument(
        "--format", choices=["parquet", "csv"], default=None, help="override the format the suffix implies"
    )
    p.add_argument(
        "--run-id", default=None, help="label of this run in the table (default: model name + time)"
    )
    p.add_argument("--no-parity", action="store_true", help="skip the parity gate on the first batch")
    p.add_argument(
        "--parity-tol",
        default=None,
        metavar="RTOL[,ATOL]",
        help="parity tolerance (default: exact with --opt-level disable, else 1e-3,1e-4)",
    )
    p.add_argument(
        "--no-weight-cache",
        action="store_true",
        help="sketch the weights afresh, without reading or writing the weight cache "
        "($OPSCOPE_CACHE_DIR, default ~/.cache/onnx-opscope; OPSCOPE_CACHE_DIR=off turns it off)",
    )
    p.add_argument(
        "--online",
        action="store_true",
        help="also write <stem>.online.json: per site and role a KLL of the sampled values and an HLL of "
        "the elemsig fingerprints, mergeable across runs (onnx_opscope.sketch.online.read_online)",
    )
    add_quiet_argument(p)
    add_feed_arguments(p)
    add_runtime_arguments(p)
    add_engine_arguments(p)
    add_tap_arguments(p)
    return p


def parse_tol(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    try:
        parts = [float(v) for v in text.split(",")]
    except ValueError:
        raise OpscopeError(f"--parity-tol {text!r}: expected RTOL or RTOL,ATOL, e.g. 1e-3,1e-5") from None
    return (parts[0], parts[1] if len(parts) > 1 else 0.0)


def _sigterm_as_interrupt() -> None:
    """A `kill` (SIGTERM) ends the run like Ctrl-C: it says what it kept, and run.json that it was interrupted."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run(args: argparse.Namespace) -> int:
    _sigterm_as_interrupt()
    runtime = runtime_config_from_args(args)
    feeds = feed_spec_from_args(args)
    console = Console(stderr=True, quiet=args.quiet)
    columns = [
        TextColumn("recording"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=True, disable=args.quiet) as bar:
        task = bar.add_task("record", total=None)

        def progress(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        result = record(
            args.model,
            out=args.output,
            feeds=feeds,
            runtime=runtime,
            sites=selection_from_args(args),
            sketches=sketches_from_args(args),
            options=sketch_options_from_args(args),
            placement=args.placement,
            fmt=args.format,
            run_id=args.run_id,
            parity=not args.no_parity,
            parity_tol=parse_tol(args.parity_tol),
            progress=progress,
            engine=engine_from_args(args),
            weight_cache=not args.no_weight_cache,
            online=args.online,
        )
    if not args.quiet:
        par = result.parity
        gate = "skipped" if par is None else f"ok (max rel {par.max_rel:.2g} on {par.worst_output!r})"
        print(
            f"{result.table}: {result.rows} rows, {result.batches} batches, {len(result.manifest.sites)} sites "
            f"on {', '.join(result.runtime['providers'])} in {result.seconds:.1f}s; parity {gate}"
        )
        print(f"sites: {result.sites}\nrun: {result.run}", file=sys.stdout)
        if result.online is not None:
            print(f"online: {result.online}")
    return 0
