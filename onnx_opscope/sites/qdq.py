"""Taps on quantized (QDQ) models that leave onnxruntime's int8 fusions in place.

In a QDQ model a quantized op reads its operands through `DequantizeLinear` and its result
goes into a `QuantizeLinear`; at `ORT_ENABLE_EXTENDED` and above onnxruntime replaces each such
group with one integer kernel (QLinearConv, QLinearMatMul, ...), and the float tensors inside
the group never exist. A tap on one of them gives it a second consumer: the group no longer
fuses and the instrumented model silently computes in float32 (0.1 of an output's max on a
real quantized speech model). So a tap never reads those float tensors:

- an operand made by a `DequantizeLinear` is tapped on that DQ's quantized input, and the tap
  dequantizes it itself with the same scale, zero point and axis;
- the output of an op with a dequantized operand whose consumers are all `QuantizeLinear` is
  tapped on the first Q's quantized output, dequantized with that Q's scale and zero point.

A role then means the real value the deployed integer kernel consumes or produces: `lhs` is
DQ(x_q), the dequantized activation; `rhs` the dequantized weight (per channel where the DQ is);
`out` the requantized output, DQ(Q(y)), on the Q's grid. Values are the same as the float tensors
they replace, except that `out` carries the Q's rounding and clipping, which is what the next
op really reads. Quantized tensors stay quantized in the graph: the tap's own DQ is one more
consumer of a tensor that is materialized anyway.
"""

from __future__ import annotations

from dataclasses import replace

from onnx import NodeProto

from ..graph.proto import input_at
from .site import Dequant, Tap
from .view import GraphView

_DQ, _Q = "DequantizeLinear", "QuantizeLinear"
_QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
_KEPT_ATTRS = ("axis", "block_size")  # the attributes a DQ takes from the Q it mirrors


def dequant_of(node: NodeProto, attrs: tuple[str, ...] | None = None) -> Dequant:
    """How to dequantize like the (De)QuantizeLinear `node`: its scale, zero point, axis attributes."""
    kept = tuple(
        (a.name, int(a.i)) for a in node.attribute if (attrs is None or a.name in attrs) and a.type == a.INT
    )
    return Dequant(input_at(node, 1) or "", input_at(node, 2) or "", kept, node.domain)


def _is(node: NodeProto | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in _QDQ_DOMAINS


def through_qdq(node: NodeProto, taps: list[Tap], view: GraphView) -> list[Tap]:
    """`taps` of the site `node`, moved off the float tensors of its QDQ group (see the module doc)."""
    dequantized = any(_is(view.producer(x), _DQ) for x in node.input if x)
    out: list[Tap] = []
    for tap in taps:
        if tap.dequant is not None:
            out.append(tap)
            continue
        producer = view.producer(tap.tensor)
        if _is(producer, _DQ) and producer.input[0]:
            out.append(replace(tap, tensor=producer.input[0], dequant=dequant_of(producer)))
            continue
        consumers = view.consumers(tap.tensor)
        if (
            dequantized
            and tap.tensor in node.output
            and consumers
            and all(_is(c, _Q) for c in consumers)
            and tap.tensor not in view.entry.outputs
        ):
            q = consumers[0]
            out.append(replace(tap, tensor=q.output[0], dequant=dequant_of(q, _KEPT_ATTRS)))
            continue
        out.append(tap)
    return out
