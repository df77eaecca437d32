"""Keep onnxruntime's CPU int8 path when a tap reads a QuantizeLinear output.

`sites.qdq` moves QDQ taps onto quantized tensors, which a tap may read without stopping a
fusion, with one exception: on x86 onnxruntime's CPU provider first turns every int8 Q -> DQ
pair into a uint8 one (`QDQS8ToU8Transformer`, zero point + 128) and fuses the uint8 groups,
and it does so only for a Q whose one consumer is the DQ. A tap is a second consumer: the pair
stays int8, its group is not fused, and the instrumented model computes in float (2.4e-2 of
the output's max on a per-tensor int8 transformer block).

So when the CPU provider runs the model, inject makes the same conversion itself on each
tapped pair: the Q, its DQs and the tap's own DQ get a uint8 zero point 128 higher. It is
exact (q_u8 = q_s8 + 128 for every value, and DQ gives the same floats), so the outputs are the
same at every optimization level, and onnxruntime then fuses the pair as it would have.
Other providers are left alone: they do not convert, and some (TensorRT) take int8 only.

The tap dequantizes with Cast, Sub and Mul rather than a DequantizeLinear node: the same floats
(the integer difference is exact, the product rounds once), and none of onnxruntime's QDQ
transformers act on it; its QDQ propagation aborts the process on some DQ nodes of QOperator
models (onnxruntime 1.22, a DQ reading a QLinearMatMul output). A DQ node is built only where
the arithmetic cannot be (blocked scales, or a per-axis scale of unknown rank).
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, numpy_helper

from ..graph.build import Builder, Constants
from ..graph.index import GraphEntry, ModelIndex
from ..graph.proto import input_at
from .manifest import TapRecord

CPU = "CPUExecutionProvider"
_DOMAINS = ("", "ai.onnx")


def converts_s8_to_u8(providers: list[str] | None) -> bool:
    """Whether onnxruntime converts int8 Q/DQ pairs to uint8 for these providers (the CPU one runs
    the QDQ nodes: it is first, or no provider is named, which means CPU)."""
    return not providers or providers[0] == CPU


def dequantize(b: Builder, index: ModelIndex, tap: TapRecord) -> str:
    """The tap's tensor dequantized as `tap.dequant` says: (x - zero_point) * scale (the module doc)."""
    dq, elem = tap.dequant, tap.elem_type
    axis, block = dq["attrs"].get("axis", 1), dq["attrs"].get("block_size", 0)
    dims = index.constant_dims(tap.graph, dq["scale"])
    per_tensor = dims is not None and int(np.prod(dims)) == 1
    if (
        block
        or dq["domain"] not in _DOMAINS
        or (not per_tensor and (dims is None or len(dims) != 1 or tap.rank is None))
    ):
        inputs = [tap.tensor, dq["scale"], *([dq["zero_point"]] if dq["zero_point"] else [])]
        return b.op("DequantizeLinear", inputs, "dq", domain=dq["domain"] or None, **dq["attrs"])
    trailing = 0 if per_tensor else tap.rank - 1 - axis % tap.rank  # scale [C] on `axis`: [C, 1, ...]

    def along_axis(v: str) -> str:
        return b.op("Reshape", [v, b.i64([-1] + [1] * trailing)]) if trailing else v

    x = b.cast(tap.tensor, elem)
    if dq["zero_point"]:
        x = b.op("Sub", [x, along_axis(b.cast(dq["zero_point"], elem))])
    return b.op("Mul", [x, along_axis(dq["scale"])], "dq")


def unsigned_pairs(index: ModelIndex, taps: list[TapRecord], constants: Constants | None) -> int:
    """Convert each int8 Q -> DQ pair whose Q output a tap reads to uint8, where onnxruntime would (the
    module doc); returns how many."""
    if constants is None:  # IR 3 (no QDQ ops exist there)
        return 0
    done: dict[tuple[str, str], str] = {}  # (graph, quantized tensor) -> its uint8 zero point
    for tap in taps:
        if tap.dequant is None or tap.constant:
            continue
        key = (tap.graph, tap.tensor)
        if key not in done:
            zp = _convert(index, index[tap.graph], tap.tensor, constants)
            if zp is None:
                continue
            done[key] = zp
        tap.dequant["zero_point"] = done[key]
    return len(done)


def _convert(index: ModelIndex, entry: GraphEntry, tensor: str, constants: Constants) -> str | None:
    """The pair's new zero point, or None where onnxruntime would not convert it: the Q must have a
    constant one-element int8 zero point and exactly one consumer, a DQ with the same zero point
    (or none, then 0) whose output has one consumer (else onnxruntime first gives each consumer a
    DQ of its own, and the Q has two)."""
    q = entry.producer(tensor)
    if q is None or q.op_type != "QuantizeLinear" or q.domain not in _DOMAINS or tensor in entry.outputs:
        return None
    dqs = entry.consumers(tensor)
    zp_name = input_at(q, 2)
    zp = _int8_scalar(index, entry.path, zp_name)
    if zp is None or len(dqs) != 1 or not _pairs_with(index, entry, dqs[0], int(zp)):
        return None
    dq = dqs[0]
    u8 = np.array(int(zp) + 128, np.uint8).reshape(zp.shape)
    users = sum(len(e.consumer_indices(zp_name)) for e in index.graphs.values())
    if users == 1 + (input_at(dq, 2) == zp_name) and zp_name in entry.constants:
        src = entry.constants[zp_name]  # only this pair reads it: convert it in place
        t = src if isinstance(src, TensorProto) else next(a.t for a in src.attribute if a.name == "value")
        t.CopyFrom(numpy_helper.from_array(u8, t.name))
        new = zp_name
    else:
        new = constants.name_for(u8)
        _set_input(q, 2, new)
    _set_input(dq, 2, new)
    for vi in entry.graph.value_info:
        if vi.name == tensor and vi.type.HasField("tensor_type"):
            vi.type.tensor_type.elem_type = TensorProto.UINT8
    return new


def _pairs_with(index: ModelIndex, entry: GraphEntry, dq: NodeProto, zp: int) -> bool:
    if (
        dq.op_type != "DequantizeLinear"
        or dq.domain not in _DOMAINS
        or len(entry.consumers(dq.output[0])) > 1
    ):
        return False
    name = input_at(dq, 2)
    if not name:
        return zp == 0
    theirs = _int8_scalar(index, entry.path, name)
    return theirs is not None and int(theirs) == zp


def _int8_scalar(index: ModelIndex, path: str, name: str | None) -> np.ndarray | None:
    """The value of `name` when it is a constant one-element int8 tensor, else None."""
    src = index.constant(path, name) if name else None
    if isinstance(src, NodeProto):
        src = next((a.t for a in src.attribute if a.name == "value"), None)
    if not isinstance(src, TensorProto) or src.data_type != TensorProto.INT8 or src.data_location:
        return None
    arr = numpy_helper.to_array(src)
    return arr if arr.size == 1 else None


def _set_input(node: NodeProto, i: int, name: str) -> None:
    while len(node.input) <= i:
        node.input.append("")
    node.input[i] = name
