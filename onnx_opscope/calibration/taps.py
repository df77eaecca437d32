"""Min/max taps on arbitrary float tensors: one ReduceMin and one ReduceMax each, exposed as outputs.

The calibrated tensors are any float tensor a quantizable op reads or writes (Pow, Softmax,
LayerNormalization inputs included), which the site finders do not cover, so the taps are
built here directly with `graph.Builder` and carried out of If / Loop / Scan bodies with
`graph.expose`: a body's tap comes back once per iteration (stacked) and a branch not taken
returns NaN, both reduced on the host with NaN-ignoring min / max. A whole-tensor ReduceMin
gives the same float32 as onnxruntime's MinMaxCalibrater (ReduceMin, keepdims=1, Reshape to
[-1]): a min is exact whatever the order.

The model is edited in place (only appends: nodes at the end of each graph, outputs after the
model's own), so its original outputs keep their names and positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from onnx import ModelProto

from ..graph import Builder, ModelIndex, opset_version
from ..graph.expose import expose
from .tensors import CalibTensor


@dataclass(frozen=True)
class MinMaxTap:
    """Where one tensor's min and max come out: two model outputs, each with `stacked` extra leading axes."""

    tensor: CalibTensor
    min_output: str
    max_output: str
    stacked: int


def add_minmax_taps(model: ModelProto, tensors: Sequence[CalibTensor]) -> list[MinMaxTap]:
    """Append a ReduceMin and a ReduceMax on each of `tensors` to `model` (in place), as model outputs."""
    index = ModelIndex(model)
    names = index.names()
    opset = opset_version(model)
    taps = []
    for t in tensors:
        b = Builder(opset, names, prefix="opscope_cal_")
        lo = b.reduce("ReduceMin", t.name, None, keepdims=0, hint=f"{t.name}_min")
        hi = b.reduce("ReduceMax", t.name, None, keepdims=0, hint=f"{t.name}_max")
        index[t.path].graph.node.extend(b.nodes)
        lo_out, stacked = expose(index, t.path, lo, t.elem, 0, names)
        hi_out, _ = expose(index, t.path, hi, t.elem, 0, names)
        taps.append(MinMaxTap(t, lo_out, hi_out, stacked))
    return taps
