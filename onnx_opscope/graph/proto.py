"""Small readers over onnx protos that every stage needs: attributes, inputs, subgraphs, external data.

One definition each: attribute lookups used to be spelled four times (sites, inference taps,
feeds, shape rules) with different defaults and speeds.
"""

from __future__ import annotations

from onnx import AttributeProto, GraphProto, NodeProto, TensorProto, helper

DEFAULT_DOMAINS = ("", "ai.onnx")


def attr(node: NodeProto, name: str, default=None):
    """One attribute's Python value, `default` when absent (cheaper than onnx.helper for the common types)."""
    for a in node.attribute:
        if a.name == name:
            t = a.type
            if t == AttributeProto.INT:
                return a.i
            if t == AttributeProto.INTS:
                return list(a.ints)
            if t == AttributeProto.FLOAT:
                return a.f
            if t == AttributeProto.FLOATS:
                return list(a.floats)
            if t == AttributeProto.STRING:
                return a.s.decode()
            if t == AttributeProto.STRINGS:
                return [s.decode() for s in a.strings]
            return helper.get_attribute_value(a)
    return default


def input_at(node: NodeProto, i: int) -> str | None:
    """The name of input `i`, None when it is absent or empty (an omitted optional input)."""
    return node.input[i] if len(node.input) > i and node.input[i] else None


def subgraphs(node: NodeProto) -> list[tuple[str, str, GraphProto]]:
    """(attribute name, path suffix, graph) of every graph attribute of `node`.

    The suffix is the attribute name, or `<name><j>` for the j-th graph of a GRAPHS attribute.
    """
    out = []
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            out.append((a.name, a.name, a.g))
        elif a.type == AttributeProto.GRAPHS:
            graphs = list(a.graphs)
            out.extend(
                (a.name, a.name if len(graphs) == 1 else f"{a.name}{j}", g) for j, g in enumerate(graphs)
            )
    return out


def int_numbers(node: NodeProto) -> dict:
    """The node's INT and FLOAT attributes as a plain dict (what site records keep)."""
    return {
        a.name: helper.get_attribute_value(a)
        for a in node.attribute
        if a.type in (AttributeProto.INT, AttributeProto.FLOAT)
    }


def is_external(t: TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL


def external_info(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def constant_value(node: NodeProto) -> TensorProto | None:
    """The TensorProto of a Constant node's `value` attribute (None for value_float and friends)."""
    for a in node.attribute:
        if a.name == "value" and a.type == AttributeProto.TENSOR:
            return a.t
    return None


def op_set(names: str) -> frozenset[str]:
    """frozenset of the space-separated op type names in `names`."""
    return frozenset(names.split())
