"""Node builders whose helpers read like the maths and hide the opset differences (`graph.opset`).

A `Builder` appends nodes for one graph (the main graph or a subgraph body) and takes its
names from a `Names` allocator shared by everything added to the model, so nothing it makes
can collide. `b.reduce("ReduceMax", x, axes)` is one call at every opset, whether the axes go
in as an attribute or as an input; `b.minimum`, `b.scatter_add`, `b.unsqueeze` likewise, and
so are the ops that older opsets lack (`b.where`, `b.isnan`, `b.isinf`, `b.arange`, `b.clip`,
`b.slice`): each spells the op with older ones where it does not exist yet (`graph.opset`).

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
from .opset import (
    axes_as_input,
    clip_bounds_as_input,
    compare_takes_ints,
    constant_takes_any_type,
    has_op,
    min_max_take_int64,
    scatter_add_available,
    slice_bounds_as_input,
)

F32_MAX = float(np.finfo(np.float32).max)
INT64_MAX = int(np.iinfo(np.int64).max)


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
        self._scalar_consts: set[str] = set()  # rank-0 constants: they never widen a broadcast

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
            name = self.constants.name_for(arr)
            if arr.ndim == 0:
                self._scalar_consts.add(name)
            return name
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self._constant_node(arr)
            self._consts[key] = name
            if arr.ndim == 0:
                self._scalar_consts.add(name)
        return self._consts[key]

    def _constant_node(self, arr: np.ndarray) -> str:
        """A Constant node holding arr. Before opset 9 Constant holds floats only: other types are a
        double Constant and a Cast (exact: the builders' integers are far below 2**53)."""
        if arr.dtype.kind != "f" and not constant_takes_any_type(self.opset):
            wide = arr.astype(np.float64)
            if not np.array_equal(wide.astype(arr.dtype), arr):
                raise ValueError(f"a {arr.dtype} constant at opset {self.opset} must be exact in float64")
            return self.cast(self._constant_node(wide), helper.np_dtype_to_tensor_dtype(arr.dtype))
        name = self.fresh("c")
        value_t = numpy_helper.from_array(arr, name)
        self.nodes.append(
            helper.make_node("Constant", [], [name], name=self.fresh("n_Constant"), value=value_t)
        )
        return name

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

    def unique_counts(self, x: str) -> tuple[str, str]:
        """(sorted distinct values, their counts) of the 1-D tensor x: Unique, which opset 11 brought."""
        if not has_op("Unique", self.opset):
            raise ValueError(f"Unique needs opset 11, graph is at {self.opset}")
        values, _, _, counts = self._ops("Unique", [x], 4, "unique", sorted=1)
        return values, counts

    def minimum(self, a: str, b: str) -> str:
        """Elementwise min of two integer tensors (sizes, indices), or of any numeric type from opset 9.

        Min takes int64 from opset 12, Where(Less) from 9; before, Less compares them in double
        (exact below 2**53; onnxruntime has no double Min / Max at opset 7) and `where` picks.
        """
        if min_max_take_int64(self.opset):
            return self._op("Min", [a, b])
        if compare_takes_ints(self.opset):
            return self._op("Where", [self._op("Less", [a, b]), a, b])
        return self._pick_in_double("Less", a, b)

    def maximum(self, a: str, b: str) -> str:
        if min_max_take_int64(self.opset):
            return self._op("Max", [a, b])
        if compare_takes_ints(self.opset):
            return self._op("Where", [self._op("Greater", [a, b]), a, b])
        return self._pick_in_double("Greater", a, b)

    def _pick_in_double(self, compare: str, a: str, b: str) -> str:
        d = TensorProto.DOUBLE
        first = self._op(compare, [self.cast(a, d), self.cast(b, d)])
        return self.where(first, a, b, TensorProto.INT64)

    def where(self, cond: str, a: str, b: str, dtype: int = TensorProto.FLOAT) -> str:
        """`a` where `cond` else `b` (broadcast); `a` and `b` are of element type `dtype`.

        Where exists from opset 9. Before: integers as b + cond·(a - b); floats, which may hold
        NaN or Inf (0·NaN is NaN, so no arithmetic mask works), gathered from [b, a] flattened,
        element i at i + N·cond_i (`_select`).
        """
        if has_op("Where", self.opset):
            return self._op("Where", [cond, a, b])
        if dtype in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16):
            return self._select(cond, a, b, dtype)
        diff = self._op("Sub", [a, b])
        return self._op("Add", [b, self._op("Mul", [self.cast(cond, dtype), diff])])

    def _select(self, cond: str, a: str, b: str, dtype: int) -> str:
        """Where for float tensors without Where: zeros of the broadcast shape (from comparisons, which
        never give NaN), then a gather from [b, a]."""
        cf = self.cast(cond, dtype)
        zeros = self._op("Sub", [cf, cf])
        for t in (a, b):
            if t not in self._scalar_consts:
                zeros = self._op("Add", [zeros, self.cast(self._op("Less", [t, t]), dtype)])
        n = self._op("Size", [zeros])
        pick = self.flat(self.cast(self._op("Add", [cf, zeros]), TensorProto.INT64))
        at = self._op("Add", [self.arange(n), self._op("Mul", [pick, n])])
        table = self._op(
            "Concat", [self.flat(self._op("Add", [b, zeros])), self.flat(self._op("Add", [a, zeros]))], axis=0
        )
        return self._op("Reshape", [self._op("Gather", [table, at], axis=0), self._op("Shape", [zeros])])

    def isnan(self, x: str, hint: str | None = None) -> str:
        """IsNaN of a float32 tensor; before opset 9, neither x < inf nor x > -inf."""
        if has_op("IsNaN", self.opset):
            return self._op("IsNaN", [x], hint)
        below = self._op("Less", [x, self.const(np.inf)])
        return self._op("Not", [self._op("Or", [below, self._op("Greater", [x, self.const(-np.inf)])])], hint)

    def isinf(self, x: str, hint: str | None = None) -> str:
        """IsInf of a float32 tensor; before opset 10, |x| > float32 max."""
        if has_op("IsInf", self.opset):
            return self._op("IsInf", [x], hint)
        return self._op("Greater", [self._op("Abs", [x]), self.const(F32_MAX)], hint)

    def nonfinite(self, x: str, hint: str | None = None) -> str:
        """NaN or ±Inf, elementwise, for a float32 tensor: IsNaN(x - x); before opset 9, not |x| < inf."""
        if has_op("IsNaN", self.opset):
            return self._op("IsNaN", [self._op("Sub", [x, x])], hint)
        return self._op("Not", [self._op("Less", [self._op("Abs", [x]), self.const(np.inf)])], hint)

    def greater_equal(self, a: str, b: str) -> str:
        """a >= b (bool): GreaterOrEqual from opset 12, Not(Less) before (the same for non-NaN)."""
        if has_op("GreaterOrEqual", self.opset):
            return self._op("GreaterOrEqual", [a, b])
        return self._op("Not", [self._op("Less", [a, b])])

    def clip(self, x: str, lo: float, hi: float) -> str:
        """x clipped to [lo, hi] (float32): bounds as inputs from opset 11, attributes before."""
        if clip_bounds_as_input(self.opset):
            return self._op("Clip", [x, self.const(lo), self.const(hi)])
        return self._op("Clip", [x], min=float(lo), max=float(hi))

    def arange(self, n: str, bound: int | None = None, hint: str | None = None) -> str:
        """int64 [0, 1, ..., n - 1] for an int64 scalar n; `bound`, when given, is a static limit n never exceeds.

        Range exists from opset 11. Before: the first n entries of the constant [0, bound) by
        Compress (opset 9); else a Loop over the bits of n (`_arange_loop`).
        """
        if has_op("Range", self.opset):
            return self._op("Range", [self.i64(0), n, self.i64(1)], hint)
        if bound is not None and has_op("Compress", self.opset) and compare_takes_ints(self.opset):
            every = self.i64(np.arange(bound))
            return self._op("Compress", [every, self._op("Less", [every, n])], hint, axis=0)
        return self._arange_loop(n, hint)

    def _arange_loop(self, n: str, hint: str | None = None) -> str:
        """[0, n) with Loop (opset 1), one iteration per bit of n, low bit first: `block` is [0, 2^i);
        when bit i of n is set, `acc` gains block + len(acc) (Tile by the bit: once or not at all),
        so acc is always [0, len(acc)). O(n) work in ~log2(n) iterations."""
        i64, body = TensorProto.INT64, self.child()
        it, go, acc, block, rest = (self.fresh(h) for h in ("it", "go", "acc", "block", "rest"))
        half = body._op("Div", [rest, body.i64(2)])
        bit = body._op(
            "Reshape", [body._op("Sub", [rest, body._op("Mul", [half, body.i64(2)])]), body.i64([1])]
        )
        grown = body._op("Tile", [body._op("Add", [block, body._op("Size", [acc])]), bit])
        acc_out = body._op("Concat", [acc, grown], axis=0)
        block_out = body._op("Concat", [block, body._op("Add", [block, body._op("Size", [block])])], axis=0)
        go_out = body._op("Greater", [body.cast(half, TensorProto.FLOAT), body.const(0.5)])
        graph = helper.make_graph(
            body.nodes,
            self.fresh("arange_body"),
            [
                helper.make_tensor_value_info(it, i64, []),
                helper.make_tensor_value_info(go, TensorProto.BOOL, []),
                helper.make_tensor_value_info(acc, i64, [None]),
                helper.make_tensor_value_info(block, i64, [None]),
                helper.make_tensor_value_info(rest, i64, []),
            ],
            [
                helper.make_tensor_value_info(go_out, TensorProto.BOOL, []),
                helper.make_tensor_value_info(acc_out, i64, [None]),
                helper.make_tensor_value_info(block_out, i64, [None]),
                helper.make_tensor_value_info(half, i64, []),
            ],
        )
        start = self._op("Greater", [self.cast(n, TensorProto.FLOAT), self.const(0.5)])
        inputs = ["", start, self.i64(np.zeros(0, np.int64)), self.i64([0]), n]
        return self._ops("Loop", inputs, 3, hint or "arange", body=graph)[0]

    # --- small conveniences ----------------------------------------------------------------------

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        """x[start:end] along `axis`: bounds as inputs from opset 10, attributes before."""
        if slice_bounds_as_input(self.opset):
            return self._op("Slice", [x, self.i64([start]), self.i64([end]), self.i64([axis])])
        return self._op("Slice", [x], starts=[start], ends=[end], axes=[axis])

    def cast(self, x: str, to: int) -> str:
        return self._op("Cast", [x], to=to)

    def flat(self, x: str, hint: str | None = None) -> str:
        return self._op("Reshape", [x, self.i64([-1])], hint)

    def rows(self, x: str, hint: str | None = None) -> str:
        """x viewed as [-1, last dim], whatever its (possibly unknown) rank."""
        last = self.slice(self._op("Shape", [x]), -1, INT64_MAX, 0)
        return self._op("Reshape", [x, self._op("Concat", [self.i64([-1]), last], axis=0)], hint)

    def dim(self, x: str, axis: int) -> str:
        """Dim `axis` of x as an int64 scalar."""
        return self._op("Gather", [self._op("Shape", [x]), self.i64(axis)], axis=0)

    def strided_indices(self, n: str, k_max: int) -> str:
        """int64 positions floor(j·n/k) for j < k = min(n, k_max); `n` is an int64 scalar."""
        k = self.minimum(n, self.i64(k_max))
        j = self.arange(k, bound=k_max)
        return self._op("Div", [self._op("Mul", [j, n]), self.maximum(k, self.i64(1))])

    def strided(self, v: str, k_max: int, hint: str | None = None) -> str:
        """At most `k_max` evenly strided entries of the 1-D tensor v (entry 0 always kept)."""
        return self._op("Gather", [v, self.strided_indices(self._op("Size", [v]), k_max)], hint, axis=0)
