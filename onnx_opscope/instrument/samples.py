"""Sample indices shared by the taps of one size: made once per (graph, element count), not once per tap.

The sampled histogram and elemsig gather blocks of a tensor at positions that depend on its
element count alone (`sketch.sample_index`: ~20 scalar nodes, ~1 µs each on CPU however
small the tensor, two thirds of a default tap's nodes). Taps whose tensors have the same
element count in the shape table (a product of dims, symbols included: ppocrv4_det's 137 taps
have 31 shapes) share one index: constants when the count is static, else one set of nodes
reading the Size of the first of those tensors, placed before the first of their taps.

This trusts the shape table as the rest of `inject` does (sites, copy-out, costs): a tensor
whose runtime shape differed from its inferred one would read another tensor's positions.
A tap whose shape is not fully known computes its own index, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx import NodeProto

from .. import sketch as sk
from ..graph.build import Builder, Constants
from ..graph.index import Names
from ..shapes import ShapeTable
from ..shapes.symbolic import Dimlike, prod
from ..sites import SHADOW_SUFFIX
from .manifest import TapRecord

IndexNodes = dict[str, dict[int, list[NodeProto]]]  # graph path -> position -> nodes after it


def shared_sample_indices(
    taps: Sequence[tuple[int, TapRecord, int]],
    table: ShapeTable,
    opset: int,
    names: Names,
    constants: Constants | None,
    options: sk.SketchOptions,
) -> tuple[dict[int, sk.SampleIndex], IndexNodes]:
    """For the taps (number, record, insert position) that gather a sample: ({tap number: its shared
    index}, the nodes making the indices, by graph and position)."""
    groups: dict[tuple[str, Dimlike], list[tuple[int, TapRecord, int]]] = {}
    for entry in taps:
        _, tap, _ = entry
        if tap.dequant is not None or tap.tensor.endswith(SHADOW_SUFFIX):
            continue
        if not sk.reads_samples(tap.sketches, options):
            continue
        shape = table.shape(tap.tensor)
        n = None if shape is None else prod(shape)
        if n is not None:
            groups.setdefault((tap.graph, n), []).append(entry)
    shared: dict[int, sk.SampleIndex] = {}
    nodes: IndexNodes = {}
    for gid, ((graph, n), members) in enumerate(groups.items()):
        b = Builder(opset, names, f"opscope_g{gid}_", constants)
        if isinstance(n, int):
            g, j = sk.sample_blocks(n, options.sample_size)
            index = sk.SampleIndex(b.i64([-1, g]), b.i64(j))
            pos = min(p for _, _, p in members)  # where Constant nodes go when there is no pool (IR 3)
        else:
            _, first, pos = min(members, key=lambda e: e[2])
            index = sk.sample_index(b, b.op("Size", [first.tensor], "numel"), options)
        if b.nodes:
            nodes.setdefault(graph, {}).setdefault(pos, []).extend(b.nodes)
        shared.update((k, index) for k, _, _ in members)
    return shared, nodes
