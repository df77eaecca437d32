"""Per-channel range: max|x| over every axis but the channel axis, and how far the top channel stands out.

The channel axis is the tap's feature axis (`TapInfo.channel_axis`: the last axis of a MatMul
operand, axis 1 of a Conv input, the output-channel axis of a weight). A channel with no
finite value is NaN. `chan_outlier` = max / mean of chan_maxabs; across Loop iterations it is
recomputed from the merged chan_maxabs, not averaged.
"""

from __future__ import annotations

import math

import numpy as np

from ..graph.build import INT64_MAX
from ..graph.opset import reshape_allows_zero
from . import merge
from .base import Sketch, row_view
from .context import TapContext
from .options import SketchOptions, TapInfo

ROW_PERIOD = 720  # 2^4 * 3^2 * 5: the row counts of real tensors (B*S, H*W) mostly share its factors
MAX_BLOCK = 16


def row_block(rows: int) -> int:
    """Rows reduced per block: the largest divisor of gcd(rows, 720) up to 16 (1 for a prime count)."""
    g = math.gcd(rows, ROW_PERIOD)
    return max(d for d in range(1, MAX_BLOCK + 1) if g % d == 0)


ROW_BLOCKS = np.array([row_block(r) for r in range(ROW_PERIOD)], np.int64)


def _row_blocks(c: TapContext) -> str:
    """The shape [rows / k, k, C] of a channel-last tensor, k = `row_block(rows)`: built once per tap,
    outside the If, from the shape alone (Shape, two Slices, ReduceProd, Mod, a table lookup: 8 scalar nodes)."""
    o = c.outer

    def make() -> str:
        b = o.b
        shape = b.op("Shape", [c.x])
        rows = b.reduce("ReduceProd", b.slice(shape, 0, -1, 0), [0], keepdims=1)
        chans = b.slice(shape, -1, INT64_MAX, 0)
        k = b.op("Gather", [b.i64(ROW_BLOCKS), b.op("Mod", [rows, b.i64([ROW_PERIOD])])], axis=0)
        return b.op("Concat", [b.op("Div", [rows, k]), k, chans], "row_blocks", axis=0)

    return o.memo("row_blocks", make)


def _build_chan_abs(c: TapContext) -> dict[str, str]:
    def make() -> str:
        b = c.b
        ch = c.axes()[0]
        absx = b.op("Abs", [c.xs])
        if c.slow:  # no finite value in a channel: -1, read back as NaN
            absx = b.where(c.bad, b.const(-1.0), absx)
        rank = c.info.rank
        keep = [a for a in range(rank) if a != ch]
        if not keep:
            return absx
        if ch == rank - 1 and reshape_allows_zero(b.opset):
            # Channel-last: onnxruntime reduces every axis but the last ~6x slower than its blocked
            # form [rows / k, k, C] over k then over the rows left (512 vs 86 us on [512, 768], k = 16).
            # allowzero keeps an empty tensor's zero dims in that target.
            blocks = b.op("Reshape", [absx, _row_blocks(c)], allowzero=1)
            return b.reduce("ReduceMax", b.reduce("ReduceMax", blocks, [1]), [0])
        if ch == rank - 1:
            # Before opset 14, the channels transposed to the front and the contiguous rest reduced:
            # ~2x faster than reducing every axis but the last (117 vs 58 us on [4, 128, 256]).
            absx = b.op("Transpose", [absx], perm=[ch, *keep])
            keep = list(range(1, rank))
        return b.flat(b.reduce("ReduceMax", absx, keep))

    return {"chan_abs": c.memo("chan_abs", make)}


def chan_maxabs_of(r: dict[str, np.ndarray]) -> np.ndarray:
    """Per-channel max|x|; the graph marks channels with no finite value by -1 (or -inf)."""
    out = r["chan_abs"].copy()
    out[out < 0] = np.nan
    return out


def outlier_ratio(v: np.ndarray) -> np.ndarray:
    """max / mean of the finite per-channel maxima (NaN when there is none)."""
    v = v[np.isfinite(v)]
    return np.array([v.max() / v.mean() if v.size and v.mean() else np.nan])


def _ref_chan(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    ch, _ = info.axes()
    v = row_view(x, info)
    other = tuple(a for a in range(v.ndim) if a != ch)
    absv = np.where(np.isfinite(v), np.abs(v), -np.inf)
    out = absv.max(axis=other) if v.size else np.full(v.shape[ch], -np.inf)  # no element: no finite value
    return np.where(np.isfinite(out), out, np.nan).ravel()


CHAN_MAXABS = Sketch(
    "chan_maxabs",
    "max|x| over every axis but the channel axis",
    build=_build_chan_abs,
    finalize=lambda r, o: chan_maxabs_of(r),
    reference=_ref_chan,
    merge=merge.ELEMENT_MAX,
    vector=True,
    needs_rank=True,
    cost="an Abs pass and a blocked reduction keeping the channel axis (+0.1x)",
)
CHAN_OUTLIER = Sketch(
    "chan_outlier",
    "max / mean of chan_maxabs",
    build=_build_chan_abs,
    finalize=lambda r, o: outlier_ratio(chan_maxabs_of(r)),
    reference=lambda x, info, o: outlier_ratio(_ref_chan(x, info, o)),
    merge=merge.Derived("chan_maxabs", outlier_ratio),
    needs_rank=True,
    cost="shares chan_maxabs' raw output",
)
