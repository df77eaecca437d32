"""Tensors computed from weights alone, tapped as weights.

An exported LSTM reads W and R unsqueezed from initializers inside its `If` branch
(silero_vad_v6: four [1, 512, 128] tensors), a TensorFlow export transposes or casts a weight
on its way to a MatMul. Such a tensor is the same on every run, so its tap is a weight tap
(`TapRecord.constant`): no nodes in the graph, sketched once on the host (`host.host_values`)
instead of once per batch.

A tensor is folded when nodes of its own graph make it from constants alone (initializers and
Constant nodes visible there, outer scopes included), through side-effect-free ops of the
default domain (`FOLDABLE`), at most `MAX_NODES` of them, reading at most `MAX_LEAF_BYTES` of
weights. The host evaluates that chain with onnx's reference evaluator, on the constants it reads.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import NodeProto, OperatorSetIdProto, TensorProto, TypeProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ..graph.chunks import nbytes
from ..graph.index import ModelIndex
from ..graph.proto import constant_value

FOLDABLE = frozenset(
    {
        "Identity", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Transpose", "Flatten", "Concat",
        "Slice", "Split", "Gather", "Expand", "Tile", "Neg", "Add", "Sub", "Mul", "Div",
    }
)  # fmt: skip
MAX_NODES = 16  # a longer chain is not a weight's layout change: leave it to the graph
# The host holds the chain's weights and what it makes while evaluating it: above this the tap stays
# in the graph (where onnxruntime folds it at session creation), so a model of many GB never needs a
# second copy of a big weight in the recording process.
MAX_LEAF_BYTES = 256 * 2**20


def chain(index: ModelIndex, graph: str, tensor: str) -> list[NodeProto] | None:
    """The nodes that make `tensor` from constants alone, in graph order; None when it is not folded
    (a constant itself, or it reads a graph input, another graph's tensor or a non-foldable op)."""
    if graph not in index or index.is_constant(graph, tensor):
        return None
    entry = index[graph]
    nodes: dict[int, NodeProto] = {}
    todo, seen, leaf_bytes = [tensor], set(), 0
    while todo:
        name = todo.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        hit = index.constant(graph, name)
        if hit is not None:
            t = hit if isinstance(hit, TensorProto) else constant_value(hit)
            leaf_bytes += nbytes(t) if t is not None else 0
            if leaf_bytes > MAX_LEAF_BYTES:
                return None
            continue
        pos = entry.producer_index(name)
        if pos is None:  # a graph input, or a tensor of an enclosing graph
            return None
        node = entry.graph.node[pos]
        if node.op_type not in FOLDABLE or node.domain not in ("", "ai.onnx"):
            return None
        if pos not in nodes:
            nodes[pos] = node
            if len(nodes) > MAX_NODES:
                return None
            todo.extend(node.input)
    return [nodes[p] for p in sorted(nodes)]


def evaluate(
    nodes: list[NodeProto], tensor: str, leaf: Callable[[str], np.ndarray], opsets: list[OperatorSetIdProto]
) -> np.ndarray:
    """`tensor` computed by `nodes` (from `chain`), each constant they read given by `leaf(name)`."""
    made = {o for n in nodes for o in n.output}
    leaves = sorted({i for n in nodes for i in n.input if i and i not in made})
    graph = helper.make_graph(
        nodes,
        "folded",
        [],
        [helper.make_value_info(tensor, TypeProto())],
        [numpy_helper.from_array(np.asarray(leaf(name)), name) for name in leaves],
    )
    model = helper.make_model(graph, opset_imports=list(opsets))
    return np.asarray(ReferenceEvaluator(model).run([tensor], {})[0])
