"""The sketch table: its schema, the writer that keeps every finished batch, and the reader.

Tidy, one row per sketch element:

    run_id, step, provider, dist, M, K, N, numel, site, op_type, role, stat, idx, value

Parquet: the table at `<out>` is a dataset folder, one complete file per finished batch
(`<out>/part-00000.parquet`, ...) plus `_SUCCESS` once the run has finished: the layout of
Spark, Dask and Ray Data, which pandas and pyarrow (`read_parquet(out)`), polars
(`pl.read_parquet(out)`, or `out/*.parquet`) and DuckDB (`read_parquet('out/*.parquet')`) read
as one table at any moment, a run killed outright included. Each part is written beside the
folder under a hidden temporary name and renamed into it: those readers take every file in the
folder and fail on a half-written one, so the folder only ever holds whole batches.

Nothing is written before the first batch has run, passed the parity gate and been decoded: a
run that fails before it (a bad option or feed, the gate, Ctrl-C) leaves an earlier table at
`<out>` and its sidecars as they were. The first batch is the commit: a new folder holding it
takes `<out>`'s place in one step (`files.replace`), its sidecars right after. From then on the
path is the new run's: a later error or a kill leaves its finished batches, no `_SUCCESS`, and
`run.json` says `"interrupted": true`. The alternative, keeping the earlier table until the run
ends and swapping then, would leave nothing of the new run at `<out>` after a kill.

A part holds one batch, or the batches that piled up while the recorder's worker decoded (a model
faster than its decode: `recorder.BatchPipeline`), never part of one. Merging parts at the end
would read and rewrite the whole table and swap the folder again, to save little: 500 batches of
1,600 rows read in 0.75 s with pandas against 0.51 s from one file, 0.18 s against 0.05 s with DuckDB.

CSV: the first batch goes to a temporary file renamed into place (the same commit), later ones
are appended and flushed one batch at a time, and an append that fails (a full disk) is cut
back; a kill in the middle of an append can leave a partial last line, which Parquet never does.

`read_table` also reads the layouts of earlier versions: one Parquet file, and the
`<out>.parts/` folder their killed runs left. Beside the table go `<stem>.sites.csv` (site,
op_type, order, M, K, N, flops) and `<stem>.run.json` (what was run, how, the parity result,
how many batches: rewritten after each batch, so a killed run's says how far it got).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import os
import re
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ..errors import OpscopeError
from ..files import atomic_path, remove, write_bytes, writing
from ..instrument import Manifest, Rows
from ..instrument.rows import arrow_float64, arrow_int64, arrow_strings, dictionary_twin

SCHEMA = pa.schema([
    ("run_id", pa.string()), ("step", pa.int64()), ("provider", pa.string()), ("dist", pa.string()),
    ("M", pa.int64()), ("K", pa.int64()), ("N", pa.int64()), ("numel", pa.int64()),
    ("site", pa.string()), ("op_type", pa.string()), ("role", pa.string()), ("stat", pa.string()),
    ("idx", pa.int64()), ("value", pa.float64()),
])  # fmt: skip

FORMATS = ("parquet", "csv")
PART = "part-{:05d}.parquet"
SUCCESS = "_SUCCESS"
_PART = re.compile(r"part-(\d{5,})\.parquet")


class TableWriter:
    """Appends batch tables so that the path always holds a readable table of whole batches.

    State is real (the batch count, the open CSV file), hence a class.
    """

    def __init__(self, out: Path, fmt: str):
        self.out, self.fmt, self.parts = out, fmt, 0
        self._csv: BinaryIO | None = None

    def write(self, part: bytes) -> None:
        """Add one part (one batch, or a group of them), encoded by `encode_part`; the first replaces
        whatever table was at the path."""
        if self.fmt == "parquet":
            self._write_part(part)
        else:
            self._write_csv(part)
        self.parts += 1

    def _write_part(self, part: bytes) -> None:
        if self.parts:
            with atomic_path(self.out / PART.format(self.parts), temp_dir=self.out.parent) as tmp:
                tmp.write_bytes(part)
            return
        with atomic_path(self.out) as folder:
            folder.mkdir()
            (folder / PART.format(0)).write_bytes(part)
        self._clear_leftovers()

    def _write_csv(self, part: bytes) -> None:
        data = memoryview(part)
        if self._csv is None:
            write_bytes(self.out, part)
            self._csv = open(self.out, "ab", buffering=0)  # noqa: SIM115 - closed in close()
            self._clear_leftovers()
            return
        size = os.fstat(self._csv.fileno()).st_size
        try:
            with writing(self.out):
                while data:  # an unbuffered write may take part of it
                    data = data[self._csv.write(data) :]
        except OpscopeError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._csv.fileno(), size)
            raise

    def _clear_leftovers(self) -> None:
        """What killed runs at this path left: temporaries beside it, an earlier version's `.parts`."""
        name = re.compile(rf"\.{re.escape(self.out.name)}\.(part-\d+\.parquet\.)?[0-9a-f]{{8}}\.tmp")
        for p in self.out.parent.iterdir():
            if name.fullmatch(p.name):
                remove(p)
        remove(self.out.with_name(self.out.name + ".parts"))

    def close(self, complete: bool) -> None:
        """End the run; a Parquet run that finished every batch gets its `_SUCCESS` marker."""
        if self._csv is not None:
            self._csv.close()
        if self.fmt == "parquet" and complete and self.parts:
            with writing(self.out):
                (self.out / SUCCESS).touch()


def encode_part(table: pa.Table, fmt: str, first: bool) -> bytes:
    """One batch's table as the bytes of its part: a whole Parquet file, or CSV lines (with the header
    when `first`). Encoded where the batch was decoded, a Ray worker included: the driver then only
    writes bytes, and a part crosses the object store as ~30 KB of Parquet instead of ~1 MB of Arrow
    (the repeated label strings)."""
    buf = pa.BufferOutputStream()
    if fmt == "parquet":
        _write_parquet(table, buf)
    else:
        pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=first))
    return buf.getvalue().to_pybytes()


def _write_parquet(table: pa.Table, sink: pa.NativeFile) -> None:
    """Write `table` as one Parquet file, the way pyarrow writes it fastest. Each choice was measured
    on real batches' tables (tiny_taps, silero_vad_v6, ppocrv4_det's default set, captcha_crnn's
    `--sketch all`, one batch or eight together): 0.72-0.91 of the time before, files -20% to +39%.

    - label columns as their dictionary twins (no string hashing); without the Arrow schema in the
      file every reader reads them as the strings they are (the schema holds nothing else);
    - a dictionary only for the labels and the sizes: the step, indices and values are written
      plain, and LZ4 (written as LZ4_RAW, which pyarrow, polars, DuckDB and Spark 3.5+ read)
      packs them about as tightly as their dictionary did under snappy;
    - min/max statistics only for the integers that tell parts apart (step, position): every part
      spans all the labels, sizes, indices and values, so theirs could never skip a part, and a
      part's run, provider and phase are one value each (string statistics were a quarter of the
      write);
    - the fields stay nullable: required ones skip the definition levels but made pyarrow write the
      dictionary twins 1.2-1.6x slower.
    """
    names, types = table.column_names, table.schema.types
    pq.write_table(
        pa.Table.from_arrays([_twin(c) for c in table.columns], names=names),
        sink,
        store_schema=False,
        use_dictionary=[n for n, t in zip(names, types, strict=True) if n in _FEW or pa.types.is_string(t)],
        compression="lz4",
        write_statistics=[n for n in names if n in _PARTS],
    )


_FEW = ("M", "K", "N", "numel")  # a tensor's sizes: a handful of values, which a dictionary packs best
_PARTS = ("step", "position")  # what tells parts apart: the only columns whose min/max can skip one


def _twin(column: pa.ChunkedArray) -> pa.ChunkedArray | pa.Array:
    """A label column as its dictionary twin; a group of batches' (one chunk a batch) as their twins
    laid end to end (Parquet then writes it as one dictionary column, a third faster than the strings)."""
    if column.num_chunks == 1:
        return dictionary_twin(column.chunk(0))
    twins = [dictionary_twin(c) for c in column.chunks]
    if all(pa.types.is_dictionary(t.type) for t in twins):
        return pa.chunked_array(twins).combine_chunks()
    return column


def is_table_folder(path: Path) -> bool:
    """Whether `path` is a folder of this writer's (parts and the marker only), which a new run may replace."""
    return path.is_dir() and all(c.name == SUCCESS or _PART.fullmatch(c.name) for c in path.iterdir())


def format_of(out: Path, fmt: str | None) -> str:
    fmt = fmt or ("csv" if out.suffix.lower() == ".csv" else "parquet")
    if fmt not in FORMATS:
        raise OpscopeError(f"unknown table format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return fmt


def sidecar_paths(table: str | os.PathLike) -> tuple[Path, Path]:
    """(<stem>.sites.csv, <stem>.run.json) beside a table."""
    t = Path(table)
    stem = t.name[: -len(t.suffix)] if t.suffix else t.name
    return t.with_name(stem + ".sites.csv"), t.with_name(stem + ".run.json")


def batch_table(rows: Rows, run_id: str, step: int, provider: str, dist: str) -> pa.Table:
    """The batch's rows in SCHEMA's column order and types (built as such: no cast, which would load
    pyarrow.compute)."""
    return batches_table([rows], run_id, [step], provider, dist)


def batches_table(rows: list[Rows], run_id: str, steps: list[int], provider: str, dist: str) -> pa.Table:
    """Batches' rows (`rows[i]` of step `steps[i]`) laid end to end as one table of SCHEMA: each layout
    column a chunk per batch (the batches of a recording share their layout's columns, built once), the
    values, steps and constant labels one array each. A table a batch and `concat_tables` cost ~70 µs a
    batch, as much as decoding one of silero_vad_v6's (`recorder.decode_group`: 64 at a time)."""
    sizes = np.array([len(r) for r in rows], np.int64)
    n = int(sizes.sum())
    layouts = [r.layout.columns() for r in rows]
    values = [r.values() for r in rows]
    cols = {
        "run_id": _constant_strings(run_id, n),
        "step": arrow_int64(np.repeat(np.asarray(steps, np.int64), sizes)),
        "provider": _constant_strings(provider, n),
        "dist": _constant_strings(dist, n),
        "value": arrow_float64(values[0] if len(values) == 1 else np.concatenate(values)),
    }
    for name in ("M", "K", "N", "numel", "site", "op_type", "role", "stat", "idx"):
        chunks = [c[name] for c in layouts]
        cols[name] = chunks[0] if len(chunks) == 1 else pa.chunked_array(chunks, SCHEMA.field(name).type)
    return pa.table([cols[f.name] for f in SCHEMA], schema=SCHEMA)


@functools.lru_cache(maxsize=8)
def _constant_strings(label: str, n: int) -> pa.Array:
    """A column of n copies of `label`: the same for every batch of a run, so built once."""
    return arrow_strings([label], np.zeros(n, np.int64))


def write_sites(path: Path, manifest: Manifest, dims: dict[str, tuple]) -> None:
    """One row per site with its run-time GEMM dims and FLOPs (the csv module: a pyarrow table from
    Python lists would load pandas when it is installed, +32 MB RSS at the end of a recording)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_NONNUMERIC)
        w.writerow(["site", "op_type", "order", "M", "K", "N", "flops"])
        for s in manifest.sites:
            m, k, n = dims.get(s.id, (None, None, None))
            flops = float(2 * m * k * n) if None not in (m, k, n) else None
            w.writerow([s.id, s.op_type, s.order, *("" if v is None else v for v in (m, k, n, flops))])


def read_table(path: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """Read a sketch table (all columns, or just `columns`): a dataset folder (a killed run's too), a
    Parquet or CSV file, or the `.parts` folder a killed run of an earlier version left."""
    p = Path(path)
    old_parts = p.with_name(p.name + ".parts")
    try:
        if p.is_file():
            if p.suffix.lower() == ".csv":
                opts = pacsv.ConvertOptions(column_types=SCHEMA, include_columns=columns)
                return pacsv.read_csv(p, convert_options=opts)
            return pq.read_table(p, columns=columns)
        if p.is_dir() or old_parts.is_dir():
            return _read_parts(p if p.is_dir() else old_parts, columns, allow_empty=not p.is_dir())
    except (pa.ArrowInvalid, OSError) as exc:
        raise OpscopeError(f"{p}: not a readable sketch table ({exc})") from None
    raise OpscopeError(f"{p}: no such table")


def _read_parts(folder: Path, columns: list[str] | None, allow_empty: bool) -> pa.Table:
    """The parts in batch order (ParquetFile, not pq.read_table: that one loads pyarrow.dataset and
    pandas, +50 MB RSS)."""
    found = [(m, f) for f in folder.iterdir() if (m := _PART.fullmatch(f.name))]
    if not found and not allow_empty:
        raise OpscopeError(f"{folder}: a folder without part-*.parquet files, not a sketch table")
    files = [f for m, f in sorted(found, key=lambda mf: int(mf[0].group(1)))]
    tables = [pq.ParquetFile(f).read(columns=columns, use_threads=False) for f in files]
    empty = SCHEMA.empty_table()
    return pa.concat_tables(tables) if tables else (empty.select(columns) if columns else empty)
