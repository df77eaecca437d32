"""Tap subgraphs built once per signature, then copied with the names swapped in their bytes.

Two taps with the same signature (TapInfo, sketches, and the byte lengths of the tap prefix
and tensor name) differ only in those names. The first is built with placeholder names of
the same byte lengths and serialized; each later one is two byte replacements, exact
because no protobuf length changes (`graph.wire`). Building ~150 nodes one by one in Python
costs ~2.5 ms a tap (a minute for the 20k taps of a 40k-node graph); a copy ~0.07 ms. Tap
names (`opscope_t<k>_...`) are then not registered one by one: the prefix is reserved, and a
model already using it gets the node-by-node build.
"""

from __future__ import annotations

from onnx import GraphProto, NodeProto

from .. import sketch as sk
from ..graph.build import Builder, Constants
from ..graph.index import Names
from ..graph.wire import Chunk, count_in_strings

TAP_PREFIX = "opscope_t"

_Template = tuple[Chunk, bytes, bytes, dict[str, str]]


class TapTemplates:
    """Builds tap subgraphs for one model. State is real: the cache of templates per signature."""

    def __init__(self, opset: int, options: sk.SketchOptions, names: Names, constants: Constants | None):
        self.opset, self.options, self.names, self.constants = opset, options, names, constants
        self.enabled = not names.any_startswith(TAP_PREFIX)
        self.cache: dict[tuple, _Template | None] = {}

    def build(
        self, prefix: str, tensor: str, info: sk.TapInfo, sketches: list[str]
    ) -> tuple[list[NodeProto] | list[Chunk], dict[str, str]]:
        """(the tap's nodes, as NodeProtos or as one encoded Chunk; raw -> output name)."""
        pb, tb = prefix.encode(), tensor.encode()
        key = (info, tuple(sketches), len(pb), len(tb))
        if self.enabled and key not in self.cache:
            self.cache[key] = self._template(info, sketches, len(pb), len(tb))
        tpl = self.cache.get(key)
        if tpl is None:
            b = Builder(self.opset, self.names, prefix, self.constants)
            return b.nodes, sk.build_tap(b, tensor, info, [sk.REGISTRY[n] for n in sketches], self.options)
        chunk, p, t, out = tpl
        ps, ts = p.decode(), t.decode()
        names = {r: n.replace(ps, prefix).replace(ts, tensor) for r, n in out.items()}
        return [Chunk(chunk.data.replace(p, pb).replace(t, tb), chunk.n)], names

    def _template(
        self, info: sk.TapInfo, sketches: list[str], n_prefix: int, n_tensor: int
    ) -> _Template | None:
        # ASCII control characters no name uses; the first byte differs from the rest, so an
        # occurrence cannot overlap another one.
        p, t = "\x1e" + "\x1d" * (n_prefix - 1), "\x1c" + "\x1b" * (n_tensor - 1)
        b = Builder(self.opset, Names(), p, self.constants)
        out = sk.build_tap(b, t, info, [sk.REGISTRY[n] for n in sketches], self.options)
        g = GraphProto()
        g.node.extend(b.nodes)
        data = g.SerializeToString()
        # Every placeholder in the bytes must be inside a name: one in, say, a constant's raw
        # bytes would be renamed too. Then this signature is built node by node.
        in_names = count_in_strings(g, (p, t))
        if data.count(p.encode()) != in_names[0] or data.count(t.encode()) != in_names[1]:
            return None
        return Chunk(data, len(b.nodes)), p.encode(), t.encode(), out
