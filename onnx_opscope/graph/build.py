"""Node builders whose helpers read like the maths and hide the opset differences (`graph.opset`).

A `Builder` appends nodes for one graph (the main graph or a subgraph body) and takes its
names from a `Names` allocator shared by everything added to the model, so nothing it makes
can collide. `b.reduce("ReduceMax", x, axes)` is one call at every opset, whether the axes go
in as an attribute or as an input; `b.minimum`, `b.scatter_add`, `b.unsqueeze` likewise.

Constants are `Constant` nodes cached per builder (a subgraph body stays self-contained), or,
with a `Constants` pool, initializers shared by every builder of the model: subgraph bodies
may read outer-scope initializers, and without sharing ~170 tap nodes in 7 were Constants.

Names: a node given `name=` keeps it (a duplicate is an error) and names its outputs
`<name>_output_<i>`, as the PyTorch exporter does (the zoo's models); otherwise the node is
`<prefix>n_<op>` and its output `<prefix><hint>`, made unique by the allocator (the taps).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from .index import Names
from .opset import axes_as_input, min_max_take_int64, scatter_add_available


class Constants:
    """Initializers shared by every builder of a model, one per (dtype, shape, value). State is real."""

    def __init__(self, names: Names, prefix: str = "opscope_c", tensors: list[TensorProto] | None = None):
        self._names = names
        self.prefix = prefix
        self.tensors: list[TensorProto] = [] if tensors is None else tensors
        self._by_value: dict[tuple, str] = {}

    def name_for(self, arr: np.ndarray) -> str:
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._by_value:
            name = self._names.fresh(f"{self.prefix}{len(self._by_value)}")
            self._by_value[key] = name
            self.tensors.append(numpy_helper.from_array(arr, name))
        return self._by_value[key]


class Builder:
    """Appends nodes to `self.nodes` for one graph at one opset. State is real: the node list and caches."""

    def __init__(self, opset: int, names: Names, prefix: str = "", constants: Constants | None = None):
        self.opset = opset
        self.names = names
        self.prefix = prefix
        self.constants = constants
        self.nodes: list[NodeProto] = []
        self._consts: dict[tuple, str] = {}

    def child(self) -> Builder:
        """A builder for a subgraph body: its own nodes, the same names and shared constants."""
        return Builder(self.opset, self.names, self.prefix, self.constants)

    def fresh(self, hint: str) -> str:
        return self.names.fresh(f"{self.prefix}{hint}")

    # --- nodes ---------------------------------------------------------------------------------

    def _op(
        self,
        op_type: str,
        inputs: Sequence[str],
        hint: str | None = None,
        *,
        name: str | None = None,
        out: str | None = None,
        domain: str | None = None,
        **attrs,
    ) -> str:
        """Add one node; returns its output name."""
        return self._ops(
            op_type, inputs, 1, hint, name=name, outs=[out] if out else None, domain=domain, **attrs
        )[0]

    def _ops(
        self,
        op_type: str,
        inputs: Sequence[str],
        n_out: int = 1,
        hint: str | None = None,
        *,
        name: str | None = None,
        outs: Sequence[str] | None = None,
        domain: str | None = None,
        **attrs,
    ) -> list[str]:
        """Add one node with `n_out` outputs (or the given `outs`); returns their names."""
        if name is not None:
            if name in self.names:
                raise ValueError(f"duplicate node name {name!r}")
            self.names.add(name)
            outputs = list(outs) if outs else [f"{name}_output_{i}" for i in range(n_out)]
            for o in outputs:
                self.names.add(o)
        elif outs:
            outputs = [self.names.add(o) for o in outs]
            name = self.fresh(f"n_{op_type}")
        else:
            outputs = [self.fresh(hint or op_type.lower()) for _ in range(n_out)]
            name = self.fresh(f"n_{op_type}")
        self.nodes.append(
            helper.make_node(op_type, list(inputs), outputs, name=name, domain=domain or None, **attrs)
        )
        return outputs

    # The helpers below call _op / _ops, so a subclass may give op / ops its own naming signature
    # (the zoo's builder does) without breaking them.
    op = _op
    ops = _ops

    def const(self, value, dtype=np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        if self.constants is not None:
            return self.constants.name_for(arr)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh("c")
            value_t = numpy_helper.from_array(arr, name)
            self.nodes.append(
                helper.make_node("Constant", [], [name], name=self.fresh("n_Constant"), value=value_t)
            )
            self._consts[key] = name
        return self._consts[key]

    def i64(self, value) -> str:
        return self.const(value, np.int64)

    # --- ops whose form depends on the opset -----------------------------------------------------

    def reduce(
        self,
        op_type: str,
        x: str,
        axes: Sequence[int] | None = None,
        keepdims: int = 0,
        hint: str | None = None,
        *,
        name: str | None = None,
        out: str | None = None,
    ) -> str:
        """`op_type` over `axes` (None: every axis), whatever the opset's way of passing axes."""
        if axes is None:
            return self._op(op_type, [x], hint, name=name, out=out, keepdims=keepdims)
        if axes_as_input(op_type, self.opset):
            return self._op(op_type, [x, self.i64(list(axes))], hint, name=name, out=out, keepdims=keepdims)
        return self._op(op_type, [x], hint, name=name, out=out, keepdims=keepdims, axes=list(axes))

    def unsqueeze(
        self, x: str, axes: Sequence[int], hint: str | None = None, *, name: str | None = None
    ) -> str:
        if axes_as_input("Unsqueeze", self.opset):
            return self._op("Unsqueeze", [x, self.i64(list(axes))], hint, name=name)
        return self._op("Unsqueeze", [x], hint, name=name, axes=list(axes))

    def squeeze(
        self, x: str, axes: Sequence[int], hint: str | None = None, *, name: str | None = None
    ) -> str:
        if axes_as_input("Squeeze", self.opset):
            return self._op("Squeeze", [x, self.i64(list(axes))], hint, name=name)
        return self._op("Squeeze", [x], hint, name=name, axes=list(axes))

    def scatter_add(self, data: str, indices: str, updates: str) -> str:
        if not scatter_add_available(self.opset):
            raise ValueError(f"ScatterElements reduction='add' needs opset 16, graph is at {self.opset}")
        return self._op("ScatterElements", [data, indices, updates], axis=0, reduction="add")

    def minimum(self, a: str, b: str) -> str:
        """Elementwise min for any numeric type."""
        if min_max_take_int64(self.opset):
            return self._op("Min", [a, b])
        return self._op("Where", [self._op("Less", [a, b]), a, b])

    def maximum(self, a: str, b: str) -> str:
        if min_max_take_int64(self.opset):
            return self._op("Max", [a, b])
        return self._op("Where", [self._op("Greater", [a, b]), a, b])

    # --- small conveniences ----------------------------------------------------------------------

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self._op("Slice", [x, self.i64([start]), self.i64([end]), self.i64([axis])])

    def cast(self, x: str, to: int) -> str:
        return self._op("Cast", [x], to=to)

    def flat(self, x: str, hint: str | None = None) -> str:
        return self._op("Reshape", [x, self.i64([-1])], hint)

    def rows(self, x: str, hint: str | None = None) -> str:
        """x viewed as [-1, last dim], whatever its (possibly unknown) rank."""
        last = self._op("Slice", [self._op("Shape", [x]), self.i64([-1]), self.i64([np.iinfo(np.int64).max])])
        return self._op("Reshape", [x, self._op("Concat", [self.i64([-1]), last], axis=0)], hint)

    def dim(self, x: str, axis: int) -> str:
        """Dim `axis` of x as an int64 scalar."""
        return self._op("Gather", [self._op("Shape", [x]), self.i64(axis)], axis=0)

    def strided_indices(self, n: str, k_max: int) -> str:
        """int64 positions floor(j·n/k) for j < k = min(n, k_max); `n` is an int64 scalar."""
        k = self.minimum(n, self.i64(k_max))
        j = self._op("Range", [self.i64(0), k, self.i64(1)])
        return self._op("Div", [self._op("Mul", [j, n]), self.maximum(k, self.i64(1))])

    def strided(self, v: str, k_max: int, hint: str | None = None) -> str:
        """At most `k_max` evenly strided entries of the 1-D tensor v (entry 0 always kept)."""
        return self._op("Gather", [v, self.strided_indices(self._op("Size", [v]), k_max)], hint, axis=0)
