"""Tap subgraphs built once per signature, then copied with the names swapped in their bytes.

Two taps with the same signature (TapInfo, sketches, and the byte lengths of the names a tap
is built from: its prefix, its tensor and, when it shares one, its sample index) differ only
in those names. The first is built with placeholder names of the same byte lengths and
serialized; each later one is a few byte replacements, exact because no protobuf length
changes (`graph.wire`). Building ~150 nodes one by one in Python costs ~2.5 ms a tap (a
minute for the 20k taps of a 40k-node graph); a copy ~0.07 ms. Tap names
(`opscope_t<k>_...`) are then not registered one by one: the prefix is reserved, and a model
already using it gets the node-by-node build.
"""

from __future__ import annotations

from onnx import GraphProto, NodeProto

from .. import sketch as sk
from ..graph.build import Builder, Constants
from ..graph.index import Names
from ..graph.wire import Chunk, count_in_strings

TAP_PREFIX = "opscope_t"

# ASCII control characters no name uses, one pair per name a tap is built from; the first byte
# of each placeholder differs from the rest, so an occurrence cannot overlap another one.
_MARKS = ("\x1e\x1d", "\x1c\x1b", "\x1a\x19", "\x18\x17")

_Template = tuple[Chunk, tuple[bytes, ...], sk.Built]


class TapTemplates:
    """Builds tap subgraphs for one model. State is real: the cache of templates per signature."""

    def __init__(self, opset: int, options: sk.SketchOptions, names: Names, constants: Constants | None):
        self.opset, self.options, self.names, self.constants = opset, options, names, constants
        self.enabled = not names.any_startswith(TAP_PREFIX)
        self.cache: dict[tuple, _Template | None] = {}

    def build(
        self,
        prefix: str,
        tensor: str,
        info: sk.TapInfo,
        sketches: list[str],
        sample: sk.SampleIndex | None = None,
        packed: bool = False,
    ) -> tuple[list[NodeProto] | list[Chunk], sk.Built]:
        """(the tap's nodes, as NodeProtos or as one encoded Chunk; its raws, `sketch.build_tap`).
        `sample`: the sample index the tap shares with others of its shape (`instrument.samples`);
        `packed`: a main-graph tap, whose raws go into packs."""
        words = [prefix, tensor, *(sample or ())]
        wb = [w.encode() for w in words]
        key = (info, tuple(sketches), tuple(len(w) for w in wb), packed)
        if self.enabled and key not in self.cache:
            self.cache[key] = self._template(info, sketches, [len(w) for w in wb], packed)
        tpl = self.cache.get(key)
        if tpl is None:
            b = Builder(self.opset, self.names, prefix, self.constants)
            chosen = [sk.REGISTRY[n] for n in sketches]
            return b.nodes, sk.build_tap(b, tensor, info, chosen, self.options, sample, packed)
        chunk, marks, built = tpl
        data = chunk.data
        for m, w in zip(marks, wb):
            data = data.replace(m, w)
        names = {}
        for r, n in built.outputs.items():
            for m, w in zip(marks, words):
                n = n.replace(m.decode(), w)
            names[r] = n
        return [Chunk(data, chunk.n)], built._replace(outputs=names)

    def _template(
        self, info: sk.TapInfo, sketches: list[str], lengths: list[int], packed: bool
    ) -> _Template | None:
        p, t, *s = (a + b * (n - 1) for (a, b), n in zip(_MARKS, lengths))
        b = Builder(self.opset, Names(), p, self.constants)
        sample = sk.SampleIndex(*s) if s else None
        out = sk.build_tap(b, t, info, [sk.REGISTRY[n] for n in sketches], self.options, sample, packed)
        g = GraphProto()
        g.node.extend(b.nodes)
        data = g.SerializeToString()
        # Every placeholder in the bytes must be inside a name: one in, say, a constant's raw
        # bytes would be renamed too. Then this signature is built node by node.
        marks = (p, t, *s)
        in_names = count_in_strings(g, marks)
        if any(data.count(m.encode()) != k for m, k in zip(marks, in_names)):
            return None
        return Chunk(data, len(b.nodes)), tuple(m.encode() for m in marks), out
