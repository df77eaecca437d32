"""`opscope zoo`: the static costs of every model of a folder or a list (and, asked, a short recording of
each), one task per model, in one table with a per-model status (`onnx_opscope.analysis.survey`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..analysis.survey import ZOO_BATCHES, SurveyResult, model_paths, survey
from ..analysis.table import si
from ..errors import OpscopeError
from ..files import atomic_path, check_writable
from .options import (
    add_engine_arguments,
    add_feed_arguments,
    add_format_argument,
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    engine_from_args,
    feed_spec_from_args,
    output_format,
    runtime_config_from_args,
)

EPILOG = f"""\
exit codes: 0 every model ok, 1 some models failed (each failed row says why; the table is still
printed or written), 2 bad input (no model in the folder, a list file that does not exist, a bad
option, an unwritable output), 130 interrupted.

examples:
  opscope zoo models/                                   # every *.onnx under models/, recursively
  opscope zoo zoo.txt -o zoo.parquet                    # one path a line, # comments, relative to zoo.txt
  opscope zoo models/ --dim batch=1 --format csv        # symbols given values: FLOPs are numbers
  opscope zoo models/ --record --record-dir runs/       # + {ZOO_BATCHES} synthetic batches recorded per model
  opscope zoo models/ --record --engine ray --workers 8 # one Ray task per model (a local Ray unless --address)

Columns: model, status (ok/failed), error, sha256, nodes, op_kinds, flops (null while it depends on
a symbol; flops_expr has the expression), bytes, intensity, params, weight_bytes, symbols, top_ops,
warnings, seconds; with --record: record_table, record_rows, record_batches, record_sites,
record_seconds. --dim/--shape apply to the analysis and to the recording of every model that has
that symbol or input, and leave the others alone (a name no model has is a warning); a --shape that
does not fit a model's input fails that model. --batches defaults to {ZOO_BATCHES} here. With --engine ray
the models and --record-dir must be on storage every node of the cluster sees.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "zoo",
        help="static costs (and a short recording) of every model of a folder or a list, in one table",
        description="Analyze every model of a folder (every *.onnx under it) or of a list file, one task per "
        "model, and with --record also record a few synthetic batches of each: one table with a `model` column "
        "and a status per model. A model that fails (missing, not ONNX, an analysis or recording error) is a "
        "row with its error, and the others go on.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "models", metavar="DIR_OR_LIST", help="a folder of .onnx models, or a text file of model paths"
    )
    add_output_argument(
        p, "write the table to FILE (.parquet, .csv or .json by its suffix) instead of printing it"
    )
    add_format_argument(p, "the table")
    p.add_argument(
        "--record",
        action="store_true",
        help=f"also record each model over the feeds (default {ZOO_BATCHES} synthetic batches) into --record-dir",
    )
    p.add_argument(
        "--record-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where --record writes <model stem>.parquet per model (default: <FILE stem>.records beside -o "
        "FILE, else zoo-records)",
    )
    add_quiet_argument(p)
    add_engine_arguments(p, "where the models run: one after the other here, or one Ray task each")
    add_feed_arguments(p)
    add_runtime_arguments(p, "onnxruntime options of the recordings (--record)")
    return p


def _record_dir(args: argparse.Namespace) -> Path:
    if args.record_dir is not None:
        return args.record_dir
    if args.output is not None:
        return args.output.with_name(args.output.stem + ".records")
    return Path("zoo-records")


def run(args: argparse.Namespace) -> int:
    fmt = output_format(args)
    if fmt == "parquet" and args.output is None:
        raise OpscopeError("--format parquet needs -o FILE")
    if args.record_dir is not None and not args.record:
        raise OpscopeError("--record-dir needs --record")
    engine = engine_from_args(args)
    feeds = feed_spec_from_args(args)
    if feeds.batches is None and feeds.data is None:
        feeds = dataclasses.replace(feeds, batches=ZOO_BATCHES)
    runtime = runtime_config_from_args(args)
    if args.output is not None:
        check_writable(args.output, inputs=[args.models])
    models = [path for _, path in model_paths(args.models)]  # bad input is one line before any progress
    console = Console(stderr=True, quiet=args.quiet)
    columns = [TextColumn("surveying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=True, disable=args.quiet) as bar:
        task = bar.add_task("zoo", total=None)
        result = survey(
            models,
            record=args.record,
            engine=engine,
            feeds=feeds,
            runtime=runtime,
            out_dir=_record_dir(args) if args.record else None,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    _emit(result, fmt, args)
    return 1 if result.failed else 0


def _emit(result: SurveyResult, fmt: str, args: argparse.Namespace) -> None:
    if fmt == "table":
        if args.output is not None:
            with atomic_path(args.output) as tmp, open(tmp, "w") as f:
                print_survey(result, Console(file=f, width=200, no_color=True))
        elif not args.quiet:
            print_survey(result, Console())
    elif args.output is not None:
        result.write(args.output, fmt)
    elif fmt == "json":
        import json

        sys.stdout.write(json.dumps(result.table.to_pylist(), indent=1, default=float) + "\n")
    else:  # csv to stdout
        import pyarrow as pa
        import pyarrow.csv as pacsv

        sink = pa.BufferOutputStream()
        pacsv.write_csv(result.table, sink)
        sys.stdout.write(sink.getvalue().to_pybytes().decode())
    if args.output is not None and not args.quiet:
        print(f"wrote {args.output}: {_summary(result)}", file=sys.stderr)
        for model, error in result.failed:
            print(f"failed: {model}: {error}", file=sys.stderr)


def _summary(result: SurveyResult) -> str:
    n, failed = result.table.num_rows, len(result.failed)
    return f"{n} models, {n - failed} ok, {failed} failed in {result.seconds:.1f}s (engine {result.engine})"


def _cost(value: float | None, expr: str | None, unit: str = "") -> str:
    if value is not None:
        return si(value, unit)
    return expr or ""


def print_survey(result: SurveyResult, console: Console) -> None:
    """The survey as a terminal table, one row per model, then every failed model with its error."""
    rows = result.table.to_pylist()
    recorded = "record_rows" in result.table.column_names
    cols = ["model", "status", "nodes", "FLOPs", "params", "weights", "top ops"]
    cols += ["rows", "batches", "rec s"] if recorded else []
    right = {"nodes", "FLOPs", "params", "weights", "rows", "batches", "rec s"}
    tab = Table(title_justify="left")
    for col in cols:
        tab.add_column(col, justify="right" if col in right else "left", overflow="fold")
    for r in rows:
        ok = r["status"] == "ok"
        cells = [
            escape(r["model"]),
            "ok" if ok else "[red]failed[/red]",
            "" if r.get("nodes") is None else str(r["nodes"]),
            _cost(r.get("flops"), r.get("flops_expr")),
            "" if r.get("params") is None else si(r["params"]),
            "" if r.get("weight_bytes") is None else si(r["weight_bytes"], "B"),
            escape(r.get("top_ops") or ""),
        ]
        if recorded:
            secs = r.get("record_seconds")
            cells += [
                "" if r.get("record_rows") is None else str(r["record_rows"]),
                "" if r.get("record_batches") is None else str(r["record_batches"]),
                "" if secs is None else f"{secs:.2f}",
            ]
        tab.add_row(*cells)
    console.print(tab, markup=True, highlight=False)
    for model, error in result.failed:  # below the table, whole: an error folded in a cell is hard to read
        console.print(f"[red]failed[/red] {escape(model)}: {escape(error or '')}", highlight=False)
    console.print(_summary(result), highlight=False)
    if any(r.get("symbols") for r in rows):
        console.print("FLOPs shown as expressions depend on input symbols: --dim NAME=N gives them a value")
