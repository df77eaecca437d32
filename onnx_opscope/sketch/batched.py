"""The sketches of many small tensors at once, on the host: one numpy pass per statistic for all.

A tap on a small tensor is cheaper copied out whole than sketched in the graph (`inject`'s
copy-out taps, `SketchOptions.copy_out_max`): a tap's ~35 bookkeeping nodes cost ~40 µs in
onnxruntime however small the tensor, an extra graph output ~1 µs. Taking each copied tensor's
`references` costs ~100-200 µs of Python per tensor, more than the graph did; here the copied
tensors of one batch are concatenated and each statistic is one segmented numpy call
(`ufunc.reduceat`, one `bincount`) over all of them, on the decode thread.

`sketch.batched_references` is the entry point. The values are those of `references` on each tensor (tests hold them to it, within each
sketch's tolerance: sums run in another order). Only tensors of at most `sample_size` elements
are taken here, where the histogram's sample is the whole tensor in order; an empty tensor, a
larger one, and any sketch without a segmented form go through `references`, tensor by tensor.
"""

from __future__ import annotations

import numpy as np

from .context import EPS_SCALE
from .options import SketchOptions

SEGMENTED = ("min", "max", "mean", "sumsq", "l1", "nnz", "nan_count", "inf_count", "hist", "elemsig")


def segmented(arrays: list[np.ndarray], wanted: set[str], o: SketchOptions) -> dict[str, list[np.ndarray]]:
    """sketch -> one value array per tensor of `arrays` (each non-empty, at most sample_size elements),
    for the `wanted` sketches that have a segmented form (`SEGMENTED`)."""
    x32 = np.concatenate([np.asarray(a).astype(np.float32).ravel() for a in arrays])  # as the graph sees it
    x = x32.astype(np.float64)
    n = np.array([a.size for a in arrays], np.int64)
    starts = np.cumsum(n) - n
    fin = np.isfinite(x)
    nfin = np.add.reduceat(fin, starts).astype(np.int64)
    none = nfin == 0
    got: dict[str, np.ndarray] = {}
    if "nan_count" in wanted:
        got["nan_count"] = np.add.reduceat(np.isnan(x), starts).astype(np.float64)
    if "inf_count" in wanted:
        got["inf_count"] = np.add.reduceat(np.isinf(x), starts).astype(np.float64)
    if "nnz" in wanted:
        got["nnz"] = np.add.reduceat(x != 0, starts).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        if "min" in wanted:
            got["min"] = np.where(none, np.nan, np.minimum.reduceat(np.where(fin, x, np.inf), starts))
        if "max" in wanted:
            got["max"] = np.where(none, np.nan, np.maximum.reduceat(np.where(fin, x, -np.inf), starts))
        zeroed = np.where(fin, x, 0.0)
        if "mean" in wanted:
            got["mean"] = np.where(none, np.nan, np.add.reduceat(zeroed, starts) / nfin)
        if "sumsq" in wanted:
            got["sumsq"] = np.add.reduceat(zeroed * zeroed, starts)
        if "l1" in wanted:
            got["l1"] = np.add.reduceat(np.abs(zeroed), starts)
    per = {name: [np.array([v]) for v in vals] for name, vals in got.items()}
    if "hist" in wanted:
        per["hist"] = list(_hist(x32, fin, n, starts, o))
    if "elemsig" in wanted:
        per["elemsig"] = _elemsig(x, n, starts, o)
    return per


def _hist(
    x32: np.ndarray, fin: np.ndarray, n: np.ndarray, starts: np.ndarray, o: SketchOptions
) -> np.ndarray:
    """[tensors, bins] counts as `histogram.hist_counts` bins each tensor (float32 arithmetic, each
    tensor by its own scale max|x| + 1e-12 unless `hist_range` fixes the range)."""
    bins = o.hist_bins
    seg = np.repeat(np.arange(n.size), n)
    v, seg = x32[fin], seg[fin]
    if o.hist_range is None:
        absmax = np.maximum.reduceat(np.where(fin, np.abs(x32), np.float32(0)), starts)
        has = np.add.reduceat(fin, starts) > 0
        scale = np.where(has, absmax, np.float32(np.inf)).astype(np.float32) + np.float32(EPS_SCALE)
        t = np.floor((v / scale[seg] + np.float32(1)) * np.float32(bins / 2))
    else:
        lo, hi = np.float32(o.hist_range[0]), np.float32(o.hist_range[1])
        keep = (v >= lo) & (v <= hi)
        v, seg = v[keep], seg[keep]
        t = np.floor((v - lo) / np.float32((hi - lo) / bins))
    idx = np.clip(t, 0, bins - 1).astype(np.int64)
    counts = np.bincount(seg * bins + idx, minlength=n.size * bins)
    return counts.reshape(n.size, bins).astype(np.float64)


def _elemsig(x: np.ndarray, n: np.ndarray, starts: np.ndarray, o: SketchOptions) -> list[np.ndarray]:
    """`histogram.elemsig_of` of each whole tensor (its sample, when it has at most sample_size elements)."""
    k = np.minimum(n, o.elemsig_k)
    j = np.arange(int(k.max()), dtype=np.int64)
    pos = starts[:, None] + (j[None, :] * n[:, None]) // np.maximum(k, 1)[:, None]
    take = j[None, :] < k[:, None]
    return np.split(x[pos[take]], np.cumsum(k)[:-1])
