"""Sketch references over a tensor given as chunks: one pass, memory bounded by a chunk.

`references` on a whole weight converts it to float64 and masks it (3-4 copies of a 1 GiB
weight at peak). The whole-tensor reductions merge exactly over pieces by their own rule
(min of mins, sum of sums, means weighted by their finite counts), so each chunk goes through `references` and
the parts through `merge_parts`; the sampled histogram and the fingerprint need only the
sample's elements, gathered as the chunks pass, and the scale max|x|, kept as they pass.
Results equal `references` on the whole tensor up to the order of float64 summation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from .context import EPS_SCALE
from .histogram import elemsig_of, hist_counts, sample_positions
from .options import SketchOptions, TapInfo

# reductions whose merge over the pieces of one tensor is exact (see sketch.merge)
CHUNKED = frozenset({"min", "max", "mean", "l1", "sumsq", "nnz", "nan_count", "inf_count"})
SAMPLED = frozenset({"hist", "elemsig"})


def streamable(names: Sequence[str], o: SketchOptions) -> bool:
    """Whether `streamed_references` computes all of `names` (the others need the whole tensor)."""
    return all(n in CHUNKED or (n in SAMPLED and o.hist_mode == "sampled") for n in names)


def streamed_references(
    names: Sequence[str],
    chunks: Iterable[np.ndarray],
    n: int,
    info: TapInfo,
    o: SketchOptions,
    references: Callable[..., dict[str, np.ndarray]],
    merge_parts: Callable[..., dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """`references(names, x, info, o)` for the tensor x of `n` elements whose flat pieces, in order,
    are `chunks` (`streamable(names, o)` must hold). `references` and `merge_parts` are the
    package's own (passed in: this module sits below `sketch/__init__`)."""
    scalar = [m for m in names if m in CHUNKED]
    sampled = [m for m in names if m in SAMPLED]
    parts, numels = [], []
    if sampled:
        positions = sample_positions(n, o.sample_size)
        order = np.argsort(positions, kind="stable")
        in_order = positions[order]
        sample = np.empty(positions.size, np.float32)
    absmax = np.float32(-np.inf)
    start = 0
    for chunk in chunks:
        clean = _clean_parts(chunk, scalar)
        if scalar:
            if clean is not None:
                parts.append({m: np.array([clean[m]]) for m in scalar})
                numels.append(chunk.size)
            else:
                parts.append(references(scalar, chunk, info, o))
                # the weights of the mean: it is over the finite values (the other rules ignore them)
                numels.append(np.count_nonzero(np.isfinite(chunk)) if "mean" in scalar else chunk.size)
        if sampled:
            lo, hi = np.searchsorted(in_order, [start, start + chunk.size])
            sample[order[lo:hi]] = chunk[in_order[lo:hi] - start].astype(np.float32)
            absmax = max(absmax, _finite_absmax(chunk) if clean is None else clean["absmax"])
        start += chunk.size
    out = dict(zip(scalar, [None] * len(scalar)))  # keep `names`' order
    if scalar:
        out.update(merge_parts(scalar, parts, numels))
    if "hist" in sampled:
        scale = (absmax if np.isfinite(absmax) else np.float32(np.inf)) + EPS_SCALE
        out["hist"] = hist_counts(sample, scale, o)
    if "elemsig" in sampled:
        out["elemsig"] = elemsig_of(sample.astype(np.float64), o)
    return {m: np.asarray(out[m], np.float64).ravel() for m in names}


def _clean_parts(chunk: np.ndarray, names: Sequence[str]) -> dict[str, float] | None:
    """The CHUNKED reductions `names` of a chunk with no NaN or Inf (and its max |x|), in passes over
    its own dtype with float64 accumulators (the references' float64 copy and finite mask made
    streaming 10x slower than reading); None when the chunk holds a NaN or an Inf (a float64 sum
    of float32 values is finite exactly then)."""
    if chunk.size == 0:
        return None
    total = np.einsum("i->", chunk, dtype=np.float64)
    if not np.isfinite(total):
        return None
    lo, hi = chunk.min(), chunk.max()
    out = {"min": float(lo), "max": float(hi), "mean": float(total) / chunk.size, "nan_count": 0.0,
           "inf_count": 0.0, "absmax": np.float32(max(abs(np.float32(lo)), abs(np.float32(hi))))}  # fmt: skip
    if "sumsq" in names:
        out["sumsq"] = float(np.einsum("i,i->", chunk, chunk, dtype=np.float64))
    if "l1" in names:
        out["l1"] = float(np.einsum("i->", np.abs(chunk), dtype=np.float64))
    if "nnz" in names:
        out["nnz"] = float(np.count_nonzero(chunk))
    return out


def _finite_absmax(chunk: np.ndarray) -> np.float32:
    """max |x| over the finite values of `chunk` in float32 (-inf when there are none), as the
    whole-tensor reference scale computes it."""
    a = np.abs(chunk.astype(np.float32, copy=False))
    m = a.max(initial=-np.inf)
    if not np.isfinite(m):
        a = a[np.isfinite(a)]
        m = a.max(initial=-np.inf)
    return np.float32(m)
