"""The histogram and the fingerprint: where a tensor's values lie, and a few of them to recognise it by.

`hist` counts `hist_bins` bins of y = x / (max|x| + 1e-12) over [-1, 1], or of x over a fixed
`hist_range`, over the finite values. Modes (`SketchOptions.hist_mode`):

- sampled (default): ~`sample_size` elements in blocks of 16 at golden-ratio positions
  (`sample_positions`), gathered outside the finite split; binned on the host. Within a
  median total-variation distance of 0.021 of the exact histogram over 418 real tensors.
- exact: every element, binned in the graph and counted there (ScatterElements add from
  opset 16, Unique's counts before), or binned in the graph as one-byte indices that the
  host counts with np.bincount (`exact_counts="host"`, what `for_providers` picks on CPU,
  and `for_opset` below opset 11, where neither counting op exists).
- host: the tensor copied out whole and binned in numpy.

`elemsig` is k = min(16, m) of the m sampled values, evenly spaced in the sample: a
fingerprint for repeats across steps, with no node of its own.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..graph.build import Builder
from ..graph.opset import scatter_add_available
from . import merge
from .base import OUTER, Sketch, Tolerance, as_f64
from .context import EPS_SCALE, GOLDEN, SAMPLE_BLOCK, TapContext
from .moments import host_scale
from .options import SketchOptions, TapInfo


def sample_positions(n: int, sample_size: int) -> np.ndarray:
    """Flat positions of the sampled histogram: every element when n <= sample_size, else
    k = ceil(sample_size / g) blocks of g contiguous elements (g = 16 when 16 divides n, else
    1), block j at floor(frac(j * golden ratio) * n/g) (every block, in order, when there are
    at most k): a low-discrepancy sequence, so the blocks cover the tensor evenly without
    lining up with any row or channel period (evenly spaced blocks did: every block of a
    [512, 256] tensor fell on channels 0-15; a fixed prime stride clusters when it is close to
    a multiple of n/g).

    Blocks, not scattered single elements: 4096 positions j * 1000003 mod n cost 3x more on
    the BERT-like encoder (a cache miss each, and index arithmetic on 4096 int64s), and whole
    rows (the cheapest) follow the tensor's structure: total-variation distance to the exact
    histogram up to 0.21 on the real models, where spread blocks stay within ~0.1.
    """
    g, j = sample_blocks(n, sample_size)
    return (j[:, None] * g + np.arange(g, dtype=np.int64)[None, :]).ravel()


def _grid(n, sample_size: int):
    """(g, k): blocks of g elements (16 when 16 divides n, else 1), k of them; n an int or an int array."""
    g = np.where(n % SAMPLE_BLOCK == 0, SAMPLE_BLOCK, 1)
    return g, np.minimum(n // g, -(-sample_size // g))


def sample_lengths(numels: np.ndarray, sample_size: int) -> np.ndarray:
    """The length of `sample_positions(n, sample_size)` for each n, without the positions (the decode
    splits a pack of samples by it, `instrument.packing`)."""
    g, k = _grid(numels, sample_size)
    return g * k


def sample_blocks(n: int, sample_size: int) -> tuple[int, np.ndarray]:
    """(g, the block indices) of `sample_positions`: what `context.sample_index` computes in the graph."""
    g, k = (int(v) for v in _grid(n, sample_size))
    rows = n // g
    j = np.arange(k, dtype=np.int64)
    if k < rows:  # else every block, in order
        u = j * GOLDEN
        j = np.floor((u - np.floor(u)) * np.float64(rows)).astype(np.int64)
    return g, j


def reads_samples(sketches: list[str], o: SketchOptions) -> bool:
    """Whether a tap with these sketches gathers the sample (`TapContext.samples`)."""
    return "elemsig" in sketches or ("hist" in sketches and o.hist_mode == "sampled")


def hist_counts(values: np.ndarray, scale: float, o: SketchOptions) -> np.ndarray:
    """Bin like the graph does (float32 arithmetic), so exact and host modes agree bit for bit."""
    v = np.asarray(values, np.float32).ravel()
    v = v[np.isfinite(v)]
    bins = o.hist_bins
    if o.hist_range is None:
        t = np.floor((v / np.float32(scale) + np.float32(1)) * np.float32(bins / 2))
    else:
        lo, hi = np.float32(o.hist_range[0]), np.float32(o.hist_range[1])
        v = v[(v >= lo) & (v <= hi)]
        t = np.floor((v - lo) / np.float32((hi - lo) / bins))
    idx = np.clip(t, 0, bins - 1).astype(np.int64)
    return np.bincount(idx, minlength=bins).astype(np.float64)


def index_dtype(o: SketchOptions) -> int:
    """Element type of the host-counted bin indices: one byte while the bins (plus the drop bin) fit."""
    return TensorProto.UINT8 if o.hist_bins < 255 else TensorProto.INT32


# --------------------------------------------------------------------------------------------
# graph side


def _bins(c: TapContext) -> tuple[str, str | None]:
    """(bin index as float, clipped to [0, bins-1]; the mask of values that count, or None for all),
    with the float32 arithmetic `hist_counts` repeats on the host."""
    b, o = c.b, c.options
    bins = o.hist_bins
    if o.hist_range is None:
        t = b.op("Floor", [b.op("Mul", [b.op("Add", [c.y_unit, b.const(1.0)]), b.const(bins / 2)])])
        valid = None
    else:
        lo, hi = (np.float32(v) for v in o.hist_range)
        width = b.const(np.float32((hi - lo) / bins))
        t = b.op("Floor", [b.op("Div", [b.op("Sub", [c.xs, b.const(lo)]), width])])
        inside = [
            b.op("Not", [b.op("Less", [c.xs, b.const(lo)])]),
            b.op("Not", [b.op("Greater", [c.xs, b.const(hi)])]),
        ]
        valid = b.op("And", inside)
    if c.bad is not None:
        ok = b.op("Not", [c.bad])
        valid = ok if valid is None else b.op("And", [valid, ok])
    return b.clip(t, 0.0, float(bins - 1)), valid


def _count_bins(b: Builder, t: str, valid: str | None, o: SketchOptions) -> str:
    """Exact in-graph counts: ScatterElements(add) from opset 16; before, Unique's counts.

    Unique (opset 11) sorts, so it costs ~8x a scatter-add on CPU, but a bins-wide one-hot
    compare was ~70x plain inference on a BERT-like model. Masked elements go to an extra
    overflow bin that is sliced off. Below opset 11 there is neither: `for_opset` has the host
    count the graph's bin indices instead (exact_counts="host").
    """
    F = TensorProto.FLOAT
    bins = o.hist_bins
    idx = b.flat(b.cast(t, TensorProto.INT64))
    if not scatter_add_available(b.opset):
        if valid is not None:
            idx = b.where(b.flat(valid), idx, b.i64(bins), TensorProto.INT64)
        values, counts = b.unique_counts(idx)
        hist = b.op(
            "ScatterElements", [b.const(np.zeros(bins + 1, np.float32)), values, b.cast(counts, F)], axis=0
        )
        return b.slice(hist, 0, bins, 0)
    updates = (
        b.op("Expand", [b.const([1.0]), b.op("Shape", [idx])]) if valid is None else b.flat(b.cast(valid, F))
    )
    return b.scatter_add(b.const(np.zeros(bins, np.float32)), idx, updates)


def _build_hist(c: TapContext) -> dict[str, str]:
    o = c.options
    out = {"min": c.min, "max": c.max}  # the host rebuilds the scale from them
    if o.hist_mode == "sampled":
        out["samples"] = c.outer.samples
    elif o.hist_mode == "host":
        out["tensor"] = c.outer.tensor
    else:
        t, valid = _bins(c)
        if o.exact_counts == "host":
            if valid is not None:  # masked or out-of-range values go to an extra bin, dropped on the host
                t = c.b.where(valid, t, c.b.const(float(o.hist_bins)))
            out["hidx"] = c.b.flat(c.b.cast(t, index_dtype(o)))
        else:
            out["hist"] = _count_bins(c.b, t, valid, o)
    return out


# --------------------------------------------------------------------------------------------
# host side and references


def _finalize_hist(r: dict[str, np.ndarray], o: SketchOptions) -> np.ndarray:
    if o.hist_mode == "exact" and o.exact_counts == "host":
        idx = np.asarray(r["hidx"]).ravel().astype(np.intp, copy=False)
        return np.bincount(idx, minlength=o.hist_bins + 1)[: o.hist_bins].astype(np.float64)
    if o.hist_mode == "exact":
        return r["hist"]
    return hist_counts(r["tensor" if o.hist_mode == "host" else "samples"], host_scale(r), o)


def _reference_scale(x: np.ndarray) -> np.float32:
    v = np.asarray(x).astype(np.float32).ravel()
    v = v[np.isfinite(v)]
    return np.float32(np.abs(v).max() if v.size else np.inf) + EPS_SCALE


def _ref_hist(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    if o.hist_mode != "sampled":
        return hist_counts(x, _reference_scale(x), o)
    flat = np.asarray(x).astype(np.float32).ravel()
    return hist_counts(flat[sample_positions(flat.size, o.sample_size)], _reference_scale(x), o)


def elemsig_of(samples: np.ndarray, o: SketchOptions) -> np.ndarray:
    """k = min(16, m) of the m sampled values, at sample positions j*m/k."""
    m = samples.size
    k = min(m, o.elemsig_k)
    return np.asarray(samples, np.float64)[(np.arange(k, dtype=np.int64) * m) // max(k, 1)]


def _ref_elemsig(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    flat = np.asarray(x).astype(np.float32).ravel()
    return elemsig_of(as_f64(flat[sample_positions(flat.size, o.sample_size)]), o)


HIST = Sketch(
    "hist",
    "counts in hist_bins bins of x/(max|x|+1e-12) over [-1, 1], or of x over hist_range",
    build=_build_hist,
    finalize=_finalize_hist,
    reference=_ref_hist,
    merge=merge.SUM,
    tol=Tolerance(0.0, 1e-3),
    vector=True,
    cost="sampled: one small gather (+0.07x); exact: 2.1x plain on CPU with host counting",
)
ELEMSIG = Sketch(
    "elemsig",
    "k = min(16, m) of the m values the sampled histogram reads, at sample positions j*m/k (NaN stays NaN)",
    build=lambda c: {"samples": c.samples},
    finalize=lambda r, o: elemsig_of(r["samples"], o),
    reference=_ref_elemsig,
    merge=merge.FIRST,
    vector=True,
    stage=OUTER,
    cost="the sample's gather, shared with hist",
)
