"""Make a tensor of any graph an output of the model: through If branches and Loop / Scan bodies.

A tensor inside an `If` branch becomes an output of that branch; the other branch returns an
empty tensor of the same type and rank (rank 0: NaN for floats, 0 otherwise; of shape [0] when
the rank is unknown, and the outputs then declare none), which decodes as "did not run"; and a
new output of the `If` node. A tensor inside a `Loop` or `Scan` body
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
from onnx import GraphProto, NodeProto, TensorProto, TypeProto, helper, numpy_helper

from ..errors import OpscopeError
from .index import ModelIndex, Names
from .opset import constant_takes_any_type, if_merges_branch_shapes
from .proto import DEFAULT_DOMAINS


@functools.cache
def _tensor_type(elem: int, rank: int | None) -> TypeProto:
    return helper.make_tensor_type_proto(elem, None if rank is None else [None] * rank)


def add_output(graph: GraphProto, name: str, elem: int, rank: int | None) -> None:
    """Append output `name` of element type `elem` and `rank` unknown dims (a big model gets 300k+);
    rank None: no shape at all."""
    vi = graph.output.add()
    vi.name = name
    vi.type.CopyFrom(_tensor_type(elem, rank))


def expose(
    index: ModelIndex, path: str, name: str, elem: int, rank: int | None, names: Names
) -> tuple[str, int]:
    """Carry tensor `name` of the graph at `path` up to the main graph's outputs (`rank` None: unknown).

    Returns (its name as a main-graph output, how many Loop/Scan levels stacked it: the output
    has that many extra leading axes).
    """
    stacked = 0

    def ranked() -> int | None:
        return None if rank is None else rank + stacked

    while path:
        entry = index[path]
        add_output(entry.graph, name, elem, ranked())
        owner = entry.owner
        if not entry.carried or owner is None:
            raise OpscopeError(
                f"cannot carry a tensor out of a {owner.op_type if owner else '?'} subgraph ({path})"
            )
        if owner.op_type == "If":
            other_attr = "else_branch" if entry.attr == "then_branch" else "then_branch"
            other = next(a.g for a in owner.attribute if a.name == other_attr)
            dummy = names.fresh("opscope_x_not_run")
            other.node.extend(not_run(dummy, elem, ranked(), owner.input[0], _opset(index), names))
            add_output(other, dummy, elem, ranked())
        else:  # Loop or Scan: a scan output
            stacked += 1
            if owner.op_type == "Scan":
                for a in owner.attribute:
                    if a.name in ("scan_output_axes", "scan_output_directions"):
                        a.ints.append(0)
        new = names.fresh("opscope_x_" + name.split("/")[-1] + "_up")
        owner.output.append(new)
        name, path = new, entry.parent
    add_output(index.main.graph, name, elem, ranked())
    return name, stacked


def _opset(index: ModelIndex) -> int | None:
    """The model's default-domain opset (None: the index is of a bare graph)."""
    if index.model is None:
        return None
    return next((o.version for o in index.model.opset_import if o.domain in DEFAULT_DOMAINS), None)


def not_run(
    name: str, elem: int, rank: int | None, cond: str, opset: int | None, names: Names
) -> list[NodeProto]:
    """Nodes making `name`, what the branch not taken returns: an empty tensor (rank 0: NaN, or 0;
    rank None: shape [0]).

    Before opset 9 a Constant holds floats only: another type is cast from float. Before opset
    11, If wants the shapes its branches' outputs are known to have to agree (onnxruntime folds
    Shape of a constant, too), so the empty tensor is reshaped to zeros made from the If's
    condition `cond`, a value known only at run time: its dims are then unknown to inference.
    """
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    rank = 1 if rank is None else rank
    empty = (
        np.full((), np.nan if dtype.kind == "f" else 0, dtype) if rank == 0 else np.zeros([0] * rank, dtype)
    )
    cast = dtype.kind != "f" and opset is not None and not constant_takes_any_type(opset)
    hide = rank > 0 and opset is not None and not if_merges_branch_shapes(opset)
    nodes: list[NodeProto] = []

    def add(op: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or names.fresh(f"{name}_{op.lower()}")
        nodes.append(
            helper.make_node(op, inputs, [out], name=names.fresh(f"opscope_x_n_not_run_{op}"), **attrs)
        )
        return out

    def constant(value: np.ndarray, out: str | None = None) -> str:
        out = out or names.fresh(f"{name}_c")
        return add("Constant", [], out, value=numpy_helper.from_array(value, out))

    if not cast and not hide:
        constant(empty, name)
        return nodes
    value = constant(empty.astype(np.float32)) if cast else constant(empty)
    if cast:
        value = add("Cast", [value], None if hide else name, to=elem)
    if hide:
        zeros = add("Mul", [add("Cast", [cond], to=TensorProto.FLOAT), constant(np.zeros(rank, np.float32))])
        add("Reshape", [value, add("Cast", [zeros], to=TensorProto.INT64)], name)
    return nodes
