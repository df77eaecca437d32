"""Expert load: how many times a router picked each expert id."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from . import merge
from .base import OUTER, Sketch
from .context import TapContext
from .options import SketchOptions, TapInfo


def _build_load(c: TapContext) -> dict[str, str]:
    """Counts of each expert id: one-hot against 0..E-1 (E = max id + 1 when not static), summed.

    The ids (int64 indices, read as float32 by the tap) are compared as int64: Equal takes
    floats only from opset 11, int64 at every opset.
    """
    b = c.b
    i64 = TensorProto.INT64
    flat = b.flat(c.x)
    if c.info.bins:
        bins = b.i64(np.arange(c.info.bins))
    else:
        top = b.reduce("ReduceMax", b.op("Concat", [flat, b.const([-1.0])], axis=0), keepdims=0)
        bins = b.arange(b.cast(b.op("Add", [top, b.const(1.0)]), i64))
    ids = b.cast(b.op("Reshape", [flat, b.i64([-1, 1])]), i64)
    onehot = b.cast(b.op("Equal", [ids, bins]), TensorProto.FLOAT)
    return {"route_load": b.reduce("ReduceSum", onehot, [0], keepdims=0, hint="route_load")}


def _ref_load(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    ids = np.asarray(x).astype(np.int64).ravel()
    n = info.bins or (int(ids.max()) + 1 if ids.size else 0)
    ids = ids[(ids >= 0) & (ids < n)]
    return np.bincount(ids, minlength=n).astype(np.float64)


ROUTE_LOAD = Sketch(
    "route_load",
    "how many times each expert id was selected, over E bins (E = the gate's last dim, else max id + 1)",
    build=_build_load,
    finalize=lambda r, o: r["route_load"].copy(),
    reference=_ref_load,
    merge=merge.SUM,
    vector=True,
    stage=OUTER,
    kinds=("route",),
    cost="a one-hot compare against E ids and a reduction (ids are few)",
)
