"""GEMM-like sites: which tensors of a MatMul, Gemm, Conv, recurrent or quantized matmul are tapped.

Each role names its channel axis (the feature axis: chan_maxabs keeps it, pos_sumsq sums over
it) and the axis its rows are adjacent along (adj_sumsq): for a Gemm with transA=1 the
channel of `a` is axis 0, for a Conv it is axis 1, for an LSTM input the rows run along time.

Quantized matmuls are tapped on their integer operands (cast to float by the tap) and, when
the operand comes out of a QuantizeLinear / DynamicQuantizeLinear or the output goes into a
DequantizeLinear, on the float tensor next to it (`lhs_float`, `out_float`).
"""

from __future__ import annotations

from onnx import NodeProto

from ..graph.proto import attr, input_at
from .site import Tap
from .view import GraphView

GEMM_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "LSTM", "GRU", "RNN", "MatMulInteger", "QLinearMatMul")


def gemm_taps(node: NodeProto, view: GraphView) -> list[Tap]:
    """The taps of a GEMM-like node (the caller checks the op type and domain)."""
    op, outs = node.op_type, list(node.output)
    taps: list[Tap] = []

    def add(role: str, name: str | None, ch: int = -1, seq: int = -2) -> None:
        if name:
            taps.append(Tap(role, name, ch, seq))

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
    elif op in ("MatMulInteger", "QLinearMatMul"):
        add("lhs", input_at(node, 0))
        add("rhs", input_at(node, 1 if op == "MatMulInteger" else 3))
        add("out", outs[0])
        q = view.producer(input_at(node, 0) or "")
        if q is not None and q.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"):
            add("lhs_float", q.input[0])
        dq = [c for c in view.consumers(outs[0]) if c.op_type == "DequantizeLinear"]
        if dq:
            add("out_float", dq[0].output[0])
    return taps
