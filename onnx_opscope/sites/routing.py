"""Routing sites: the expert ids a mixture-of-experts router picks.

The indices output of a TopK over at most MAX_EXPERTS candidates (a TopK over a vocabulary
is a sampler, not a router), and ArgMax indices that gather stacked expert weights. The tap
carries E, the number of experts, when it is static (the gate's last dim, or the stacked
weights' first dim), so `route_load` counts over E bins and never-chosen experts show as 0.
"""

from __future__ import annotations

from onnx import NodeProto

from ..graph.proto import attr
from .site import Tap
from .view import GraphView

MAX_EXPERTS = 1024


def _feeds_expert_gather(view: GraphView, ids: str) -> int | None:
    """E when `ids` index axis 0 of stacked constant expert weights ([E, ...], rank >= 3)."""
    for c in view.consumers(ids):
        if c.op_type == "Gather" and len(c.input) > 1 and c.input[1] == ids and view.is_constant(c.input[0]):
            d = view.constant_dims(c.input[0]) or []
            if len(d) >= 3 and attr(c, "axis", 0) == 0:
                return d[0]
    return None


def topk_taps(node: NodeProto, view: GraphView) -> tuple[list[Tap], dict] | None:
    if len(node.output) < 2 or not node.output[1] or not view.used(node.output[1]):
        return None
    d = view.dims(node.input[0])
    if d is not None and attr(node, "axis", -1) % len(d) != len(d) - 1:
        return None
    e = d[-1] if d and isinstance(d[-1], int) else None
    gathered = _feeds_expert_gather(view, node.output[1])
    if gathered is None and (e is None or e > MAX_EXPERTS):
        return None
    return [Tap("route", node.output[1], bins=e if e is not None else gathered)], {}


def argmax_taps(node: NodeProto, view: GraphView) -> tuple[list[Tap], dict] | None:
    e = _feeds_expert_gather(view, node.output[0])
    return None if e is None else ([Tap("route", node.output[0], bins=e)], {})
