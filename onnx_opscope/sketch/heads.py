"""Per-head KV-cache statistics: what per-head and per-(head, channel) KV-cache quantization scales need.

A KV tap (`sites.kv`) holds cache entries of several heads: [batch, kv_heads, seq, head_dim] on a
plain export (the Concat's new entries), [batch, seq, kv_heads·head_dim] on a fused one
(GroupQueryAttention's key / value input, the heads packed head-major in the last axis). These
sketches reduce over the *position* axes only, batch (axis 0, rank >= 3) and seq (`TapInfo.seq_axis`),
and view what is left as [heads, head_dim]: the head axis is the one axis that is neither a position
nor the channel axis, or, where the heads are packed in the channel axis, the channel axis split in
`TapInfo.bins` heads (the head count the kv site gives its tap; 1 when it is not known). Both exports
thus give the same figures in the same order:

- `head_min`, `head_max`: the smallest / largest finite value of each head (kv_heads values);
- `head_sumsq`: Σx² of each head's finite values (RMS per head = sqrt(head_sumsq / (numel / kv_heads)));
- `head_chan_maxabs`: max|x| per (head, channel), head-major (kv_heads·head_dim values): on a fused
  tap exactly chan_maxabs, on a plain one what chan_maxabs pools over the heads, kept apart.

In the graph: three reductions over the position axes keeping (head, channel) (ReduceMin, ReduceMax,
Σy²), everything else on the [heads, head_dim] results (tiny). A head or channel with no finite value
is NaN (its Σx² 0). Kind `kv` only (`sites.KIND_SKETCHES`): the axes mean heads only on a KV tap.
"""

from __future__ import annotations

import math

import numpy as np

from . import merge
from .base import Sketch, Tolerance, as_f64, ynorm
from .context import TapContext
from .options import SketchOptions, TapInfo

EXACT = Tolerance()
ELEMENT_MIN = merge.Merge("elementwise min", lambda p, n: np.nanmin(np.stack(p), axis=0))


def head_layout(info: TapInfo) -> tuple[list[int], int]:
    """(the position axes reduced over, the number of heads packed in the channel axis: 1 when none)."""
    rank = info.rank or 0
    ch, seq = info.axes() or (rank - 1, None)
    positions = sorted(
        {a for a in ((0,) if rank >= 3 else ()) + ((seq,) if seq is not None else ()) if a != ch}
    )
    kept = [a for a in range(rank) if a not in positions]
    packed = info.bins if kept == [ch] and ch == rank - 1 and info.bins and info.bins > 1 else 1
    return positions, packed


def _raws(c: TapContext) -> dict[str, str]:
    """The four raws of the head sketches, built once per branch, whichever sketch asks first."""
    names = ("head_lo", "head_hi", "head_ss", "head_chan")
    made: dict[str, str] = {}
    for k in names:
        c.memo(k, lambda k=k: (made or made.update(_make(c)) or made)[k])
    return {k: c.memo(k, lambda: "") for k in names}


def _make(c: TapContext) -> dict[str, str]:
    b = c.b
    rank = c.info.rank
    positions, packed = head_layout(c.info)

    def view(t: str) -> str:  # the channel axis split in `packed` heads
        if packed == 1:
            return t
        return b.op("Reshape", [t, b.i64([0] * (rank - 1) + [packed, -1])])

    kept = rank - len(positions) + (packed > 1)

    def heads(t: str) -> str:  # [*kept] -> [heads, head_dim]
        if kept == 2:
            return t
        if kept == 1:
            return b.op("Reshape", [t, b.i64([1, -1])])
        return b.rows(t)

    def over_positions(op: str, t: str) -> str:
        t = view(t)
        return heads(b.reduce(op, t, positions, keepdims=0) if positions else t)

    lo = over_positions("ReduceMin", b.where(c.bad, b.const(np.inf), c.x) if c.slow else c.x)
    hi = over_positions("ReduceMax", b.where(c.bad, b.const(-np.inf), c.x) if c.slow else c.x)
    ss = over_positions("ReduceSum", b.op("Mul", [c.y, c.y]))
    return {
        "head_lo": b.flat(b.reduce("ReduceMin", lo, [1], keepdims=0), "head_lo"),
        "head_hi": b.flat(b.reduce("ReduceMax", hi, [1], keepdims=0), "head_hi"),
        "head_ss": b.flat(b.reduce("ReduceSum", ss, [1], keepdims=0), "head_ss"),
        "head_chan": b.flat(b.op("Max", [b.op("Abs", [lo]), b.op("Abs", [hi])]), "head_chan"),
    }


def _finite_or_nan(v: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(v), v, np.nan)


# --------------------------------------------------------------------------------------------
# the numpy reference, straight from the definition (also what a copied-out tap gets)


def head_views(x: np.ndarray, info: TapInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(min, max, Σx²) of the finite values per (head, channel), each [heads, head_dim], float64."""
    v = as_f64(x)
    positions, packed = head_layout(
        TapInfo(v.ndim, info.elem_type, info.channel_axis, info.seq_axis, info.bins)
    )
    if packed > 1:  # sizes spelled out, not -1: numpy cannot infer one of an empty tensor
        v = v.reshape(*v.shape[:-1], packed, v.shape[-1] // packed)
    v = np.moveaxis(v, positions, list(range(len(positions))))
    k = len(positions)
    v = v.reshape(math.prod(v.shape[:k]), *v.shape[k:]) if positions else v[None]
    v = v.reshape(v.shape[0], math.prod(v.shape[1:-1]), v.shape[-1]) if v.ndim != 3 else v
    fin = np.isfinite(v)
    if v.shape[0] == 0:
        empty = np.full(v.shape[1:], np.inf)
        return empty, -empty, np.zeros(v.shape[1:])
    lo = np.where(fin, v, np.inf).min(axis=0)
    hi = np.where(fin, v, -np.inf).max(axis=0)
    z = np.where(fin, v, 0.0)
    return lo, hi, (z * z).sum(axis=0)


_LAST: list = [None]  # (x, info, head_views(x, info)) of the last call, one tuple: threads see all or none


def _views_once(x: np.ndarray, info: TapInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """head_views, computed once for the four head sketches that ask for it one after the other on the
    same tensor (a copied kv tap: ~4 ms of a 30-layer decode step). The last tensor is held, so its
    identity cannot be reused by another."""
    last = _LAST[0]
    if last is not None and last[0] is x and last[1] == info:
        return last[2]
    got = head_views(x, info)
    _LAST[0] = (x, info, got)
    return got


def _ref(which: str):
    def ref(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
        lo, hi, ss = _views_once(x, info)
        if which == "head_min":  # initial: a head of no channel (an empty tensor) is NaN, not an error
            return _finite_or_nan(lo.min(axis=1, initial=np.inf))
        if which == "head_max":
            return _finite_or_nan(hi.max(axis=1, initial=-np.inf))
        if which == "head_sumsq":
            return ss.sum(axis=1)
        return _finite_or_nan(np.maximum(np.abs(lo), np.abs(hi))).ravel()

    return ref


def _sketch(name: str, doc: str, raw: str, fin, mrule, tol: Tolerance = EXACT, cost: str = "") -> Sketch:
    return Sketch(
        name,
        doc,
        build=lambda c: {raw: _raws(c)[raw], **({"ynorm": c.ynorm} if raw == "head_ss" else {})},
        finalize=fin,
        reference=_ref(name),
        merge=mrule,
        tol=tol,
        vector=True,
        needs_rank=True,
        kinds=("kv",),
        cost=cost,
    )


HEAD_MIN = _sketch(
    "head_min",
    "smallest finite value of each KV head (heads: the axis beside batch, seq and head_dim, or head_dim·heads split)",
    "head_lo",
    lambda r, o: _finite_or_nan(r["head_lo"]),
    ELEMENT_MIN,
    cost="a ReduceMin over batch and seq keeping (head, channel), shared by the head sketches",
)
HEAD_MAX = _sketch(
    "head_max",
    "largest finite value of each KV head",
    "head_hi",
    lambda r, o: _finite_or_nan(r["head_hi"]),
    merge.ELEMENT_MAX,
    cost="a ReduceMax over batch and seq keeping (head, channel), shared",
)
HEAD_SUMSQ = _sketch(
    "head_sumsq",
    "sum of x² over each KV head's finite values (RMS per head: sqrt(head_sumsq / (numel / heads)))",
    "head_ss",
    lambda r, o: r["head_ss"] * ynorm(r) ** 2,
    merge.SUM,
    tol=Tolerance(1e-4, 1e-5),
    cost="an elementwise square and a ReduceSum over batch and seq, shared",
)
HEAD_CHAN_MAXABS = _sketch(
    "head_chan_maxabs",
    "max|x| per (KV head, head_dim channel) over batch and seq: heads·head_dim values, head-major",
    "head_chan",
    lambda r, o: _finite_or_nan(r["head_chan"]),
    merge.ELEMENT_MAX,
    cost="max(|min|, |max|) of the per-(head, channel) reductions above (no pass of its own)",
)
