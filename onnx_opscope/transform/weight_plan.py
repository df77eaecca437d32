"""Act on a weight plan: each planned weight stored as its chosen option, in a form the model's opset allows.

A plan (`weights.allocate.plan_dict`, JSON) names weights and one option each. Per weight:

- int4, per channel or grouped, on a 2-D weight read only as the B input of MatMuls, or of Gemms
  that are one plus a bias (transA 0, alpha 1, C absent or a constant [N] at beta 1, which becomes
  MatMulNBits' bias; how PyTorch exports nn.Linear and LSTM cells, e.g. captcha_crnn's): onnxruntime's
  com.microsoft MatMulNBits (bits 4, block_size along K: the group, or for per channel the
  smallest power of two >= max(K, 16), one block per column). Packed here, not by
  onnxruntime's `MatMulNBitsQuantizer`: its symmetric rule (inside the C++ packer, no option
  changes it) maps each block's largest-magnitude value to -8 (scale = signed max / -8, q in
  [-8, 7]); ours (`weights.menu.quantize`) is scale = amax / 7, q in [-7, 7]. q + 8 is stored
  without zero points (MatMulNBits' default zero point is 8), so the node computes
  x @ (q * scale), the folded weight.
- int8 / int4 otherwise: DequantizeLinear on the weight, its output taking the weight's name (the
  consumers are not touched): one scale per output channel (`axis`) from opset 13 for int8, 21
  for int4; grouped (`block_size` along the input axis) from 21, for weights whose input
  channels lie on one axis (2-D, 1x1 Conv); float16 scales from 19. Where the opset or the shape
  does not allow it: "folded", the dequantized weight stored as float (no bytes saved).
- lowrank r on a 2-D weight read only as the B input of MatMuls / Gemms: B = L[K, r] @ R[r, N]
  (`weights.menu.lowrank_factors`, so L @ R is `reconstruct`'s matrix), x @ L @ R as two
  MatMuls; a Gemm becomes two Gemms (the first keeps transA, the second alpha, beta and C; with
  transB=1 both read their factor transposed, so no factor is stored twice). Any other reader
  (Conv, ...): folded.
- ternary, sparse_2_4, monarch, tucker, tt: folded (`weights.menu.reconstruct`, same shape and
  dtype). dense: unchanged.

Quantized forms are made for float32 and float16 weights (scales in the weight's dtype); others
are folded. The model's opset is kept, never upgraded; MatMulNBits adds the com.microsoft domain
(version 1) to the opset imports. The input is not touched (a copy is rewritten). Planned weights
are read one at a time (external data from its bytes, `weights.matrix`) and what replaces them is
embedded in the rewritten model; unplanned weights keep their external references
(`graph.io.save_model` links the data file beside the new model).

Measured (onnxruntime 1.32, CPU): at graph_opt "all" onnxruntime fuses DequantizeLinear + MatMul
into its own MatMulNBits computing with int8 activations (accuracy level 4, session option
`session.qdq_matmulnbits_accuracy_level`): 0.4% relative output error on opset21_mlp on top of the
weights'. The MatMulNBits nodes made here leave the accuracy level unset (float activations).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from operator import attrgetter
from pathlib import Path

import numpy as np
from onnx import AttributeProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

from ..errors import OpscopeError, did_you_mean
from ..graph.index import Constant, GraphEntry, ModelIndex, Names
from ..graph.io import ModelLike, opset_version
from ..graph.proto import DEFAULT_DOMAINS, attr, input_at
from ..graph.wire import splice
from ..weights.matrix import WeightView, find_weights, from_matrix
from ..weights.menu import KINDS, Option, dequantize, lowrank_factors, option_from_dict, quantize, reconstruct
from ..weights.plan import LayerMenu
from .result import check_rewrite, copy_of

_QUANT_BITS = {"int8_channel": 8, "int4_channel": 4, "int8_group": 8, "int4_group": 4}
_SCALE_TYPES = {"float32": np.float32, "float16": np.float16}  # weights DequantizeLinear / MatMulNBits take
_MS_DOMAIN = "com.microsoft"
_AXIS_SINCE, _FP16_SINCE, _INT4_BLOCK_SINCE = 13, 19, 21  # DequantizeLinear: per axis, float16, int4 / blocks


@dataclass
class AppliedLayer:
    """One planned weight: its option and how it now sits in the graph, with its bytes as stored."""

    weight: str
    graph: str
    kind: str
    label: str
    how: str  # MatMulNBits, DequantizeLinear int8|int4 per-axis|blocked, two MatMuls|Gemms, folded, unchanged
    bytes_before: int
    bytes_after: int
    nodes: list[str] = field(default_factory=list)  # the readers replaced (MatMulNBits, two MatMuls / Gemms)
    note: str = ""  # why a quantized or low-rank option was folded instead


@dataclass
class WeightPlanApplied:
    """What `apply_weight_plan` did, layer by layer, at the model's (unchanged) opset."""

    layers: list[AppliedLayer]
    opset: int

    @property
    def bytes_before(self) -> int:
        return sum(a.bytes_before for a in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(a.bytes_after for a in self.layers)

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_before": self.bytes_before, "bytes_after": self.bytes_after}


Use = tuple[GraphEntry, int, NodeProto, int]  # (graph, node position, node, input index)


@dataclass
class _Target:
    view: WeightView
    load: Callable[[], np.ndarray]  # its float32 [rows, cols] matrix
    src: Constant  # the initializer or Constant node holding it
    option: Option
    uses: list[Use]
    is_output: bool  # some graph hands the weight out as an output


class _Edits:
    """Graph edits gathered per graph and made at the end, so node positions stay valid until then.
    State is real: the tensors and nodes to add, the constants to drop."""

    def __init__(self, index: ModelIndex):
        self.index = index
        self.names: Names = index.names()
        self.tensors: dict[str, list[TensorProto]] = {}  # graph path -> new initializers
        self.drop: dict[str, set[str]] = {}  # graph path -> constants nothing reads any more
        self.nodes: dict[str, dict[int, list[NodeProto]]] = {}  # graph path -> {after position: nodes}
        self.ms_domain = False

    def tensor(self, path: str, hint: str, value: np.ndarray | TensorProto) -> str:
        """A new initializer of the graph at `path`, under a fresh name from `hint`."""
        t = value if isinstance(value, TensorProto) else numpy_helper.from_array(np.ascontiguousarray(value))
        t.name = self.names.fresh(hint)
        self.tensors.setdefault(path, []).append(t)
        return t.name

    def insert(self, path: str, after: int, node: NodeProto) -> None:
        self.nodes.setdefault(path, {}).setdefault(after, []).append(node)

    def apply(self) -> None:
        paths = set(self.tensors) | set(self.drop) | set(self.nodes)
        for path in sorted(paths, key=lambda p: -p.count("/")):  # a graph before the graphs around it
            graph = self.index[path].graph
            if path in self.nodes:
                splice(graph, self.nodes[path])
            gone = self.drop.get(path, set())
            _remove(graph.node, _constant_output, gone)
            _remove(graph.initializer, attrgetter("name"), gone)
            _remove(graph.input, attrgetter("name"), gone)  # IR < 4 lists initializers as inputs too
            graph.initializer.extend(self.tensors.get(path, []))


def _constant_output(node: NodeProto) -> str:
    return node.output[0] if node.op_type == "Constant" and node.output else ""


def _remove(items, key: Callable, gone: set[str]) -> None:
    for i in reversed(range(len(items))):
        if key(items[i]) in gone:
            del items[i]


def apply_weight_plan(
    model: ModelLike, plan: dict, *, base_dir: str | os.PathLike | None = None
) -> tuple[ModelProto, WeightPlanApplied]:
    """A copy of `model` with each weight of `plan` stored as its option (module doc), and what was done.

    `base_dir`: where a ModelProto's external data lives (a path finds its own). Raises OpscopeError
    for a malformed plan, a weight the model lacks (or has in another shape), an unknown kind.
    """
    layers = _plan_layers(plan)
    source, m = copy_of(model)
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    index = ModelIndex(m)
    targets = _targets(index, m, layers, base_dir)
    opset = opset_version(m)
    edits = _Edits(index)
    applied = [_apply(t, opset, edits) for t in targets]
    edits.apply()
    if edits.ms_domain and not any(o.domain == _MS_DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    check_rewrite(source, m, "weight_plan")
    return m, WeightPlanApplied(applied, opset)


# --------------------------------------------------------------------------------------------
# the plan and the weights it names


def _plan_layers(plan: dict) -> list[tuple[str, str, tuple | None, Option]]:
    """(graph, weight, shape or None, option) per layer, the plan checked whole before any work."""
    layers = plan.get("layers") if isinstance(plan, dict) else None
    if not isinstance(layers, list):
        raise OpscopeError("weight plan: expected a JSON object with a 'layers' list")
    out, seen = [], set()
    for i, layer in enumerate(layers):
        d = layer.get("option") if isinstance(layer, dict) else None
        if not isinstance(d, dict) or not isinstance(layer.get("weight"), str) or "kind" not in d:
            raise OpscopeError(f"weight plan: layer {i} needs a 'weight' and an 'option' with a 'kind'")
        name, kind = layer["weight"], d["kind"]
        if kind not in KINDS:
            raise OpscopeError(
                f"weight plan: {name!r} has unknown kind {kind!r}{did_you_mean(str(kind), KINDS)}; "
                f"known: {', '.join(KINDS)}"
            )
        option = option_from_dict(d)
        key = (layer.get("graph", ""), name)
        if key in seen:
            raise OpscopeError(f"weight plan: {name!r} is planned twice")
        seen.add(key)
        needs = {"int8_group": "group", "int4_group": "group", "lowrank": "rank"}.get(kind)
        if needs and not isinstance(option.params.get(needs), int):
            raise OpscopeError(f"weight plan: {name!r} is {kind} without an integer params.{needs}")
        shape = layer.get("shape")
        out.append((*key, None if shape is None else tuple(shape), option))
    return out


def _targets(index: ModelIndex, model: ModelProto, layers: list, base_dir) -> list[_Target]:
    """Each planned weight's view, loader, constant and readers; every error raised before any edit."""
    found = {
        (v.graph, v.name): (v, load) for v, load in find_weights(model, base_dir=base_dir, min_elements=1)
    }
    uses, outputs = _readers(index, {(g, n) for g, n, _, _ in layers})
    targets = []
    for graph, name, shape, option in layers:
        if (graph, name) not in found:
            where = f"graph {graph!r}" if graph else "the main graph"
            close = did_you_mean(name, [n for g, n in found if g == graph])
            raise OpscopeError(
                f"weight plan: {name!r} is not a float weight of {where}{close}",
                hint="a plan applies to the model it was made from",
            )
        view, load = found[graph, name]
        if shape is not None and shape != view.shape:
            raise OpscopeError(
                f"weight plan: {name!r} is {list(view.shape)} in the model, {list(shape)} in the plan",
                hint="a plan applies to the model it was made from",
            )
        src = index[graph].constants[name]
        targets.append(
            _Target(view, load, src, option, uses.get((graph, name), []), (graph, name) in outputs)
        )
    return targets


def _readers(index: ModelIndex, keys: set[tuple[str, str]]) -> tuple[dict[tuple[str, str], list[Use]], set]:
    """(defining graph, name) -> the nodes reading it, for the planned weights; and those some graph outputs.

    A name read in a body resolves to the innermost graph around it that defines it."""
    names = {n for _, n in keys}
    uses: dict[tuple[str, str], list[Use]] = {}
    outputs = set()

    def owner(path: str, name: str) -> tuple[str, str]:
        return next((e.path for e in index.scopes(path) if e.defines(name)), ""), name

    for entry in index.graphs.values():
        for pos, node in enumerate(entry.graph.node):
            for i, name in enumerate(node.input):
                if name in names and (key := owner(entry.path, name)) in keys:
                    uses.setdefault(key, []).append((entry, pos, node, i))
        outputs.update(owner(entry.path, o) for o in entry.outputs if o in names)
    return uses, outputs & keys


# --------------------------------------------------------------------------------------------
# one weight


def _apply(t: _Target, opset: int, edits: _Edits) -> AppliedLayer:
    kind, before = t.option.kind, t.view.dense_bytes
    record = AppliedLayer(t.view.name, t.view.graph, kind, t.option.label, "unchanged", before, before)
    if kind == "dense":
        return record
    w = t.load()
    if kind in _QUANT_BITS:
        _quantized(t, w, opset, edits, record)
        return record
    record.note = _factorable(t) if kind == "lowrank" else ""
    if kind == "lowrank" and not record.note:
        _lowrank(t, w, edits, record)
    else:
        _fold(t, from_matrix(t.view, reconstruct(w, t.option)), record)
    return record


def _fold(t: _Target, array: np.ndarray, record: AppliedLayer) -> None:
    """The weight's values replaced in place by `array` (float32, the weight's shape), in its own dtype."""
    tensor = _float_tensor(array, t.view.dtype, t.view.name)
    if isinstance(t.src, TensorProto):
        t.src.CopyFrom(tensor)
    else:
        value = next(a for a in t.src.attribute if a.name in ("value", "value_floats"))
        if value.type == AttributeProto.FLOATS:
            del value.floats[:]
            value.floats.extend(array.ravel().tolist())
        else:
            tensor.name = value.t.name
            value.t.CopyFrom(tensor)
    record.how, record.bytes_after = "folded", record.bytes_before


def _float_tensor(array: np.ndarray, dtype: str, name: str) -> TensorProto:
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits of the float32
        bits = np.ascontiguousarray(array, np.float32).view(np.uint32)
        top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return helper.make_tensor(name, TensorProto.BFLOAT16, array.shape, top.tobytes(), raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(array, dtype=dtype), name)


# --------------------------------------------------------------------------------------------
# int8 / int4


def _quantized(t: _Target, w: np.ndarray, opset: int, edits: _Edits, record: AppliedLayer) -> None:
    bits = _QUANT_BITS[t.option.kind]
    group = t.option.params["group"] if t.option.kind.endswith("_group") else None
    padded, scale = quantize(w, bits, group)
    q = padded[:, : w.shape[1]]  # the codes of the zero padding dropped
    stype = _SCALE_TYPES.get(t.view.dtype)
    why = "" if stype else f"quantized weights are made for float32 / float16, not {t.view.dtype}"
    if not why and bits == 4 and _nbits_readers(t, edits.index):
        block = _nbits_block(w.shape[1], scale.shape[1] == 1, group)
        if block:
            _matmul_nbits(t, q, scale.astype(stype), block, edits, record)
            return
    why = why or _dequant_blocker(t.view, bits, scale.shape[1], opset, stype)
    if why:
        record.note = why
        _fold(t, from_matrix(t.view, dequantize(padded, scale, w.shape[1])), record)
        return
    _dequantize_linear(t, q, scale.astype(stype), bits, group, edits, record)


def _nbits_readers(t: _Target, index: ModelIndex) -> bool:
    """Whether MatMulNBits can replace every reader of the 2-D weight (`_nbits_reader`)."""
    if len(t.view.shape) != 2 or not t.uses or t.is_output:
        return False
    return all(_nbits_reader(index, entry, node, i, t.view) for entry, _, node, i in t.uses)


def _nbits_reader(index: ModelIndex, entry: GraphEntry, node: NodeProto, i: int, view: WeightView) -> bool:
    """A MatMul reading the weight as B [K, N], or a Gemm that is one plus a bias: B read along the view's
    axes, transA 0, alpha 1, and C absent or a constant [N] at beta 1 (MatMulNBits' own bias input)."""
    if node.domain not in DEFAULT_DOMAINS or i != 1:
        return False
    if node.op_type == "MatMul":
        return view.out_axis == 1
    if node.op_type != "Gemm" or attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0:
        return False
    if attr(node, "transB", 0) != (view.out_axis == 0):
        return False
    c = input_at(node, 2)
    return c is None or (attr(node, "beta", 1.0) == 1.0 and index.constant_dims(entry.path, c) == [view.rows])


def _nbits_block(k: int, per_channel: bool, group: int | None) -> int:
    """MatMulNBits' block_size (a power of two >= 16) for these scales, 0 when it has none: the group,
    or with one scale per column the smallest such block holding all of K."""
    if per_channel:
        return max(16, 1 << (k - 1).bit_length())
    return group if group >= 16 and group & (group - 1) == 0 else 0


def _matmul_nbits(
    t: _Target, q: np.ndarray, scale: np.ndarray, block: int, edits: _Edits, record: AppliedLayer
) -> None:
    """Every reader becomes MatMulNBits (same name, A, output, a Gemm's C as bias) on shared packed weights:
    B uint8 [N, k_blocks, block / 2] (two codes a byte, low nibble first), scales [N * k_blocks]."""
    n, k = q.shape  # rows are the output channels
    blocks = -(-k // block)
    codes = np.full((n, blocks * block), 8, np.uint8)  # 8 = the zero point: padding dequantizes to 0
    codes[:, :k] = (q.astype(np.int16) + 8).astype(np.uint8)
    pairs = codes.reshape(n, blocks, block // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    b = edits.tensor(t.view.graph, f"{t.view.name}_nbits", packed)
    s = edits.tensor(t.view.graph, f"{t.view.name}_nbits_scale", scale.ravel())
    for entry, pos, node, _ in t.uses:
        bias = input_at(node, 2) if node.op_type == "Gemm" else None
        inputs = [node.input[0], b, s] + (["", "", bias] if bias else [])  # no zero points, no g_idx
        attrs = {"K": k, "N": n, "bits": 4, "block_size": block}
        node.CopyFrom(
            helper.make_node(
                "MatMulNBits", inputs, list(node.output), name=node.name, domain=_MS_DOMAIN, **attrs
            )
        )
        record.nodes.append(entry.ids[pos])
    edits.drop.setdefault(t.view.graph, set()).add(t.view.name)
    edits.ms_domain = True
    record.how, record.bytes_after = "MatMulNBits", packed.nbytes + scale.nbytes


def _dequant_blocker(view: WeightView, bits: int, groups: int, opset: int, stype) -> str:
    """Why DequantizeLinear cannot hold this weight at `opset` ("" when it can)."""
    if bits == 4 and opset < _INT4_BLOCK_SINCE:
        return f"int4 DequantizeLinear needs opset {_INT4_BLOCK_SINCE}, the model has {opset}"
    if groups > 1 and opset < _INT4_BLOCK_SINCE:
        return f"blocked DequantizeLinear needs opset {_INT4_BLOCK_SINCE}, the model has {opset}"
    if opset < _AXIS_SINCE:
        return f"per-axis DequantizeLinear needs opset {_AXIS_SINCE}, the model has {opset}"
    if stype is np.float16 and opset < _FP16_SINCE:
        return f"float16 DequantizeLinear needs opset {_FP16_SINCE}, the model has {opset}"
    if view.rows != view.shape[view.out_axis]:
        return "its output channels span several axes (DequantizeLinear scales lie along one)"
    if groups > 1 and _input_axis(view) is None:
        return "its input channels span several axes (DequantizeLinear blocks lie along one)"
    return ""


def _input_axis(view: WeightView) -> int | None:
    """The one axis besides the output axis that is longer than 1 (None when there are several)."""
    axes = [i for i, d in enumerate(view.shape) if i != view.out_axis and d > 1]
    return axes[0] if len(axes) == 1 else None


def _dequantize_linear(
    t: _Target,
    q: np.ndarray,
    scale: np.ndarray,
    bits: int,
    group: int | None,
    edits: _Edits,
    record: AppliedLayer,
) -> None:
    """DequantizeLinear(codes, scale) named as the weight: per axis, or blocked along the input axis."""
    view, path = t.view, t.view.graph
    codes = from_matrix(view, q).astype(np.int8)
    groups = scale.shape[1]
    if groups == 1:
        attrs, scales, how = {"axis": view.out_axis}, scale[:, 0], "per-axis"
    else:
        axis = _input_axis(view)
        shape = [groups if i == axis else d for i, d in enumerate(view.shape)]
        moved = [shape[view.out_axis], *(d for i, d in enumerate(shape) if i != view.out_axis)]
        scales = np.moveaxis(scale.reshape(moved), 0, view.out_axis)
        attrs, how = {"axis": axis, "block_size": group}, "blocked"
    q_name = edits.tensor(path, f"{view.name}_q", _int4_tensor(codes) if bits == 4 else codes)
    s_name = edits.tensor(path, f"{view.name}_scale", scales)
    node = helper.make_node("DequantizeLinear", [q_name, s_name], [view.name],
                            name=edits.names.fresh(f"{view.name}_dequantize"), **attrs)  # fmt: skip
    if isinstance(t.src, TensorProto):
        edits.drop.setdefault(path, set()).add(view.name)
        edits.insert(path, -1, node)
    else:
        t.src.CopyFrom(node)  # the Constant node becomes the DequantizeLinear, in its place
    record.how = f"DequantizeLinear int{bits} {how}"
    record.bytes_after = -(-codes.size * bits // 8) + scales.nbytes


def _int4_tensor(codes: np.ndarray) -> TensorProto:
    """An INT4 tensor of int8 codes in [-8, 7]: two a byte, low nibble first (ONNX's packing)."""
    nibbles = (codes.ravel() & 0xF).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    raw = (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
    return helper.make_tensor("", TensorProto.INT4, codes.shape, raw, raw=True)


# --------------------------------------------------------------------------------------------
# low rank


def _factorable(t: _Target) -> str:
    """Why the weight cannot become two MatMuls / Gemms ("" when it can)."""
    if len(t.view.shape) != 2:
        return f"a {len(t.view.shape)}-D weight ({t.view.op or 'no reader'}) is not two matrices"
    if t.view.dtype not in ("float32", "float16", "float64"):
        return f"low-rank factors are made for float32 / float16 / float64, not {t.view.dtype}"
    if t.is_output or not t.uses:
        return "the weight is a graph output or has no reader"
    for _, _, node, i in t.uses:
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in DEFAULT_DOMAINS or i != 1:
            return f"{node.op_type} {node.name!r} reads it as input {i}, not as a MatMul / Gemm B"
    return ""


def _lowrank(t: _Target, w: np.ndarray, edits: _Edits, record: AppliedLayer) -> None:
    """B = L @ R for every MatMul / Gemm reading the weight B (L, R shared by all of them)."""
    a, b = lowrank_factors(w, t.option)  # w = a @ b, and w is B (out axis 0) or B^T (out axis 1)
    left, right = (a, b) if t.view.out_axis == 0 else (b.T, a.T)
    dtype = np.dtype(t.view.dtype)
    path = t.view.graph
    l_name = edits.tensor(path, f"{t.view.name}_lowrank_l", left.astype(dtype))
    r_name = edits.tensor(path, f"{t.view.name}_lowrank_r", right.astype(dtype))
    for entry, pos, node, _ in t.uses:
        mid = edits.names.fresh(f"{node.output[0]}_lowrank")
        name = edits.names.fresh(f"{node.name or node.op_type}_lowrank")
        if node.op_type == "MatMul":
            first = helper.make_node("MatMul", [node.input[0], l_name], [mid], name=name)
            node.input[0], node.input[1] = mid, r_name
        else:  # Gemm: A' @ B = (A' @ L) @ R; with transB=1, A' @ B^T = (A' @ R^T) @ L^T
            trans_b = attr(node, "transB", 0)
            f1, f2 = (r_name, l_name) if trans_b else (l_name, r_name)
            first = helper.make_node("Gemm", [node.input[0], f1], [mid], name=name,
                                     transA=attr(node, "transA", 0), transB=trans_b)  # fmt: skip
            node.input[0], node.input[1] = mid, f2
            _set_int(node, "transA", 0)
        edits.insert(entry.path, pos - 1, first)
        record.nodes.append(entry.ids[pos])
    edits.drop.setdefault(path, set()).add(t.view.name)
    record.how = _two_ops(t.uses)
    record.bytes_after = (left.size + right.size) * dtype.itemsize


def _two_ops(uses: list[Use]) -> str:
    """How a low-rank weight is stored: "two MatMuls", "two Gemms" or "two Gemms / MatMuls"."""
    return "two " + " / ".join(f"{op}s" for op in sorted({node.op_type for _, _, node, _ in uses}))


def _set_int(node: NodeProto, name: str, value: int) -> None:
    for a in node.attribute:
        if a.name == name:
            a.i = value
            return
    node.attribute.append(helper.make_attribute(name, value))


# --------------------------------------------------------------------------------------------
# what a plan would store, before it is applied


def storage(model: ModelProto) -> Callable[[WeightView, Option], tuple[str, int]]:
    """How `apply_weight_plan` would store each (weight, option) of `model`: (how, bytes as stored),
    decided by the same rules without reading a weight. An allocator given these bytes plans only
    what this model's opset and readers can hold (`weights.allocate` on nominal bytes plans what a
    runtime with kernels for every option could)."""
    index = ModelIndex(model)
    opset = opset_version(model)
    keys = {(e.path, name) for e in index.graphs.values() for name in e.constants}
    uses, outputs = _readers(index, keys)

    def stored(view: WeightView, option: Option) -> tuple[str, int]:
        t = _Target(view, lambda: np.zeros(0), None, option, uses.get((view.graph, view.name), []),
                    (view.graph, view.name) in outputs)  # fmt: skip
        kind, dense = option.kind, view.dense_bytes
        if kind == "dense":
            return "unchanged", dense
        if kind == "lowrank":
            if _factorable(t):
                return "folded", dense
            rank = int(option.params["rank"])
            return _two_ops(t.uses), (view.rows + view.cols) * rank * view.itemsize
        if kind not in _QUANT_BITS:
            return "folded", dense
        return _quantized_storage(t, index, opset)

    return stored


def _quantized_storage(t: _Target, index: ModelIndex, opset: int) -> tuple[str, int]:
    bits = _QUANT_BITS[t.option.kind]
    group = t.option.params.get("group") if t.option.kind.endswith("_group") else None
    rows, cols = t.view.rows, t.view.cols
    stype = _SCALE_TYPES.get(t.view.dtype)
    if stype is None:
        return "folded", t.view.dense_bytes
    scale_bytes = np.dtype(stype).itemsize
    groups = 1 if group is None else -(-cols // group)  # one group holding every column: per channel
    if bits == 4 and _nbits_readers(t, index) and (block := _nbits_block(cols, groups == 1, group)):
        blocks = -(-cols // block)
        return "MatMulNBits", rows * blocks * (block // 2 + scale_bytes)
    if _dequant_blocker(t.view, bits, groups, opset, stype):
        return "folded", t.view.dense_bytes
    return f"DequantizeLinear int{bits}", -(-rows * cols * bits // 8) + rows * groups * scale_bytes


def stored_menus(model: ModelProto, menus: Sequence[LayerMenu]) -> list[LayerMenu]:
    """`menus` as this model can store them: each option's bytes as `apply_weight_plan` would store it,
    and the options it would only fold (no bytes saved, error kept) left out, so an allocator given
    these plans a file that really shrinks."""
    stored = storage(model)
    out = []
    for m in menus:
        options = []
        for option in m.options:
            how, nbytes = stored(m.view, option)
            if how != "folded":
                options.append(replace(option, bytes=nbytes))
        out.append(LayerMenu(m.view, options))
    return out
