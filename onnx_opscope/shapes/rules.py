"""Per-node shape rules: what fills the dims that shape inference leaves unknown.

`Fallback` walks a graph in node order and, for every output whose shape is incomplete,
applies the op's rule to its input shapes: broadcasting, MatMul/Gemm/Conv/pool output
sizes, Reshape/Expand/Slice/Pad targets, contrib attention ops, recurrent ops, constant
If conditions and so on. Rules need the values of small tensors (shape vectors, pads,
scales), so it also folds constant subgraphs with numpy (`const`) and tracks shape vectors
whose entries are symbols (`value`: Shape -> Gather -> Concat keeps `batch` and `seq`).

A rule that cannot decide leaves the dims unknown; nothing here guesses a number. Two
assumptions are written where they are made: a Slice end at or past 1e9 means "to the
end", and a symbolic Slice end is in range (the model could not run otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from onnx import NodeProto, TensorProto, numpy_helper

from ..graph.index import ModelIndex
from ..graph.proto import attr as get_attr
from ..graph.proto import op_set
from .symbolic import Poly, parse_dim, prod
from .table import Dim, Shape, ShapeTable, best_shape, complete

_TO_THE_END = 10**9  # Slice ends at or past this mean "to the end" (exporters write 1e9, INT_MAX, ...)
_SMALL_CONST = 4096  # small tensors (shapes, pads, scales) are folded by value up to this size


# Ops whose shape and dtype rules below are exact (given known inputs), so that a huge graph
# made only of them needs no other shape inference. Multi-output ops with side outputs
# (LayerNormalization's mean, MaxPool's indices, Dropout's mask) stay unresolved if used.
EXACT_RULE_OPS = op_set(
    "Add Sub Mul Div Pow Max Min Sum Mean Equal Less Greater LessOrEqual GreaterOrEqual And Or Xor Where "
    "Abs Ceil Cos Erf Exp Floor Identity Log Neg Not Reciprocal Relu Round Sigmoid Sign Sin Sqrt Tanh Gelu "
    "LeakyRelu Elu Selu HardSigmoid HardSwish Softplus Softsign Clip Softmax LogSoftmax LayerNormalization "
    "BatchNormalization Cast MatMul Gemm Conv MaxPool AveragePool GlobalAveragePool GlobalMaxPool Reshape "
    "Flatten Transpose Unsqueeze Squeeze Concat Gather Shape Split Slice Constant Expand"
)


# -- the per-node walk -------------------------------------------------------------------

_SAME_AS_INPUT = op_set(
    "Abs Acos Acosh Asin Asinh Atan Atanh Ceil Cos Cosh Elu Erf Exp Floor Gelu HardSigmoid HardSwish "
    "Identity IsInf IsNaN LeakyRelu Log LogSoftmax Mish Neg Not Reciprocal Relu Round Selu Celu Shrink "
    "Sigmoid Sign Sin Sinh Softmax Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Cast CastLike Clip "
    "Dropout LpNormalization BatchNormalization InstanceNormalization LayerNormalization "
    "GroupNormalization MeanVarianceNormalization SimplifiedLayerNormalization QuantizeLinear "
    "DequantizeLinear DynamicQuantizeLinear FastGelu BiasGelu QuickGelu Hardmax CumSum "
    "SkipLayerNormalization SkipSimplifiedLayerNormalization QLinearLeakyRelu QLinearSigmoid "
    "RotaryEmbedding Trilu ReverseSequence Swish"
)
_BROADCAST = op_set(
    "Add Sub Mul Div Pow Max Min Sum Mean Equal Less Greater LessOrEqual GreaterOrEqual And Or Xor Where "
    "PRelu Mod BitShift BitwiseAnd BitwiseOr BitwiseXor BiasAdd"
)


class Fallback:
    """Walk nodes in order and fill unknown dims from inputs; tracks small shape tensors by value.

    State is real (the table it fills, the folded constants), hence a class.
    """

    def __init__(self, index: ModelIndex, table: ShapeTable, inits: dict[str, TensorProto], strong: set[str]):
        self.index, self.table, self.inits, self.strong = index, table, inits, strong
        self.producer: dict[str, NodeProto] | None = None
        self._consts: dict[str, np.ndarray | None] = {}
        # (op, id of each input's shape) -> (those shapes, the rule's answer), for the rules that read
        # nothing but input shapes: a 160k-node chain has a handful of distinct cases. The shapes are
        # kept in the entry so that their ids cannot be reused by other objects while it lives.
        self._memo: dict[tuple, tuple[list, list]] = {}
        self._same: dict[tuple, Shape] = {}  # shape_key -> the first such answer: equal answers share a tuple
        self.filled = self.incomplete = 0

    def run(self) -> tuple[int, int]:
        """Fill what can be filled; returns (dims filled, node outputs still incomplete).

        Subgraphs are visited before the node that owns them: an If's outputs follow its branches'.
        """
        self.filled = self.incomplete = 0
        fill = self._fill
        if len(self.index.graphs) == 1:  # no subgraphs: the node list itself (160k nodes: no generator)
            main = self.index.main
            for node, (ins, outs) in zip(main.graph.node, main.io, strict=True):
                fill(node, ins, outs)
        else:
            for entry, i, node in self.index.nodes(subgraphs_first=True):
                fill(node, *entry.io[i])
        return self.filled, self.incomplete

    def _fill(self, node: NodeProto, in_names: tuple[str, ...], outs: tuple[str, ...]) -> None:
        """The inner loop of shape inference (once per node, 160k times on big graphs): single-output
        nodes and ops whose dtype is their first input's take the short ways, and the rules that read
        only input shapes answer once per distinct inputs."""
        table, strong = self.table, self.strong
        shapes, dtypes = table.shapes, table.dtypes
        op = node.op_type
        for i, o in enumerate(outs):
            if o and o not in dtypes:
                if op in _DTYPE_RULE_OPS:
                    dt = _out_dtype(node, i, dtypes)
                else:
                    dt = dtypes.get(in_names[0], 0) if in_names and in_names[0] else 0
                if dt:
                    dtypes[o] = dt
        if len(outs) == 1:
            if not outs[0] or complete(shapes.get(outs[0]), strong):
                return
        elif all(not o or complete(shapes.get(o), strong) for o in outs):
            return
        new = self._answer(node, op, in_names)
        for o, shp in zip(outs, new, strict=False):
            if o and shp is not None:
                old = shapes.get(o)
                if old is None:
                    best = tuple(shp)
                    self.filled += len(best)
                    shapes[o] = best
                    continue
                best = best_shape(old, tuple(shp), strong)
                if best != old:
                    self.filled += (
                        len(best)
                        if len(old) != len(best)
                        else sum(1 for d, e in zip(best, old, strict=True) if d is not e)
                    )
                    shapes[o] = best
        for o in outs:
            if o and not complete(shapes.get(o), strong):
                self.incomplete += 1

    def _answer(self, node: NodeProto, op: str, in_names: tuple[str, ...]) -> list:
        """The op's rule's output shapes; memoised (and the answers interned) for shape-only rules."""
        key = None
        if op in _SHAPE_ONLY_RULE_OPS:
            get = self.table.shapes.get
            ins = [get(n) if n else _ABSENT for n in in_names]
            key = (op, *[id(x) for x in ins])
            memo = self._memo.get(key)
            if memo is not None:
                return memo[1]
        rule = _RULE_OF.get(op)
        try:
            new = rule(self, node) if rule is not None else []
        except Exception:  # noqa: BLE001 - a rule that cannot decide leaves the dims unknown
            new = []
        if key is not None:
            same = self._same
            new = [shp if shp is None else same.setdefault(shape_key(shp), shp) for shp in new]
            self._memo[key] = (ins, new)
        return new

    def forget_values(self) -> None:
        """Drop the folded constants and tracked shape values, after the table learnt more shapes."""
        self.table.values.clear()
        self._consts.clear()

    # helpers used by rules
    def shape(self, node: NodeProto, i: int) -> Shape | None:
        name = node.input[i] if i < len(node.input) else ""
        return self.table.shapes.get(name) if name else None

    def value(self, name: str, depth: int = 0) -> tuple[Dim, ...] | None:
        """The value of a small int tensor (a shape), as dims; None when not trackable."""
        if not name:
            return None
        vals = self.table.values
        if name in vals:
            return vals[name]
        v = self._value(name, depth)
        vals[name] = v
        return v

    def _producer(self, name: str) -> NodeProto | None:
        if self.producer is None:
            self.producer = {o: n for _, _, n in self.index.nodes() for o in n.output}
        return self.producer.get(name)

    def const(self, name: str, depth: int = 0) -> np.ndarray | None:
        """The value of a small tensor computable from constants and static shapes, else None."""
        if not name:
            return None
        cache = self._consts
        if name in cache:
            return cache[name]
        cache[name] = None  # guards against cycles
        try:
            v = self._const(name, depth)
        except Exception:  # noqa: BLE001 - anything we cannot fold is simply not a constant
            v = None
        if v is not None and v.size > _SMALL_CONST:
            v = None
        cache[name] = v
        return v

    def _const(self, name: str, depth: int) -> np.ndarray | None:
        if depth > 64:
            return None
        t = self.inits.get(name)
        if t is not None:
            return _small_array(t)
        node = self._producer(name)
        if node is None:
            return None
        op = node.op_type
        if op == "Constant":
            t = get_attr(node, "value")
            if isinstance(t, TensorProto):
                return _small_array(t)
            for key in ("value_ints", "value_int", "value_floats", "value_float"):
                v = get_attr(node, key)
                if v is not None:
                    return np.array(v)
            return None
        if op in ("Shape", "Size"):
            shp = self.table.shapes.get(node.input[0])
            if shp is None or not all(isinstance(d, int) for d in shp):
                return None
            if op == "Size":
                return np.array(math.prod(shp), dtype=np.int64)
            start, end = get_attr(node, "start", 0), get_attr(node, "end", None)
            return np.array(shp[slice(start, end)], dtype=np.int64)
        if op not in _FOLDS and op != "ConstantOfShape":
            return None
        ins = [self.const(i, depth + 1) if i else None for i in node.input]
        if not ins or ins[0] is None:
            return None
        return _fold(node, ins)

    def _value(self, name: str, depth: int) -> tuple[Dim, ...] | None:
        if depth > 64:
            return None
        c = self.const(name)
        if c is not None:
            if c.dtype.kind not in "iub":
                return None
            return tuple(int(x) for x in c.reshape(-1))
        node = self._producer(name)
        if node is None:
            return None
        op = node.op_type
        if op == "Shape":
            s = self.table.shapes.get(node.input[0])
            if s is None:
                return None
            start, end = get_attr(node, "start", 0), get_attr(node, "end", None)
            return tuple(s[slice(start, end)])
        if op == "Size":
            s = self.table.shapes.get(node.input[0])
            return None if s is None else (prod(s),)
        ins = [self.value(i, depth + 1) for i in node.input]
        if op in _VALUE_KEEPERS and ins and ins[0] is not None:
            return ins[0]  # a shape tensor keeps its values through these
        if op == "Concat" and ins and all(v is not None for v in ins):
            return tuple(d for v in ins for d in v)
        if op == "Gather" and len(ins) == 2 and ins[0] is not None and ins[1] is not None:
            n = len(ins[0])
            return tuple(ins[0][int(i) + n if int(i) < 0 else int(i)] for i in ins[1] if isinstance(i, int))
        if op == "Slice" and ins and ins[0] is not None and len(ins) >= 3 and ins[1] and ins[2]:
            return _value_slice(ins)
        if op in ("Add", "Sub", "Mul", "Div") and len(ins) == 2 and ins[0] is not None and ins[1] is not None:
            return _value_arith(op, ins[0], ins[1])
        return None


_VALUE_KEEPERS = frozenset({"Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten"})


def _value_slice(ins: list[tuple[Dim, ...] | None]) -> tuple[Dim, ...] | None:
    step = ins[4][0] if len(ins) > 4 and ins[4] else 1
    st, en = ins[1][0], ins[2][0]
    if isinstance(st, int) and isinstance(en, int) and isinstance(step, int):
        return tuple(ins[0][st:en:step])
    return None


def _value_arith(op: str, a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """Elementwise Add / Sub / Mul / Div of two shape vectors (one may broadcast from length 1)."""
    if len(a) != len(b):
        if len(a) == 1:
            a = a * len(b)
        elif len(b) == 1:
            b = b * len(a)
        else:
            return None
    out: list[Dim] = []
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            out.append(None)
        elif op == "Add":
            out.append(x + y)
        elif op == "Sub":
            out.append(x - y)
        elif op == "Mul":
            out.append(x * y)
        elif isinstance(x, int) and isinstance(y, int):
            out.append(x // y if y else None)
        else:
            try:
                out.append(x / y)
            except (ValueError, ZeroDivisionError):
                out.append(None)
    return tuple(out)


_BOOL_OUT = op_set("Equal Less Greater LessOrEqual GreaterOrEqual And Or Xor Not IsNaN IsInf")
_I64_OUT = op_set("Shape Size ArgMax ArgMin NonZero NonMaxSuppression")
_I32_OUT = op_set("MatMulInteger ConvInteger")
_FLOAT_OUT = op_set("MatMulIntegerToFloat DynamicQuantizeMatMul DynamicQuantizeLSTM")


_DTYPE_RULE_OPS = (
    _BOOL_OUT
    | _I64_OUT
    | _I32_OUT
    | _FLOAT_OUT
    | op_set("Where OneHot Constant TopK Cast DynamicQuantizeLinear QuantizeLinear DequantizeLinear")
    | op_set("ConstantOfShape If Loop Scan")
)
"""The ops whose output dtype is not simply their first input's (`_out_dtype` has a rule for each)."""


def _out_dtype(node: NodeProto, i: int, dtypes: dict[str, int]) -> int:
    """Element type of output `i` for ops onnx inference does not know (contrib ops); 0 if unsure."""
    op = node.op_type
    first = dtypes.get(node.input[0], 0) if node.input and node.input[0] else 0
    if op in _BOOL_OUT:
        return TensorProto.BOOL
    if op == "Where":
        return dtypes.get(node.input[1], 0)
    if op == "OneHot":
        return dtypes.get(node.input[2], 0)
    if op == "Constant":
        t = get_attr(node, "value")
        return t.data_type if isinstance(t, TensorProto) else 0
    if op in _I64_OUT or (op == "TopK" and i == 1):
        return TensorProto.INT64
    if op in _I32_OUT:
        return TensorProto.INT32
    if op in _FLOAT_OUT:
        return TensorProto.FLOAT
    if op == "Cast":
        return get_attr(node, "to", 0)
    if op == "DynamicQuantizeLinear":
        return TensorProto.FLOAT if i == 1 else TensorProto.UINT8
    if op == "QuantizeLinear":
        zp = node.input[2] if len(node.input) > 2 else ""
        return dtypes.get(zp, TensorProto.UINT8) if zp else TensorProto.UINT8
    if op == "DequantizeLinear":
        return dtypes.get(node.input[1], TensorProto.FLOAT)
    if op == "ConstantOfShape":
        v = get_attr(node, "value")
        return v.data_type if isinstance(v, TensorProto) else TensorProto.FLOAT
    if op in ("If", "Loop", "Scan"):
        return 0
    return first


def _small_array(t: TensorProto) -> np.ndarray | None:
    if t.data_location == TensorProto.EXTERNAL or math.prod(t.dims) > _SMALL_CONST:
        return None
    if t.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return None
    try:
        return numpy_helper.to_array(t)
    except Exception:  # noqa: BLE001
        return None


_NP_TYPES = {
    TensorProto.INT64: np.int64,
    TensorProto.INT32: np.int32,
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.BOOL: np.bool_,
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.FLOAT16: np.float16,
}


def _fold_reshape(node: NodeProto, ins: list[np.ndarray]) -> np.ndarray:
    x, zero_copies = ins[0], not get_attr(node, "allowzero", 0)
    return x.reshape([x.shape[i] if d == 0 and zero_copies else int(d) for i, d in enumerate(ins[1])])


def _axes_of(node: NodeProto, ins: list[np.ndarray]) -> list[int] | None:
    """`axes` as an attribute (older opsets) or as the second input."""
    axes = get_attr(node, "axes")
    if axes is None and len(ins) > 1 and ins[1] is not None:
        axes = [int(a) for a in ins[1]]
    return axes


def _fold_squeeze(node: NodeProto, ins: list[np.ndarray]) -> np.ndarray:
    axes = _axes_of(node, ins)
    return np.squeeze(ins[0]) if axes is None else np.squeeze(ins[0], axis=tuple(axes))


def _fold_unsqueeze(node: NodeProto, ins: list[np.ndarray]) -> np.ndarray:
    x, axes = ins[0], _axes_of(node, ins)
    rank = x.ndim + len(axes)
    for a in sorted(a + rank if a < 0 else a for a in axes):
        x = np.expand_dims(x, a)
    return x


def _fold_slice(node: NodeProto, ins: list[np.ndarray]) -> np.ndarray:
    x, starts, ends = ins[0], ins[1], ins[2]
    axes = ins[3] if len(ins) > 3 and ins[3] is not None else range(len(starts))
    steps = ins[4] if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    sl = [slice(None)] * x.ndim
    for st, en, ax, sp in zip(starts, ends, axes, steps, strict=False):
        end = int(en) if -(2**62) < int(en) < 2**62 else None  # INT64 min / max: to the end
        sl[int(ax)] = slice(int(st), end, int(sp))
    return x[tuple(sl)]


def _fold_reduce(node: NodeProto, ins: list[np.ndarray]) -> np.ndarray:
    axes = _axes_of(node, ins)
    fn = np.prod if node.op_type == "ReduceProd" else np.sum
    return fn(ins[0], axis=None if not axes else tuple(axes), keepdims=bool(get_attr(node, "keepdims", 1)))


def _elementwise(fn):
    """Fold a variadic elementwise op; Div of integers floors, as ONNX's integer Div does."""

    def fold(node: NodeProto, ins: list[np.ndarray]) -> np.ndarray:
        f = np.floor_divide if fn is np.divide and all(x.dtype.kind in "iu" for x in ins) else fn
        out = ins[0]
        for b in ins[1:]:
            out = f(out, b)
        return out

    return fold


def _unary(fn):
    return lambda node, ins: fn(ins[0])


_BINARY = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Mod": np.mod, "Equal": np.equal,
    "Less": np.less, "Greater": np.greater, "Min": np.minimum, "Max": np.maximum,
}  # fmt: skip
_UNARY = {
    "Neg": np.negative,
    "Abs": np.abs,
    "Not": np.logical_not,
    "Floor": np.floor,
    "Ceil": np.ceil,
    "Sqrt": np.sqrt,
}
_FOLDS = {
    "Cast": lambda n, ins: ins[0].astype(_NP_TYPES[get_attr(n, "to")]),
    "Identity": lambda n, ins: ins[0],
    "Reshape": _fold_reshape,
    "Flatten": lambda n, ins: ins[0].reshape(int(np.prod(ins[0].shape[: get_attr(n, "axis", 1)])), -1),
    "Squeeze": _fold_squeeze,
    "Unsqueeze": _fold_unsqueeze,
    "Concat": lambda n, ins: np.concatenate(ins, axis=get_attr(n, "axis", 0)),
    "Gather": lambda n, ins: np.take(ins[0], ins[1].astype(np.int64), axis=get_attr(n, "axis", 0)),
    "Slice": _fold_slice,
    "Transpose": lambda n, ins: np.transpose(ins[0], get_attr(n, "perm")),
    "Where": lambda n, ins: np.where(ins[0], ins[1], ins[2]),
    "Range": lambda n, ins: np.arange(ins[0], ins[1], ins[2]).astype(ins[0].dtype),
    "Expand": lambda n, ins: ins[0] * np.ones(tuple(int(d) for d in ins[1]), dtype=ins[0].dtype),
    "Tile": lambda n, ins: np.tile(ins[0], tuple(int(d) for d in ins[1])),
    "ReduceProd": _fold_reduce,
    "ReduceSum": _fold_reduce,
    **{op: _elementwise(fn) for op, fn in _BINARY.items()},
    **{op: _unary(fn) for op, fn in _UNARY.items()},
}


def _fold(node: NodeProto, ins: list[np.ndarray | None]) -> np.ndarray | None:
    """Evaluate one node on small constant inputs with numpy (shape arithmetic only)."""
    if node.op_type == "ConstantOfShape":
        if ins[0] is None:
            return None
        val = get_attr(node, "value")
        fill = numpy_helper.to_array(val).reshape(-1)[0] if isinstance(val, TensorProto) else np.float32(0)
        return np.full(tuple(int(d) for d in ins[0]), fill)
    if any(i is None for i, name in zip(ins, node.input, strict=True) if name):
        return None
    fold = _FOLDS.get(node.op_type)
    return None if fold is None else fold(node, ins)


def _broadcast(shapes: Sequence[Shape | None]) -> Shape | None:
    if any(s is None for s in shapes):
        return None
    if len(shapes) == 2 and all(type(d) is int for s in shapes for d in s):  # fast path: two static shapes
        a, b = shapes
        if len(a) < len(b):
            a, b = b, a
        b = (1,) * (len(a) - len(b)) + tuple(b)
        for x, y in zip(a, b, strict=True):
            if x != y and x != 1 and y != 1:
                return None
        return tuple(y if x == 1 else x for x, y in zip(a, b, strict=True))
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for axis in range(rank):
        ds = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
        d = ds[0]
        t = type(d)
        if (t is int or t is Poly) and all(e is d for e in ds):  # one dim (or the same one) at this axis
            out.append(d)
            continue
        d = _broadcast_axis(ds)
        if d is _MISMATCH:
            return None
        out.append(d)
    return tuple(out)


_MISMATCH = object()


def _broadcast_axis(ds: list[Dim]) -> Dim | object:
    """The broadcast of one axis' dims, `_MISMATCH` when two static sizes differ."""
    ints = {d for d in ds if isinstance(d, int) and d != 1}
    if len(ints) == 1:
        return ints.pop()
    if len(ints) > 1:
        return _MISMATCH
    polys = [d for d in ds if isinstance(d, Poly)]
    if polys:
        # Different expressions broadcast together must be equal at run time (or 1):
        # keep the shortest, as ORT's auto-merge keeps one.
        return min(polys, key=lambda p: len(str(p)))
    if all(d == 1 for d in ds):
        return 1
    return None


def _same_as_input(fb: Fallback, node: NodeProto) -> list:
    s = fb.shape(node, 0)
    if node.op_type == "DynamicQuantizeLinear":
        return [s, (), ()]
    return [s]


def _broadcast_rule(fb: Fallback, node: NodeProto) -> list:
    get = fb.table.shapes.get
    return [_broadcast([get(name) for name in node.input if name])]


def _matmul_shape(a: Shape | None, b: Shape | None) -> Shape | None:
    if a is None or b is None:
        return None
    a1, b1 = len(a) == 1, len(b) == 1
    a2 = (1, *a) if a1 else a
    b2 = (*b, 1) if b1 else b
    batch = _broadcast([a2[:-2], b2[:-2]])
    if batch is None:
        return None
    out = (*batch, a2[-2], b2[-1])
    if a1:
        out = out[:-2] + out[-1:]
    if b1:
        out = out[:-1]
    return out


def _rule_matmul(fb: Fallback, node: NodeProto) -> list:
    op = node.op_type
    if op == "QLinearMatMul":
        return [_matmul_shape(fb.shape(node, 0), fb.shape(node, 3))]
    a, b = fb.shape(node, 0), fb.shape(node, 1)
    if op == "FusedMatMul" and a is not None and b is not None:
        if get_attr(node, "transA", 0) and len(a) >= 2:
            a = (*a[:-2], a[-1], a[-2])
        if get_attr(node, "transB", 0) and len(b) >= 2:
            b = (*b[:-2], b[-1], b[-2])
    return [_matmul_shape(a, b)]


def _rule_gemm(fb: Fallback, node: NodeProto) -> list:
    a, b = fb.shape(node, 0), fb.shape(node, 1)
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return [None]
    m = a[1] if get_attr(node, "transA", 0) else a[0]
    n = b[0] if get_attr(node, "transB", 0) else b[1]
    return [(m, n)]


def _out_len(size: Dim, k: int, stride: int, dil: int, pad: int, ceil_mode: bool, auto_pad: str) -> Dim:
    if size is None:
        return None
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if isinstance(size, int):
            return -(-size // stride)
        return size if stride == 1 else parse_dim(f"ceil(({size}) / {stride})")
    span = dil * (k - 1) + 1
    if auto_pad == "VALID":
        pad = 0
    num = size + (pad - span)
    if isinstance(num, int):
        return (-(-num // stride) if ceil_mode else num // stride) + 1
    if stride == 1:
        return num + 1
    fn = "ceil" if ceil_mode else "floor"
    return parse_dim(f"{fn}(({num}) / {stride}) + 1")


def _rule_conv(fb: Fallback, node: NodeProto) -> list:
    op = node.op_type
    xi, wi = (0, 3) if op == "QLinearConv" else (0, 1)
    x = fb.shape(node, xi)
    if x is None or len(x) < 3:
        return [None]
    spatial = len(x) - 2
    if op in ("Conv", "ConvInteger", "QLinearConv", "FusedConv"):
        w = fb.shape(node, wi)
        kernel = get_attr(node, "kernel_shape") or (list(w[2:]) if w is not None else None)
        cout = w[0] if w is not None else None
    else:  # pools
        kernel = get_attr(node, "kernel_shape")
        cout = x[1]
    if kernel is None or any(not isinstance(k, int) for k in kernel):
        return [None]
    strides = get_attr(node, "strides") or [1] * spatial
    dil = get_attr(node, "dilations") or [1] * spatial
    pads = get_attr(node, "pads") or [0] * (2 * spatial)
    auto_pad = get_attr(node, "auto_pad", "NOTSET")
    ceil_mode = bool(get_attr(node, "ceil_mode", 0))
    out = [
        _out_len(x[2 + i], kernel[i], strides[i], dil[i], pads[i] + pads[i + spatial], ceil_mode, auto_pad)
        for i in range(spatial)
    ]
    return [(x[0], cout, *out)] + ([None] if op == "MaxPool" else [])


def _rule_conv_transpose(fb: Fallback, node: NodeProto) -> list:
    x, w = fb.shape(node, 0), fb.shape(node, 1)
    if x is None or w is None or len(x) < 3:
        return [None]
    spatial = len(x) - 2
    group = get_attr(node, "group", 1)
    cout = w[1] * group if isinstance(w[1], int) else None
    out_shape = get_attr(node, "output_shape")
    if out_shape:
        return [(x[0], cout, *out_shape[-spatial:])]
    kernel = get_attr(node, "kernel_shape") or list(w[2:])
    strides = get_attr(node, "strides") or [1] * spatial
    dil = get_attr(node, "dilations") or [1] * spatial
    pads = get_attr(node, "pads") or [0] * (2 * spatial)
    opad = get_attr(node, "output_padding") or [0] * spatial
    auto_pad = get_attr(node, "auto_pad", "NOTSET")
    out: list[Dim] = []
    for i in range(spatial):
        size = x[2 + i]
        if size is None or not isinstance(kernel[i], int):
            out.append(None)
        elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(size * strides[i])
        else:
            out.append(
                (size - 1) * strides[i] + opad[i] + (kernel[i] - 1) * dil[i] + 1 - pads[i] - pads[i + spatial]
            )
    return [(x[0], cout, *out)]


def _rule_global_pool(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    return [None if x is None else (*x[:2], *([1] * (len(x) - 2)))]


def _rule_reshape(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    target = fb.value(node.input[1]) if len(node.input) > 1 else tuple(get_attr(node, "shape") or ())
    if target is None:
        return [None]
    allowzero = get_attr(node, "allowzero", 0)
    out: list[Dim] = []
    for i, t in enumerate(target):
        if t == 0 and not allowzero:
            out.append(x[i] if x is not None and i < len(x) else None)
        else:
            out.append(t)
    if -1 in out:
        k = out.index(-1)
        total = prod(x) if x is not None else None
        rest = prod(out[:k] + out[k + 1 :])
        if total is None or rest is None or rest == 0:
            out[k] = None
        else:
            try:
                out[k] = total // rest if isinstance(total, int) and isinstance(rest, int) else total / rest
            except (ValueError, ZeroDivisionError):
                out[k] = None
    return [tuple(out)]


def _rule_flatten(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    if x is None:
        return [None]
    axis = get_attr(node, "axis", 1)
    axis = axis + len(x) if axis < 0 else axis
    return [(prod(x[:axis]), prod(x[axis:]))]


def _rule_transpose(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    if x is None:
        return [None]
    perm = get_attr(node, "perm") or list(range(len(x)))[::-1]
    return [tuple(x[p] for p in perm)]


def _axes(fb: Fallback, node: NodeProto, input_index: int = 1) -> list[int] | None:
    axes = get_attr(node, "axes")
    if axes is None and len(node.input) > input_index and node.input[input_index]:
        v = fb.value(node.input[input_index])
        axes = list(v) if v is not None and all(isinstance(a, int) for a in v) else None
    return axes


def _rule_unsqueeze(fb: Fallback, node: NodeProto) -> list:
    x, axes = fb.shape(node, 0), _axes(fb, node)
    if x is None or axes is None:
        return [None]
    rank = len(x) + len(axes)
    axes = sorted(a + rank if a < 0 else a for a in axes)
    out = list(x)
    for a in axes:
        out.insert(a, 1)
    return [tuple(out)]


def _rule_squeeze(fb: Fallback, node: NodeProto) -> list:
    x, axes = fb.shape(node, 0), _axes(fb, node)
    if x is None:
        return [None]
    if axes is None:
        if any(not isinstance(d, int) for d in x):
            return [None]
        return [tuple(d for d in x if d != 1)]
    drop = {a + len(x) if a < 0 else a for a in axes}
    return [tuple(d for i, d in enumerate(x) if i not in drop)]


def _rule_concat(fb: Fallback, node: NodeProto) -> list:
    shapes = [fb.shape(node, i) for i in range(len(node.input))]
    if any(s is None for s in shapes) or not shapes:
        return [None]
    rank = len(shapes[0])
    axis = get_attr(node, "axis", 0)
    axis = axis + rank if axis < 0 else axis
    out = list(shapes[0])
    total: Dim = 0
    for s in shapes:
        total = None if total is None or s[axis] is None else total + s[axis]
    out[axis] = total
    for i in range(rank):
        if i != axis and out[i] is None:
            out[i] = next((s[i] for s in shapes if s[i] is not None), None)
    return [tuple(out)]


def _rule_reduce(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    if x is None:
        return [None]
    axes = _axes(fb, node)
    keep = get_attr(node, "keepdims", 1)
    if node.op_type in ("ArgMax", "ArgMin"):
        axes = [get_attr(node, "axis", 0)]
    if axes is None or not axes:
        if get_attr(node, "noop_with_empty_axes", 0):
            return [x]
        axes = list(range(len(x)))
    drop = {a + len(x) if a < 0 else a for a in axes}
    if keep:
        return [tuple(1 if i in drop else d for i, d in enumerate(x))]
    return [tuple(d for i, d in enumerate(x) if i not in drop)]


def _rule_gather(fb: Fallback, node: NodeProto) -> list:
    x, idx = fb.shape(node, 0), fb.shape(node, 1)
    if x is None or idx is None:
        return [None]
    axis = get_attr(node, "axis", 0)
    axis = axis + len(x) if axis < 0 else axis
    return [(*x[:axis], *idx, *x[axis + 1 :])]


def _rule_shape(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    if x is None:
        return [None]
    start, end = get_attr(node, "start", 0), get_attr(node, "end", None)
    return [(len(range(len(x))[slice(start, end)]),)]


def _rule_expand(fb: Fallback, node: NodeProto) -> list:
    target = fb.value(node.input[1])
    x = fb.shape(node, 0)
    if target is None:
        return [None]
    return [_broadcast([x, tuple(target)])]


def _rule_constant_of_shape(fb: Fallback, node: NodeProto) -> list:
    v = fb.value(node.input[0])
    return [None if v is None else tuple(v)]


def _rule_split(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    if x is None:
        return [None] * len(node.output)
    axis = get_attr(node, "axis", 0)
    axis = axis + len(x) if axis < 0 else axis
    sizes = get_attr(node, "split")
    if sizes is None and len(node.input) > 1 and node.input[1]:
        v = fb.value(node.input[1])
        sizes = list(v) if v is not None else None
    n = len(node.output)
    if sizes is None:
        d = x[axis]
        if isinstance(d, int) and d % n == 0:
            sizes = [d // n] * n
        elif isinstance(d, Poly):
            try:
                sizes = [d / n] * n
            except ValueError:
                return [None] * n
        else:
            return [None] * n
    return [(*x[:axis], s, *x[axis + 1 :]) for s in sizes]


def _rule_slice(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    if x is None:
        return [None]
    starts, ends = fb.value(node.input[1]), fb.value(node.input[2])
    axes = (
        fb.value(node.input[3]) if len(node.input) > 3 and node.input[3] else tuple(range(len(starts or ())))
    )
    steps = fb.value(node.input[4]) if len(node.input) > 4 and node.input[4] else (1,) * len(starts or ())
    if starts is None or ends is None or axes is None or steps is None:
        return [None]
    out = list(x)
    for st, en, ax, sp in zip(starts, ends, axes, steps, strict=False):
        ax = ax + len(x) if ax < 0 else ax
        d = x[ax]
        if isinstance(d, int) and all(isinstance(v, int) for v in (st, en, sp)):
            out[ax] = len(range(d)[slice(st, en, sp)])
        elif isinstance(st, int) and st >= 0 and sp == 1 and isinstance(en, int) and en >= _TO_THE_END:
            out[ax] = None if d is None else d - st
        elif isinstance(st, int) and st >= 0 and sp == 1 and isinstance(en, Poly):
            out[ax] = en - st  # a symbolic end (x[:seq]) must be in range for the model to run
        else:
            out[ax] = None
    return [tuple(out)]


def _rule_attention(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    if node.op_type == "Attention":
        w = fb.shape(node, 1)
        sizes = get_attr(node, "qkv_hidden_sizes")
        hv = sizes[2] if sizes else (w[1] / 3 if w is not None and w[1] is not None else None)
    else:
        v = fb.shape(node, 2)
        hv = v[-1] if v is not None and len(v) == 3 else (x[-1] if x is not None else None)
    if x is None or len(x) != 3:
        return [None]
    return [(x[0], x[1], hv)]


def _rule_if(fb: Fallback, node: NodeProto) -> list:
    then_g, else_g = get_attr(node, "then_branch"), get_attr(node, "else_branch")
    cond = fb.const(node.input[0])
    if cond is not None and cond.size == 1:  # statically decided: the taken branch's shapes
        taken = then_g if bool(cond.reshape(-1)[0]) else else_g
        return [fb.table.shapes.get(o.name) for o in taken.output]
    outs = []
    for a, b in zip(then_g.output, else_g.output, strict=False):
        sa, sb = fb.table.shapes.get(a.name), fb.table.shapes.get(b.name)
        if sa is None or sb is None or len(sa) != len(sb):
            outs.append(None)
        else:
            outs.append(tuple(x if x == y else None for x, y in zip(sa, sb, strict=True)))
    return outs


def _rule_pad(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    pads = get_attr(node, "pads")
    if pads is None and len(node.input) > 1:
        pads = fb.value(node.input[1])
    if x is None or pads is None:
        return [None]
    rank = len(x)
    axes = list(range(rank))
    if len(node.input) > 3 and node.input[3]:
        v = fb.value(node.input[3])
        if v is None:
            return [None]
        axes = [a + rank if a < 0 else a for a in v]
    out = list(x)
    n = len(axes)
    for i, ax in enumerate(axes):
        b, e = pads[i], pads[i + n]
        out[ax] = None if out[ax] is None or b is None or e is None else out[ax] + b + e
    return [tuple(out)]


def _rule_range(fb: Fallback, node: NodeProto) -> list:
    vals = [fb.const(i) for i in node.input]
    if any(v is None for v in vals):
        return [None]
    start, limit, delta = (float(v) for v in vals)
    return [(max(int(math.ceil((limit - start) / delta)), 0),)]


def _rule_tile(fb: Fallback, node: NodeProto) -> list:
    x, reps = fb.shape(node, 0), fb.value(node.input[1])
    if x is None or reps is None or len(reps) != len(x):
        return [None]
    return [tuple(None if d is None or r is None else d * r for d, r in zip(x, reps, strict=True))]


def _rule_resize(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    if x is None:
        return [None]
    if node.op_type == "Upsample":
        scales = fb.const(node.input[1]) if len(node.input) > 1 else np.array(get_attr(node, "scales") or [])
        sizes = None
    else:
        scales = fb.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        sizes = fb.value(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    if sizes is not None and len(sizes) == len(x):
        return [tuple(sizes)]
    if scales is None or scales.size != len(x):
        return [None]
    out: list[Dim] = []
    for d, sc in zip(x, scales.reshape(-1).tolist(), strict=True):
        if sc == 1:
            out.append(d)
        elif isinstance(d, int):
            out.append(int(math.floor(d * sc)))
        elif isinstance(d, Poly) and float(sc).is_integer():
            out.append(d * int(sc))
        else:
            out.append(None)
    return [tuple(out)]


def _rule_topk(fb: Fallback, node: NodeProto) -> list:
    x = fb.shape(node, 0)
    k = fb.value(node.input[1]) if len(node.input) > 1 else (get_attr(node, "k"),)
    if x is None or not k:
        return [None, None]
    axis = get_attr(node, "axis", -1)
    axis = axis + len(x) if axis < 0 else axis
    out = (*x[:axis], k[0], *x[axis + 1 :])
    return [out, out]


def _rule_recurrent(fb: Fallback, node: NodeProto) -> list:
    x, w = fb.shape(node, 0), fb.shape(node, 1)
    if x is None or len(x) != 3:
        return [None] * len(node.output)
    hidden = get_attr(node, "hidden_size")
    dirs = w[0] if w is not None else (2 if get_attr(node, "direction", "forward") == "bidirectional" else 1)
    if get_attr(node, "layout", 0):
        b, sq = x[0], x[1]
        return [(b, sq, dirs, hidden), (b, dirs, hidden), (b, dirs, hidden)]
    sq, b = x[0], x[1]
    return [(sq, dirs, b, hidden), (dirs, b, hidden), (dirs, b, hidden)]


def _rule_qlinear_binary(fb: Fallback, node: NodeProto) -> list:
    return [_broadcast([fb.shape(node, 0), fb.shape(node, 3)])]


def _rule_gather_elements(fb: Fallback, node: NodeProto) -> list:
    return [fb.shape(node, 1)]


_RULES = {
    "MatMul": _rule_matmul,
    "MatMulInteger": _rule_matmul,
    "QLinearMatMul": _rule_matmul,
    "FusedMatMul": _rule_matmul,
    "DynamicQuantizeMatMul": _rule_matmul,
    "MatMulIntegerToFloat": _rule_matmul,
    "Gemm": _rule_gemm,
    "Conv": _rule_conv,
    "ConvInteger": _rule_conv,
    "QLinearConv": _rule_conv,
    "FusedConv": _rule_conv,
    "MaxPool": _rule_conv,
    "AveragePool": _rule_conv,
    "LpPool": _rule_conv,
    "ConvTranspose": _rule_conv_transpose,
    "GlobalAveragePool": _rule_global_pool,
    "GlobalMaxPool": _rule_global_pool,
    "GlobalLpPool": _rule_global_pool,
    "Reshape": _rule_reshape,
    "Flatten": _rule_flatten,
    "Transpose": _rule_transpose,
    "Unsqueeze": _rule_unsqueeze,
    "Squeeze": _rule_squeeze,
    "Concat": _rule_concat,
    "Gather": _rule_gather,
    "Shape": _rule_shape,
    "Expand": _rule_expand,
    "ConstantOfShape": _rule_constant_of_shape,
    "Split": _rule_split,
    "Slice": _rule_slice,
    "Attention": _rule_attention,
    "MultiHeadAttention": _rule_attention,
    "If": _rule_if,
    "Pad": _rule_pad,
    "Range": _rule_range,
    "Tile": _rule_tile,
    "Resize": _rule_resize,
    "Upsample": _rule_resize,
    "TopK": _rule_topk,
    "LSTM": _rule_recurrent,
    "GRU": _rule_recurrent,
    "RNN": _rule_recurrent,
    "GatherElements": _rule_gather_elements,
    "QLinearAdd": _rule_qlinear_binary,
    "QLinearMul": _rule_qlinear_binary,
    "QLinearAveragePool": _rule_conv,
    "QLinearGlobalAveragePool": _rule_global_pool,
    **{
        op: _rule_reduce
        for op in (
            "ReduceSum",
            "ReduceMean",
            "ReduceMax",
            "ReduceMin",
            "ReduceProd",
            "ReduceL1",
            "ReduceL2",
            "ReduceLogSum",
            "ReduceLogSumExp",
            "ReduceSumSquare",
            "ArgMax",
            "ArgMin",
        )
    },
}


def shape_key(shape: Shape) -> tuple:
    """A key equal for interchangeable shapes only: int dims by value, any other dim by identity.

    (By value, 4.0 == 4 and equal polynomials built in another term order would collide.)
    """
    return tuple(d if type(d) is int else (id(d),) for d in shape)


_SHAPE_ONLY_RULE_OPS = _BROADCAST | {"MatMul"}
"""Ops whose rule reads only the input shapes (no attribute, no tensor value): memoised in `Fallback._fill`."""
_ABSENT = object()  # stands for an omitted optional input in a memo key

_RULE_OF = {
    **dict.fromkeys(_BROADCAST, _broadcast_rule),
    **dict.fromkeys(_SAME_AS_INPUT, _same_as_input),
    **_RULES,
}
"""Every op's rule in one lookup: its own rule first, then same-as-input, then broadcasting."""
