"""The sketch table: its schema, the writer that keeps every finished batch, and the reader.

Tidy, one row per sketch element:

    run_id, step, provider, dist, M, K, N, numel, site, op_type, role, stat, idx, value

Parquet: each finished batch is written as its own complete file under `<out>.parts/`; when
the run ends (normally, on Ctrl-C or on an error) the parts are merged into `<out>` and
removed. A run killed outright leaves the parts folder, which `read_table(<out>)`, pyarrow
and pandas read as one table. CSV: each batch is appended and flushed, so the file is always
readable. Beside the table go `<stem>.sites.csv` (site, op_type, order, M, K, N, flops) and
`<stem>.run.json` (what was run, how, and the parity result).
"""

from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ..errors import OpscopeError
from ..instrument import Manifest, Rows
from ..instrument.rows import arrow_int64, arrow_strings

SCHEMA = pa.schema([
    ("run_id", pa.string()), ("step", pa.int64()), ("provider", pa.string()), ("dist", pa.string()),
    ("M", pa.int64()), ("K", pa.int64()), ("N", pa.int64()), ("numel", pa.int64()),
    ("site", pa.string()), ("op_type", pa.string()), ("role", pa.string()), ("stat", pa.string()),
    ("idx", pa.int64()), ("value", pa.float64()),
])  # fmt: skip

FORMATS = ("parquet", "csv")


class TableWriter:
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
    """Read a sketch table (all columns, or just `columns`): a Parquet or CSV file, or the `.parts` folder
    an interrupted run left."""
    p = Path(path)
    parts = p.with_name(p.name + ".parts")
    try:
        if p.is_file():
            if p.suffix.lower() == ".csv":
                opts = pacsv.ConvertOptions(column_types=SCHEMA, include_columns=columns)
                return pacsv.read_csv(p, convert_options=opts)
            return pq.read_table(p, columns=columns)
        if parts.is_dir():
            files = sorted(parts.glob("part-*.parquet"))
            if not files:
                empty = SCHEMA.empty_table()
                return empty.select(columns) if columns else empty
            return pa.concat_tables([pq.read_table(f, schema=SCHEMA, columns=columns) for f in files])
    except (pa.ArrowInvalid, OSError) as exc:
        raise OpscopeError(f"{p}: not a readable sketch table ({exc})") from None
    raise OpscopeError(f"{p}: no such table")
