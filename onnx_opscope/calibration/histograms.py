"""Exact histograms over a fixed range per tensor, counted in the graph and summed across batches.

Percentile, entropy and MSE calibration need one distribution per tensor over all batches,
so the range must be fixed before counting: pass 1 (min/max, `calibration.taps`) gives each
tensor's [min, max], this pass counts every element in `bins` bins of that range. Per tensor,
appended to the graph that defines it (If / Loop / Scan bodies too, carried out by
`graph.expose`), in float32:

    t = Clip(Floor(x·n + off + eps), 1, bins)              n = bins/(hi-lo), off = -lo·n
    t -= x < t·step + lo                                   step = (hi-lo)/bins, as numpy's linspace
    t = bins + 1 where x is NaN or ±inf                    (not counted; `Histogram.nonfinite`)

The counts are those of `np.histogram(x, bins, range=(lo, hi))` exactly, which is what
onnxruntime's HistogramCollector calls: numpy bins by comparing with its float32 `linspace`
edges (last bin closed), and Floor(x·n) alone misplaces ~1e-4 of the elements near an edge
(every zero, when 0 is an edge and n is not a power of two). The estimate is biased up by
`eps` (twice a bound on its rounding error, `_estimate_error`), so it is the bin or the one
above, and one comparison with its left edge, computed in float32 as linspace computes it,
decides; `_arithmetic_step` checks that arithmetic against numpy's own edges when the taps are
built. Where no such bound holds (a span over float32 max, as with -3.4e38 masks, or a narrow
range far from 0) both neighbouring edges come from a table (two Gathers: slower, as exact).
x·n + off rather than (x - lo)·n, so such a span does not overflow.

Counting, fastest first on each provider: on onnxruntime's CPU provider the main graph's
indices come back in the narrowest unsigned type (uint8 up to 254 bins, uint16 up to 65534)
and np.bincount counts them: ~4 ns an element against ~12 for ScatterElements(add) and ~60 for
Unique's sort. Elsewhere (a GPU keeps the work on the device; a Loop body's per-iteration
indices could not be stacked) the graph counts: ScatterElements(add) on int64 from opset 16
(exact past 2**24 elements), Unique's counts at opsets 11-15; below 11 the host counts. The
host sums the [bins + 2] counts of each batch into one int64 array per tensor: memory is
bins-sized, flat in the number of batches, whatever the sequence length of each batch.

Modes (what onnxruntime's calibrators histogram, `HistogramCollector`, onnxruntime 1.32):
- "symmetric": x over [-t, t], t = max(|min|, |max|), the `collect_value` range that
  entropy, distribution and asymmetric percentile use;
- "absolute": |x| over [0, t], the `collect_absolute_value` of symmetric percentile (which
  starts at min |x| of its first batch; 0 here, so edges are the same for every batch);
- "minmax": x over [min, max] as given.

Values: NaN and ±inf are not counted (`Histogram.nonfinite` says how many): onnxruntime
ignores NaN in its min/max and histogram, and fails on inf (its range becomes infinite).
Finite values outside [lo, hi] (only when the caller narrows the range) go to the
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
from ..graph.io import ModelLike, without_weight_data
from ..graph.opset import has_op, scatter_add_available
from ..run.engine import Engine, run_batches, sessions_for
from ..run.session import CPU, RuntimeConfig, for_tapped, resolve_providers

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
    counts: str  # output name: [bins + 2] int64 counts, or the bin indices (host counting)
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


def _arithmetic_step(lo32: float, hi32: float, edges: np.ndarray) -> np.float32 | None:
    """numpy's linspace step when fl(fl(k·step) + lo) reproduces every inner edge (its float32 arithmetic),
    else None (then the edges are looked up in a table: a span over float32 max, or a zero step)."""
    step = np.float32(np.float32(np.float32(hi32) - np.float32(lo32)) / np.float32(edges.size - 1))
    if not np.isfinite(step) or step == 0:
        return None
    k = np.arange(1, edges.size - 1, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        ok = np.array_equal(k * step + np.float32(lo32), edges[1:-1])
    return step if ok else None


def _estimate_error(lo32: float, hi32: float, bins: int) -> float:
    """A bound, in bins, on how far Floor(x·n + off) and the float32 edges stray from exact arithmetic:
    a few unit roundoffs of the index and of the largest magnitude over the bin width (module doc)."""
    u = 2.0**-24
    span = np.float64(hi32) - np.float64(lo32)
    return float(4 * u * bins + 4 * u * max(abs(lo32), abs(hi32)) * bins / span)


def _bin_index(b: Builder, x: str, lo: float, hi: float, bins: int, absolute: bool) -> str:
    """The float32 bin of each element of x, numpy's exactly; `bins` + 1 for NaN / ±inf; `bins` for
    the top edge (folded into the last bin by the caller, as numpy closes it).

    An estimate biased up by `eps` is the bin or the one above it, so one comparison with its own
    left edge, computed as numpy's linspace does, corrects it (no table lookup, which costs more
    than the rest of the arithmetic). Where that cannot be guaranteed (a span over float32 max, a
    narrow range far from 0) the edges come from a table, below and above.
    """
    edges = bin_edges(lo, hi, bins)
    lo32, hi32 = float(edges[0]), float(edges[-1])
    n = np.float32(bins / (np.float64(hi32) - np.float64(lo32)))
    off = -np.float64(lo32) * np.float64(n)
    step = _arithmetic_step(lo32, hi32, edges)
    v = b.op("Abs", [x]) if absolute else x
    if step is not None and (delta := _estimate_error(lo32, hi32, bins)) < 0.3:
        # t in {k, k + 1} for the true bin k, clipped to [1, bins]: t -= v < E[t] then gives k
        # (below the range: 0; at or over its top: bins, which the caller folds into the last bin)
        up = b.op("Add", [b.op("Mul", [v, b.const(n)]), b.const(np.float32(off + 2 * delta))])
        t = b.clip(b.op("Floor", [up]), 1.0, float(bins))
        left = b.op("Add", [b.op("Mul", [t, b.const(step)]), b.const(np.float32(lo32))])
        t = b.op("Sub", [t, b.cast(b.op("Less", [v, left]), TensorProto.FLOAT)])
    else:  # t within one bin either way: compare with both table edges
        t = b.clip(
            b.op("Floor", [b.op("Add", [b.op("Mul", [v, b.const(n)]), b.const(np.float32(off))])]),
            0.0,
            bins - 1.0,
        )
        table = b.const(np.append(edges[:-1], np.float32(np.inf)).astype(np.float32))
        ti = b.cast(t, I64)
        below = b.cast(b.op("Less", [v, b.op("Gather", [table, ti], axis=0)]), TensorProto.FLOAT)
        upper = b.op("Gather", [table, b.op("Add", [ti, b.i64(1)])], axis=0)
        t = b.op("Add", [b.op("Sub", [t, below]), b.cast(b.greater_equal(v, upper), TensorProto.FLOAT)])
    return b.where(b.nonfinite(x), b.const(np.float32(bins + 1)), t)


def _index_type(bins: int) -> int:
    """The narrowest unsigned type holding bins + 2 indices: what the host reads back per element."""
    return (
        TensorProto.UINT8
        if bins + 2 <= 256
        else TensorProto.UINT16
        if bins + 2 <= 65536
        else TensorProto.INT32
    )


def _count(b: Builder, t: str, bins: int, host: bool) -> str:
    """[bins + 2] int64 counts of the float bin indices t (last two: the top edge, non-finite values),
    or, with `host`, the indices themselves in the narrowest integer type, counted by np.bincount.

    On onnxruntime's CPU provider the host count is the fastest exact one: ScatterElements(add)
    costs ~12 ns an element, np.bincount of the narrow indices ~4, Unique (a sort, opsets 11-15)
    ~60. Below opset 11 there is nothing else.
    """
    if host:
        return b.cast(b.flat(t), _index_type(bins))
    idx = b.flat(b.cast(t, I64))
    zeros = b.const(np.zeros(bins + 2, np.int64), np.int64)
    if scatter_add_available(b.opset):
        ones = b.op("Expand", [b.i64(1), b.op("Shape", [idx])])
        return b.scatter_add(zeros, idx, ones)
    values, counts = b.unique_counts(idx)
    return b.op("ScatterElements", [zeros, values, counts], axis=0)


def add_histogram_taps(
    model: ModelProto,
    ranges: Mapping[Any, tuple[float, float]],
    bins: int = 2048,
    mode: str = "symmetric",
    host_counts: bool = False,
) -> list[_Tap]:
    """Append the counting subgraph of each tensor to `model` (in place: only appends, after the
    model's own outputs). `ranges`: the pass-1 (min, max) of each tensor, keyed by name or by
    a `CalibTensor` (which also gives the graph path and element type). `host_counts`: main-graph
    tensors return their bin indices, counted on the host (`_count`: the CPU provider's fastest)."""
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
        t = _bin_index(b, x, lo, hi, bins, absolute=mode == "absolute")
        # a Loop body's indices would differ in length per iteration: stacked, they must not
        host = (host_counts and not path) or not has_op("Unique", opset)
        out = _count(b, t, bins, host)
        index[path].graph.node.extend(b.nodes)
        counts_out, stacked = expose(index, path, out, _index_type(bins) if host else I64, 1, names)
        edges = bin_edges(lo, hi, bins)
        taps.append(_Tap(name, counts_out, stacked, host, float(edges[0]), float(edges[-1]), x_min, x_max))
    return taps


def _accumulate(acc: np.ndarray, got: np.ndarray, tap: _Tap) -> None:
    """Add one run's counts of a tensor to `acc` ([bins + 2]: the top edge and non-finite last)."""
    if tap.host:
        acc += np.bincount(np.asarray(got).ravel(), minlength=acc.size)
    else:  # a Loop / Scan body's counts come back once per iteration: sum the stacked axes
        acc += np.asarray(got, np.int64).reshape(-1, acc.size).sum(axis=0)


def histogram_pass(
    model: ModelLike,
    ranges: Mapping[Any, tuple[float, float]],
    feeds: Iterable[Mapping[str, np.ndarray]],
    runtime: RuntimeConfig | None = None,
    *,
    bins: int = 2048,
    mode: str = "symmetric",
    base_dir: str | os.PathLike | None = None,
    engine: Engine | None = None,
) -> dict[str, Histogram]:
    """Histograms of every tensor in `ranges` over all `feeds` (one session run per feed dict; on
    `engine`'s Ray workers each counts its batches and returns [bins + 2] arrays, summed here).

    `ranges`: each tensor's (min, max) from pass 1, keyed by name or `CalibTensor`; `mode`:
    "symmetric" | "absolute" | "minmax" (the module doc). The model is not changed (a copy is
    instrumented); external weights stay on disk. `base_dir`: the folder a ModelProto's external
    data locations are relative to (default: a path's own folder).
    """
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    source = load_model(model)
    tapped = without_weight_data(source)  # the weights stay in `source`; the session borrows them
    runtime = runtime or RuntimeConfig()
    cpu_only = resolve_providers(runtime.providers, runtime.fallback) == [CPU]
    taps = add_histogram_taps(tapped, ranges, bins, mode, host_counts=cpu_only)
    engine = engine or Engine()
    data, factory = sessions_for(engine, tapped, for_tapped(runtime), base_dir, weights_from=source)
    outputs = [tap.counts for tap in taps]
    acc = {tap.name: np.zeros(bins + 2, np.int64) for tap in taps}
    for _, counts in run_batches(engine, data, factory, feeds, outputs, BatchCounts(taps, bins)):
        for tap, c in zip(taps, counts):
            acc[tap.name] += c
    return {tap.name: _histogram(acc[tap.name], tap, mode) for tap in taps}


@dataclass(frozen=True)
class BatchCounts:
    """One batch's [bins + 2] counts per tap, from its outputs (where the batch ran: a Ray worker
    sends these back, not the bin indices)."""

    taps: list[_Tap]
    bins: int

    def __call__(self, step: int, outputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = []
        for tap in self.taps:
            acc = np.zeros(self.bins + 2, np.int64)
            _accumulate(acc, outputs[tap.counts], tap)
            out.append(acc)
        return out


def _histogram(acc: np.ndarray, tap: _Tap, mode: str) -> Histogram:
    counts = acc[:-2].copy()
    counts[-1] += acc[-2]  # the top edge: numpy's last bin is closed
    return Histogram(counts, tap.lo, tap.hi, mode, float(tap.x_min), float(tap.x_max), int(acc[-1]))
