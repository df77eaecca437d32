"""Make a tensor of any graph an output of the model: through If branches and Loop / Scan bodies.

A tensor inside an `If` branch becomes an output of that branch; the other branch returns an
empty tensor of the same type and rank (rank 0: NaN for floats, 0 otherwise), which decodes
as "did not run"; and a new output of the `If` node. A tensor inside a `Loop` or `Scan` body
becomes a new scan output, so its values come back once per iteration, stacked on a new
leading axis. Nested graphs repeat this up to the main graph, where it is appended after the
model's own outputs (whose names and order do not change).

Exposing edits graphs in place and only appends (outputs, and one Constant node to the other
branch), so do it before `wire.splice` rebuilds any node list: the index's graph objects
stay valid.
"""

from __future__ import annotations

import functools

import numpy as np
from onnx import GraphProto, TypeProto, helper, numpy_helper

from ..errors import OpscopeError
from .index import ModelIndex, Names


@functools.cache
def _tensor_type(elem: int, rank: int) -> TypeProto:
    return helper.make_tensor_type_proto(elem, [None] * rank)


def add_output(graph: GraphProto, name: str, elem: int, rank: int) -> None:
    """Append output `name` of element type `elem` and `rank` unknown dims (a big model gets 300k+)."""
    vi = graph.output.add()
    vi.name = name
    vi.type.CopyFrom(_tensor_type(elem, rank))


def expose(index: ModelIndex, path: str, name: str, elem: int, rank: int, names: Names) -> tuple[str, int]:
    """Carry tensor `name` of the graph at `path` up to the main graph's outputs.

    Returns (its name as a main-graph output, how many Loop/Scan levels stacked it: the output
    has that many extra leading axes).
    """
    stacked = 0
    while path:
        entry = index[path]
        add_output(entry.graph, name, elem, rank + stacked)
        owner = entry.owner
        if not entry.carried or owner is None:
            raise OpscopeError(
                f"cannot carry a tensor out of a {owner.op_type if owner else '?'} subgraph ({path})"
            )
        if owner.op_type == "If":
            other_attr = "else_branch" if entry.attr == "then_branch" else "then_branch"
            other = next(a.g for a in owner.attribute if a.name == other_attr)
            dummy = names.fresh("opscope_x_not_run")
            dtype = helper.tensor_dtype_to_np_dtype(elem)
            r = rank + stacked
            empty = (
                np.full((), np.nan if dtype.kind == "f" else 0, dtype) if r == 0 else np.zeros([0] * r, dtype)
            )
            other.node.append(
                helper.make_node(
                    "Constant",
                    [],
                    [dummy],
                    name=names.fresh("opscope_x_n_not_run"),
                    value=numpy_helper.from_array(empty, dummy),
                )
            )
            add_output(other, dummy, elem, r)
        else:  # Loop or Scan: a scan output
            stacked += 1
            if owner.op_type == "Scan":
                for a in owner.attribute:
                    if a.name in ("scan_output_axes", "scan_output_directions"):
                        a.ints.append(0)
        new = names.fresh("opscope_x_" + name.split("/")[-1] + "_up")
        owner.output.append(new)
        name, path = new, entry.parent
    add_output(index.main.graph, name, elem, rank + stacked)
    return name, stacked
