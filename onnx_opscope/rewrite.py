"""Graph rewrites whose effect on the outputs we then measure: residual-block skip, int8 fake-quant.

Each transform copies its input (which is left untouched), never loads external weights, and
returns `(new model, report)`: a plain dict saying what it did. Both check their own
invariants: the original outputs keep their names and order, and a model that passed
`onnx.checker` before still passes after.

- `skip_blocks`: a residual Add x + f(x) becomes Identity(x); the branch f, now dead, is
  removed with every initializer only it used, so its weights and compute really disappear.
- `fake_quant`: before every MatMul / Gemm, activation operands go through a symmetric int8
  round trip, q = clip(round(a·127/amax), ±127), a' = q·amax/127, with amax per token or per
  channel (see `fake_quant`); weights optionally per output channel. The round trip is in the
  graph (weights included), so onnxruntime folds the weight part once at session creation.
- `prune`: dead-node and unused-initializer removal, subgraphs included (used by skip).
"""

from __future__ import annotations

import fnmatch
from collections import Counter

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, helper

from .errors import OpscopeError, did_you_mean, listing
from .model import ModelLike, iter_graphs, load_model, opset_version
from .ops import Builder
from .sites import Site, find_sites

QMAX = 127.0
AMAX_FLOOR = 1e-12  # an all-zero row quantizes to zeros instead of 0/0
QUANT_MODES = ("token", "channel")
_PROTO_LIMIT = 2**31 - 1


# --------------------------------------------------------------------------------------------
# invariants and dead code


def _copy(model: ModelLike) -> tuple[ModelProto, ModelProto]:
    source = load_model(model)
    m = ModelProto()
    m.CopyFrom(source)
    return source, m


def _checks_ok(model: ModelProto) -> bool:
    if model.ByteSize() > _PROTO_LIMIT:
        return False
    try:
        onnx.checker.check_model(model)
    except Exception:
        return False
    return True


def _check(before: ModelProto, after: ModelProto, transform: str) -> None:
    """Post-conditions of every rewrite; a failure is a bug in `transform`, not a user error."""
    names = [o.name for o in before.graph.output]
    if [o.name for o in after.graph.output] != names:
        raise AssertionError(f"{transform}: the rewrite changed the model's outputs")
    if _checks_ok(before) and not _checks_ok(after):
        onnx.checker.check_model(after)  # raises with onnx's own message
        raise AssertionError(f"{transform}: the rewritten model fails onnx.checker")


def _subgraphs(node: NodeProto) -> list[GraphProto]:
    out = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def _referenced(graph: GraphProto) -> set[str]:
    """Every name a graph's nodes read, nested subgraphs included (a superset of its free names)."""
    names = set()
    for n in graph.node:
        names.update(i for i in n.input if i)
        for sub in _subgraphs(n):
            names |= _referenced(sub)
    return names


def _numel(t: TensorProto) -> int:
    return int(np.prod(t.dims)) if t.dims else 1


def _nbytes(t: TensorProto) -> int:
    try:
        size = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        size = 1
    return _numel(t) * size


def _prune_graph(graph: GraphProto, removed: list[NodeProto], dropped: list[tuple[int, int]]) -> None:
    live = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in live for o in node.output if o):
            for sub in _subgraphs(node):
                _prune_graph(sub, removed, dropped)
                live |= _referenced(sub)
            live.update(i for i in node.input if i)
            keep.append(node)
        else:
            removed.append(node)
    if len(keep) != len(graph.node):
        new = [NodeProto() for _ in keep]
        for dst, src in zip(new, reversed(keep)):
            dst.CopyFrom(src)
        del graph.node[:]
        graph.node.extend(new)
    unused = [t for t in graph.initializer if t.name not in live]
    if unused:
        names = {t.name for t in unused}
        dropped.extend((_numel(t), _nbytes(t)) for t in unused)
        kept = [t for t in graph.initializer if t.name not in names]
        new_inits = [TensorProto() for _ in kept]
        for dst, src in zip(new_inits, kept):
            dst.CopyFrom(src)
        del graph.initializer[:]
        graph.initializer.extend(new_inits)
        # IR < 4 lists initializers as inputs too: an input only an unused initializer fed goes with it
        for i in reversed(range(len(graph.input))):
            if graph.input[i].name in names:
                del graph.input[i]
    produced = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    for i in reversed(range(len(graph.value_info))):
        if graph.value_info[i].name not in produced:
            del graph.value_info[i]


def prune(model: ModelProto) -> dict:
    """Remove, in place, nodes no output depends on and initializers nothing reads; returns counts.

    Graph inputs stay (the model's interface does not change), except inputs that only
    duplicated a removed initializer (IR < 4). External data is never read.
    """
    removed: list[NodeProto] = []
    dropped: list[tuple[int, int]] = []  # (elements, bytes) of each removed initializer, from dims only
    _prune_graph(model.graph, removed, dropped)
    return {
        "nodes_removed": len(removed),
        "ops_removed": dict(Counter(n.op_type for n in removed).most_common()),
        "initializers_removed": len(dropped),
        "params_removed": sum(n for n, _ in dropped),
        "bytes_removed": sum(b for _, b in dropped),
    }


# --------------------------------------------------------------------------------------------
# residual-block skip


def residual_sites(model: ModelLike) -> list[Site]:
    """The residual Adds `skip_blocks` can remove, in execution order."""
    return [s for s in find_sites(load_model(model)) if s.kind == "residual"]


def resolve_blocks(sites: list[Site], blocks: list[str]) -> list[Site]:
    """Residual sites named by `blocks`: site ids, node names, globs, or N (the N-th, from 0)."""
    chosen: dict[str, Site] = {}
    ids = [s.id for s in sites]
    for spec in blocks:
        spec = spec.strip()
        if spec.lstrip("-").isdigit():
            k = int(spec)
            if not -len(sites) <= k < len(sites):
                raise OpscopeError(
                    f"--blocks {spec}: the model has {len(sites)} residual Adds (0..{len(sites) - 1})"
                )
            matched = [sites[k]]
        else:
            matched = [
                s
                for s in sites
                if fnmatch.fnmatchcase(s.id, spec) or (s.node and fnmatch.fnmatchcase(s.node, spec))
            ]
        if not matched:
            raise OpscopeError(
                f"--blocks {spec!r} matches no residual Add{did_you_mean(spec, ids)}; "
                f"residual Adds: {listing(ids, limit=20) or 'none'}",
                hint="a residual Add is x + f(x) where f holds weights (MatMul, Conv, ...); "
                "`opscope rewrite skip MODEL --list` lists them",
            )
        chosen.update((s.id, s) for s in matched)
    return sorted(chosen.values(), key=lambda s: s.order)


def skip_blocks(model: ModelLike, adds: list[str]) -> tuple[ModelProto, dict]:
    """Copy `model` with each chosen residual Add replaced by its residual input, dead code removed.

    `adds`: residual Add site ids, node names, globs or execution-order indices (see
    `resolve_blocks`). The Add becomes an Identity of the input that skips the block, so
    tensor and output names do not change; the block's nodes and weights are then removed.
    """
    source, m = _copy(model)
    sites = resolve_blocks(residual_sites(m), adds)
    graphs = dict(iter_graphs(m.graph))
    skipped = []
    for site in sites:
        a, b = site.role("residual_a").tensor, site.role("residual_b").tensor
        keep = int(site.attrs.get("skip", 0))
        graph = graphs[site.graph]
        node = next(n for n in graph.node if n.op_type == "Add" and list(n.input) == [a, b])
        kept, dropped = node.input[keep], node.input[1 - keep]
        node.op_type = "Identity"
        del node.input[:]
        node.input.append(kept)
        del node.attribute[:]
        skipped.append({"site": site.id, "node": node.name, "kept": kept, "dropped": dropped})
    report = {"transform": "skip_blocks", "copied": True, "skipped": skipped, **prune(m)}
    _check(source, m, "skip_blocks")
    return m, report


# --------------------------------------------------------------------------------------------
# int8 fake-quant


def _elem_types(model: ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        inferred = model
    out = {}
    for _, g in iter_graphs(inferred.graph):
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.HasField("tensor_type"):
                out[vi.name] = vi.type.tensor_type.elem_type
        out.update((t.name, t.data_type) for t in g.initializer)
    return out


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
        trans = next((a.i for a in node.attribute if a.name == ("transA", "transB")[idx]), 0)
        axis = idx if trans else 1 - idx
        axis = axis if mode == "token" else 1 - axis
        return [axis], None, f"reduce axis {axis}"
    k_axis = -1 if idx == 0 else -2
    if mode == "token":
        return [k_axis], None, f"reduce axis {k_axis}"
    return None, k_axis, f"keep axis {k_axis}"


def fake_quant(model: ModelLike, mode: str = "token", weights: bool = False) -> tuple[ModelProto, dict]:
    """Copy `model` with a symmetric int8 round trip on the activation operands of every MatMul / Gemm.

    mode "token": amax per token, i.e. over the last axis of A (the contraction axis; for an
    activation B operand, over its axis -2, one scale per output column); mode "channel": amax
    per channel, over every token axis (one scale per K index). `weights`: constant B operands
    too, per output channel (over K). An operand feeding several GEMMs is quantized once.
    """
    if mode not in QUANT_MODES:
        raise OpscopeError(
            f"fake-quant mode {mode!r}{did_you_mean(mode, QUANT_MODES)}; choose token or channel"
        )
    source, m = _copy(model)
    opset = opset_version(m)
    elem = _elem_types(m)
    graphs = list(iter_graphs(m.graph))
    constants = {t.name for _, g in graphs for t in g.initializer}
    constants |= {n.output[0] for _, g in graphs for n in g.node if n.op_type == "Constant"}
    taken = {n for _, g in graphs for node in g.node for n in [*node.input, *node.output, node.name]}
    taken |= {i.name for _, g in graphs for i in [*g.input, *g.initializer]}
    quantized, skipped = [], []
    # Deepest graphs first: splicing a graph copies its nodes, subgraphs included.
    for path, graph in sorted(graphs, key=lambda pg: -pg[0].count("/")):
        inserts: dict[int, list[NodeProto]] = {}
        done: dict[tuple, str] = {}
        for pos, node in enumerate(graph.node):
            if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
                continue
            for idx in (0, 1):
                name = node.input[idx] if len(node.input) > idx else ""
                if not name:
                    continue
                is_weight = name in constants
                if is_weight and not (weights and idx == 1):
                    continue
                t = elem.get(name, TensorProto.UNDEFINED)
                if t not in (
                    TensorProto.FLOAT,
                    TensorProto.FLOAT16,
                    TensorProto.BFLOAT16,
                    TensorProto.UNDEFINED,
                ):
                    skipped.append({"node": node.name, "input": name, "why": f"not a float tensor ({t})"})
                    continue
                reduce_axes, keep_axis, how = _operand_plan(node, idx, "token" if is_weight else mode)
                key = (name, tuple(reduce_axes or ()), keep_axis)
                if key not in done:
                    b = Builder(opset, f"opscope_fq{len(quantized)}_", taken)
                    done[key] = _fake_quant_nodes(b, name, reduce_axes, keep_axis, t)
                    inserts.setdefault(pos - 1, []).extend(b.nodes)
                    quantized.append(
                        {
                            "graph": path,
                            "node": node.name,
                            "input": name,
                            "operand": "AB"[idx],
                            "kind": "weight" if is_weight else "activation",
                            "amax": how,
                        }
                    )
                node.input[idx] = done[key]
        if inserts:
            nodes = list(inserts.get(-1, []))
            for i, n in enumerate(graph.node):
                nodes.append(n)
                nodes.extend(inserts.get(i, []))
            new = [NodeProto() for _ in nodes]
            for dst, src in zip(new, nodes):
                dst.CopyFrom(src)
            del graph.node[:]
            graph.node.extend(new)
    report = {
        "transform": "fake_quant",
        "copied": True,
        "mode": mode,
        "weights": weights,
        "quantized": quantized,
        "skipped": skipped,
    }
    _check(source, m, "fake_quant")
    return m, report
