"""Dead-code removal: nodes no output depends on and initializers nothing reads, subgraphs included.

In place. Graph inputs stay (the model's interface does not change), except inputs that only
duplicated a removed initializer (IR < 4). External data is never read: removed weights
simply stop being referenced.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, helper

from ..graph.index import ModelIndex
from .result import Pruned


def _numel(t: TensorProto) -> int:
    return int(np.prod(t.dims)) if t.dims else 1


def _nbytes(t: TensorProto) -> int:
    try:
        size = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        size = 1
    return _numel(t) * size


def _liveness(index: ModelIndex, path: str, plan: dict[str, tuple[list[int], set[str]]]) -> set[str]:
    """Fill `plan[path]` = (positions of the nodes some output depends on, the names they read, nested
    live subgraphs included); returns those names. Read-only: the index stays valid."""
    entry = index[path]
    live = set(entry.outputs)
    keep = []
    for i in reversed(range(len(entry.graph.node))):
        node = entry.graph.node[i]
        if any(o in live for o in node.output if o):
            for child in index.children(path, i):
                live |= _liveness(index, child.path, plan)
            live.update(x for x in node.input if x)
            keep.append(i)
    plan[path] = (keep[::-1], live)
    return live


def _apply(graph: GraphProto, keep: list[int], live: set[str], pruned: Pruned, ops: Counter) -> None:
    if len(keep) != len(graph.node):
        kept = set(keep)
        ops.update(n.op_type for i, n in enumerate(graph.node) if i not in kept)
        pruned.nodes_removed += len(graph.node) - len(keep)
        new = [NodeProto() for _ in keep]
        for dst, i in zip(new, keep):
            dst.CopyFrom(graph.node[i])
        del graph.node[:]
        graph.node.extend(new)
    names = {t.name for t in graph.initializer if t.name not in live}
    if names:
        for t in graph.initializer:
            if t.name in names:
                pruned.initializers_removed += 1
                pruned.params_removed += _numel(t)
                pruned.bytes_removed += _nbytes(t)
        kept_t = [t for t in graph.initializer if t.name not in names]
        copies = [TensorProto() for _ in kept_t]
        for dst, src in zip(copies, kept_t):
            dst.CopyFrom(src)
        del graph.initializer[:]
        graph.initializer.extend(copies)
        for i in reversed(range(len(graph.input))):  # IR < 4 lists initializers as inputs too
            if graph.input[i].name in names:
                del graph.input[i]
    produced = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    for i in reversed(range(len(graph.value_info))):
        if graph.value_info[i].name not in produced:
            del graph.value_info[i]


def prune(model: ModelProto) -> Pruned:
    """Remove, in place, the nodes no output depends on and the initializers nothing reads."""
    index = ModelIndex(model)
    plan: dict[str, tuple[list[int], set[str]]] = {}
    _liveness(index, "", plan)
    pruned, ops = Pruned(), Counter()
    for path in sorted(plan, key=lambda p: -p.count("/")):  # a graph before the graphs around it
        _apply(index[path].graph, *plan[path], pruned, ops)
    pruned.ops_removed = dict(ops.most_common())
    return pruned
