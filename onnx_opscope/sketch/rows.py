"""Per-row energy and adjacent-row change: what positional structure and delta-compute read.

Rows run along the tap's seq axis (`TapInfo.seq_axis`), channels along its channel axis; a
MatMul operand of unknown rank is viewed as [rows, channels] = reshape(x, [-1, C]).
`pos_sumsq` is Σx² over the channels, one value per row; `adj_sumsq` is Σ(row_{t+1} - row_t)²
for `adj_pairs` evenly spaced pairs per sequence. Both keep at most `max_rows` values, evenly
strided; non-finite values count as 0.
"""

from __future__ import annotations

import numpy as np

from . import merge
from .base import Sketch, Tolerance, cap_rows, row_view, ynorm, zero_nonfinite
from .context import TapContext
from .options import SketchOptions, TapInfo


def _build_pos(c: TapContext) -> dict[str, str]:
    return {"pos": c.b.strided(c.row_energy, c.options.max_rows), "ynorm": c.ynorm}


def _build_adj(c: TapContext) -> dict[str, str]:
    """Only `adj_pairs` evenly spaced pairs per sequence: the miner needs the mean ratio to
    pos_sumsq, and diffing every pair cost 4 passes over the tensor (two Slice copies)."""
    b = c.b
    ch, seq = c.axes()
    if seq is None:
        return {"adj": b.const(np.zeros(0, np.float32)), "ynorm": c.ynorm}
    y = c.y
    t = b.strided_indices(b.op("Sub", [b.dim(y, seq), b.i64(1)]), c.options.adj_pairs)
    rank = c.info.rank or 2  # rank unknown: the [rows, channels] view
    moved = seq == rank - 1
    if moved:
        # A Gather along the innermost axis copies one element at a time in onnxruntime; with that
        # axis moved to the front it copies whole blocks (ppocrv4_det, --sketch all, profiled: 46 ms
        # of Gather a batch -> 8 ms, plus 3 ms of Transpose). The sums come out seq-first and are put
        # back in the tensor's order, which the strided rows read.
        perm = [seq, *(a for a in range(rank) if a != seq)]
        y = b.op("Transpose", [y], perm=perm)
        ch, seq = perm.index(ch), 0
    after = b.op("Gather", [y, b.op("Add", [t, b.i64(1)])], axis=seq)
    diff = b.op("Sub", [after, b.op("Gather", [y, t], axis=seq)])
    adj = b.reduce("ReduceSum", b.op("Mul", [diff, diff]), [ch])
    if moved and rank > 2:
        adj = b.op("Transpose", [adj], perm=[*range(1, rank - 1), 0])
    return {"adj": b.strided(b.flat(adj), c.options.max_rows), "ynorm": c.ynorm}


def _ref_pos(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    ch, _ = info.axes()
    return cap_rows((zero_nonfinite(row_view(x, info)) ** 2).sum(axis=ch), o.max_rows)


def _ref_adj(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    ch, seq = info.axes()
    if seq is None:
        return np.zeros(0)
    v = zero_nonfinite(row_view(x, info))
    n = v.shape[seq] - 1
    if n <= 0:
        return np.zeros(0)
    k = min(n, o.adj_pairs)
    t = (np.arange(k, dtype=np.int64) * n) // k
    d = np.take(v, t + 1, axis=seq) - np.take(v, t, axis=seq)
    return cap_rows((d**2).sum(axis=ch), o.max_rows)


POS_SUMSQ = Sketch(
    "pos_sumsq",
    "sum of x² over the channel axis, one value per row (at most max_rows rows)",
    build=_build_pos,
    finalize=lambda r, o: r["pos"] * ynorm(r) ** 2,
    reference=_ref_pos,
    merge=merge.CONCAT,
    tol=Tolerance(1e-4, 1e-6),
    vector=True,
    needs_rank=True,
    uses_rows=True,
    cost="Σx² per row, the check summed from it, and a gather (+0.14x bert_like, +0.39x ppocrv4_det: a conv sums over a middle axis)",
)
ADJ_SUMSQ = Sketch(
    "adj_sumsq",
    "sum of (row_{t+1} - row_t)² over the channel axis, for adj_pairs evenly spaced pairs per sequence",
    build=_build_adj,
    finalize=lambda r, o: r["adj"] * ynorm(r) ** 2,
    reference=_ref_adj,
    merge=merge.CONCAT,
    tol=Tolerance(1e-4, 1e-6),
    vector=True,
    needs_rank=True,
    cost="two gathers of adj_pairs rows (after a whole-tensor Transpose where rows run along the last axis, as a conv's do), their difference and a per-row reduction (+0.15x bert_like, +0.72x ppocrv4_det)",
)
