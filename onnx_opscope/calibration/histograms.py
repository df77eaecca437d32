"""Exact histograms over a fixed range per tensor, counted in the graph and summed across batches.

Percentile, entropy and MSE calibration need one distribution per tensor over all batches,
so the range must be fixed before counting: pass 1 (min/max, `calibration.taps`) gives each
tensor's [min, max], this pass counts every element in `bins` bins of that range. Per tensor,
appended to the graph that defines it (If / Loop / Scan bodies too, carried out by
`graph.expose`), in float32:

    c = Clip(x, lo, hi);  t = Clip(Floor(c·n + off), 0, bins-1)     n = bins/(hi-lo), off = -lo·n
    t -= c < E[t];  t += c >= E[t+1]                                E: the bin edges, E[bins] = +inf
    counts = ScatterElements(zeros[bins] int64, t, valid, reduction="add")

The second line makes the counts those of `np.histogram(x, bins, range=(lo, hi))` exactly,
which is what onnxruntime's HistogramCollector calls: numpy bins by comparing with its
float32 `linspace` edges (last bin closed), and Floor(c·n) alone misplaces ~1e-4 of the
elements near an edge (every zero, when 0 is an edge and n is not a power of two). c·n + off
rather than (c - lo)·n, so a span over float32 max (masks of -3.4e38) does not overflow.

Counting: ScatterElements(add) on int64 from opset 16 (int64, so a bin is exact past 2**24
elements in one batch, where the float32 `sketch.histogram` counter would round); Unique's
counts at opsets 11-15 (it sorts: ~8x slower); below 11 the int32 bin indices come back and
the host counts them (tensor-sized transfers: the one case that copies). The host sums the
[bins] counts of each batch into one int64 array per tensor: memory is bins-sized, flat in
the number of batches, whatever the sequence length of each batch.

Modes (what onnxruntime's calibrators histogram, `HistogramCollector`, onnxruntime 1.32):
- "symmetric": x over [-t, t], t = max(|min|, |max|), the `collect_value` range that
  entropy, distribution and asymmetric percentile use;
- "absolute": |x| over [0, t], the `collect_absolute_value` of symmetric percentile (which
  starts at min |x| of its first batch; 0 here, so edges are the same for every batch);
- "minmax": x over [min, max] as given.

Values: NaN and ±inf are not counted (`Histogram.nonfinite` says how many): onnxruntime
ignores NaN in its min/max and histogram, and fails on inf (its range becomes infinite).
Finite values outside [lo, hi] (only when the caller narrows the range) are clipped into the
edge bins, as onnxruntime's clipping to the range would saturate them. A -3.4e38 mask inside
the range is counted where it lies: in the lowest bin; with the pass-1 range that spans it,
onnxruntime's histogram does the same, and grows by ~1e38/width bins until it runs out of
memory, where ours stays `bins` long. To keep masks out of the distribution, give a range
that excludes them: they then saturate in bin 0 (and `compute_ranges` treats bin 0's
outliers as onnxruntime treats outliers).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from onnx import ModelProto, TensorProto, ValueInfoProto

from ..errors import OpscopeError
from ..graph import Builder, ModelIndex, load_model, opset_version
from ..graph.expose import expose
from ..graph.io import ModelLike
from ..graph.opset import has_op, scatter_add_available
from ..run.session import RuntimeConfig, for_tapped, make_session, run

MODES = ("symmetric", "absolute", "minmax")
F32_MAX = float(np.finfo(np.float32).max)
I64 = TensorProto.INT64


@dataclass(frozen=True)
class Histogram:
    """Counts of one tensor over all batches: `counts[i]` values in [edges[i], edges[i+1]) (last bin closed).

    `lo`, `hi`: the range counted (of |x| in mode "absolute"); `x_min`, `x_max`: the tensor's own
    min and max (pass 1), which onnxruntime clips its thresholds to; `nonfinite`: NaN / inf
    values not counted.
    """

    counts: np.ndarray
    lo: float
    hi: float
    mode: str = "minmax"
    x_min: float = 0.0
    x_max: float = 0.0
    nonfinite: int = 0

    @property
    def bins(self) -> int:
        return int(self.counts.size)

    @property
    def edges(self) -> np.ndarray:
        return bin_edges(self.lo, self.hi, self.bins)

    @property
    def width(self) -> float:
        return (self.hi - self.lo) / self.bins


def bin_edges(lo: float, hi: float, bins: int) -> np.ndarray:
    """The float32 edges np.histogram uses for a float32 tensor on range (float32 lo, float32 hi),
    as onnxruntime calls it; an empty range widens to [lo - 0.5, hi + 0.5], as numpy does."""
    lo32, hi32 = np.float32(lo), np.float32(hi)
    if np.isfinite(np.float64(hi32) - np.float64(lo32)) and abs(float(hi32) - float(lo32)) < F32_MAX:
        return np.histogram_bin_edges(np.zeros(0, np.float32), bins, range=(lo32, hi32))
    # a span over float32 max (masks of -3.4e38 to +x): numpy cannot (nor can onnxruntime); float64 edges
    return np.linspace(np.float64(lo32), np.float64(hi32), bins + 1).astype(np.float32)


def counting_range(lo: float, hi: float, mode: str) -> tuple[float, float]:
    """The range counted for a tensor whose pass-1 min / max are lo / hi, in `mode` (see the module doc)."""
    if mode not in MODES:
        raise OpscopeError(f"unknown histogram mode {mode!r}; choose one of: {', '.join(MODES)}")
    if mode == "minmax":
        return float(lo), float(hi)
    t = float(max(abs(np.float32(lo)), abs(np.float32(hi))))
    return (-t, t) if mode == "symmetric" else (0.0, t)


@dataclass(frozen=True)
class _Tap:
    name: str
    counts: str  # output name: [bins] int64 counts, or int32 bin indices (host counting)
    size: str  # output name: the tensor's element count (int64 scalar)
    stacked: int
    host: bool
    lo: float
    hi: float
    x_min: float
    x_max: float


def _key(t: Any) -> tuple[str, str | None, int | None]:
    """(name, graph path or None, element type or None) of a ranges key: a name, or A's CalibTensor."""
    if isinstance(t, str):
        return t, None, None
    return t.name, getattr(t, "path", None), getattr(t, "elem", None)


def _find_path(index: ModelIndex, name: str) -> str:
    """The graph that defines `name` (the main graph first)."""
    for path, entry in index.graphs.items():
        if entry.defines(name):
            return path
    raise OpscopeError(f"tensor {name!r} is not in the model")


def _elem_of(index: ModelIndex, path: str, name: str) -> int | None:
    for entry in index.scopes(path):
        g = entry.graph
        vis: Iterable[ValueInfoProto] = [*g.input, *g.value_info, *g.output]
        for vi in vis:
            if vi.name == name and vi.type.HasField("tensor_type"):
                return vi.type.tensor_type.elem_type
    return None


def _bin_index(b: Builder, x: str, lo: float, hi: float, bins: int, absolute: bool) -> tuple[str, str]:
    """(int64 bin index of each element, bool mask of the finite ones), both of x's shape."""
    edges = bin_edges(lo, hi, bins)
    lo32, hi32 = float(edges[0]), float(edges[-1])
    n = np.float32(bins / (np.float64(hi32) - np.float64(lo32)))
    off = np.float32(-np.float64(lo32) * np.float64(n))
    bad = b.nonfinite(x)
    v = b.op("Abs", [x]) if absolute else x
    c = b.clip(v, lo32, hi32)  # inf -> an edge (then masked); NaN stays NaN:
    c = b.where(bad, b.const(np.float32(lo32)), c)  # no NaN may reach the int cast / Gather
    t = b.clip(b.op("Floor", [b.op("Add", [b.op("Mul", [c, b.const(n)]), b.const(off)])]), 0.0, bins - 1.0)
    t = b.cast(t, I64)
    table = b.const(np.append(edges[:-1], np.float32(np.inf)).astype(np.float32))  # last bin closed
    below = b.cast(b.op("Less", [c, b.op("Gather", [table, t], axis=0)]), I64)
    upper = b.op("Gather", [table, b.op("Add", [t, b.i64(1)])], axis=0)
    above = b.cast(b.op("Not", [b.op("Less", [c, upper])]), I64)
    t = b.op("Add", [b.op("Sub", [t, below]), above])
    return t, b.op("Not", [bad])


def _count(b: Builder, t: str, valid: str, bins: int) -> tuple[str, bool]:
    """(output to expose, whether the host counts it): [bins] int64 counts, or the indices below opset 11."""
    idx = b.flat(t)
    if scatter_add_available(b.opset):
        return b.scatter_add(
            b.const(np.zeros(bins, np.int64), np.int64), idx, b.flat(b.cast(valid, I64))
        ), False
    dropped = b.where(b.flat(valid), idx, b.i64(bins), I64)  # non-finite: an extra bin, sliced off
    if has_op("Unique", b.opset):
        values, counts = b.unique_counts(dropped)
        hist = b.op(
            "ScatterElements", [b.const(np.zeros(bins + 1, np.int64), np.int64), values, counts], axis=0
        )
        return b.slice(hist, 0, bins, 0), False
    return b.cast(dropped, TensorProto.INT32), True


def add_histogram_taps(
    model: ModelProto,
    ranges: Mapping[Any, tuple[float, float]],
    bins: int = 2048,
    mode: str = "symmetric",
) -> list[_Tap]:
    """Append the counting subgraph of each tensor to `model` (in place: only appends, after the
    model's own outputs). `ranges`: the pass-1 (min, max) of each tensor, keyed by name or by
    a `CalibTensor` (which also gives the graph path and element type)."""
    if bins < 1:
        raise OpscopeError(f"bins must be a positive integer, got {bins}")
    index = ModelIndex(model)
    names = index.names()
    opset = opset_version(model)
    taps = []
    for key, (x_min, x_max) in ranges.items():
        name, path, elem = _key(key)
        path = _find_path(index, name) if path is None else path
        elem = _elem_of(index, path, name) if elem is None else elem
        lo, hi = counting_range(x_min, x_max, mode)
        b = Builder(opset, names, prefix="opscope_hist_")
        x = name if elem == TensorProto.FLOAT else b.cast(name, TensorProto.FLOAT)
        t, valid = _bin_index(b, x, lo, hi, bins, absolute=mode == "absolute")
        out, host = _count(b, t, valid, bins)
        size = b.op("Size", [x])
        index[path].graph.node.extend(b.nodes)
        counts_out, stacked = expose(index, path, out, TensorProto.INT32 if host else I64, 1, names)
        size_out, _ = expose(index, path, size, I64, 0, names)
        edges = bin_edges(lo, hi, bins)
        taps.append(
            _Tap(name, counts_out, size_out, stacked, host, float(edges[0]), float(edges[-1]), x_min, x_max)
        )
    return taps


def _accumulate(acc: np.ndarray, got: np.ndarray, tap: _Tap, bins: int) -> None:
    if tap.host:
        idx = np.asarray(got).ravel().astype(np.intp, copy=False)
        acc += np.bincount(idx, minlength=bins + 1)[:bins]
    else:  # a Loop / Scan body's counts come back once per iteration: sum the stacked axes
        acc += np.asarray(got, np.int64).reshape(-1, bins).sum(axis=0)


def histogram_pass(
    model: ModelLike,
    ranges: Mapping[Any, tuple[float, float]],
    feeds: Iterable[Mapping[str, np.ndarray]],
    runtime: RuntimeConfig | None = None,
    *,
    bins: int = 2048,
    mode: str = "symmetric",
    base_dir: str | os.PathLike | None = None,
) -> dict[str, Histogram]:
    """Histograms of every tensor in `ranges` over all `feeds` (one session run per feed dict).

    `ranges`: each tensor's (min, max) from pass 1, keyed by name or `CalibTensor`; `mode`:
    "symmetric" | "absolute" | "minmax" (the module doc). The model is not changed (a copy is
    instrumented); external weights stay on disk. `base_dir`: the folder a ModelProto's external
    data locations are relative to (default: a path's own folder).
    """
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    tapped = ModelProto()
    tapped.CopyFrom(load_model(model))
    taps = add_histogram_taps(tapped, ranges, bins, mode)
    session = make_session(tapped, for_tapped(runtime or RuntimeConfig()), base_dir=base_dir)
    outputs = [o for tap in taps for o in (tap.counts, tap.size)]
    acc = {tap.name: np.zeros(bins, np.int64) for tap in taps}
    sizes = dict.fromkeys(acc, 0)
    for feed in feeds:
        got = run(session, feed, outputs)
        for k, tap in enumerate(taps):
            _accumulate(acc[tap.name], got[2 * k], tap, bins)
            sizes[tap.name] += int(np.asarray(got[2 * k + 1], np.int64).sum())
    return {
        tap.name: Histogram(
            acc[tap.name],
            tap.lo,
            tap.hi,
            mode,
            float(tap.x_min),
            float(tap.x_max),
            sizes[tap.name] - int(acc[tap.name].sum()),
        )
        for tap in taps
    }
