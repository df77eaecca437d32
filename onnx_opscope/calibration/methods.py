"""Ranges from histograms: percentile, entropy (KL divergence) and mse, as the peers define them.

Each takes the `Histogram` of one tensor (`calibration.histograms`: exact counts over all
batches on one fixed range) and returns (lo, hi) as float32 values.

- **percentile** (onnxruntime `HistogramCollector.compute_percentile`, 1.32): cdf =
  cumsum(counts / total). symmetric: on the histogram of |x|, i = searchsorted(cdf, p/100)
  and the range is (-E[i], E[i]); else on x over [-t, t], i_lo = searchsorted(cdf, c),
  i_hi = searchsorted(cdf, 1 - c) with c = (100 - p)/200, range (E[i_lo], E[i_hi]). E are the
  bin edges (the left edge of the bin where the cdf crosses). Both ends are then clipped to
  the tensor's [min, max].
- **entropy** (onnxruntime `get_entropy_threshold`, after TensorRT's 8-bit calibration talk,
  GTC 2017 s7310, and MXNet): on x over [-t, t] with N bins, for each half-width i from
  Q/2 to N/2 (Q = num_quantized_bins): p = counts[z-i : z+i+1] (z = N/2) with the outliers
  added to its end bins; q = the slice merged into Q bins of len(p)//Q (the rest into the last
  one) and spread back over each bin's nonzero entries of p (integer division, as onnxruntime
  does); both smoothed (zeros -> 1e-4, taken off the nonzeros); KL(p || q) in float32. The
  range is (E[z-i], E[z+i+1]) of the smallest KL (first on ties), clipped to [min, max].
  Reproduced operation for operation, vectorised within each i.
- **entropy-trt** (TensorRT's entropy calibrator as NVIDIA's pytorch-quantization reproduces it,
  `_compute_amax_entropy`, TensorRT 8.6 tools): on |x| over [0, max|x|] with N bins (2048), the
  first bin set to the second's count (the spike of zeros a ReLU leaves); for each cut i from
  `start_bin` (128) to N: p is bins[:i] with the outliers added to its last bin; q gives each
  nonzero bin j < i the mean of the nonzero bins of its group, j's group being floor(j·Q/i) of
  Q = 128 (no smoothing); KL(p||q) of both normalised, infinite where p > 0 and q = 0. amax =
  E[i*] of the last smallest KL; the range is (-amax, amax), not clipped to [min, max]: TensorRT
  keeps one scale, amax / 127, whatever the sign of the values. One difference on purpose: a cut
  whose bins[:i] are all empty (a tensor far from 0, e.g. a sigmoid's outputs above 0.17) has
  q = 0, which pytorch-quantization's scipy call turns into NaN and np.argmin then picks (an amax
  below every value); here it is infinite, as p > 0 where q = 0. Computed for every i at once
  from prefix sums (per group: sum and count of nonzero bins; sum of b log b), where
  pytorch-quantization loops over i and j in Python: ~1,900 cuts of up to 2,048 bins.
- **mse** (the histogram form of NVIDIA pytorch-quantization's `_compute_amax_mse`):
  T* = argmin over T of sum_b n_b (c_b - s * clip(round(c_b / s), -127, 127))^2, s = T/127,
  c_b the bin centres (each bin's values taken at its centre), T over the positive bin
  edges above the first 1/16 of them (its `start_bin` 128 of 2048); range (-T*, T*) clipped
  to [min, max]. Works on any histogram mode.

Our histogram is over the exact global range from pass 1, where onnxruntime's starts at the
first batch's range and grows by whole bins (of the first batch's width) when a later batch
exceeds it; so the edges differ, and a threshold can differ by up to a bin of either
histogram (measured in tests/test_calibrate_methods.py). onnxruntime's 'distribution'
method returns a mean and std for float8, not a range, and is not here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import OpscopeError
from .histograms import Histogram

METHODS = ("percentile", "entropy", "entropy-trt", "mse")
QMAX = 127  # signed int8, symmetric: [-127, 127] * scale


def _clip_to_tensor(lo: float, hi: float, h: Histogram) -> tuple[float, float]:
    """onnxruntime clips every threshold to the tensor's own [min, max]. Where that inverts the
    range (a constant tensor c: the symmetric percentile's edge falls inside |c|), onnxruntime
    keeps (c, edge) or (-edge, c); we return the tensor's [min, max], (c, c), which its quantizer
    reads as the same or a tighter scale."""
    lo, hi = float(np.float32(max(lo, h.x_min))), float(np.float32(min(hi, h.x_max)))
    return (lo, hi) if lo <= hi else (float(np.float32(h.x_min)), float(np.float32(h.x_max)))


def _empty(h: Histogram) -> bool:
    """No value was counted (every value NaN / inf, or a branch that never ran): the range is the
    tensor's own [min, max], as there is no distribution to cut."""
    return not h.counts.any()


def percentile_range(
    h: Histogram, percentile: float = 99.999, symmetric: bool = False
) -> tuple[float, float]:
    """onnxruntime's percentile range of one tensor; symmetric needs an "absolute" histogram."""
    if not 0 <= percentile <= 100:
        raise OpscopeError(f"percentile {percentile}: expected a number in [0, 100]")
    if symmetric and h.mode != "absolute":
        raise OpscopeError("a symmetric percentile reads the histogram of |x|: count it with mode='absolute'")
    if _empty(h):
        return _clip_to_tensor(h.lo, h.hi, h)
    edges = h.edges
    cdf = np.cumsum(h.counts / h.counts.sum())
    if symmetric:
        i = np.searchsorted(cdf, percentile / 100.0)
        return _clip_to_tensor(-float(edges[i]), float(edges[i]), h)
    cut = (100.0 - percentile) / 200.0
    i_lo, i_hi = np.searchsorted(cdf, cut), np.searchsorted(cdf, 1.0 - cut)
    return _clip_to_tensor(float(edges[i_lo]), float(edges[i_hi]), h)


def _smooth(p: np.ndarray, eps: float = 0.0001) -> np.ndarray | None:
    """onnxruntime's `smooth_distribution` (float32): zeros become eps, the nonzeros pay for it."""
    is_zeros = (p == 0).astype(np.float32)
    is_nonzeros = (p != 0).astype(np.float32)
    n_zeros = is_zeros.sum()
    n_nonzeros = p.size - n_zeros
    if not n_nonzeros:
        return None
    eps1 = eps * float(n_zeros) / float(n_nonzeros)
    return p.astype(np.float32) + eps * is_zeros + (-eps1) * is_nonzeros


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    """onnxruntime's `entropy(p, q)`: both normalised, sum p log(p/q), float32; inf where either is 0."""
    p = p / np.sum(p)
    q = q / np.sum(q)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = p * np.log(p / q)
    terms[~((p > 0) & (q > 0))] = np.inf
    return float(np.float32(np.sum(terms)))


def _kl_at(counts: np.ndarray, start: int, end: int, n_q: int) -> float:
    sliced = counts[start:end]
    p = sliced.copy()
    p[0] += counts[:start].sum()
    p[-1] += counts[end:].sum()
    nonzeros = (p != 0).astype(np.int64)
    merged = sliced.size // n_q
    whole = n_q * merged
    quantized = sliced[:whole].reshape(n_q, merged).sum(axis=1)
    quantized[-1] += sliced[whole:].sum()
    norm = nonzeros[:whole].reshape(n_q, merged).sum(axis=1)
    spread = np.where(norm != 0, quantized / np.maximum(norm, 1), 0).astype(np.int64)  # int64 q, as in ORT
    q = np.zeros(p.size, np.int64)
    q[:whole] = np.repeat(spread, merged)
    ps, qs = _smooth(p), _smooth(q)
    return np.inf if ps is None or qs is None else _kl(ps, qs)


def entropy_range(h: Histogram, num_quantized_bins: int = 128) -> tuple[float, float]:
    """onnxruntime's entropy (KL) range of one tensor, from a "symmetric" histogram (x over [-t, t])."""
    if h.mode != "symmetric":
        raise OpscopeError("entropy reads the histogram of x over [-t, t]: count it with mode='symmetric'")
    if _empty(h):
        return _clip_to_tensor(h.lo, h.hi, h)
    counts, edges, n = h.counts.astype(np.int64), h.edges, h.bins
    zero, half_q = n // 2, num_quantized_bins // 2
    if half_q > zero:
        raise OpscopeError(f"num_quantized_bins {num_quantized_bins} exceeds the histogram's {n} bins")
    widths = range(half_q, zero + 1)
    kl = [_kl_at(counts, zero - i, min(zero + i + 1, n), num_quantized_bins) for i in widths]
    best = widths[int(np.argmin(np.asarray(kl, np.float64)))]
    return _clip_to_tensor(float(edges[zero - best]), float(edges[min(zero + best + 1, n)]), h)


def entropy_trt_range(
    h: Histogram, start_bin: int = 128, num_quantized_bins: int = 128
) -> tuple[float, float]:
    """TensorRT's entropy amax of one tensor (the module doc), from an "absolute" histogram (|x| over
    [0, t]), as (-amax, amax) in float32."""
    if h.mode != "absolute":
        raise OpscopeError("entropy-trt reads the histogram of |x|: count it with mode='absolute'")
    n, nq = h.bins, num_quantized_bins
    if not nq <= start_bin <= n:
        raise OpscopeError(f"entropy-trt needs {nq} <= start_bin ({start_bin}) <= bins ({n})")
    if _empty(h):
        return _clip_to_tensor(h.lo, h.hi, h)
    kl = _trt_divergences(h.counts, start_bin, nq)
    best = start_bin + kl.size - 1 - int(np.argmin(kl[::-1]))  # the last smallest, as NVIDIA's code
    amax = float(np.float32(h.edges[best]))
    return (-amax, amax)


def _trt_divergences(counts: np.ndarray, start: int, nq: int) -> np.ndarray:
    """KL(p || q) for every cut i in start..N (the module doc), from prefix sums: O(N * nq)."""
    b = counts.astype(np.float64)
    if b.size > 1:
        b[0] = b[1]
    total = b.sum()
    cuts = np.arange(start, b.size + 1)
    prefix = np.concatenate([[0.0], np.cumsum(b)])
    nonzero = np.concatenate([[0], np.cumsum(b != 0)])
    with np.errstate(divide="ignore", invalid="ignore"):
        blogb = np.concatenate([[0.0], np.cumsum(np.where(b > 0, b * np.log(b), 0.0))])
        # group k of cut i holds bins ceil(k*i/nq) .. ceil((k+1)*i/nq) - 1: j's group is floor(j*nq/i)
        bounds = (np.arange(nq + 1)[None, :] * cuts[:, None] + nq - 1) // nq
        sums, counts_nz = np.diff(prefix[bounds], axis=1), np.diff(nonzero[bounds], axis=1)
        mean = np.where(counts_nz > 0, sums / np.maximum(counts_nz, 1), 0.0)
        log_mean = np.where(mean > 0, np.log(mean), 0.0)
        last = b[cuts - 1]  # bin i-1: the last group's, with the outliers added to p
        outliers = total - prefix[cuts]
        q_total = prefix[cuts]  # sum of q over j < i: each group's sum, spread over its nonzero bins
        inner = prefix[cuts - 1]  # sum of p over j < i - 1 (p = b there)
        cross = (sums * log_mean).sum(axis=1) - last * log_mean[:, -1]  # sum over j < i-1 of b_j log q_j
        body = blogb[cuts - 1] - cross - inner * (np.log(total) - np.log(q_total))
        p_last = last + outliers
        tail = np.where(
            p_last > 0,
            p_last * (np.log(p_last / total) - (log_mean[:, -1] - np.log(q_total))),
            0.0,
        )
        kl = (body + tail) / total
    kl[(p_last > 0) & (last == 0)] = np.inf  # p > 0 where q = 0 (and q_total = 0 falls here too)
    return kl


def mse_range(h: Histogram, start_fraction: float = 1 / 16, chunk: int = 256) -> tuple[float, float]:
    """The symmetric int8 range whose fake-quantization of the bin centres has the least squared error."""
    edges = h.edges.astype(np.float64)
    centres = (edges[:-1] + edges[1:]) * 0.5
    counts = h.counts.astype(np.float64)
    positive = np.unique(np.abs(edges[edges != 0]))
    candidates = positive[int(positive.size * start_fraction) :]
    if candidates.size == 0 or counts.sum() == 0:
        return _clip_to_tensor(float(edges[0]), float(edges[-1]), h)
    errors = []
    for k in range(0, candidates.size, chunk):  # [chunk, bins] at a time: memory bounded
        s = candidates[k : k + chunk, None] / QMAX
        q = np.clip(np.round(centres[None, :] / s), -QMAX, QMAX) * s
        errors.append(((q - centres[None, :]) ** 2 * counts[None, :]).sum(axis=1))
    t = float(candidates[int(np.argmin(np.concatenate(errors)))])
    return _clip_to_tensor(-t, t, h)


def compute_ranges(
    method: str,
    hists: Mapping[str, Histogram],
    *,
    percentile: float = 99.999,
    symmetric: bool = False,
    num_quantized_bins: int = 128,
) -> dict[str, tuple[float, float]]:
    """(lo, hi) of every tensor by `method`: "percentile", "entropy", "entropy-trt" or "mse" (the module doc)."""
    if method == "percentile":
        return {k: percentile_range(h, percentile, symmetric) for k, h in hists.items()}
    if method == "entropy":
        return {k: entropy_range(h, num_quantized_bins) for k, h in hists.items()}
    if method == "entropy-trt":
        return {k: entropy_trt_range(h) for k, h in hists.items()}
    if method == "mse":
        return {k: mse_range(h) for k, h in hists.items()}
    raise OpscopeError(f"unknown histogram method {method!r}; choose one of: {', '.join(METHODS)}")
