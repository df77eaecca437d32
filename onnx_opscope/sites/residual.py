"""Residual sites: an Add of x and f(x), where f reaches x's other summand through weights.

Roles `residual_a` and `residual_b` are the Add's two inputs; the site's `skip` attribute
says which one is the residual (skip) path, the one the other reaches through at least one
GEMM-like node. Both must be activations of the same shape (symbolic dims compared as
expressions). The block influence gap sqrt(min(Σa², Σb²) / max(Σa², Σb²)) is small when the
block barely changes its input: a skip candidate (`transform.skip`).
"""

from __future__ import annotations

from onnx import NodeProto

from .site import Tap
from .view import Dims, GraphView

GEMM_LIKE = frozenset(
    {
        "MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "QLinearMatMul", "QLinearConv",
        "ConvInteger", "LSTM", "GRU", "RNN", "Einsum", "FusedMatMul", "Attention", "MultiHeadAttention",
        "GroupQueryAttention", "MatMulNBits",
    }
)  # fmt: skip
_ANCESTRY_LIMIT = 4000  # tensors visited per Add when looking for its skip path


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
    entry = view.entry
    # node order is topological: nothing produced before `src` depends on it, so the walk stops there
    # (without this bound every residual Add walked the whole model above it: quadratic, 10 s on 30 layers)
    first = entry.producer_index(src)
    first = -1 if first is None else first
    seen: set[str] = set()
    stack, found, between = [dst], False, set()
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
        i = entry.producer_index(t)
        if i is not None and i > first:
            between.add(i)
            stack.extend(x for x in entry.graph.node[i].input if x)
    if not found:
        return False
    reach = {src}
    for i in sorted(between):  # node order is topological
        n = entry.graph.node[i]
        if any(x in reach for x in n.input):
            reach.update(n.output)
            if n.op_type in GEMM_LIKE:
                return True
    return False


def residual_taps(node: NodeProto, view: GraphView) -> tuple[list[Tap], dict] | None:
    if len(node.input) != 2 or any(not i or view.is_constant(i) for i in node.input):
        return None
    a, b = node.input
    if not _same_shape(view.dims(a), view.dims(b)):
        return None
    keep = skip_input(node, view)
    if keep is None:
        return None
    return [Tap("residual_a", a), Tap("residual_b", b)], {"skip": keep}
