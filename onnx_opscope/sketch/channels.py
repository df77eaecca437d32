"""Per-channel range: max|x| over every axis but the channel axis, and how far the top channel stands out.

The channel axis is the tap's feature axis (`TapInfo.channel_axis`: the last axis of a MatMul
operand, axis 1 of a Conv input, the output-channel axis of a weight). A channel with no
finite value is NaN. `chan_outlier` = max / mean of chan_maxabs; across Loop iterations it is
recomputed from the merged chan_maxabs, not averaged.
"""

from __future__ import annotations

import numpy as np

from . import merge
from .base import Sketch, row_view
from .context import TapContext
from .options import SketchOptions, TapInfo


def _build_chan_abs(c: TapContext) -> dict[str, str]:
    def make() -> str:
        b = c.b
        if not c.slow:  # max|x| = max(max x, -min x): the two per-channel reductions min and max share
            return b.op("Max", [c.chan_max, b.op("Neg", [c.chan_min])])
        # no finite value in a channel: -1, read back as NaN
        return c.per_channel("ReduceMax", b.where(c.bad, b.const(-1.0), b.op("Abs", [c.xs])))

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
    uses_channels=True,
    cost="per-channel max and min, from which min and max then come too (+0.1x)",
)
CHAN_OUTLIER = Sketch(
    "chan_outlier",
    "max / mean of chan_maxabs",
    build=_build_chan_abs,
    finalize=lambda r, o: outlier_ratio(chan_maxabs_of(r)),
    reference=lambda x, info, o: outlier_ratio(_ref_chan(x, info, o)),
    merge=merge.Derived("chan_maxabs", outlier_ratio),
    needs_rank=True,
    uses_channels=True,
    cost="shares chan_maxabs' raw output",
)
