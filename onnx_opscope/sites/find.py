"""Find every site of a model: one pass over the model index, subgraphs included.

Subgraphs of owners that cannot hand an output to the graph around them (anything but
If / Loop / Scan of the default domain, e.g. a contrib BeamSearch) are not searched: a tap
there could not reach the model's outputs. `subgraphs_not_tappable` names them.
"""

from __future__ import annotations

from collections.abc import Callable

from onnx import ModelProto, NodeProto

from ..graph.index import ModelIndex
from ..graph.io import opset_version
from ..graph.proto import DEFAULT_DOMAINS, int_numbers
from ..shapes import ShapeTable, infer_shapes
from .attention import FUSED_ATTENTION, fused_attention_taps, softmax_taps
from .decoder import DECODER_OPS, decoder_site
from .gemm import GEMM_OPS, gemm_taps
from .kv import kv_sites
from .nbits import NBITS_OPS, nbits_taps
from .qdq import through_qdq
from .residual import residual_taps
from .routing import argmax_taps, topk_taps
from .site import Site, Tap
from .view import GraphView

Finder = Callable[[NodeProto, GraphView], tuple[list[Tap], dict] | None]

_FINDERS: dict[str, tuple[str, Finder]] = {
    "Softmax": ("attn", softmax_taps),
    "TopK": ("route", topk_taps),
    "ArgMax": ("route", argmax_taps),
    "Add": ("residual", residual_taps),
}
TAPPABLE_OPS = (
    *GEMM_OPS,
    "Softmax",
    "Attention",
    "MultiHeadAttention",
    "GroupQueryAttention",
    "TopK",
    "ArgMax",
    "Add",
    "MatMulNBits",
    *DECODER_OPS,
)


def _site_of(node: NodeProto, view: GraphView) -> tuple[str, list[Tap], dict] | None:
    if (node.domain, node.op_type) in FUSED_ATTENTION:
        found = fused_attention_taps(node, view)
        return None if found is None else ("attn", *found)
    if (node.domain, node.op_type) in NBITS_OPS:
        return "gemm", nbits_taps(node, view), {}
    decoder = decoder_site(node, view)
    if decoder is not None:
        return decoder
    if node.domain not in DEFAULT_DOMAINS:
        return None
    if node.op_type in GEMM_OPS:
        return "gemm", gemm_taps(node, view), {}
    kind_finder = _FINDERS.get(node.op_type)
    if kind_finder is None:
        return None
    found = kind_finder[1](node, view)
    return None if found is None else (kind_finder[0], *found)


def find_sites(
    model: ModelProto, table: ShapeTable | None = None, index: ModelIndex | None = None
) -> list[Site]:
    """Every site of a known kind, main graph and If/Loop/Scan bodies, in depth-first order.

    `table`: the model's shapes (`shapes.infer_shapes`), inferred here when not given; the
    attention, routing and residual finders need ranks and same-shape tests.
    """
    index = index or ModelIndex(model)
    table = table if table is not None else infer_shapes(model)
    opset = opset_version(model) or 1
    views: dict[str, GraphView] = {}
    out: list[Site] = []
    for entry, i, node in index.nodes():
        if not entry.carried:
            continue
        view = views.get(entry.path)
        if view is None:
            view = views[entry.path] = GraphView(index, entry, opset, table)
        found = _site_of(node, view)
        if found is None:
            continue
        kind, taps, extra = found
        taps = through_qdq(node, taps, view)
        attrs = {**int_numbers(node), **extra}
        out.append(
            Site(entry.ids[i], node.op_type, kind, node.name, entry.path, len(out), tuple(taps), attrs)
        )
    return out + kv_sites(index, len(out))  # a decoder's present.* outputs: its KV cache


def subgraphs_not_tappable(model: ModelProto, index: ModelIndex | None = None) -> list[str]:
    """Ids of the nodes whose subgraphs are not searched for sites (their outputs cannot be carried out)."""
    index = index or ModelIndex(model)
    return sorted(
        {
            index[e.parent].ids[e.owner_index]
            for e in index.graphs.values()
            if e.parent is not None and not e.carried and index[e.parent].carried
        }
    )
