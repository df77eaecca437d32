"""The tap plan: from sites and sketch names to one tap per tensor, before any node is built.

A tensor feeding several sites (Q, K and V projections) is tapped once, with the union of
the sketches its sites need: a gemm site gets the user's sketches, an attn / route /
residual site its kind's own (`sites.KIND_SKETCHES`) unless the user named some of them.
A role left out by the selection keeps a shape-only tap, so the site's M, K, N are still
known. A tap on a weight (an initializer or a Constant output, outer scopes included, or a tensor
made from those alone: `folded`) is a `constant` tap: it gets no nodes, its sketches are taken on
the host (`host.host_values`).
A tap that reads a quantized tensor through a DequantizeLinear (`sites.qdq`) is its own tap,
typed as the float the DQ makes.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx import TensorProto

from .. import sketch as sk
from ..graph.index import ModelIndex
from ..shapes import ShapeTable, TensorType
from ..sites import KIND_SKETCHES, SHADOW_SUFFIX, Dequant, Site
from . import folded
from .manifest import SiteRecord, TapRecord

SHADOW_TYPE = TensorType(TensorProto.FLOAT, 4, None)  # a shadow softmax: [B, heads, S, T] float32


def sketches_for_kind(kind: str, names: Sequence[str]) -> list[str]:
    """The sketches a site of `kind` gets from the chosen `names` (see the module doc)."""
    if kind not in KIND_SKETCHES:  # gemm, norm, rotary: activations, the user's sketches
        return [n for n in names if not sk.REGISTRY[n].kinds]
    own = [n for n in names if kind in sk.REGISTRY[n].kinds]
    return own or [n for n in sk.REGISTRY if n in KIND_SKETCHES.get(kind, ())]


def tensor_type(table: ShapeTable, tensor: str) -> TensorType | None:
    return SHADOW_TYPE if tensor.endswith(SHADOW_SUFFIX) else table.type_of(tensor)


def dequantized_type(table: ShapeTable, dq: Dequant) -> int:
    """The element type a DequantizeLinear with this scale makes (the scale's; float32 when unknown)."""
    ti = table.type_of(dq.scale)
    return ti.elem_type if ti and ti.elem_type else TensorProto.FLOAT


def dequant_record(dq: Dequant | None) -> dict | None:
    """A Dequant as the manifest stores it (JSON: attrs as a dict)."""
    if dq is None:
        return None
    return {"scale": dq.scale, "zero_point": dq.zero_point, "attrs": dict(dq.attrs), "domain": dq.domain}


def plan_taps(
    sites: Sequence[Site], names: Sequence[str], table: ShapeTable, index: ModelIndex
) -> tuple[list[SiteRecord], list[TapRecord]]:
    """(one record per site with its roles' tap ids, one record per tapped tensor without outputs yet)."""
    wanted: dict[tuple, set[str]] = {}
    for site in sites:
        for tap in site.taps:
            key = (site.graph, tap.tensor, tap.channel_axis, tap.seq_axis, tap.bins, tap.dequant, False)
            wanted.setdefault(key, set()).update(sketches_for_kind(site.kind, names))
    taps: dict[tuple, TapRecord] = {}
    records = []
    for site in sites:
        roles: dict[str, str] = {}
        shape_roles: dict[str, str] = {}
        for tap, only_shape in [(t, False) for t in site.taps] + [(t, True) for t in site.shape_only]:
            # `bins` is in the key: a kv tap splitting the channel axis in heads is not the gemm `out` tap
            # of the same tensor, which has no head count
            key = (site.graph, tap.tensor, tap.channel_axis, tap.seq_axis, tap.bins, tap.dequant, only_shape)
            if key not in taps:
                ti = tensor_type(table, tap.tensor)
                elem = ti.elem_type if ti and ti.elem_type else TensorProto.UNDEFINED
                if tap.dequant is not None:  # sketched as the float the DequantizeLinear makes
                    elem = dequantized_type(table, tap.dequant)
                info = sk.TapInfo(ti.rank if ti else None, elem, tap.channel_axis, tap.seq_axis, tap.bins)
                own = [n for n in sk.REGISTRY if n in wanted.get(key, ())]
                taps[key] = TapRecord(
                    id=f"t{len(taps)}",
                    tensor=tap.tensor,
                    graph=site.graph,
                    rank=info.rank,
                    elem_type=elem,
                    channel_axis=tap.channel_axis,
                    seq_axis=tap.seq_axis,
                    numel=ti.numel if ti else None,
                    constant=index.is_constant(site.graph, tap.tensor)
                    or (tap.dequant is None and folded.chain(index, site.graph, tap.tensor) is not None),
                    stacked=0,
                    sketches=[] if only_shape else sk.applicable(own, info),
                    outputs={},
                    bins=tap.bins,
                    dequant=dequant_record(tap.dequant),
                )
            (shape_roles if only_shape else roles)[tap.role] = taps[key].id
        records.append(
            SiteRecord(
                site.id,
                site.op_type,
                site.node,
                site.graph,
                site.order,
                roles,
                shape_roles,
                dict(site.attrs),
                site.kind,
            )
        )
    return records, list(taps.values())
