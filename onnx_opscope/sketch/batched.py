"""The sketches of many small tensors at once, on the host: one numpy pass per statistic for all.

A tap on a small tensor is cheaper copied out whole than sketched in the graph (`inject`'s
copy-out taps, `SketchOptions.copy_out_max`): a tap's ~35 bookkeeping nodes cost ~40 µs in
onnxruntime however small the tensor, an extra graph output ~1 µs. Taking each copied tensor's
`references` costs ~100-200 µs of Python per tensor, more than the graph did; here the copied
tensors of one batch are concatenated and each statistic is one segmented numpy call
(`ufunc.reduceat`, one `bincount`) over all of them, on the decode thread.

`sketch.batched_references` is the entry point. The values are those of `references` on each tensor (tests hold them to it, within each
sketch's tolerance: sums run in another order). Only tensors of at most `sample_size` elements
are taken here, where the histogram's sample is the whole tensor in order. The per-channel and
per-row sketches (`SHAPED`) need each tensor's shape: tensors of one shape are stacked and each
such sketch is one call over the stack (`stacked`). An empty tensor, a larger one, and any other
sketch go through `references`, tensor by tensor.
"""

from __future__ import annotations

import itertools

import numpy as np

from .base import cap_rows, row_view
from .context import EPS_SCALE
from .moments import EPS_KURT
from .options import SketchOptions, TapInfo

SEGMENTED = (
    "min", "max", "mean", "sumsq", "l1", "nnz", "nan_count", "inf_count", "kurtosis", "hist", "elemsig",
)  # fmt: skip
# per channel or per row: one numpy call over a stack of the tensors of one shape (`stacked`)
SHAPED = ("chan_maxabs", "chan_outlier", "pos_sumsq", "adj_sumsq")

Flat = tuple[np.ndarray, np.ndarray]  # every tensor's values one after another, and how many each has


def segmented(arrays: list[np.ndarray], wanted: set[str], o: SketchOptions) -> dict[str, list[np.ndarray]]:
    """sketch -> one value array per tensor of `arrays` (each non-empty, at most sample_size elements),
    for the `wanted` sketches that have a segmented form (`SEGMENTED`)."""
    return {name: _split(flat) for name, flat in segmented_flat(arrays, wanted, o).items()}


def _split(flat: Flat) -> list[np.ndarray]:
    values, counts = flat
    return np.split(values, np.cumsum(counts)[:-1]) if counts.size else []


SEGMENT_VALUES = 1 << 15
"""Values one segmented pass takes at most. A group of batches' small tensors (silero_vad_v6: 64 batches,
218k values) made float64 temporaries of ~2 MB, which glibc maps fresh for each numpy call and the
kernel faults in page by page: half of the pass. Passes over ~32k values stay in the heap (and in L2)."""


Segments = np.ndarray | tuple[np.ndarray, np.ndarray]
"""A tensor, or a block of tensors laid end to end in one float32 vector with their sizes (a copied pack)."""


def segmented_flat(arrays: list[Segments], wanted: set[str], o: SketchOptions) -> dict[str, Flat]:
    """`segmented`, each sketch's values of all the tensors in one array (`Flat`): what the decoding of a
    batch puts in its value column without a Python step per tensor. An entry of `arrays` may be a block
    of tensors already end to end, (float32 values, sizes): a copied pack, never cut apart. Tensors of
    more than `SEGMENT_VALUES` values in all go through in several passes, whose values are laid end to end."""
    x32, n = _values(arrays)
    ends = np.cumsum(n)
    cut = [0]
    while cut[-1] < n.size:  # the next pass: whole tensors up to SEGMENT_VALUES values (one at least)
        done = ends[cut[-1] - 1] if cut[-1] else 0
        cut.append(max(cut[-1] + 1, int(np.searchsorted(ends, done + SEGMENT_VALUES, side="right"))))
    if len(cut) <= 2:
        return _segmented_pass(x32, n, wanted, o)
    starts = np.concatenate([[0], ends])
    parts = [
        _segmented_pass(x32[starts[i] : starts[j]], n[i:j], wanted, o) for i, j in itertools.pairwise(cut)
    ]
    return {
        name: (np.concatenate([p[name][0] for p in parts]), np.concatenate([p[name][1] for p in parts]))
        for name in parts[0]
    }


def _values(arrays: list[Segments]) -> tuple[np.ndarray, np.ndarray]:
    """Every tensor's values end to end as float32, and each one's size. float32 when every dtype is exact in
    float32 (float32, float16, int8, bool, ...); else each tensor is cast on its own, as the graph sees it
    (an int64 cast through float64 could round twice)."""
    chunks = [a[0] if isinstance(a, tuple) else a for a in arrays]
    n = np.concatenate([a[1] if isinstance(a, tuple) else [a.size] for a in arrays]).astype(np.int64)
    x32 = np.concatenate(chunks, axis=None)
    if x32.dtype != np.float32:
        x32 = np.concatenate([np.asarray(a).astype(np.float32).ravel() for a in chunks])
    return x32, n


def _segmented_pass(x32: np.ndarray, n: np.ndarray, wanted: set[str], o: SketchOptions) -> dict[str, Flat]:
    """`segmented_flat` in one pass over tensors of sizes `n` end to end in `x32`. When every value is finite
    (the usual case) the masking passes are left out: the same values, ~40% less work."""
    x = x32.astype(np.float64)
    starts = np.cumsum(n) - n
    fin = np.isfinite(x)
    clean = bool(fin.all())
    nfin = n if clean else np.add.reduceat(fin, starts).astype(np.int64)
    none = nfin == 0
    got: dict[str, np.ndarray] = {}
    if "nan_count" in wanted:
        got["nan_count"] = (
            np.zeros(n.size) if clean else np.add.reduceat(np.isnan(x), starts).astype(np.float64)
        )
    if "inf_count" in wanted:
        got["inf_count"] = (
            np.zeros(n.size) if clean else np.add.reduceat(np.isinf(x), starts).astype(np.float64)
        )
    if "nnz" in wanted:
        got["nnz"] = np.add.reduceat(x != 0, starts).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        if "min" in wanted:
            got["min"] = np.where(
                none, np.nan, np.minimum.reduceat(x if clean else np.where(fin, x, np.inf), starts)
            )
        if "max" in wanted:
            got["max"] = np.where(
                none, np.nan, np.maximum.reduceat(x if clean else np.where(fin, x, -np.inf), starts)
            )
        zeroed = x if clean else np.where(fin, x, 0.0)
        if "mean" in wanted:
            got["mean"] = np.where(none, np.nan, np.add.reduceat(zeroed, starts) / nfin)
        if "sumsq" in wanted:
            got["sumsq"] = np.add.reduceat(zeroed * zeroed, starts)
        if "l1" in wanted:
            got["l1"] = np.add.reduceat(np.abs(zeroed), starts)
        if "kurtosis" in wanted:  # moments.KURTOSIS's reference: centred on each tensor's finite mean
            d = zeroed - np.repeat(np.add.reduceat(zeroed, starts) / nfin, n)
            d2 = d * d if clean else np.where(fin, d * d, 0.0)
            m2 = np.add.reduceat(d2, starts) / nfin
            m4 = np.add.reduceat(d2 * d2, starts) / nfin
            got["kurtosis"] = np.where(none, np.nan, m4 / (m2 * m2 + EPS_KURT))
    ones = np.ones(n.size, np.int64)
    out: dict[str, Flat] = {name: (vals, ones) for name, vals in got.items()}
    if "hist" in wanted:
        if o.hist_range is None:
            mags = np.abs(x32) if clean else np.where(fin, np.abs(x32), np.float32(0))
            absmax = np.maximum.reduceat(mags, starts)
            scale = np.where(nfin > 0, absmax, np.float32(np.inf)).astype(np.float32) + np.float32(EPS_SCALE)
        else:
            scale = None
        out["hist"] = (bin_segments(x32, n, scale, o, clean).ravel(), np.full(n.size, o.hist_bins, np.int64))
    if "elemsig" in wanted:
        out["elemsig"] = elemsig_segments(x, n, o)
    return out


def bin_segments(
    x32: np.ndarray, n: np.ndarray, scale: np.ndarray | None, o: SketchOptions, finite: bool = False
) -> np.ndarray:
    """[segments, bins] counts, binned as `histogram.hist_counts` bins each segment of x32 (float32
    arithmetic, the finite values only): by the segment's own float32 `scale`, or over `hist_range`.
    `finite`: every value is known to be finite (no mask)."""
    bins = o.hist_bins
    keep = None if finite else np.isfinite(x32)
    if o.hist_range is not None:
        lo, hi = np.float32(o.hist_range[0]), np.float32(o.hist_range[1])
        inside = (x32 >= lo) & (x32 <= hi)  # NaN is neither
        keep = inside if keep is None else keep & inside
    # int32 bin numbers and float32 steps done in place: the same float32 arithmetic as before, ~3x less
    # time (the histograms of a 30-layer decode step's ~0.9M sampled and copied values: 19 -> 6 ms)
    seg = np.repeat(np.arange(n.size, dtype=np.int32) * np.int32(bins), n)  # segment i counts from i * bins
    if keep is not None:
        x32, seg = x32[keep], seg[keep]
    if o.hist_range is None:
        per = np.repeat(scale, n)
        t = np.divide(x32, per if keep is None else per[keep])
        t += np.float32(1)
        t *= np.float32(bins / 2)
    else:
        t = x32 - lo
        t /= np.float32((hi - lo) / bins)
    np.floor(t, out=t)
    np.clip(t, 0, bins - 1, out=t)
    idx = t.astype(np.int32)
    idx += seg
    counts = np.bincount(idx, minlength=n.size * bins)
    return counts.reshape(n.size, bins).astype(np.float64)


def elemsig_segments(x: np.ndarray, n: np.ndarray, o: SketchOptions) -> Flat:
    """`histogram.elemsig_of` of each segment of x (a tensor's sample; the whole tensor when it has at
    most sample_size elements)."""
    starts = np.cumsum(n) - n
    k = np.minimum(n, o.elemsig_k)
    j = np.arange(int(k.max()) if k.size else 0, dtype=np.int64)
    pos = starts[:, None] + (j[None, :] * n[:, None]) // np.maximum(k, 1)[:, None]
    take = j[None, :] < k[:, None]
    return x[pos[take]], k


def stacked(
    names: list[str], arrays: list[np.ndarray], info: TapInfo, o: SketchOptions
) -> list[dict[str, np.ndarray]]:
    """The `SHAPED` sketches among `names` of each of `arrays`, all of one shape and read through one
    `info`: each sketch one numpy call over their stack [T, *shape], where each tensor's `references`
    cost ~50 µs of Python (captcha_crnn's 162 copied taps, `--sketch all`: ~25 ms a batch)."""
    v = np.stack([row_view(a, info) for a in arrays])
    ch, seq = info.axes()
    finite = np.isfinite(v)
    got: dict[str, np.ndarray] = {}
    if "chan_maxabs" in names or "chan_outlier" in names:  # channels.CHAN_MAXABS, per tensor [T, C]
        other = tuple(1 + a for a in range(v.ndim - 1) if a != ch)
        m = np.where(finite, np.abs(v), -np.inf).max(axis=other)
        chan = np.where(np.isfinite(m), m, np.nan).reshape(len(arrays), -1)
        got["chan_maxabs"] = chan
        fin = np.isfinite(chan)
        with np.errstate(invalid="ignore", divide="ignore"):
            top = np.where(fin, chan, -np.inf).max(axis=1)
            mean = np.where(fin, chan, 0.0).sum(axis=1) / fin.sum(axis=1)
            ratio = top / mean
        got["chan_outlier"] = np.where(fin.any(axis=1) & (mean != 0), ratio, np.nan)[:, None]
    if "pos_sumsq" in names or "adj_sumsq" in names:  # the rows' sums, non-finite values as 0
        z = np.where(finite, v, 0.0)
    if "pos_sumsq" in names:  # rows.POS_SUMSQ
        got["pos_sumsq"] = _cap_rows((z**2).sum(axis=1 + ch), o.max_rows)
    if "adj_sumsq" in names:  # rows.ADJ_SUMSQ
        n = v.shape[1 + seq] - 1 if seq is not None else 0
        if n <= 0:
            got["adj_sumsq"] = np.zeros((len(arrays), 0))
        else:
            k = min(n, o.adj_pairs)
            t = (np.arange(k, dtype=np.int64) * n) // k
            d = np.take(z, t + 1, axis=1 + seq) - np.take(z, t, axis=1 + seq)
            got["adj_sumsq"] = _cap_rows((d**2).sum(axis=1 + ch), o.max_rows)
    return [{name: got[name][j] for name in names if name in got} for j in range(len(arrays))]


def _cap_rows(v: np.ndarray, k_max: int) -> np.ndarray:
    """`base.cap_rows` of each tensor's values: [T, ...] -> [T, k]."""
    v = v.reshape(v.shape[0], -1)
    keep = cap_rows(np.arange(v.shape[1]), k_max)
    return v[:, keep]


# --------------------------------------------------------------------------------------------
# the finalize of the hot sketches, for many in-graph taps at once


def _finite_or_nan(v: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(v), v, np.nan)


def _mean(r: dict[str, np.ndarray], o: SketchOptions) -> np.ndarray:
    nf = _n_finite(r)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(nf != 0, (r["ysum"] * r["ynorm"]) / nf, np.nan)  # base.ratio


def _sumsq(r: dict[str, np.ndarray], o: SketchOptions) -> np.ndarray:
    # Python's float power, as moments.SUMSQ computes ynorm ** 2 (libm pow, not always x * x)
    return r["yss"] * np.array([y**2 for y in r["ynorm"].tolist()], np.float64)


def _n_finite(r: dict[str, np.ndarray]) -> np.ndarray:
    return r["numel"] - (r["nan"] + r["inf"])  # base.n_finite, elementwise


def _kurtosis(r: dict[str, np.ndarray], o: SketchOptions) -> np.ndarray:
    """moments.KURTOSIS's finalize of every tap: the scale's powers in Python's float power, as it takes them."""
    nf = _n_finite(r)
    s = _host_scale(r).astype(np.float64).tolist()
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m2 = r["m2"] / nf * np.array([v**2 for v in s], np.float64)
        m4 = r["m4"] / nf * np.array([v**4 for v in s], np.float64)
        return np.where(nf > 0, m4 / (m2 * m2 + EPS_KURT), np.nan)


def _ynorm2_per_value(r: dict[str, np.ndarray], raw: str) -> Flat:
    """rows.POS_SUMSQ / ADJ_SUMSQ's finalize of every tap: its values times ynorm² (Python's float power)."""
    values, counts = r[raw]
    scale = np.repeat(np.array([y**2 for y in r["ynorm"].tolist()], np.float64), counts)
    return values * scale, counts


def _chan_maxabs(r: dict[str, np.ndarray], o: SketchOptions) -> Flat:
    """channels.chan_maxabs_of every tap: a channel with no finite value (marked below 0) is NaN."""
    values, counts = r["chan_abs"]
    return np.where(values < 0, np.nan, values), counts


def _host_scale(r: dict[str, np.ndarray]) -> np.ndarray:
    """moments.host_scale of every tap: max(|min|, |max|) in float32, 0 when not finite, + 1e-12."""
    with np.errstate(invalid="ignore"):
        a = np.maximum(np.abs(r["min"].astype(np.float32)), np.abs(r["max"].astype(np.float32)))
    return np.where(np.isfinite(a), a, np.float32(0)).astype(np.float32) + EPS_SCALE


def _hist(r: dict[str, np.ndarray], o: SketchOptions) -> Flat:
    samples, m = r["samples"]
    scale = _host_scale(r) if o.hist_range is None else None
    x32 = samples.astype(np.float32, copy=False)
    counts = bin_segments(x32, m, scale, o, finite=bool(np.isfinite(x32).all()))
    return counts.ravel(), np.full(m.size, o.hist_bins, np.int64)


# sketch -> (the raws it reads, finalize of T taps: scalar raws as [T] float64, "samples" and the
# VECTOR_RAWS as Flat, "numel" [T] float64 -> [T] values or Flat); the same values as each sketch's
# finalize, bit for bit
STACKED = {
    "min": (("min",), lambda r, o: _finite_or_nan(r["min"])),
    "max": (("max",), lambda r, o: _finite_or_nan(r["max"])),
    "mean": (("ysum", "ynorm", "nan", "inf"), _mean),
    "sumsq": (("yss", "ynorm"), _sumsq),
    "nan_count": (("nan",), lambda r, o: r["nan"].copy()),
    "inf_count": (("inf",), lambda r, o: r["inf"].copy()),
    "l1": (("yl1", "ynorm"), lambda r, o: r["yl1"] * r["ynorm"]),
    "nnz": (("nnz", "nan", "inf"), lambda r, o: r["nnz"] + (r["nan"] + r["inf"])),
    "kurtosis": (("m2", "m4", "min", "max", "nan", "inf"), _kurtosis),
    "chan_maxabs": (("chan_abs",), _chan_maxabs),
    "pos_sumsq": (("pos", "ynorm"), lambda r, o: _ynorm2_per_value(r, "pos")),
    "adj_sumsq": (("adj", "ynorm"), lambda r, o: _ynorm2_per_value(r, "adj")),
    "hist": (("min", "max", "samples"), _hist),
    "elemsig": (("samples",), lambda r, o: elemsig_segments(*r["samples"], o)),
}


VECTOR_RAWS = frozenset({"chan_abs", "pos", "adj"})
"""The vector raws `STACKED` reads, one after another with their lengths (`Flat`), like the samples."""


def stacked_names(o: SketchOptions) -> set[str]:
    """The sketches `STACKED` finalizes under these options (the sampled histogram only)."""
    return set(STACKED) - ({"hist"} if o.hist_mode != "sampled" else set())
