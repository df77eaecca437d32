"""The sketch table split into series: all steps of one (run, site, role), stat by stat."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import OpscopeError
from ..run.table import read_table

REQUIRED_COLUMNS = ("site", "role", "stat", "idx", "value")
TableLike = Any  # a path (Parquet dataset folder or file, CSV, an older .parts folder), a pyarrow.Table or a pandas DataFrame


@dataclass
class Series:
    """All steps of one (run, site, role): stat -> values (ordered by idx) per step."""

    run_id: str
    provider: str
    dist: str
    site: str
    op_type: str
    role: str
    dims: tuple[int | None, int | None, int | None]
    steps: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    numel: dict[int, int | None] = field(default_factory=dict)

    def stat(self, step: int, name: str) -> np.ndarray:
        return self.steps[step].get(name, np.zeros(0))

    def label(self, with_run: bool = False) -> str:
        base = f"{self.site}/{self.role}"
        return f"{base} [{self.dist}]" if with_run else base


def read_sketch_table(table: TableLike, columns: list[str] | None = None) -> tuple[pa.Table, Path | None]:
    """The table as pyarrow (and its path, if it came from a file); wrong input is an OpscopeError.

    `columns`: read only these (from a file; an in-memory table is returned whole)."""
    path = None
    if isinstance(table, pa.Table):
        t = table
    elif isinstance(table, str | os.PathLike):
        path = Path(table)
        t = read_table(path, columns)
    elif hasattr(table, "columns") and hasattr(table, "dtypes"):  # a pandas DataFrame
        t = pa.Table.from_pandas(table, preserve_index=False)
    else:
        raise TypeError(f"expected a table path, a pyarrow.Table or a DataFrame, got {type(table).__name__}")
    missing = [c for c in columns or REQUIRED_COLUMNS if c not in t.column_names]
    if missing:
        where = str(path) if path else "table"
        raise OpscopeError(
            f"{where}: not a sketch table (missing column(s) {', '.join(missing)}; "
            f"has {', '.join(t.column_names) or 'none'})",
            hint="record one with `opscope record MODEL -o TABLE`",
        )
    return t, path


def _strings(t: pa.Table, name: str, default: str = "") -> np.ndarray:
    if name not in t.column_names:
        return np.full(t.num_rows, default, dtype=object)
    col = pc.fill_null(t.column(name).cast(pa.string()), default)
    return col.to_numpy(zero_copy_only=False)


def _numbers(t: pa.Table, name: str, default: float = np.nan) -> np.ndarray:
    if name not in t.column_names:
        return np.full(t.num_rows, default)
    return t.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)


def collect(table: TableLike) -> list[Series]:
    """Split the tidy table into one Series per (run_id, provider, dist, site, role), sorted.

    Vectorised: one lexsort and one pass over the segments, so a table of millions of rows
    costs one Python iteration per (run, site, role, step, stat), not per row.
    """
    t, _ = read_sketch_table(table)
    if t.num_rows == 0:
        return []
    text = {c: _strings(t, c) for c in ("run_id", "provider", "dist", "site", "op_type", "role", "stat")}
    codes, uniq = {}, {}
    for c, arr in text.items():
        uniq[c], codes[c] = np.unique(arr.astype(str), return_inverse=True)
    step = _numbers(t, "step", 0.0)
    step = np.where(np.isfinite(step), step, 0).astype(np.int64)
    idx = _numbers(t, "idx", 0.0)
    value = _numbers(t, "value")
    numel = _numbers(t, "numel")
    dims = [_numbers(t, d) for d in ("M", "K", "N")]
    keys = [
        codes["run_id"],
        codes["provider"],
        codes["dist"],
        codes["site"],
        codes["role"],
        step,
        codes["stat"],
    ]
    order = np.lexsort([idx, *reversed(keys)])
    keys = [k[order] for k in keys]
    value, numel, idx = value[order], numel[order], idx[order]
    dims = [d[order] for d in dims]
    op_codes = codes["op_type"][order]
    change = np.zeros(len(order), dtype=bool)
    change[0] = True
    for k in keys:
        change[1:] |= k[1:] != k[:-1]
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], len(order))
    out: dict[tuple, Series] = {}
    for s, e in zip(starts, ends):
        run, prov, dist, site, role, st, stat = (int(k[s]) for k in keys)
        key = (run, prov, dist, site, role)
        series = out.get(key)
        if series is None:
            series = out[key] = Series(
                str(uniq["run_id"][run]), str(uniq["provider"][prov]), str(uniq["dist"][dist]),
                str(uniq["site"][site]), str(uniq["op_type"][op_codes[s]]), str(uniq["role"][role]),
                tuple(_int_or_none(d[s:e]) for d in dims),
            )  # fmt: skip
        series.steps.setdefault(st, {})[str(uniq["stat"][stat])] = value[s:e]
        if series.numel.get(st) is None:
            series.numel[st] = _int_or_none(numel[s:e])
        if None in series.dims:
            series.dims = tuple(
                a if a is not None else _int_or_none(d[s:e]) for a, d in zip(series.dims, dims)
            )
    return list(out.values())


def _int_or_none(v: np.ndarray) -> int | None:
    ok = v[np.isfinite(v)]
    return int(ok[0]) if ok.size else None
