"""Survey a model zoo: the static costs of many models (and, asked, a short recording of each), one
task per model, in one table with a `model` column and a per-model status.

A zoo is a folder (every *.onnx under it, recursively, in sorted order), a text file listing model
paths (one a line, `#` comments, relative paths taken from the list file's folder), or a list of
paths. A model that cannot be surveyed (missing, not ONNX, an analysis or a recording error) is a
row with status "failed" and its one-line error, and the other models go on: in a zoo of hundreds,
one broken export must not cost the rest.

Where the tasks run (`Engine`): here, one after the other, or as Ray tasks of one CPU each, at most
`workers` at a time, gathered as they finish (so progress moves) and put back in the order the
models were listed, so the table is the same either way. A task gets paths, not bytes: a model of
several GB is read where it runs, so on a cluster the models and `out_dir` must be on storage every
node sees. A task returns a plain dict (a few hundred bytes), never a proto. Under Ray a recording
runs with one intra-op thread unless `runtime.threads` says otherwise: the task holds one CPU, and
onnxruntime's default (one thread per core) on every worker would oversubscribe the node.

Columns: model, status, error, then the analysis (sha256, nodes, op_kinds, flops, flops_expr, bytes,
bytes_expr, intensity, params, weight_bytes, symbols, unmodelled_nodes, top_ops), warnings, seconds,
and with `record` the recording (record_table, record_rows, record_batches, record_sites,
record_seconds). A cost that still depends on an input symbol (`batch`) is null with its
expression in the *_expr column, never a made-up number; `feeds.dims` / `feeds.shapes` give the
symbols values, for the analysis as for the recording. Zoo-wide, they apply to the models that have
that symbol or input and leave the others alone (a model of the zoo without a `batch` dim is no
mistake of `--dim batch=1`); a name that no model has is a warning, a typo most likely.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import OpscopeError
from ..files import write_table, writing
from ..run.engine import Engine, ensure_ray, worker_count
from ..run.feeds import FeedSpec
from ..run.session import RuntimeConfig

ZOO_BATCHES = 2  # batches recorded per model when the feeds do not say
TOP_OPS = 3  # op kinds named in `top_ops`
USED = "_used"  # a task's note of the --shape/--dim names its model took, dropped from the table

ModelsLike = str | os.PathLike | Iterable[str | os.PathLike]

_ANALYSIS = [
    ("sha256", pa.string()),
    ("nodes", pa.int64()),
    ("op_kinds", pa.int64()),
    ("flops", pa.float64()),
    ("flops_expr", pa.string()),
    ("bytes", pa.float64()),
    ("bytes_expr", pa.string()),
    ("intensity", pa.float64()),
    ("params", pa.float64()),
    ("weight_bytes", pa.float64()),
    ("symbols", pa.string()),
    ("unmodelled_nodes", pa.int64()),
    ("top_ops", pa.string()),
]
_RECORD = [
    ("record_table", pa.string()),
    ("record_rows", pa.int64()),
    ("record_batches", pa.int64()),
    ("record_sites", pa.int64()),
    ("record_seconds", pa.float64()),
]
_HEAD = [("model", pa.string()), ("status", pa.string()), ("error", pa.string())]
_TAIL = [("warnings", pa.string()), ("seconds", pa.float64())]


def schema(record: bool = False) -> pa.Schema:
    """The survey table's columns (the recording's only with `record`)."""
    return pa.schema(_HEAD + _ANALYSIS + _TAIL + (_RECORD if record else []))


@dataclass(frozen=True)
class SurveyResult:
    """`table`: one row per model, in the order they were listed; `seconds`: the whole survey."""

    table: pa.Table
    seconds: float
    engine: str = "local"

    @property
    def ok(self) -> int:
        return sum(1 for s in self.table.column("status").to_pylist() if s == "ok")

    @property
    def failed(self) -> list[tuple[str, str]]:
        """(model, error) of every model that failed, in table order."""
        rows = zip(self.table.column("model").to_pylist(), self.table.column("status").to_pylist())
        errors = self.table.column("error").to_pylist()
        return [(m, e) for (m, s), e in zip(rows, errors) if s != "ok"]

    def write(self, path: str | os.PathLike, fmt: str | None = None) -> Path:
        """Save as parquet, csv or json (by `fmt` or the suffix), whole or not at all."""
        return write_table(self.table, path, fmt)


def survey(
    models: ModelsLike,
    *,
    record: bool = False,
    engine: Engine | None = None,
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
    out_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SurveyResult:
    """Analyze (and with `record`, record `feeds` through) every model of `models`, one task each.

    `out_dir` holds the recordings, `<stem>.parquet` per model (stems that repeat get `-2`, `-3`, ...
    in listing order); it is needed with `record`. `progress(done, total)` is called after every
    model. Raises OpscopeError for a zoo with no model in it, a list file that cannot be read or an
    `out_dir` that cannot be made; a model's own failure is its row's error, never an exception.
    """
    started = time.perf_counter()
    engine = engine or Engine()
    entries = model_paths(models)
    feeds = feeds or FeedSpec(batches=ZOO_BATCHES)
    runtime = runtime or RuntimeConfig()
    outs: list[str | None] = [None] * len(entries)
    if record:
        if out_dir is None:
            raise OpscopeError("recording a zoo needs a folder for the tables (out_dir)")
        folder = Path(out_dir)
        with writing(folder):
            folder.mkdir(parents=True, exist_ok=True)
        outs = [str((folder / f"{name}.parquet").absolute()) for name in _table_names(p for _, p in entries)]
    tasks = [(str(path.absolute()), label, out, feeds, runtime) for (label, path), out in zip(entries, outs)]
    if engine.kind == "ray":
        rows = _on_ray(engine, tasks, progress)
    else:
        rows = []
        for task in tasks:
            rows.append(survey_one(*task))
            if progress:
                progress(len(rows), len(tasks))
    _unused(feeds, rows)
    table = pa.Table.from_pylist(rows, schema=schema(record))
    return SurveyResult(table=table, seconds=time.perf_counter() - started, engine=engine.kind)


def _unused(feeds: FeedSpec, rows: list[dict]) -> None:
    """Warn of a --shape or --dim no model took (a typo, most likely), and drop the rows' note of them."""
    used = {name for row in rows for name in row.pop(USED, None) or []}
    if not any(row["status"] == "ok" for row in rows):
        return  # the failures say why; no model was read far enough to tell
    for flag, names in (("--shape", feeds.shapes), ("--dim", feeds.dims)):
        for name in names:
            if f"{flag} {name}" not in used:
                what = "an input" if flag == "--shape" else "an input dim"
                warnings.warn(
                    f"{flag} {name}: no model has {what} named {name!r}; it was not used", stacklevel=3
                )


# -- the zoo -----------------------------------------------------------------------------------


def model_paths(models: ModelsLike) -> list[tuple[str, Path]]:
    """(label, path) of every model of a folder, a list file, one .onnx file or a list of paths.

    The label is the path as given: the folder or the list file's folder joined with the entry.
    """
    if isinstance(models, str | os.PathLike):
        given = Path(models)
        if given.is_dir():
            found = sorted((p for p in given.rglob("*.onnx") if p.is_file()), key=lambda p: p.parts)
            if not found:
                raise OpscopeError(
                    f"{given}: no .onnx file in this folder (searched recursively)",
                    hint="give a folder of models, a text file listing model paths, or the paths",
                )
            return [(str(p), p) for p in found]
        if not given.exists():
            raise OpscopeError(
                f"{given}: no such file or folder",
                hint="give a folder of .onnx models or a text file listing model paths",
            )
        if given.suffix.lower() == ".onnx":
            return [(str(given), given)]
        return _list_file(given)
    entries = [(str(p), Path(p)) for p in models]
    if not entries:
        raise OpscopeError("no models to survey: the list of paths is empty")
    return entries


def _list_file(path: Path) -> list[tuple[str, Path]]:
    with writing(path):  # an unreadable list is one line too (the helper words any OSError)
        raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise OpscopeError(
            f"{path}: not a list of model paths (not UTF-8 text)",
            hint="a list file holds one model path a line; # starts a comment",
        ) from None
    lines = [line.strip() for line in text.splitlines()]
    names = [line for line in lines if line and not line.startswith("#")]
    if not names:
        raise OpscopeError(
            f"{path}: the list names no model", hint="one model path a line; # starts a comment"
        )
    out = []
    for name in names:
        p = Path(os.path.expanduser(name))
        p = p if p.is_absolute() else path.parent / p
        out.append((str(p), p))
    return out


def _table_names(paths: Iterable[Path]) -> list[str]:
    """A file stem per model for its recording, unique: a repeated stem gets -2, -3, ..."""
    seen: dict[str, int] = {}
    names = []
    for p in paths:
        n = seen.get(p.stem, 0) + 1
        seen[p.stem] = n
        names.append(p.stem if n == 1 else f"{p.stem}-{n}")
    return names


# -- one model -----------------------------------------------------------------------------------


def survey_one(
    path: str, label: str, out: str | None, feeds: FeedSpec, runtime: RuntimeConfig
) -> dict[str, Any]:
    """The row of one model: analysis, then (with `out`) a recording to `out`. Never raises for the
    model's own faults: they are the row's `error` (the path in it spelt as `label`)."""
    started = time.perf_counter()
    row: dict[str, Any] = {"model": label, "status": "ok", "error": None, USED: []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for_analysis, for_record, row[USED] = _feeds_for(path, feeds)
            row.update(_analysis(path, for_analysis))
        except Exception as exc:  # noqa: BLE001 - one model's fault is its row, the zoo goes on
            row.update(status="failed", error=_message(exc, path, label))
        if out is not None and row["status"] == "ok":
            try:
                row.update(_recording(path, out, for_record, runtime))
            except Exception as exc:  # noqa: BLE001
                row.update(status="failed", error="record: " + _message(exc, path, label))
    seen = dict.fromkeys(str(w.message).splitlines()[0] for w in caught if str(w.message))
    row["warnings"] = "; ".join(seen).replace(path, label) or None
    row["seconds"] = time.perf_counter() - started
    return row


def _feeds_for(path: str, feeds: FeedSpec) -> tuple[FeedSpec, FeedSpec, list[str]]:
    """The feeds narrowed to the inputs and symbols this model has, for its analysis and its recording,
    and the names it took. A zoo-wide `--dim batch=1` is for the models with a `batch`; to one model,
    a name it lacks is an error (analyze and the feeds check them), to a zoo it is someone else's."""
    if not feeds.shapes and not feeds.dims:
        return feeds, feeds, []
    from ..graph.io import load_model
    from ..run.feeds import input_signature
    from ..shapes import input_symbols, safe_symbol

    proto = load_model(path)
    signature = input_signature(proto)
    inputs = {spec.name for spec in signature}
    symbols = set(input_symbols(proto))  # the analysis' names: unnamed dims too, as INPUT_AXIS
    declared = {d for spec in signature for d in spec.dims or [] if isinstance(d, str)}  # the feeds' names
    shapes = {k: v for k, v in feeds.shapes.items() if k in inputs}
    dims = {k: v for k, v in feeds.dims.items() if safe_symbol(k) in symbols}
    used = [f"--shape {k}" for k in shapes] + [f"--dim {k}" for k in dims]
    analysis = dataclasses.replace(feeds, shapes=shapes, dims=dims)
    recording = dataclasses.replace(analysis, dims={k: v for k, v in dims.items() if k in declared})
    return analysis, recording, used


def _analysis(path: str, feeds: FeedSpec) -> dict[str, Any]:
    from .costs import analyze

    report = analyze(path, feeds.shapes or None, feeds.dims or None)
    t = report.totals
    return {
        "sha256": report.model_sha256,
        "nodes": t["nodes"],
        "op_kinds": len({(r.domain, r.op_type) for r in report.records}),
        "flops": t["flops"],
        "flops_expr": t["flops_expr"],
        "bytes": t["bytes"],
        "bytes_expr": t["bytes_expr"],
        "intensity": t["intensity"],
        "params": t["params"],
        "weight_bytes": t["weights_unique_bytes"],
        "symbols": ",".join(t.get("symbols", [])) or None,
        "unmodelled_nodes": t["unmodelled_nodes"],
        "top_ops": ", ".join(_top_op(op) for op in report.by_op[:TOP_OPS]) or None,
    }


def _top_op(op: dict) -> str:
    """'MatMul 95.3%' (share of the FLOPs), or 'MatMul x2' (its count) when the share is not a number."""
    share = op.get("flops_share")
    return f"{op['op_type']} {100 * share:.3g}%" if share is not None else f"{op['op_type']} x{op['count']}"


def _recording(path: str, out: str, feeds: FeedSpec, runtime: RuntimeConfig) -> dict[str, Any]:
    from ..run.recorder import record

    result = record(path, out=out, feeds=feeds, runtime=runtime)
    return {
        "record_table": str(result.table),
        "record_rows": result.rows,
        "record_batches": result.batches,
        "record_sites": len(result.manifest.sites),
        "record_seconds": result.seconds,
    }


def _message(exc: BaseException, path: str, label: str) -> str:
    """One line: an OpscopeError's message; anything else (a bug, or a library's) with its type; the
    model's path, which the row names already, left out of the front."""
    first = (str(exc).strip().splitlines() or [""])[0]
    text = first if isinstance(exc, OpscopeError) else f"{type(exc).__name__}: {first}".rstrip(": ")
    text = text.replace(path, label)
    return text.removeprefix(f"{label}: ")  # the row names the model already


def _failed(label: str, error: str) -> dict[str, Any]:
    return {"model": label, "status": "failed", "error": error}


# -- on Ray ----------------------------------------------------------------------------------------


def _on_ray(engine: Engine, tasks: list[tuple], progress: Callable[[int, int], None] | None) -> list[dict]:
    """Every task as a Ray task of one CPU, at most `worker_count` at a time; rows in task order."""
    ray = ensure_ray(engine)
    window = worker_count(engine)
    remote = ray.remote(num_cpus=1, max_retries=1)(survey_one)
    rows: list[dict | None] = [None] * len(tasks)
    running: dict[Any, int] = {}
    queue = iter(enumerate(tasks))
    done = 0

    def submit() -> None:
        for i, (path, label, out, feeds, runtime) in queue:
            if runtime.threads is None:
                runtime = dataclasses.replace(runtime, threads=1)
            running[remote.remote(path, label, out, feeds, runtime)] = i
            if len(running) >= window:
                return

    try:
        submit()
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            for ref in ready:
                i = running.pop(ref)
                try:
                    rows[i] = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the worker died (a crash in a runtime, OOM)
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    rows[i] = _failed(tasks[i][1], f"the Ray task died: {first}")
                done += 1
                if progress:
                    progress(done, len(tasks))
            submit()
    except BaseException:
        for ref in running:
            ray.cancel(ref, force=True)
        raise
    return [r for r in rows if r is not None]
