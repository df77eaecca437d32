"""GEMM-like sites: which tensors of a MatMul, Gemm, Conv, recurrent or quantized matmul are tapped.

Each role names its channel axis (the feature axis: chan_maxabs keeps it, pos_sumsq sums over
it) and the axis its rows are adjacent along (adj_sumsq): for a Gemm with transA=1 the
channel of `a` is axis 0, for a Conv it is axis 1, for an LSTM input the rows run along time.

QOperator ops (QLinearMatMul, QLinearConv) are tapped on their quantized operands, dequantized
by the tap with the op's own scales and zero points, so `lhs` / `rhs` / `out` (`in` / `weight` /
`out` for the conv) are the real values the integer kernel reads and writes, as on a QDQ site
(`sites.qdq`). MatMulInteger and ConvInteger carry no scales: their integer operands are cast to
float. Where an operand comes out of a QuantizeLinear / DynamicQuantizeLinear or the output goes
into a DequantizeLinear, the float tensor next to it is tapped too (`lhs_float`, `out_float`).
"""

from __future__ import annotations

from onnx import NodeProto

from ..graph.proto import attr, input_at
from .site import Dequant, Tap
from .view import GraphView

GEMM_OPS = (
    "MatMul", "Gemm", "Conv", "ConvTranspose", "LSTM", "GRU", "RNN",
    "MatMulInteger", "QLinearMatMul", "ConvInteger", "QLinearConv",
)  # fmt: skip


def gemm_taps(node: NodeProto, view: GraphView) -> list[Tap]:
    """The taps of a GEMM-like node (the caller checks the op type and domain)."""
    op, outs = node.op_type, list(node.output)
    taps: list[Tap] = []

    def add(role: str, name: str | None, ch: int = -1, seq: int = -2, dq: Dequant | None = None) -> None:
        if name:
            taps.append(Tap(role, name, ch, seq, dequant=dq))

    def scaled(i: int, axis: int | None = None) -> Dequant | None:
        """Dequantize like the op does its operand with scale input `i` and zero point `i + 1`."""
        scale = input_at(node, i)
        attrs = (("axis", axis),) if axis is not None else ()
        return Dequant(scale, input_at(node, i + 1) or "", attrs) if scale else None

    if op == "MatMul":
        add("lhs", input_at(node, 0)), add("rhs", input_at(node, 1)), add("out", outs[0])
    elif op == "Gemm":
        ta, tb = attr(node, "transA", 0), attr(node, "transB", 0)
        add("a", input_at(node, 0), 0 if ta else 1, 1 if ta else 0)
        add("b", input_at(node, 1), 0 if tb else 1, 1 if tb else 0)
        add("out", outs[0], 1, 0)
    elif op in ("Conv", "ConvTranspose"):
        add("in", input_at(node, 0), 1, -1)
        add("weight", input_at(node, 1), 0 if op == "Conv" else 1, -1)
        add("out", outs[0], 1, -1)
    elif op in ("LSTM", "GRU", "RNN"):
        t = 1 if attr(node, "layout", 0) else 0
        (
            add("x", input_at(node, 0), -1, t),
            add("w", input_at(node, 1), 1, -1),
            add("r", input_at(node, 2), 1, -1),
        )
        if outs and outs[0]:
            add("y", outs[0], -1, t)
    elif op == "QLinearConv":
        add("in", input_at(node, 0), 1, -1, scaled(1))
        add("weight", input_at(node, 3), 0, -1, scaled(4, 0))
        add("out", outs[0], 1, -1, scaled(6))
    elif op == "ConvInteger":
        add("in", input_at(node, 0), 1, -1)
        add("weight", input_at(node, 1), 0, -1)
        add("out", outs[0], 1, -1)
    elif op in ("MatMulInteger", "QLinearMatMul"):
        qlinear = op == "QLinearMatMul"
        add("lhs", input_at(node, 0), dq=scaled(1) if qlinear else None)
        add("rhs", input_at(node, 3 if qlinear else 1), dq=scaled(4, -1) if qlinear else None)
        add("out", outs[0], dq=scaled(6) if qlinear else None)
        q = view.producer(input_at(node, 0) or "")
        if q is not None and q.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"):
            add("lhs_float", q.input[0])
        dq = [c for c in view.consumers(outs[0]) if c.op_type == "DequantizeLinear"]
        if dq and not qlinear:  # QLinearMatMul's `out` is dequantized already
            add("out_float", dq[0].output[0])
    return taps
