"""Decoded rows of one batch, and Arrow columns built straight from numpy buffers.

`pa.array()` imports pandas when it is installed, and with it pyarrow.compute and numpy.ma
(+40 MB RSS for a recording that needs none of them), so every column here is made with
`pa.Array.from_buffers`.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa


class Rows:
    """Tidy rows of one batch, kept as one chunk per (site, role, stat) until columns are asked for.

    `to_arrow()` builds the table with dictionary codes and numpy repeats; building Python
    lists of ~100k strings per batch made decoding cost more than the taps on small models.
    The list-valued attributes (site, op_type, role, stat, idx, value, numel, M, K, N) stay for
    callers that iterate.
    """

    COLUMNS = ("site", "op_type", "role", "stat", "idx", "value", "numel", "M", "K", "N")
    _META = ("site", "op_type", "role", "stat", "numel", "M", "K", "N")

    def __init__(self) -> None:
        self._meta: list[tuple] = []  # one (site, op_type, role, stat, numel, M, K, N) per chunk
        self._values: list[np.ndarray] = []

    def add(self, meta: tuple, values: np.ndarray) -> None:
        if len(values):
            self._meta.append(meta)
            self._values.append(np.asarray(values, np.float64))

    def __len__(self) -> int:
        return sum(len(v) for v in self._values)

    def _repeat(self, field_name: str) -> list:
        i = self._META.index(field_name)
        return [m[i] for m, v in zip(self._meta, self._values) for _ in range(len(v))]

    def __getattr__(self, name: str) -> list:
        if name in self._META:
            return self._repeat(name)
        if name == "idx":
            return [j for v in self._values for j in range(len(v))]
        if name == "value":
            return np.concatenate(self._values).tolist() if self._values else []
        raise AttributeError(name)

    def chunks(self) -> list[tuple]:
        """One (site, op_type, role, stat, numel, M, K, N) per chunk of rows, in row order."""
        return list(self._meta)

    def to_pydict(self) -> dict[str, list]:
        return {c: getattr(self, c) for c in self.COLUMNS}

    def to_arrow(self) -> pa.Table:
        """The rows as a pyarrow Table with columns M, K, N, numel, site, op_type, role, stat, idx, value."""
        counts = np.array([len(v) for v in self._values], np.int64)
        chunk = np.repeat(np.arange(len(counts)), counts)
        starts = np.cumsum(counts) - counts
        cols: dict[str, pa.Array] = {}
        for name in ("M", "K", "N", "numel"):
            i = self._META.index(name)
            per_chunk = [m[i] for m in self._meta]
            missing = np.array([v is None for v in per_chunk], bool)
            ints = np.array([0 if v is None else v for v in per_chunk], np.int64)
            cols[name] = arrow_int64(ints[chunk], missing[chunk])
        labels = tuple(m[:4] for m in self._meta)  # (site, op_type, role, stat) per chunk
        cols.update(_label_columns(labels, counts.tobytes()))
        cols["idx"] = arrow_int64(np.arange(len(chunk), dtype=np.int64) - starts[chunk])
        cols["value"] = arrow_float64(np.concatenate(self._values) if self._values else np.zeros(0))
        return pa.table(cols)


@functools.lru_cache(maxsize=2)
def _label_columns(labels: tuple[tuple[str, str, str, str], ...], counts: bytes) -> dict[str, pa.Array]:
    """The site, op_type, role and stat columns of chunks with these labels and row counts. Every batch
    of a recording has the same ones, so they are built once (3,000 taps: ~10 ms a batch otherwise)."""
    chunk = np.repeat(np.arange(len(labels)), np.frombuffer(counts, np.int64))
    cols = {}
    for i, name in enumerate(("site", "op_type", "role", "stat")):
        column = [lab[i] for lab in labels]
        uniq = list(dict.fromkeys(column))
        code = {u: k for k, u in enumerate(uniq)}
        cols[name] = arrow_strings(uniq, np.array([code[v] for v in column], np.int64)[chunk])
    return cols


def arrow_int64(values: np.ndarray, missing: np.ndarray | None = None) -> pa.Array:
    v = np.ascontiguousarray(values, np.int64)
    valid = None
    if missing is not None and missing.any():
        valid = pa.py_buffer(np.packbits(~missing.astype(bool), bitorder="little"))
    return pa.Array.from_buffers(pa.int64(), len(v), [valid, pa.py_buffer(v)])


def arrow_float64(values: np.ndarray) -> pa.Array:
    v = np.ascontiguousarray(values, np.float64)
    return pa.Array.from_buffers(pa.float64(), len(v), [None, pa.py_buffer(v)])


def arrow_strings(labels: list[str], codes: np.ndarray) -> pa.Array:
    """A string column whose row i is labels[codes[i]], its bytes gathered by numpy (a Python join over
    the rows was half of decoding a batch: on a Ray worker that is time the session does not run)."""
    enc = [lab.encode() for lab in labels]
    sizes = np.array([len(e) for e in enc], np.int64)
    lengths = sizes[codes]
    offsets = np.zeros(len(codes) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("string column over 2 GiB")
    pool = np.frombuffer(b"".join(enc), np.uint8)
    label_start = np.cumsum(sizes) - sizes
    # byte j of row i is pool[label_start[codes[i]] + j]: one gather over every byte of the column
    shift = np.repeat(label_start[codes] - offsets[:-1], lengths)
    data = pool[np.arange(offsets[-1], dtype=np.int64) + shift] if len(pool) else np.zeros(0, np.uint8)
    return pa.Array.from_buffers(
        pa.string(), len(codes), [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)]
    )
