"""Int8 fake-quant: a symmetric int8 round trip on the operands of every MatMul / Gemm.

q = clip(round(a·127/amax), ±127), a' = q·amax/127, with amax per token (over the
contraction axis) or per channel (over the token axes); weights optionally per output
channel. The round trip is in the graph (weights included), so onnxruntime folds the weight
part once at session creation; `fake_quant_reference` is its numpy form.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto

from ..errors import OpscopeError, did_you_mean
from ..graph.build import Builder
from ..graph.index import ModelIndex
from ..graph.io import ModelLike, opset_version, without_weight_data
from ..graph.proto import attr
from ..graph.wire import splice
from ..shapes import infer_shapes
from .result import QuantizedOperand, Rewritten, check_rewrite, copy_of

QMAX = 127.0
AMAX_FLOOR = 1e-12  # an all-zero row quantizes to zeros instead of 0/0
QUANT_MODES = ("token", "channel")
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.UNDEFINED)


def _amax_all_but(b: Builder, absx: str, axis: int) -> str:
    """max|x| over every axis but `axis` (-1 or -2), shaped to broadcast against x, any rank."""
    big = np.iinfo(np.int64).max
    if axis == -1:
        rows = b.op(
            "Reshape",
            [absx, b.op("Concat", [b.i64([-1]), b.slice(b.op("Shape", [absx]), -1, big, 0)], axis=0)],
        )
        return b.reduce("ReduceMax", rows, [0], keepdims=0)  # [K]
    col = b.reduce("ReduceMax", absx, [-1], keepdims=1)  # [..., K, 1]
    rows = b.op(
        "Reshape", [col, b.op("Concat", [b.i64([-1]), b.slice(b.op("Shape", [col]), -2, big, 0)], axis=0)]
    )
    return b.reduce("ReduceMax", rows, [0], keepdims=0)  # [K, 1]


def _fake_quant_nodes(
    b: Builder, x: str, reduce_axes: list[int] | None, keep_axis: int | None, elem: int
) -> str:
    """q = clip(round(x·127/amax), ±127); returns q·amax/127 (in x's own float type)."""
    xf = x if elem in (TensorProto.FLOAT, TensorProto.UNDEFINED) else b.cast(x, TensorProto.FLOAT)
    absx = b.op("Abs", [xf])
    if keep_axis is not None:
        amax = _amax_all_but(b, absx, keep_axis)
    else:
        amax = b.reduce("ReduceMax", absx, reduce_axes, keepdims=1)
    amax = b.op("Max", [amax, b.const(np.float32(AMAX_FLOOR))], "amax")
    q = b.op("Round", [b.op("Div", [b.op("Mul", [xf, b.const(np.float32(QMAX))]), amax])])
    q = b.op("Clip", [q, b.const(np.float32(-QMAX)), b.const(np.float32(QMAX))], "q")
    y = b.op("Mul", [q, b.op("Div", [amax, b.const(np.float32(QMAX))])], "dq")
    return y if xf == x else b.cast(y, elem)


def fake_quant_reference(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Numpy form of the in-graph round trip, amax over `axes` (keepdims), in float32 like the graph."""
    x = np.asarray(x, np.float32)
    amax = np.maximum(np.abs(x).max(axis=axes, keepdims=True), np.float32(AMAX_FLOOR))
    q = np.clip(np.round(x * np.float32(QMAX) / amax), -QMAX, QMAX)
    return (q * (amax / np.float32(QMAX))).astype(np.float32)


def _operand_plan(node: NodeProto, idx: int, mode: str) -> tuple[list[int] | None, int | None, str]:
    """(axes to reduce, or None) / (axis to keep, or None) and a label, for operand `idx` of a GEMM.

    token: one scale per row of A / column of B (reduce the contraction axis K);
    channel: one scale per K index (reduce every other axis).
    """
    if node.op_type == "Gemm":  # rank 2: K is axis 1 of A and axis 0 of B, swapped by transA / transB
        trans = attr(node, ("transA", "transB")[idx], 0)
        axis = idx if trans else 1 - idx
        axis = axis if mode == "token" else 1 - axis
        return [axis], None, f"reduce axis {axis}"
    k_axis = -1 if idx == 0 else -2
    if mode == "token":
        return [k_axis], None, f"reduce axis {k_axis}"
    return None, k_axis, f"keep axis {k_axis}"


def fake_quant(model: ModelLike, mode: str = "token", weights: bool = False) -> Rewritten:
    """A copy of `model` with a symmetric int8 round trip on the activation operands of every MatMul / Gemm.

    mode "token": amax per token, i.e. over the last axis of A (the contraction axis; for an
    activation B operand, over its axis -2, one scale per output column); mode "channel": amax
    per channel, over every token axis (one scale per K index). `weights`: constant B operands
    too, per output channel (over K). An operand feeding several GEMMs is quantized once.
    """
    if mode not in QUANT_MODES:
        raise OpscopeError(
            f"fake-quant mode {mode!r}{did_you_mean(mode, QUANT_MODES)}; choose token or channel"
        )
    source, m = copy_of(model)
    opset = opset_version(m)
    dtypes = infer_shapes(without_weight_data(m)).dtypes
    index = ModelIndex(m)
    names = index.names()
    quantized: list[QuantizedOperand] = []
    left_alone: list[dict] = []
    inserts: dict[str, dict[int, list[NodeProto]]] = {}
    for entry in index.graphs.values():
        done: dict[tuple, str] = {}
        for pos, node in enumerate(entry.graph.node):
            if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
                continue
            for idx in (0, 1):
                name = node.input[idx] if len(node.input) > idx else ""
                if not name:
                    continue
                is_weight = index.is_constant(entry.path, name)
                if is_weight and not (weights and idx == 1):
                    continue
                t = dtypes.get(name, TensorProto.UNDEFINED)
                if t not in _FLOATS:
                    left_alone.append({"node": node.name, "input": name, "why": f"not a float tensor ({t})"})
                    continue
                reduce_axes, keep_axis, how = _operand_plan(node, idx, "token" if is_weight else mode)
                key = (name, tuple(reduce_axes or ()), keep_axis)
                if key not in done:
                    b = Builder(opset, names, f"opscope_fq{len(quantized)}_")
                    done[key] = _fake_quant_nodes(b, name, reduce_axes, keep_axis, t)
                    inserts.setdefault(entry.path, {}).setdefault(pos - 1, []).extend(b.nodes)
                    kind = "weight" if is_weight else "activation"
                    quantized.append(QuantizedOperand(entry.path, node.name, name, "AB"[idx], kind, how))
                node.input[idx] = done[key]
    for path in sorted(inserts, key=lambda p: -p.count("/")):  # a graph before the graphs around it
        splice(index[path].graph, inserts[path])
    result = Rewritten(
        m,
        "fake_quant",
        quantized=quantized,
        left_alone=left_alone,
        options={"mode": mode, "weights": weights},
    )
    check_rewrite(source, m, "fake_quant")
    return result
