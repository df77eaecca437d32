"""Decoded rows of one batch, and Arrow columns built straight from numpy buffers.

`pa.array()` imports pandas when it is installed, and with it pyarrow.compute and numpy.ma
(+40 MB RSS for a recording that needs none of them), so every column here is made with
`pa.Array.from_buffers`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import pyarrow as pa


class RowLayout:
    """What a batch's rows look like apart from their values: one (site, op_type, role, stat, numel, M, K,
    N) and a row count per chunk. Every batch of a recording usually has the same one, so its Arrow
    columns are built once per layout (`columns`), and a batch only brings its value column."""

    def __init__(self, meta: list[tuple] | None, counts: np.ndarray, coded: Coded | None = None):
        if meta is None and coded is None:
            raise ValueError("a row layout needs its chunks' meta or their codes")
        self._meta, self.counts = meta, np.asarray(counts, np.int64)
        self.coded = coded
        self._columns: dict[str, pa.Array] | None = None

    @property
    def meta(self) -> list[tuple]:
        """One (site, op_type, role, stat, numel, M, K, N) per chunk; made from `coded` when first asked for
        (a generate step's layout is new every step, and the tuples are read on its first step only)."""
        if self._meta is None:
            self._meta = _meta_of(self.coded)
        return self._meta

    def columns(self) -> dict[str, pa.Array]:
        """M, K, N, numel, site, op_type, role, stat and idx, in that order, for these chunks."""
        if self._columns is None:
            if self.coded is None:
                self._columns = _layout_columns(self.meta, self.counts)
            else:
                self._columns = _coded_columns(self.coded, self.counts)
        return self._columns


class Coded(NamedTuple):
    """`meta` as per-chunk arrays, for a caller that keeps them (the decode plan): the label columns'
    distinct values and codes [chunk, 4] (site, op_type, role, stat), and [chunk, 4] ints in the order M, K,
    N, numel with their missing mask. Building them from the tuples again cost ~4 ms a decode step on 30 layers."""

    labels: tuple[list[str], list[str], list[str], list[str]]
    codes: np.ndarray
    ints: np.ndarray
    missing: np.ndarray


class Rows:
    """Tidy rows of one batch: one chunk per (site, role, stat), its values kept as numpy arrays until
    columns are asked for.

    `decode` builds one from a cached `RowLayout` and the batch's value column in one piece
    (`of_layout`); `add` appends a chunk. `to_arrow()` builds the table with dictionary codes and numpy
    repeats; building Python lists of ~100k strings per batch made decoding cost more than the taps on
    small models. The list-valued attributes (site, op_type, role, stat, idx, value, numel, M, K, N)
    stay for callers that iterate.
    """

    COLUMNS = ("site", "op_type", "role", "stat", "idx", "value", "numel", "M", "K", "N")
    _META = ("site", "op_type", "role", "stat", "numel", "M", "K", "N")

    def __init__(self) -> None:
        self._meta: list[tuple] = []  # one (site, op_type, role, stat, numel, M, K, N) per chunk
        self._values: list[np.ndarray] = []
        self._layout: RowLayout | None = None  # of_layout: meta and counts there, values in _flat
        self._flat = np.zeros(0)

    @classmethod
    def of_layout(cls, layout: RowLayout, values: np.ndarray) -> Rows:
        """Rows of `layout` whose value column is `values` (float64, len = the layout's row count)."""
        rows = cls()
        rows._layout, rows._flat = layout, values
        return rows

    def _unpack(self) -> None:
        """Back to one array per chunk, before a chunk is added to rows made `of_layout`."""
        if self._layout is not None:
            self._meta = list(self._layout.meta)
            self._values = np.split(self._flat, np.cumsum(self._layout.counts)[:-1]) if self._meta else []
            self._layout = None

    def add(self, meta: tuple, values: np.ndarray) -> None:
        if len(values):
            self._unpack()
            self._meta.append(meta)
            self._values.append(np.asarray(values, np.float64))

    def __len__(self) -> int:
        return len(self._flat) if self._layout is not None else sum(len(v) for v in self._values)

    @property
    def layout(self) -> RowLayout:
        """The layout of these rows: the decode's cached one (shared by every batch of that shape), or one
        made for rows built by `add`."""
        return self._layout or RowLayout(self._meta, self._counts())

    def _counts(self) -> np.ndarray:
        return (
            self._layout.counts
            if self._layout is not None
            else np.array([len(v) for v in self._values], np.int64)
        )

    def values(self) -> np.ndarray:
        """The value column, float64, in row order."""
        if self._layout is not None:
            return self._flat
        return np.concatenate(self._values) if self._values else np.zeros(0)

    def _repeat(self, field_name: str) -> list:
        i = self._META.index(field_name)
        return [m[i] for m, c in zip(self.chunks(), self._counts().tolist()) for _ in range(c)]

    def __getattr__(self, name: str) -> list:
        if name in self._META:
            return self._repeat(name)
        if name == "idx":
            return [j for c in self._counts().tolist() for j in range(c)]
        if name == "value":
            return self.values().tolist()
        raise AttributeError(name)

    def chunks(self) -> list[tuple]:
        """One (site, op_type, role, stat, numel, M, K, N) per chunk of rows, in row order."""
        return list(self._layout.meta if self._layout is not None else self._meta)

    def to_pydict(self) -> dict[str, list]:
        return {c: getattr(self, c) for c in self.COLUMNS}

    def to_arrow(self) -> pa.Table:
        """The rows as a pyarrow Table with columns M, K, N, numel, site, op_type, role, stat, idx, value."""
        return pa.table({**self.layout.columns(), "value": arrow_float64(self.values())})


def _meta_of(coded: Coded) -> list[tuple]:
    labels = [[v[i] for i in c] for v, c in zip(coded.labels, coded.codes.T.tolist())]
    ints = [[None if gone else v for v, gone in zip(col, miss)]
            for col, miss in zip(coded.ints.T.tolist(), coded.missing.T.tolist())]  # fmt: skip
    m, k, n, numel = ints
    return list(zip(*labels, numel, m, k, n))


def _layout_columns(meta: list[tuple], counts: np.ndarray) -> dict[str, pa.Array]:
    chunk = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    cols: dict[str, pa.Array] = {}
    for name in ("M", "K", "N", "numel"):
        i = Rows._META.index(name)
        per_chunk = [m[i] for m in meta]
        missing = np.array([v is None for v in per_chunk], bool)
        ints = np.array([0 if v is None else v for v in per_chunk], np.int64)
        cols[name] = arrow_int64(ints[chunk], missing[chunk])
    labels = tuple(m[:4] for m in meta)  # (site, op_type, role, stat) per chunk
    cols.update(_label_columns(labels, counts.tobytes()))
    cols["idx"] = arrow_int64(np.arange(len(chunk), dtype=np.int64) - starts[chunk])
    return cols


def _coded_columns(coded: Coded, counts: np.ndarray) -> dict[str, pa.Array]:
    chunk = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    cols: dict[str, pa.Array] = {}
    for j, name in enumerate(("M", "K", "N", "numel")):
        cols[name] = arrow_int64(coded.ints[chunk, j], coded.missing[chunk, j])
    for j, name in enumerate(("site", "op_type", "role", "stat")):
        cols[name] = arrow_strings(coded.labels[j], coded.codes[chunk, j])
    cols["idx"] = arrow_int64(np.arange(len(chunk), dtype=np.int64) - starts[chunk])
    return cols


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
    """A string column whose row i is labels[codes[i]]: the dictionary's `take` (Arrow's C++ gather;
    a Python join over the rows was half of decoding a batch, numpy's gather over every byte 10x
    slower than `take`). Its dictionary-encoded twin is kept beside it (`dictionary_twin`) for the
    Parquet writer."""
    enc = [lab.encode() for lab in labels]
    sizes = np.array([len(e) for e in enc], np.int64)
    if int(sizes[codes].sum()) >= 2**31:
        raise ValueError("string column over 2 GiB")
    label_offsets = np.zeros(len(enc) + 1, np.int32)
    np.cumsum(sizes, out=label_offsets[1:])
    dictionary = pa.Array.from_buffers(
        pa.string(), len(enc), [None, pa.py_buffer(label_offsets), pa.py_buffer(b"".join(enc))]
    )
    indices = pa.Array.from_buffers(pa.int32(), len(codes), [None, pa.py_buffer(codes.astype(np.int32))])
    if len(enc) == 1:  # one label (a run id, a phase): its bytes repeated, no gather (a generate step's 4
        # constant columns of ~60k rows were 4 takes, ~5 ms a step; their row count changes every step)
        n = len(codes)
        offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(enc[0]))
        column = pa.Array.from_buffers(
            pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(enc[0] * n)]
        )
    else:
        column = dictionary.take(indices)
    _TWINS[_identity(column)] = (column, pa.DictionaryArray.from_arrays(indices, dictionary))
    while len(_TWINS) > _KEEP_TWINS:
        _TWINS.pop(next(iter(_TWINS)))
    return column


# Label columns are built once per row layout and reused by every batch; the Parquet writer takes a
# dictionary-encoded column without hashing its strings again (~1 ms a column on 20k rows, most of
# what writing a part cost), so each keeps its twin here, by the address of its buffers (a table
# hands out a new Python object for the same column each time; the entry holds the column, so its
# buffers stay where they are).
_TWINS: dict[tuple[int, int, int], tuple[pa.Array, pa.DictionaryArray]] = {}
_KEEP_TWINS = 32


def _identity(column: pa.Array) -> tuple[int, int, int]:
    _, offsets, data = column.buffers()
    return offsets.address, data.address if data is not None else 0, len(column)


def dictionary_twin(column: pa.Array) -> pa.Array:
    """The dictionary-encoded twin of a column `arrow_strings` made, or the column itself."""
    if not pa.types.is_string(column.type) or column.offset:
        return column
    twin = _TWINS.get(_identity(column))
    return twin[1] if twin is not None else column
