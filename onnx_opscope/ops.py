"""Opset-aware node builders: the one place that knows how ONNX ops changed across opsets.

A `Builder` appends nodes for one graph (the main graph or a subgraph body) and hands out
unique tensor names. Its helpers read like the maths (`b.reduce("ReduceMax", x, axes)`),
hiding the differences that matter to us:

- Reduce* take `axes` as an attribute before opset 18 (ReduceSum: before 13), as an input after;
- ScatterElements `reduction="add"` exists from opset 16;
- Constants are `Constant` nodes, cached per value, so subgraph bodies stay self-contained.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import NodeProto, helper, numpy_helper

MIN_OPSET = 11
MAX_OPSET = onnx.defs.onnx_opset_version()

_AXES_AS_INPUT_SINCE = {"ReduceSum": 13}
_DEFAULT_AXES_AS_INPUT_SINCE = 18


def axes_as_input(op_type: str, opset: int) -> bool:
    """Whether `op_type` takes its axes as a second input at `opset`."""
    return opset >= _AXES_AS_INPUT_SINCE.get(op_type, _DEFAULT_AXES_AS_INPUT_SINCE)


def scatter_add_available(opset: int) -> bool:
    return opset >= 16


class Constants:
    """Constants shared by every tap of a model, kept as main-graph initializers, one per value.

    Subgraph bodies may read outer-scope initializers, so a tap inside an If branch or a Loop
    body uses them too; without sharing, each of ~170 tap nodes in 7 was a Constant node.
    """

    def __init__(self, taken: set[str]):
        self._taken = taken
        self._names: dict[tuple, str] = {}
        self.tensors: list[onnx.TensorProto] = []

    def name_for(self, arr: np.ndarray) -> str:
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._names:
            name, i = "opscope_c0", 0
            while name in self._taken:
                i += 1
                name = f"opscope_c{i}"
            self._taken.add(name)
            self._names[key] = name
            self.tensors.append(numpy_helper.from_array(arr, name))
        return self._names[key]


class Builder:
    """Appends nodes to `self.nodes` for one graph at one opset; names are unique across the model.

    State is real here (the node list, the name counter and the constant cache), hence a class.
    """

    def __init__(self, opset: int, prefix: str, taken: set[str], constants: Constants | None = None):
        self.opset = opset
        self.prefix = prefix
        self.nodes: list[NodeProto] = []
        self._taken = taken
        self._consts: dict[tuple, str] = {}
        self.constants = constants

    def child(self) -> Builder:
        """A builder for a subgraph body (its own nodes, the same name space and shared constants)."""
        return Builder(self.opset, self.prefix, self._taken, self.constants)

    def fresh(self, hint: str) -> str:
        name = f"{self.prefix}{hint}"
        i = 0
        while name in self._taken:
            i += 1
            name = f"{self.prefix}{hint}_{i}"
        self._taken.add(name)
        return name

    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, **attrs) -> str:
        """Add one node; returns its output name."""
        return self.ops(op_type, inputs, 1, hint, **attrs)[0]

    def ops(
        self, op_type: str, inputs: Sequence[str], n_out: int, hint: str | None = None, **attrs
    ) -> list[str]:
        """Add one node with `n_out` outputs; returns their names."""
        outs = [self.fresh(hint or op_type.lower()) for _ in range(n_out)]
        node = helper.make_node(op_type, list(inputs), outs, name=self.fresh(f"n_{op_type}"), **attrs)
        self.nodes.append(node)
        return outs

    def const(self, value, dtype=np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        if self.constants is not None:
            return self.constants.name_for(arr)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh("c")
            self.nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [name],
                    name=self.fresh("n_Constant"),
                    value=numpy_helper.from_array(arr, name),
                )
            )
            self._consts[key] = name
        return self._consts[key]

    def i64(self, value) -> str:
        return self.const(value, np.int64)

    # --- ops whose form depends on the opset -------------------------------------------------------

    def reduce(
        self,
        op_type: str,
        x: str,
        axes: Sequence[int] | None = None,
        keepdims: int = 0,
        hint: str | None = None,
    ) -> str:
        """`op_type` over `axes` (None: every axis), whatever the opset's way of passing axes."""
        if axes is None:
            return self.op(op_type, [x], hint, keepdims=keepdims)
        if axes_as_input(op_type, self.opset):
            return self.op(op_type, [x, self.i64(list(axes))], hint, keepdims=keepdims)
        return self.op(op_type, [x], hint, keepdims=keepdims, axes=list(axes))

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self.op("Slice", [x, self.i64([start]), self.i64([end]), self.i64([axis])])

    def scatter_add(self, data: str, indices: str, updates: str) -> str:
        if not scatter_add_available(self.opset):
            raise ValueError(f"ScatterElements reduction='add' needs opset 16, graph is at {self.opset}")
        return self.op("ScatterElements", [data, indices, updates], axis=0, reduction="add")

    # --- small conveniences ------------------------------------------------------------------------

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", [x], to=to)

    def flat(self, x: str, hint: str | None = None) -> str:
        return self.op("Reshape", [x, self.i64([-1])], hint)

    def minimum(self, a: str, b: str) -> str:
        """Elementwise min for any numeric type: Min takes int64 only from opset 12."""
        if self.opset >= 12:
            return self.op("Min", [a, b])
        return self.op("Where", [self.op("Less", [a, b]), a, b])

    def maximum(self, a: str, b: str) -> str:
        if self.opset >= 12:
            return self.op("Max", [a, b])
        return self.op("Where", [self.op("Greater", [a, b]), a, b])

    def strided_indices(self, n: str, k_max: int) -> str:
        """int64 positions floor(j·n/k) for j < k = min(n, k_max); `n` is an int64 scalar."""
        k = self.minimum(n, self.i64(k_max))
        j = self.op("Range", [self.i64(0), k, self.i64(1)])
        return self.op("Div", [self.op("Mul", [j, n]), self.maximum(k, self.i64(1))])
