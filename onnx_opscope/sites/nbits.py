"""MatMulNBits (com.microsoft weight-only int2 / int4 / int8 matmul) as a GEMM-kind site.

Tapped: the float activation A (`lhs`, [..., K]) and the output (`out`, [..., N]), both read as
any MatMul's. The packed weight B [N, k_blocks, blob] is not tapped in the graph: its codes mean
nothing without the scales and zero points, and a weight is the same at every step, so the weight
probes dequantize it on the host, once (`weights.nbits`). M, K, N: M is A's rows (batch dims
included), K and N the node's attributes (`instrument.decode.gemm_dims`).
"""

from __future__ import annotations

from onnx import NodeProto

from ..graph.proto import input_at
from .site import Tap
from .view import GraphView

NBITS_OPS = {("com.microsoft", "MatMulNBits")}


def nbits_taps(node: NodeProto, view: GraphView) -> list[Tap]:
    """`lhs` and `out` of a MatMulNBits node (the caller checks domain and op type)."""
    taps = [Tap("lhs", input_at(node, 0) or ""), Tap("out", node.output[0] if node.output else "")]
    return [t for t in taps if t.tensor]
