"""Inference taps: attention concentration, MoE routing load and residual-block influence.

Three site kinds beyond the GEMM-like ones of `sites.py`, each with its own sketches:

- **attn** (role `attn`): every Softmax of known rank >= 2 over its last axis (role `probs`
  instead when its output does not weight values through a MatMul: a classifier head or a
  router, which the attention findings leave alone), and a shadow
  softmax for fused attention ops (com.microsoft Attention / MultiHeadAttention /
  GroupQueryAttention, opset-23 Attention). The shadow recomputes softmax(Q·Kᵀ·scale + mask)
  from the op's own inputs, next to it; the fused op and its outputs are untouched.
  Sketches: `attn_qmax` (max over keys, averaged over batch and heads: one value per query
  position) and `attn_krecv` (summed over batch, heads and queries: one value per key; a
  sink is a key that receives most of it). Both keep at most `max_rows` positions, evenly
  strided, position 0 always included.
- **route** (role `route`): the indices output of a TopK router (and ArgMax indices that feed
  a Gather of stacked expert weights). Sketch `route_load`: how many selections each expert
  got, over E bins, E being the gate's last dim (static from shape inference; when it is not
  known the graph uses max id + 1).
- **residual** (roles `residual_a`, `residual_b`): an Add of two activations of the same shape
  where one input reaches the other through weights (x + f(x), f holding a MatMul / Conv /
  ...). Sketch `sumsq` on each input; the block influence gap is
  sqrt(min(Σa², Σb²) / max(Σa², Σb²)), small when the block barely changes its input.

This module is a leaf: `sites.py` calls `find_taps`, `sketches.py` registers the builders and
references, `inject.py` calls `build_shadow`. It also holds the pure findings functions the
miner and the report call (`attention_findings`, `routing_findings`, `residual_findings`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, helper

from .errors import OpscopeError
from .model import iter_graphs
from .ops import Builder

KINDS: dict[str, str] = {
    "Softmax": "attn",
    "Attention": "attn",
    "MultiHeadAttention": "attn",
    "GroupQueryAttention": "attn",
    "TopK": "route",
    "ArgMax": "route",
    "Add": "residual",
}
"""op type -> site kind, for the op types this module finds; every other site is `gemm`."""
SITE_KINDS = ("gemm", "attn", "route", "residual")
FUSED_ATTENTION = {
    ("com.microsoft", "Attention"),
    ("com.microsoft", "MultiHeadAttention"),
    ("com.microsoft", "GroupQueryAttention"),
    ("", "Attention"),
    ("ai.onnx", "Attention"),
}
KIND_SKETCHES: dict[str, tuple[str, ...]] = {
    "attn": ("attn_qmax", "attn_krecv"),
    "route": ("route_load",),
    "residual": ("sumsq",),
}
SHADOW_SUFFIX = "/opscope_shadow_probs"
MAX_EXPERTS = 1024  # a TopK over more candidates is a sampler (vocab), not a router
GEMM_LIKE = frozenset(
    {
        "MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "QLinearMatMul", "QLinearConv",
        "ConvInteger", "LSTM", "GRU", "RNN", "Einsum", "FusedMatMul", "Attention", "MultiHeadAttention",
        "GroupQueryAttention", "MatMulNBits",
    }
)  # fmt: skip
_ANCESTRY_LIMIT = 4000  # tensors visited per Add when looking for its skip path

Dims = list[int | str | None]


def kind_of(op_type: str) -> str:
    return KINDS.get(op_type, "gemm")


# --------------------------------------------------------------------------------------------
# shapes: ranks, same-shape tests and expert counts need inference, symbolic dims included


def infer_dims(model: ModelProto) -> dict[str, dict[str, Dims | None]]:
    """Per graph path (as `sites` names them), tensor -> dims (int, symbol expression or None each).

    From `shapes.infer_shapes` (onnx inference, per-node rules that carry symbols through
    Reshape/Concat/Slice, onnxruntime's symbolic inference only where those leave gaps on small
    graphs), so x and f(x) get equal dims and same-shape tests work on symbolic models.
    """
    if not any(n.op_type in KINDS for _, g in iter_graphs(model.graph) for n in g.node):
        return {}
    from .shapes import infer_shapes

    table = infer_shapes(model)
    out: dict[str, dict[str, Dims | None]] = {}
    for path, g in iter_graphs(model.graph):
        names = (
            [v.name for v in g.input]
            + [t.name for t in g.initializer]
            + [o for n in g.node for o in n.output]
        )
        dims: dict[str, Dims | None] = {}
        for name in names:
            shape = table.shapes.get(name)
            if shape is not None or name in table.shapes:
                dims[name] = None if shape is None else [_as_dim(d) for d in shape]
        out[path] = dims
    return out


def _as_dim(d) -> int | str | None:
    """An int, a canonical string for a symbolic expression (equal expressions, equal strings), or None."""
    if d is None or isinstance(d, int):
        return d if d is None or d > 0 else None
    return str(d)


# --------------------------------------------------------------------------------------------
# finders


@dataclass
class GraphView:
    """What the finders know about one (sub)graph: producers, consumers, constants, dims."""

    path: str
    opset: int
    producers: dict[str, NodeProto]
    consumers: dict[str, list[NodeProto]]
    index: dict[int, int]  # id(node) -> position in the graph (topological)
    constants: set[str]  # initializers and Constant outputs, enclosing graphs included
    const_dims: dict[str, list[int]]
    dims: dict[str, Dims | None]  # enclosing graphs included
    outputs: set[str] = field(default_factory=set)


def graph_view(
    graph: GraphProto,
    path: str,
    opset: int,
    dims_table: Mapping[str, Mapping[str, Dims | None]],
    parent: GraphView | None = None,
) -> GraphView:
    producers = {o: n for n in graph.node for o in n.output if o}
    consumers: dict[str, list[NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    const_dims = dict(parent.const_dims) if parent else {}
    const_dims.update({t.name: [int(d) for d in t.dims] for t in graph.initializer})
    for n in graph.node:
        if n.op_type == "Constant" and n.output:
            value = next(
                (a.t for a in n.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None
            )
            const_dims[n.output[0]] = [int(d) for d in value.dims] if value is not None else []
    constants = set(parent.constants) if parent else set()
    constants |= {t.name for t in graph.initializer} | {
        n.output[0] for n in graph.node if n.op_type == "Constant"
    }
    dims = dict(parent.dims) if parent else {}
    dims.update(dims_table.get(path, {}))
    return GraphView(
        path,
        opset,
        producers,
        consumers,
        {id(n): i for i, n in enumerate(graph.node)},
        constants,
        const_dims,
        dims,
        {o.name for o in graph.output},
    )


TapSpec = tuple[str, str, int, int, int | None]  # role, tensor, channel axis, seq axis, bins


def find_taps(node: NodeProto, view: GraphView) -> tuple[list[TapSpec], dict] | None:
    """The taps (and extra site attributes) of `node` if it is an attn / route / residual site."""
    op, domain = node.op_type, node.domain
    if (domain, op) in FUSED_ATTENTION:
        return _fused_taps(node, view)
    if domain not in ("", "ai.onnx"):
        return None
    if op == "Softmax":
        return _softmax_taps(node, view)
    if op == "TopK":
        return _topk_taps(node, view)
    if op == "ArgMax":
        return _argmax_taps(node, view)
    if op == "Add":
        return _residual_taps(node, view)
    return None


def _attr(node: NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _input(node: NodeProto, i: int) -> str | None:
    return node.input[i] if len(node.input) > i and node.input[i] else None


def _rank(view: GraphView, name: str) -> int | None:
    d = view.dims.get(name)
    return None if d is None else len(d)


def _used(view: GraphView, name: str) -> bool:
    return bool(view.consumers.get(name)) or name in view.outputs


def _softmax_taps(node: NodeProto, view: GraphView):
    rank = _rank(view, node.output[0])
    if rank is None:
        rank = _rank(view, node.input[0])
    if rank is None or rank < 2:
        return None
    axis = _attr(node, "axis", -1 if view.opset >= 13 else 1)
    if axis % rank != rank - 1:  # attention normalises over keys, the last axis
        return None
    role = "attn" if _weights_values(view, node.output[0]) else "probs"
    return [(role, node.output[0], -1, -2, None)], {}


_PASS_THROUGH = frozenset({"Cast", "Dropout", "Identity", "Where", "Reshape", "Mul", "Div"})


def _weights_values(view: GraphView, probs: str, depth: int = 4) -> bool:
    """Whether softmax output `probs` weights values (probs @ V): attention, not a classifier or router."""
    for c in view.consumers.get(probs, []):
        if c.op_type in ("MatMul", "Einsum") or (
            depth
            and c.op_type in _PASS_THROUGH
            and c.output
            and _weights_values(view, c.output[0], depth - 1)
        ):
            return True
    return False


def _feeds_expert_gather(view: GraphView, ids: str) -> int | None:
    """E when `ids` index axis 0 of stacked constant expert weights ([E, ...], rank >= 3)."""
    for c in view.consumers.get(ids, []):
        if c.op_type == "Gather" and len(c.input) > 1 and c.input[1] == ids and c.input[0] in view.constants:
            d = view.const_dims.get(c.input[0], [])
            if len(d) >= 3 and _attr(c, "axis", 0) == 0:
                return d[0]
    return None


def _topk_taps(node: NodeProto, view: GraphView):
    if len(node.output) < 2 or not node.output[1] or not _used(view, node.output[1]):
        return None
    d = view.dims.get(node.input[0])
    if d is not None and _attr(node, "axis", -1) % len(d) != len(d) - 1:
        return None
    e = d[-1] if d and isinstance(d[-1], int) else None
    gathered = _feeds_expert_gather(view, node.output[1])
    if gathered is None and (e is None or e > MAX_EXPERTS):
        return None
    return [("route", node.output[1], -1, -2, e if e is not None else gathered)], {}


def _argmax_taps(node: NodeProto, view: GraphView):
    e = _feeds_expert_gather(view, node.output[0])
    return None if e is None else ([("route", node.output[0], -1, -2, e)], {})


def _same_shape(a: Dims | None, b: Dims | None) -> bool:
    if a is None or b is None:
        return True  # unknown: the structure (a skip path through weights) decides
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def skip_input(node: NodeProto, view: GraphView) -> int | None:
    """Which input of Add `node` is the residual (skip) path: the one the other reaches through weights."""
    if len(node.input) != 2 or node.input[0] == node.input[1]:
        return None
    for keep in (0, 1):
        if _reaches_through_weights(view, node.input[keep], node.input[1 - keep]):
            return keep
    return None


def _reaches_through_weights(view: GraphView, src: str, dst: str) -> bool:
    """Whether `dst` depends on `src` through at least one GEMM-like node."""
    seen: set[str] = set()
    stack, found, between = [dst], False, []
    while stack:
        t = stack.pop()
        if t == src:
            found = True
            continue
        if t in seen:
            continue
        seen.add(t)
        if len(seen) > _ANCESTRY_LIMIT:
            return False
        p = view.producers.get(t)
        if p is not None:
            between.append(p)
            stack.extend(i for i in p.input if i)
    if not found:
        return False
    reach = {src}
    for n in sorted({id(n): n for n in between}.values(), key=lambda n: view.index.get(id(n), 0)):
        if any(i in reach for i in n.input):
            reach.update(n.output)
            if n.op_type in GEMM_LIKE:
                return True
    return False


def _residual_taps(node: NodeProto, view: GraphView):
    if len(node.input) != 2 or any(i in view.constants or not i for i in node.input):
        return None
    a, b = node.input
    if not _same_shape(view.dims.get(a), view.dims.get(b)):
        return None
    keep = skip_input(node, view)
    if keep is None:
        return None
    return [("residual_a", a, -1, -2, None), ("residual_b", b, -1, -2, None)], {"skip": keep}


def _fused_taps(node: NodeProto, view: GraphView):
    op = node.op_type
    why = _fused_unsupported(node, view)
    if why is not None or not node.output or not node.output[0]:
        return None
    return [("attn", node.output[0] + SHADOW_SUFFIX, -1, -2, None)], {"shadow_of": op}


def _fused_unsupported(node: NodeProto, view: GraphView) -> str | None:
    """Why the shadow cannot be built for this fused attention node (None: it can)."""
    op = node.op_type
    if node.domain == "com.microsoft" and op == "Attention":
        if _input(node, 4) or _attr(node, "do_rotary", 0) or _attr(node, "past_present_share_buffer", 0):
            return "past state or rotary embedding"
        if not _input(node, 1):
            return "no weights input"
        if _input(node, 3) and _rank(view, node.input[3]) == 4:
            return "4-D Megatron mask"
        return None
    if op == "MultiHeadAttention":
        if not _input(node, 1) or _input(node, 6) or _rank(view, node.input[0]) not in (None, 3):
            return "packed QKV or past state"
        if _input(node, 4) and _rank(view, node.input[4]) not in (None, 2):
            return "key padding mask other than 2-D"
        return None
    if op == "GroupQueryAttention":
        if (
            not _input(node, 1)
            or _input(node, 3)
            or _attr(node, "do_rotary", 0)
            or _attr(node, "smooth_softmax", 0)
        ):
            return "packed QKV, past state, rotary or smooth softmax"
        return None
    # opset-23 Attention
    if (
        _input(node, 6)
        or _attr(node, "left_window_size", -1) >= 0
        or _attr(node, "right_window_size", -1) >= 0
    ):
        return "non-pad lengths or sliding window"
    return None


# --------------------------------------------------------------------------------------------
# sketches: in-graph builders (outside the finite/non-finite If), host finalize, numpy references


def _strided(b: Builder, v: str, k_max: int, hint: str) -> str:
    return b.op("Gather", [v, b.strided_indices(b.op("Size", [v]), k_max)], hint, axis=0)


def _cap(v: np.ndarray, k_max: int) -> np.ndarray:
    v = v.ravel()
    k = min(v.size, k_max)
    return v[(np.arange(k, dtype=np.int64) * v.size) // max(k, 1)]


def _rows(b: Builder, x: str) -> str:
    """x viewed as [-1, last dim]: works whatever the (possibly unknown) rank."""
    last = b.op("Slice", [b.op("Shape", [x]), b.i64([-1]), b.i64([np.iinfo(np.int64).max])])
    return b.op("Reshape", [x, b.op("Concat", [b.i64([-1]), last], axis=0)])


def build_attn_qmax(b: Builder, x: str, info, o) -> str:
    """max over keys (last axis), then mean over every leading axis: one value per query, capped."""
    m = b.reduce("ReduceMax", x, [-1], keepdims=0)
    return _strided(b, b.reduce("ReduceMean", _rows(b, m), [0], keepdims=0), o.max_rows, "attn_qmax")


def build_attn_krecv(b: Builder, x: str, info, o) -> str:
    """sum over every axis but the key axis (last): one value per key, capped."""
    return _strided(b, b.reduce("ReduceSum", _rows(b, x), [0], keepdims=0), o.max_rows, "attn_krecv")


def build_route_load(b: Builder, x: str, info, o) -> str:
    """Counts of each expert id: one-hot against 0..E-1 (E = max id + 1 when not static), summed."""
    flat = b.flat(x)
    if info.bins:
        bins = b.const(np.arange(info.bins, dtype=np.float32))
    else:
        top = b.reduce("ReduceMax", b.op("Concat", [flat, b.const([-1.0])], axis=0), keepdims=0)
        bins = b.op("Range", [b.const(0.0), b.op("Add", [top, b.const(1.0)]), b.const(1.0)])
    onehot = b.cast(b.op("Equal", [b.op("Reshape", [flat, b.i64([-1, 1])]), bins]), TensorProto.FLOAT)
    return b.reduce("ReduceSum", onehot, [0], keepdims=0, hint="route_load")


def ref_attn_qmax(x: np.ndarray, info, o) -> np.ndarray:
    m = np.asarray(x, np.float64).max(axis=-1)
    return _cap(m.reshape(-1, m.shape[-1]).mean(axis=0), o.max_rows)


def ref_attn_krecv(x: np.ndarray, info, o) -> np.ndarray:
    v = np.asarray(x, np.float64)
    return _cap(v.reshape(-1, v.shape[-1]).sum(axis=0), o.max_rows)


def ref_route_load(x: np.ndarray, info, o) -> np.ndarray:
    ids = np.asarray(x).astype(np.int64).ravel()
    n = info.bins or (int(ids.max()) + 1 if ids.size else 0)
    ids = ids[(ids >= 0) & (ids < n)]
    return np.bincount(ids, minlength=n).astype(np.float64)


# --------------------------------------------------------------------------------------------
# shadow attention for fused ops


def build_shadow(
    b: Builder, graph: GraphProto, shadow: str, type_of: Callable[[str], tuple[int, int | None]]
) -> int:
    """Append to `b` the nodes computing `shadow` (softmax probabilities [B, heads, S, T]).

    `shadow` is `<fused op's first output>` + SHADOW_SUFFIX; returns the fused node's
    position, after which the nodes go. `type_of(name)` -> (elem type, rank or None).
    """
    target = shadow[: -len(SHADOW_SUFFIX)]
    at = next((i for i, n in enumerate(graph.node) if n.output and n.output[0] == target), None)
    if at is None:
        raise OpscopeError(f"no fused attention node produces {target!r}: cannot build its shadow softmax")
    node = graph.node[at]
    op = node.op_type
    if node.domain == "com.microsoft" and op == "Attention":
        scores, guard = _contrib_attention(b, node, type_of), False
    elif op == "MultiHeadAttention":
        scores, guard = _multi_head_attention(b, node, type_of), False
    elif op == "GroupQueryAttention":
        scores, guard = _group_query_attention(b, node), True
    else:
        scores, guard = _onnx_attention(b, node, type_of), True
    if guard:  # -inf masks: a fully masked row gives NaN, which the op itself turns into 0
        p = b.op("Softmax", [scores], "probs", axis=-1)
        b.nodes.append(
            helper.make_node(
                "Where", [b.op("IsNaN", [p]), b.const(0.0), p], [shadow], name=b.fresh("n_Where_shadow")
            )
        )
    else:
        b.nodes.append(
            helper.make_node("Softmax", [scores], [shadow], name=b.fresh("n_Softmax_shadow"), axis=-1)
        )
    b._taken.add(shadow)
    return at


def _dim_of(b: Builder, t: str, axis: int) -> str:
    """Dim `axis` of `t` as an int64 scalar."""
    return b.op("Gather", [b.op("Shape", [t]), b.i64(axis)], axis=0)


def _heads(b: Builder, t: str, heads: int) -> str:
    """[B, S, heads·d] -> [B, heads, S, d]."""
    r = b.op("Reshape", [t, b.i64([0, 0, heads, -1])])
    return b.op("Transpose", [r], perm=[0, 2, 1, 3])


def _qk(b: Builder, qh: str, kh: str) -> str:
    """Q·Kᵀ for q [B, Hq, S, d], k [B, Hk, T, d] with Hq a multiple of Hk (query head h uses kv head h // G)."""
    shape_q, shape_k = b.op("Shape", [qh]), b.op("Shape", [kh])
    grouped = b.op(
        "Reshape",
        [qh, b.op("Concat", [b.slice(shape_k, 0, 2, 0), b.i64([-1]), b.slice(shape_q, 2, 4, 0)], axis=0)],
    )  # [B, Hk, G, S, d]
    kt = b.op("Reshape", [b.op("Transpose", [kh], perm=[0, 1, 3, 2]), b.op("Concat", [
        b.slice(shape_k, 0, 2, 0), b.i64([1]), b.slice(shape_k, 3, 4, 0), b.slice(shape_k, 2, 3, 0)], axis=0)])  # fmt: skip
    s = b.op("MatMul", [grouped, kt])  # [B, Hk, G, S, T]
    return b.op(
        "Reshape", [s, b.op("Concat", [b.slice(shape_q, 0, 3, 0), b.slice(shape_k, 2, 3, 0)], axis=0)]
    )


def _scaled(b: Builder, scores: str, qh: str, scale: float | None) -> str:
    if scale:
        return b.op("Mul", [scores, b.const(np.float32(scale))])
    d = b.cast(_dim_of(b, qh, 3), TensorProto.FLOAT)
    return b.op("Div", [scores, b.op("Sqrt", [d])])


def _causal(b: Builder, scores: str, fill: float, window: int = 0) -> str:
    """Mask key j for query i when j > i + (T - S) (bottom-right aligned), or j <= i + (T - S) - window."""
    s, t = _dim_of(b, scores, -2), _dim_of(b, scores, -1)
    i = b.op("Reshape", [b.op("Range", [b.i64(0), s, b.i64(1)]), b.i64([-1, 1])])
    j = b.op("Reshape", [b.op("Range", [b.i64(0), t, b.i64(1)]), b.i64([1, -1])])
    frontier = b.op("Add", [i, b.op("Sub", [t, s])])
    masked = b.op("Greater", [j, frontier])
    if window > 0:
        masked = b.op(
            "Or", [masked, b.op("Not", [b.op("Greater", [j, b.op("Sub", [frontier, b.i64(window)])])])]
        )
    return b.op("Add", [scores, b.op("Where", [masked, b.const(np.float32(fill)), b.const(0.0)])])


def _keep_mask(b: Builder, scores: str, keep: str, fill: float) -> str:
    return b.op("Add", [scores, b.op("Where", [keep, b.const(0.0), b.const(np.float32(fill))])])


def _mask_2d(b: Builder, mask: str) -> str:
    """[B, T] (1 keep, 0 mask) -> bool [B, 1, 1, T]."""
    keep = b.op("Greater", [b.cast(mask, TensorProto.FLOAT), b.const(0.0)])
    return b.op("Reshape", [keep, b.i64([0, 1, 1, -1])])


def _contrib_attention(b: Builder, node: NodeProto, type_of) -> str:
    """com.microsoft Attention: input [B, S, Hin] @ weights [Hin, 3H] + bias, heads, mask_index."""
    x, w = node.input[0], node.input[1]
    heads = _attr(node, "num_heads")
    qkv = b.op("MatMul", [x, w])
    if _input(node, 2):
        qkv = b.op("Add", [qkv, node.input[2]])
    sizes = _attr(node, "qkv_hidden_sizes")
    if sizes:
        q, k = b.slice(qkv, 0, sizes[0], -1), b.slice(qkv, sizes[0], sizes[0] + sizes[1], -1)
    else:
        third = b.op("Div", [b.slice(b.op("Shape", [w]), 1, 2, 0), b.i64([3])])
        q = b.op("Slice", [qkv, b.i64([0]), third, b.i64([-1])])
        k = b.op("Slice", [qkv, third, b.op("Mul", [third, b.i64([2])]), b.i64([-1])])
    qh, kh = _heads(b, q, heads), _heads(b, k, heads)
    scores = _scaled(
        b, b.op("MatMul", [qh, b.op("Transpose", [kh], perm=[0, 1, 3, 2])]), qh, _attr(node, "scale")
    )
    fill = float(_attr(node, "mask_filter_value", -10000.0))
    mask = _input(node, 3)
    if mask:
        rank = type_of(mask)[1]
        if rank == 1:  # end position of each sequence (right padding)
            t = _dim_of(b, scores, -1)
            pos = b.op("Reshape", [b.op("Range", [b.i64(0), t, b.i64(1)]), b.i64([1, -1])])
            lens = b.op("Reshape", [b.cast(mask, TensorProto.INT64), b.i64([-1, 1])])
            keep = b.op("Reshape", [b.op("Less", [pos, lens]), b.i64([0, 1, 1, -1])])
        elif rank == 3:  # [B, S, T]
            m = b.op("Greater", [b.cast(mask, TensorProto.FLOAT), b.const(0.0)])
            keep = b.op(
                "Reshape",
                [m, b.op("Concat", [b.i64([0, 1, -1]), b.slice(b.op("Shape", [m]), 2, 3, 0)], axis=0)],
            )
        else:  # raw 2-D [B, T]
            keep = _mask_2d(b, mask)
        scores = _keep_mask(b, scores, keep, fill)
    if _attr(node, "unidirectional", 0):
        scores = _causal(b, scores, fill)
    if _input(node, 5):
        scores = b.op("Add", [scores, node.input[5]])
    return scores


def _multi_head_attention(b: Builder, node: NodeProto, type_of) -> str:
    """com.microsoft MultiHeadAttention: query [B, S, D], key [B, T, D] or [B, heads, T, d], bias [3D]."""
    heads = _attr(node, "num_heads")
    q, k = node.input[0], node.input[1]
    key_4d = type_of(k)[1] == 4
    bias = _input(node, 3)
    if bias:
        d = b.slice(b.op("Shape", [q]), 2, 3, 0)
        q = b.op("Add", [q, b.op("Slice", [bias, b.i64([0]), d, b.i64([0])])])
        if not key_4d:
            k = b.op("Add", [k, b.op("Slice", [bias, d, b.op("Mul", [d, b.i64([2])]), b.i64([0])])])
    qh = _heads(b, q, heads)
    kh = k if key_4d else _heads(b, k, heads)
    scores = _scaled(
        b, b.op("MatMul", [qh, b.op("Transpose", [kh], perm=[0, 1, 3, 2])]), qh, _attr(node, "scale")
    )
    fill = float(_attr(node, "mask_filter_value", -10000.0))
    if _input(node, 4):
        scores = _keep_mask(b, scores, _mask_2d(b, node.input[4]), fill)
    if _input(node, 5):
        scores = b.op("Add", [scores, node.input[5]])
    if _attr(node, "unidirectional", 0):
        scores = _causal(b, scores, fill)
    return scores


def _softcap(b: Builder, scores: str, cap: float | None) -> str:
    if not cap or cap <= 0:
        return scores
    c = b.const(np.float32(cap))
    return b.op("Mul", [b.op("Tanh", [b.op("Div", [scores, c])]), c])


def _group_query_attention(b: Builder, node: NodeProto) -> str:
    """com.microsoft GroupQueryAttention (no past, no rotary): causal, optional local window, seqlens_k."""
    qh = _heads(b, node.input[0], _attr(node, "num_heads"))
    kh = _heads(b, node.input[1], _attr(node, "kv_num_heads"))
    scores = _softcap(b, _scaled(b, _qk(b, qh, kh), qh, _attr(node, "scale")), _attr(node, "softcap"))
    scores = _causal(b, scores, -np.inf, max(0, int(_attr(node, "local_window_size", -1))))
    if _input(node, 5):  # seqlens_k[b] = valid length - 1: later keys are padding
        t = _dim_of(b, scores, -1)
        pos = b.op("Reshape", [b.op("Range", [b.i64(0), t, b.i64(1)]), b.i64([1, -1])])
        last = b.op("Reshape", [b.cast(node.input[5], TensorProto.INT64), b.i64([-1, 1])])
        keep = b.op("Reshape", [b.op("Not", [b.op("Greater", [pos, last])]), b.i64([0, 1, 1, -1])])
        scores = _keep_mask(b, scores, keep, -np.inf)
    return scores


def _onnx_attention(b: Builder, node: NodeProto, type_of) -> str:
    """ONNX Attention (opset 23): Q, K 3-D (with q/kv_num_heads) or 4-D, past_key, attn_mask, is_causal."""
    q, k = node.input[0], node.input[1]
    three_d = type_of(q)[1] == 3 or (type_of(q)[1] is None and _attr(node, "q_num_heads") is not None)
    qh = _heads(b, q, _attr(node, "q_num_heads")) if three_d else q
    kh = _heads(b, k, _attr(node, "kv_num_heads")) if three_d else k
    if _input(node, 4):
        kh = b.op("Concat", [node.input[4], kh], axis=2)
    scores = _softcap(b, _scaled(b, _qk(b, qh, kh), qh, _attr(node, "scale")), _attr(node, "softcap"))
    mask = _input(node, 3)
    if mask:
        if type_of(mask)[0] == TensorProto.BOOL:
            scores = _keep_mask(b, scores, mask, -np.inf)
        else:
            scores = b.op("Add", [scores, b.cast(mask, TensorProto.FLOAT)])
    if _attr(node, "is_causal", 0):
        scores = _causal(b, scores, -np.inf)
    return scores


# --------------------------------------------------------------------------------------------
# findings: pure functions over the sketch table (the miner and the report call them)


def _columns(table) -> dict[str, list]:
    """A sketch table as columns: pyarrow Table, pandas DataFrame, manifest.Rows, or a dict of lists."""
    if hasattr(table, "to_pydict"):
        return table.to_pydict()
    if hasattr(table, "to_dict") and hasattr(table, "columns"):
        return {c: table[c].tolist() for c in table.columns}
    if isinstance(table, Mapping):
        return {k: list(v) for k, v in table.items()}
    return {k: list(v) for k, v in vars(table).items()}


def _vectors(table, stat: str) -> dict[tuple[str, str], dict]:
    """(site, role) -> {op_type, idx -> list of values over steps} for one stat, in first-seen order."""
    cols = _columns(table)
    out: dict[tuple[str, str], dict] = {}
    for site, op, role, st, idx, val in zip(
        cols["site"], cols["op_type"], cols["role"], cols["stat"], cols["idx"], cols["value"]
    ):
        if st != stat:
            continue
        entry = out.setdefault((site, role), {"op_type": op, "idx": {}})
        entry["idx"].setdefault(int(idx), []).append(float(val))
    return out


def _sum_by_idx(entry: dict) -> np.ndarray:
    n = max(entry["idx"]) + 1 if entry["idx"] else 0
    v = np.zeros(n)
    for i, vals in entry["idx"].items():
        v[i] = np.nansum(vals)
    return v


def attention_findings(table, min_peak: float = 0.3, min_sink_share: float = 0.25) -> list[dict]:
    """Concentrated attention (mean of attn_qmax > min_peak) -> windowed / sink sparse attention.

    The sink is the key receiving the largest share of attn_krecv; it is named in the exploit
    when its share is at least `min_sink_share` and 4x the uniform share.
    """
    krecv = _vectors(table, "attn_krecv")
    found = []
    for (site, role), entry in _vectors(table, "attn_qmax").items():
        if role != "attn":  # the same tensor tapped as a MatMul operand carries these stats too
            continue
        vals = np.array([v for vs in entry["idx"].values() for v in vs])
        vals = vals[np.isfinite(vals)]
        if not vals.size:
            continue
        peak = float(vals.mean())
        mass = _sum_by_idx(krecv[(site, role)]) if (site, role) in krecv else np.zeros(0)
        total = float(mass.sum())
        sink = int(np.argmax(mass)) if total > 0 else None
        share = float(mass[sink] / total) if sink is not None else None
        is_sink = share is not None and share >= max(min_sink_share, 4.0 / mass.size)
        if peak <= min_peak:
            continue
        exploit = (
            f"sink + sliding-window sparse attention (keep key {sink} plus a recent window)"
            if is_sink
            else "windowed / top-k sparse attention (each query puts most of its mass on few keys)"
        )
        found.append(
            {
                "site": site,
                "op_type": entry["op_type"],
                "role": role,
                "rule": "concentrated_attention",
                "signals": {"mean_peak": peak, "sink_key": sink, "sink_share": share, "keys": int(mass.size)},
                "condition": f"mean attn_qmax {peak:.3f} > {min_peak}",
                "guard": f"mean attn_qmax stays > {min_peak} on deployment data",
                "exploit": exploit,
                "score": peak,
            }
        )
    return found


def routing_findings(table, cold_share: float = 0.02) -> list[dict]:
    """Experts with < cold_share of the routed load -> drop / merge; the hottest one -> prefetch."""
    found = []
    for (site, role), entry in _vectors(table, "route_load").items():
        if role != "route":
            continue
        load = _sum_by_idx(entry)
        total = float(load.sum())
        if total <= 0:
            continue
        share = load / total
        e = share.size
        base = {"site": site, "op_type": entry["op_type"], "role": role}
        cold = [int(i) for i in np.flatnonzero(share < cold_share)]
        if cold:
            found.append(
                {
                    **base,
                    "rule": "cold_experts",
                    "signals": {"load_share": share.tolist(), "cold": cold, "experts": e},
                    "condition": f"load share < {cold_share} for {len(cold)} of {e} experts",
                    "guard": "the cold experts stay below the threshold on deployment data",
                    "exploit": f"drop or merge expert(s) {', '.join(map(str, cold))}: together "
                    f"{share[cold].sum():.1%} of the routed tokens",
                    "score": len(cold) / e,
                }
            )
        hot = int(np.argmax(share))
        found.append(
            {
                **base,
                "rule": "hot_expert",
                "signals": {"load_share": share.tolist(), "hot": hot, "imbalance": float(share[hot] * e)},
                "condition": f"expert {hot} takes {share[hot]:.1%} of the load ({share[hot] * e:.1f}x uniform)",
                "guard": f"expert {hot} stays the most loaded",
                "exploit": f"prefetch / pin expert {hot}'s weights: {share[hot]:.1%} of the routed tokens",
                "score": float(share[hot]),
            }
        )
    return found


def residual_gaps(table) -> list[dict]:
    """Every residual site in execution order: Σa², Σb² (summed over steps) and the influence gap."""
    sums = _vectors(table, "sumsq")
    rows: dict[str, dict] = {}
    for (site, role), entry in sums.items():
        if role not in ("residual_a", "residual_b"):
            continue
        row = rows.setdefault(site, {"site": site, "op_type": entry["op_type"]})
        row[role] = float(np.nansum([v for vs in entry["idx"].values() for v in vs]))
    out = []
    for row in rows.values():
        a, b = row.get("residual_a"), row.get("residual_b")
        if a is None or b is None:
            continue
        hi = max(a, b)
        out.append({**row, "gap": math.sqrt(min(a, b) / hi) if hi > 0 else float("nan")})
    return out


def residual_findings(
    table,
    skip_quality: Mapping[str, Mapping] | None = None,
    max_gap: float = 0.10,
    min_cosine: float = 0.999,
    min_top1: float = 0.99,
) -> list[dict]:
    """Blocks whose branch barely moves the residual stream (gap < max_gap) -> skip candidates.

    `skip_quality` maps a site id to the skip rewrite's quality numbers on real feeds (as
    `parity.validate_skips` returns them: cosine, max_rel, top1); a candidate is validated
    when cosine >= min_cosine and top-1 agreement (when the output looks like logits) >= min_top1.
    """
    found = []
    for row in residual_gaps(table):
        gap = row["gap"]
        if not gap < max_gap:
            continue
        record = {
            "site": row["site"],
            "op_type": row["op_type"],
            "role": "residual",
            "rule": "weak_residual_branch",
            "signals": {"sumsq_a": row["residual_a"], "sumsq_b": row["residual_b"], "gap": gap},
            "condition": f"gap {gap:.4f} < {max_gap}",
            "guard": "output quality of the skipped model on real feeds (see validation)",
            "exploit": f"skip the block: `opscope rewrite skip MODEL --blocks {row['site']}`",
            "score": 1.0 - gap,
        }
        q = (skip_quality or {}).get(row["site"])
        if q is not None:
            top1 = q.get("top1")
            ok = q.get("cosine", 0.0) >= min_cosine and (top1 is None or top1 >= min_top1)
            record["validation"] = {**dict(q), "passed": bool(ok)}
        found.append(record)
    return found
