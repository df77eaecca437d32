"""Run batches through an instrumented model and write the tidy sketch table.

`record` injects the sketches, takes the weights' sketches once on the host
(`weights.host_values`), opens one onnxruntime session, checks on the first batch
that the model's own outputs did not move (the parity gate), then runs every batch,
decodes the extra outputs through the manifest and appends the rows to the table:

    run_id, step, provider, dist, M, K, N, numel, site, op_type, role, stat, idx, value

Nothing is held back until the end. Parquet: each finished batch is written as its own
complete file under `<out>.parts/`; when the run ends (normally, on Ctrl-C or on an error)
the parts are merged into `<out>` and removed. A run killed outright leaves the parts
folder, which `read_table(<out>)`, pyarrow and pandas read as one table. CSV: each batch is
appended and flushed, so the file is always readable.

Beside the table go `<stem>.sites.csv` (site, op_type, order, M, K, N, flops: the GEMM
dims seen on the first batch, flops = 2·M·K·N) and `<stem>.run.json` (what was run, how,
and the parity result).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from onnx import ModelProto

from . import sketches as sk
from .data import FeedSpec, describe_feeds, iter_feeds
from .errors import OpscopeError
from .inject import inject
from .manifest import Manifest, Rows, arrow_int64, arrow_strings, decode
from .model import ModelLike
from .runtime import RuntimeConfig, for_tapped, make_session, resolve_providers, run
from .sites import Selection, Site
from .weights import host_values

SCHEMA = pa.schema([
    ("run_id", pa.string()), ("step", pa.int64()), ("provider", pa.string()), ("dist", pa.string()),
    ("M", pa.int64()), ("K", pa.int64()), ("N", pa.int64()), ("numel", pa.int64()),
    ("site", pa.string()), ("op_type", pa.string()), ("role", pa.string()), ("stat", pa.string()),
    ("idx", pa.int64()), ("value", pa.float64()),
])  # fmt: skip

FORMATS = ("parquet", "csv")


@dataclass
class ParityResult:
    ok: bool
    worst_output: str | None
    max_abs: float
    max_rel: float
    rtol: float
    atol: float


@dataclass
class RecordResult:
    table: Path
    sites: Path
    run: Path
    manifest: Manifest
    batches: int
    rows: int
    seconds: float
    parity: ParityResult | None = None
    runtime: dict = field(default_factory=dict)


def default_parity_tolerance(graph_opt: str) -> tuple[float, float]:
    """(rtol, atol): bit-exact without graph optimizations; with them, tapping blocks some fusions and
    outputs may move (about 1e-4 relative seen on real CNNs), so allow 1e-3 relative."""
    return (0.0, 0.0) if graph_opt == "disable" else (1e-3, 1e-4)


def check_parity(
    names: list[str], plain: list[np.ndarray], tapped: list[np.ndarray], rtol: float, atol: float
) -> ParityResult:
    """Compare the model's own outputs with and without taps: |a - b| <= atol + rtol·max|b| per output."""
    worst, worst_rel, worst_abs, ok = None, 0.0, 0.0, True
    for name, a, b in zip(names, plain, tapped):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return ParityResult(False, name, float("inf"), float("inf"), rtol, atol)
        if a.dtype.kind not in "fc":
            bad = not np.array_equal(a, b)
            diff, scale = float(bad), 1.0
        else:
            with np.errstate(all="ignore"):
                d = np.abs(a.astype(np.float64) - b.astype(np.float64))
                same = (a == b) | (np.isnan(a) & np.isnan(b))
                d = np.where(same, 0.0, d)
                diff = float(d.max()) if d.size else 0.0
                fin = np.abs(a[np.isfinite(a)])
                scale = float(fin.max()) if fin.size else 0.0
            bad = diff > atol + rtol * scale
        rel = diff / scale if scale else (0.0 if diff == 0 else float("inf"))
        if bad:
            ok = False
        if worst is None or rel > worst_rel or (bad and rel >= worst_rel):
            worst, worst_rel, worst_abs = name, rel, diff
    return ParityResult(ok, worst, worst_abs, worst_rel, rtol, atol)


def _short_provider(name: str) -> str:
    return name.removesuffix("ExecutionProvider").lower()


def _batch_table(rows: Rows, run_id: str, step: int, provider: str, dist: str) -> pa.Table:
    """The batch's rows in SCHEMA's column order and types (built as such: no cast, which would load
    pyarrow.compute)."""
    t = rows.to_arrow()
    n = t.num_rows
    same = np.zeros(n, np.int64)
    head = {
        "run_id": arrow_strings([run_id], same),
        "step": arrow_int64(same + step),
        "provider": arrow_strings([provider], same),
        "dist": arrow_strings([dist], same),
    }
    cols = {**head, **{c: t.column(c) for c in t.column_names}}
    return pa.table([cols[f.name] for f in SCHEMA], schema=SCHEMA)


class BatchPipeline:
    """Runs `work(step, outputs)` for one batch on a worker thread while the next batch runs.

    onnxruntime releases the GIL while it runs, so decoding and writing (numpy, pyarrow, Python:
    ~6 ms a batch on bert_like with the default set, against ~20 ms of run on one thread)
    overlap the next run instead of adding to it. At most one batch waits, so at most two
    batches of raw outputs are held. An error in `work` is raised by the next `submit` or by
    `close`. State is real (the worker and the batch in flight), hence a class.
    """

    def __init__(self, work: Callable[[int, dict[str, np.ndarray]], None]):
        self._work = work
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="opscope-decode")
        self._pending: Future | None = None

    def submit(self, step: int, outputs: dict[str, np.ndarray]) -> None:
        self._wait()
        self._pending = self._pool.submit(self._work, step, outputs)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self, quiet: bool = False) -> None:
        """Finish the batch in flight; `quiet` drops its error (another one is already being raised)."""
        try:
            self._wait()
        except Exception:
            if not quiet:
                raise
        finally:
            self._pool.shutdown(wait=True)


class _TableWriter:
    """Appends batch tables so that whatever was written survives an interrupted run.

    State is real (open files, part count), hence a class.
    """

    def __init__(self, out: Path, fmt: str):
        self.out, self.fmt, self.parts = out, fmt, 0
        self.parts_dir = out.with_name(out.name + ".parts")
        out.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "parquet":
            if self.parts_dir.exists():
                shutil.rmtree(self.parts_dir)
            self.parts_dir.mkdir()
        else:
            self._csv = open(out, "wb")  # noqa: SIM115 - closed in close()
            self._csv_header = True

    def write(self, table: pa.Table) -> None:
        if self.fmt == "parquet":
            part = self.parts_dir / f"part-{self.parts:05d}.parquet"
            pq.write_table(table, part.with_suffix(".tmp"))
            os.replace(part.with_suffix(".tmp"), part)  # a part is either whole or absent
        else:
            buf = pa.BufferOutputStream()
            pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=self._csv_header))
            self._csv.write(buf.getvalue().to_pybytes())
            self._csv.flush()
            self._csv_header = False
        self.parts += 1

    def close(self) -> None:
        if self.fmt == "csv":
            if self._csv_header:  # no batch finished: still leave a readable, empty table
                pacsv.write_csv(SCHEMA.empty_table(), self._csv)
            self._csv.close()
            return
        tmp = self.out.with_name(self.out.name + ".tmp")
        with pq.ParquetWriter(tmp, SCHEMA) as writer:
            for part in sorted(self.parts_dir.glob("part-*.parquet")):
                # ParquetFile, not pq.read_table: that one loads pyarrow.dataset and pandas (+50 MB RSS)
                writer.write_table(pq.ParquetFile(part).read(use_threads=False))
        os.replace(tmp, self.out)
        shutil.rmtree(self.parts_dir)


def _format_of(out: Path, fmt: str | None) -> str:
    fmt = fmt or ("csv" if out.suffix.lower() == ".csv" else "parquet")
    if fmt not in FORMATS:
        raise OpscopeError(f"unknown table format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return fmt


def sidecar_paths(table: str | os.PathLike) -> tuple[Path, Path]:
    """(<stem>.sites.csv, <stem>.run.json) beside a table."""
    t = Path(table)
    stem = t.name[: -len(t.suffix)] if t.suffix else t.name
    return t.with_name(stem + ".sites.csv"), t.with_name(stem + ".run.json")


def record(
    model: ModelLike,
    *,
    out: str | os.PathLike = "sketches.parquet",
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
    sites: list[Site] | Selection | None = None,
    sketches: list[str] | None = None,
    options: sk.SketchOptions | None = None,
    placement: str = "producer",
    fmt: str | None = None,
    run_id: str | None = None,
    parity: bool = True,
    parity_tol: tuple[float, float] | None = None,
    base_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> RecordResult:
    """Record sketches of `model` over the batches of `feeds` into the table at `out`.

    Returns paths and counts; raises OpscopeError for user mistakes and for a failed parity
    gate (the instrumented model's own outputs differ from the plain model's on batch 0 by
    more than `parity_tol` = (rtol, atol), default `default_parity_tolerance`).
    `progress(step_done, total_or_None)` is called after every batch.
    """
    started = time.perf_counter()
    feeds = feeds or FeedSpec()
    runtime = runtime or RuntimeConfig()
    out = Path(out)
    fmt = _format_of(out, fmt)
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    options = sk.for_providers(options or sk.SketchOptions(), _providers_quietly(runtime))
    instrumented, manifest = inject(model, sites, sketches, options, placement)
    # One copy of the model in memory: the instrumented one also gives the feeds' signature and
    # the weights; the plain parity session reads the file itself when there is one.
    host = host_values(manifest, instrumented, base_dir)  # the weight taps, once, before any batch
    tapped_runtime = for_tapped(runtime)
    # the weights go into the session; the proto keeps the graph (the feeds' signature) only
    session = make_session(instrumented, tapped_runtime, base_dir=base_dir, take_weights=True)
    provider = _short_provider(session.get_providers()[0])
    record_rt = tapped_runtime.to_record(session)
    run_id = run_id or f"{Path(manifest.source).stem}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}"
    dist = "data" if feeds.data is not None else feeds.dist
    tap_outputs = manifest.output_names()
    originals = manifest.original_outputs
    total = feeds.batches if feeds.batches is not None else (None if feeds.data else _default_batches())
    rtol, atol = parity_tol or default_parity_tolerance(runtime.graph_opt)

    writer = _TableWriter(out, fmt)
    n_rows = steps = 0
    parity_result = None
    site_dims: dict[str, tuple] = {}

    def encode(step: int, outputs: dict[str, np.ndarray]) -> None:  # on the pipeline's thread
        nonlocal n_rows, steps, site_dims
        rows = decode(manifest, outputs, host)
        if step == 0:
            site_dims = _site_dims(rows)
        writer.write(_batch_table(rows, run_id, step, provider, dist))
        n_rows += len(rows)
        steps += 1
        if progress:
            progress(steps, total)

    pipeline = BatchPipeline(encode)
    try:
        for step, batch in enumerate(iter_feeds(instrumented, feeds)):
            want = (originals + tap_outputs) if (parity and step == 0) else tap_outputs
            values = run(session, batch, want)
            outputs = dict(zip(want, values))
            if parity and step == 0:
                plain = make_session(model, runtime, base_dir=base_dir)
                plain_out = run(plain, batch, originals)
                del plain
                parity_result = check_parity(originals, plain_out, values[: len(originals)], rtol, atol)
                if not parity_result.ok:
                    p = parity_result
                    raise OpscopeError(
                        f"parity failed on batch 0 ({describe_feeds(batch)}): output {p.worst_output!r} moved by "
                        f"{p.max_abs:.3g} ({p.max_rel:.3g} of its max) with the taps in place (rtol {rtol}, "
                        f"atol {atol})",
                        hint="record with --opt-level disable, or loosen --parity-tol; --no-parity skips the check",
                        exit_code=3,
                    )
            pipeline.submit(step, {name: outputs[name] for name in tap_outputs})
        pipeline.close()
    finally:
        pipeline.close(quiet=True)  # after an error or Ctrl-C: the batch already run is still written
        writer.close()
        sites_path, run_path = sidecar_paths(out)
        _write_sites(sites_path, manifest, site_dims)
        meta = {
            "run_id": run_id, "model": manifest.source, "model_sha256": manifest.source_sha256,
            "runtime": record_rt, "feeds": _feed_record(feeds), "sketches": manifest.sketches,
            "options": manifest.options, "placement": placement, "batches": steps, "rows": n_rows,
            "seconds": round(time.perf_counter() - started, 3),
            "parity": asdict(parity_result) if parity_result else None, "table": out.name,
        }  # fmt: skip
        run_path.write_text(json.dumps(meta, indent=1, default=str))
    return RecordResult(
        out, sites_path, run_path, manifest, steps, n_rows, meta["seconds"], parity_result, record_rt
    )


def _providers_quietly(runtime: RuntimeConfig) -> list[str]:
    """The providers the session will get; its own creation warns about any fallback."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_providers(runtime.providers, fallback=runtime.fallback)


def _default_batches() -> int:
    from .data import DEFAULT_BATCHES

    return DEFAULT_BATCHES


def _feed_record(spec: FeedSpec) -> dict:
    d = asdict(spec)
    d["data"] = str(spec.data) if spec.data is not None else None
    return d


def _site_dims(rows: Rows) -> dict[str, tuple]:
    dims: dict[str, tuple] = {}
    for site, _, _, _, _, m, k, n in rows.chunks():
        if site not in dims:
            dims[site] = (m, k, n)
    return dims


def _write_sites(path: Path, manifest: Manifest, dims: dict[str, tuple]) -> None:
    """One row per site with its run-time GEMM dims and FLOPs (the csv module: a pyarrow table from
    Python lists would load pandas when it is installed, +32 MB RSS at the end of a recording)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_NONNUMERIC)
        w.writerow(["site", "op_type", "order", "M", "K", "N", "flops"])
        for s in manifest.sites:
            m, k, n = dims.get(s.id, (None, None, None))
            flops = float(2 * m * k * n) if None not in (m, k, n) else None
            w.writerow([s.id, s.op_type, s.order, *("" if v is None else v for v in (m, k, n, flops))])


def read_table(path: str | os.PathLike) -> pa.Table:
    """Read a sketch table: Parquet or CSV file, or the `.parts` folder an interrupted run left."""
    p = Path(path)
    parts = p.with_name(p.name + ".parts")
    try:
        if p.is_file():
            if p.suffix.lower() == ".csv":
                return pacsv.read_csv(p, convert_options=pacsv.ConvertOptions(column_types=SCHEMA))
            return pq.read_table(p)
        if parts.is_dir():
            files = sorted(parts.glob("part-*.parquet"))
            return (
                pa.concat_tables([pq.read_table(f, schema=SCHEMA) for f in files])
                if files
                else SCHEMA.empty_table()
            )
    except (pa.ArrowInvalid, OSError) as exc:
        raise OpscopeError(f"{p}: not a readable sketch table ({exc})") from None
    raise OpscopeError(f"{p}: no such table")
