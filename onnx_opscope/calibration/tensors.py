"""The tensors to calibrate: exactly those onnxruntime's `quantize_static` would, plus subgraph bodies.

onnxruntime's rule (`CalibraterBase.select_tensors_to_calibrate`, onnxruntime 1.32): on the
model after onnx's shape inference, every input and output of a node whose op type is in
`op_types_to_quantize` (default: the union of its QLinear and QDQ registries), when the
tensor has a type (a graph input, output or value_info entry) of float32 or float16 and is
not an initializer. Constant-node outputs are not excluded, and untyped tensors are skipped:
we keep both quirks, so a cache we write is never missing a tensor onnxruntime looks up.

onnxruntime looks at the main graph only; we apply the same rule inside If / Loop / Scan
bodies (types from the body's and the enclosing graphs' value_info, initializers of every
enclosing scope excluded). A body node that reads a tensor of an enclosing graph selects it
in the graph that defines it, where its tap goes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import onnx
from onnx import ModelProto, TensorProto, ValueInfoProto

from ..graph import ModelIndex, load_model
from ..graph.io import ModelLike, without_weight_data

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16})


@dataclass(frozen=True)
class CalibTensor:
    """One tensor to calibrate: its name, the graph path that defines it ("" = main), its element type and
    the path of the graph whose node selected it first (`""`: onnxruntime selects it too)."""

    name: str
    path: str
    elem: int
    selected_in: str = ""


@functools.cache
def default_op_types() -> tuple[str, ...]:
    """The op types `quantize_static` quantizes when given none (its QLinear + QDQ registries)."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return tuple(sorted(set(QLinearOpsRegistry) | set(QDQRegistry)))


def inferred(model: ModelProto) -> ModelProto:
    """`model` after onnx's shape inference, as onnxruntime's calibrator sees it (weights left out:
    inference reads their dims only, and a >2 GB model could not be serialised for it)."""
    return onnx.shape_inference.infer_shapes(without_weight_data(model))


def _typed(graph) -> dict[str, ValueInfoProto]:
    """onnxruntime's lookup order: value_info, then outputs, then inputs (later ones win)."""
    out = {vi.name: vi for vi in graph.value_info}
    out.update({vi.name: vi for vi in graph.output})
    out.update({vi.name: vi for vi in graph.input})
    return out


def _float_elem(vi: ValueInfoProto | None) -> int | None:
    if vi is None or not vi.type.HasField("tensor_type"):
        return None
    elem = vi.type.tensor_type.elem_type
    return elem if elem in FLOAT_TYPES else None


def onnxruntime_selection(tensors: Iterable[CalibTensor]) -> set[str]:
    """The names onnxruntime's own calibrator selects among `tensors` (main-graph nodes' tensors)."""
    return {t.name for t in tensors if t.selected_in == ""}


def tensors_to_calibrate(
    model: ModelLike, op_types: Iterable[str] | None = None, *, subgraphs: bool = True
) -> list[CalibTensor]:
    """The tensors `quantize_static(model, op_types_to_quantize=op_types)` calibrates, in node order;
    with `subgraphs`, also those of If / Loop / Scan bodies by the same rule (see the module doc)."""
    types = set(op_types) if op_types else set(default_op_types())
    index = ModelIndex(inferred(load_model(model)))
    typed = {path: _typed(e.graph) for path, e in index.graphs.items()}
    inits = {path: {t.name for t in e.graph.initializer} for path, e in index.graphs.items()}
    out: dict[tuple[str, str], CalibTensor] = {}
    paths = list(index.graphs) if subgraphs else [""]
    for path in paths:
        scopes = [e.path for e in index.scopes(path)]
        for node in index[path].graph.node:
            if node.op_type not in types:
                continue
            for name in itertools.chain(node.input, node.output):
                hit = _select(name, path, scopes, typed, inits, index)
                if hit is not None and (hit.path, name) not in out:
                    out[(hit.path, name)] = hit
    return list(out.values())


def _select(
    name: str, reader: str, scopes: Sequence[str], typed: dict, inits: dict, index: ModelIndex
) -> CalibTensor | None:
    if not name:
        return None
    if len(scopes) == 1:  # the main graph: onnxruntime's rule as it is written
        elem = _float_elem(typed[""].get(name))
        return None if elem is None or name in inits[""] else CalibTensor(name, "", elem)
    for path in scopes:  # innermost first: the graph whose name it is
        if name in inits[path]:
            return None
        if index[path].defines(name):
            elem = _float_elem(typed[path].get(name))
            return None if elem is None else CalibTensor(name, path, elem, reader)
    return None
