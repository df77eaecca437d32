"""Packed outputs: the many small raws of the main graph's in-graph taps leave the model as four outputs.

Every graph output costs 1.3-2.5 µs in `InferenceSession.run` however small it is, whatever its
rank (an OrtValue, a numpy array and a dict entry each; `scripts/bench_outputs.py`: 800 scalar
outputs 1.6-3.3 ms a run against 0.6-0.9 ms for the same reductions concatenated into one). A
default tap has nine (its shape, its sample, seven scalars), more than its reductions cost on a
small tensor. So the main graph's in-graph taps hand their raws to four packs, each one `Concat`
at the end of the graph:

- `shapes`: every tap's [1, *shape] (int64), of static length rank + 1;
- `scalars`: every rank-0 float raw, each `Reshape`d to [1] (0.4-0.5 µs a value in priority
  order: a fifth to a third of an output; reductions made [1]-shaped would not need them);
- `samples`: every tap's sample, of a length the host works out from the tap's shape
  (`histogram.sample_lengths`), so it needs no output of its own;
- `slow`: every tap's masking-branch vector (`sketch.build_tap`: its clean branch runs in the graph
  itself), empty for a tap that took the clean branch. The host knows which taps took the masking
  branch from their check Σx² (not finite), and cuts their vectors by the sizes of the clean raws
  they replace (`Unpacked.overridden`).

A tap in If branches (its outputs are If outputs, with "not run" markers from the branches not taken)
packs its rank-0 float raws and its sample into one vector of its own (`pack_branch_raws`); from opset 11
those vectors and shapes, and the copied float32 tensors of the branches, leave the model in one stream
of two outputs (`branches`). The copied float32 tensors of the main graph (and of the branches before
opset 11) leave it as two outputs, their values end to end and their ranks and shapes (`pack_copied`).
Taps in Loop / Scan bodies (stacked per iteration) and the other raws (per-channel vectors, bin indices)
keep an output each.
The manifest lists each pack with its (tap, raw) members in order (`Manifest.packed`), and
`unpacked` gives the decode a run's outputs under the members' own names, sliced on first use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from onnx import GraphProto, NodeProto, TensorProto

from .. import sketch as sk
from ..graph.build import Builder, Constants
from ..graph.expose import add_output
from ..graph.index import Names
from ..sketch.histogram import sample_lengths
from .manifest import Manifest, PackLayout, TapRecord

PACKS = ("shapes", "scalars", "samples", "slow")
_ELEM = {p: TensorProto.INT64 if p == "shapes" else TensorProto.FLOAT for p in PACKS}


def pack_of(tap: TapRecord, raw: str, options: sk.SketchOptions) -> str | None:
    """The pack a raw of `tap` goes into, or None when it keeps an output of its own."""
    if tap.graph or tap.copied or tap.constant:
        return None
    if raw == "shape":
        return "shapes" if tap.rank is not None else None
    if raw in ("samples", "slow"):
        return raw
    chosen = [sk.REGISTRY[n] for n in tap.sketches]
    if sk.raw_dtype(raw, options) == TensorProto.FLOAT and sk.raw_rank(raw, chosen) == 0:
        return "scalars"
    return None


def branch_raws(tap: TapRecord, options: sk.SketchOptions) -> list[str]:
    """The raws of an in-graph tap in If branches (not in a Loop or Scan body) that leave its branch as one
    vector (`pack_branch_raws`): its rank-0 float raws, then its sample (whose length the host works out
    from the tap's shape, as for the main graph's samples pack); [] for fewer than two."""
    chosen = [sk.REGISTRY[n] for n in tap.sketches]
    got = [
        raw
        for raw in tap.outputs
        if raw not in ("shape", "samples")
        and sk.raw_dtype(raw, options) == TensorProto.FLOAT
        and sk.raw_rank(raw, chosen) == 0
    ]
    got += ["samples"] if "samples" in tap.outputs else []
    return got if len(got) > 1 else []


def pack_branch_raws(
    tap: TapRecord, members: list[str], b: Builder, names: Names
) -> tuple[list[NodeProto], str]:
    """The nodes that concatenate `members` of a tap in If branches into one vector (the scalars `Reshape`d
    to [1]), and its name. Every output of a branch is an output of each If above it, and each branch not
    taken gives an empty one in its place: silero_vad_v6's six taps in the branch it does not take made 54
    of them, 12 with their shapes beside these vectors."""
    one = b.i64([1])
    parts = [tap.outputs[r] if r == "samples" else b.op("Reshape", [tap.outputs[r], one]) for r in members]
    out = names.fresh(f"opscope_{tap.id}_raws")
    b.op("Concat", parts, out=out, axis=0)
    return b.nodes, out


def copied_groups(taps: list[TapRecord]) -> dict[str, list[TapRecord]]:
    """graph path -> its copied float32 taps, in tap order, where a graph has two or more: each group
    leaves its graph as one vector and their ranks and shapes (`pack_copied`). Any rank: the pack's
    shapes carry each member's, and say for all of them whether their If branch ran, so a scalar or a
    tensor of unknown rank needs no marker of its own."""
    groups: dict[str, list[TapRecord]] = {}
    for tap in taps:
        if tap.copied and tap.elem_type == TensorProto.FLOAT:
            groups.setdefault(tap.graph, []).append(tap)
    return {graph: members for graph, members in groups.items() if len(members) > 1}


def pack_copied(members: list[TapRecord], b: Builder, names: Names) -> tuple[list[NodeProto], str, str]:
    """The nodes that lay the copied tensors of one graph end to end (flattened) and their ranks and shapes
    end to end, to append after every other node of that graph: (nodes, the values' vector, the shapes'). Two
    outputs for the lot, where each tensor was an output: captcha_crnn copies 162 tensors out."""
    flat = b.i64([-1])
    values = names.fresh("opscope_copied")
    b.op("Concat", [b.op("Reshape", [t.outputs["tensor"], flat]) for t in members], out=values, axis=0)
    shapes = names.fresh("opscope_copied_shapes")  # each tensor's rank, then its dims: a rank may follow
    dims = [b.op("Shape", [t.outputs["tensor"]]) for t in members]  # the inputs' (an unrolled loop's)
    b.op("Concat", [p for d in dims for p in (b.op("Shape", [d]), d)], out=shapes, axis=0)
    return b.nodes, values, shapes


def pack_outputs(
    graph: GraphProto,
    opset: int,
    names: Names,
    constants: Constants | None,
    taps: list[TapRecord],
    options: sk.SketchOptions,
) -> tuple[list[NodeProto], list[dict]]:
    """The nodes that pack the packable raws of `taps` (to append after every other node of the main
    `graph`, whose outputs they add) and the manifest's `packed` entries. A pack of one member is left
    as that member's own output."""
    members: dict[str, list[tuple[TapRecord, str]]] = {p: [] for p in PACKS}
    for tap in taps:
        for raw in tap.outputs:
            pack = pack_of(tap, raw, options)
            if pack is not None:
                members[pack].append((tap, raw))
    b = Builder(opset, names, "opscope_pack_", constants)
    packed = []
    for pack in PACKS:
        got = members[pack]
        if len(got) < (1 if pack == "slow" else 2):  # the slow pack always: `Unpacked` cuts it
            for tap, raw in got:
                add_output(graph, tap.outputs[raw], _ELEM[pack], 1 if pack != "scalars" else 0)
            continue
        parts = [tap.outputs[raw] for tap, raw in got]
        if pack == "scalars":
            one = b.i64([1])
            parts = [b.op("Reshape", [p, one]) for p in parts]
        out = names.fresh(f"opscope_packed_{pack}")
        b.op("Concat", parts, out=out, axis=0)
        add_output(graph, out, _ELEM[pack], 1)
        packed.append({"output": out, "pack": pack, "raws": [[tap.id, raw] for tap, raw in got]})
    return b.nodes, packed


class Unpacked(dict):
    """A run's outputs, each packed member readable under its own name: sliced (a view) when first read."""

    def __init__(self, outputs: Mapping, layout: PackLayout):
        super().__init__(outputs)
        self.layout = layout
        self.overridden: set[str] = set()
        if layout.slow is not None and np.asarray(super().__getitem__(layout.slow[0])).size:
            self._override_slow()

    def __missing__(self, key: str) -> np.ndarray:
        if key in self.layout.stream_of:
            self._unpack_stream(self.layout.stream_of[key])
            return self[key]
        if key in self.layout.tap_samples:
            v = self[key] = self._tap_sample(*self.layout.tap_samples[key])
            return v
        if key in self.layout.copied_in:
            self._unpack_copied(self.layout.copied_in[key])
            return self[key]
        where = self.layout.where.get(key)
        if where is None and self.layout.slow is not None and key in self.layout.slow_members:
            v = np.asarray(super().__getitem__(self.layout.slow[0]))[:0]  # its tap took the clean branch
            self[key] = v
            return v
        if where is None:
            samples = self.layout.samples
            if samples is None or key not in samples[1]:
                raise KeyError(key)
            self._unpack_samples()
            return self[key]
        out, start, stop, scalar = where
        v = np.asarray(self[out])[start:stop]  # a branch tap's vector may itself be in a stream
        if scalar and v.size:  # rank 0, as its own output would be (a branch not taken: empty)
            v = v.reshape(())
        self[key] = v
        return v

    def scalars(self, members: list[str]) -> np.ndarray | None:
        """The values of scalar `members` of one pack as float64, one gather (the decode's hot path); None
        when one is not a packed scalar."""
        where = [self.layout.where.get(m) for m in members]
        if not where or any(w is None or not w[3] or w[0] != where[0][0] for w in where):
            return None
        pack = np.asarray(self[where[0][0]])
        got = pack[np.fromiter((w[1] for w in where), np.int64, len(where))].astype(np.float64)
        if self.overridden:  # taps that took the masking branch
            for i, m in enumerate(members):
                if m in self.overridden:
                    got[i] = self[m]
        return got

    def samples(self, members: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """(the samples of `members`, one after another, their lengths) when they are the samples pack's
        members in its order (the decode's hot path: the pack itself, no copy); else None."""
        got = self.layout.samples
        if got is None or members != got[1]:
            return None
        return np.asarray(super().__getitem__(got[0])), self._sample_lengths()

    def _override_slow(self) -> None:
        """The masking branch's raws of the taps that took it (their Σx² not finite), in place of the clean
        raws those taps also made: cut from the slow pack by the clean raws' sizes, in their dtypes."""
        out, taps = self.layout.slow
        flat = np.asarray(super().__getitem__(out))
        checks = [check for _, check, _ in taps]
        got = self.scalars(checks)
        if got is None:
            got = np.array([float(self[c]) for c in checks])
        cuts, at = [], 0
        for j in np.flatnonzero(~np.isfinite(got)).tolist():
            own, _, members = taps[j]
            clean = [np.asarray(self[m]) for m in members]
            cuts.append((own, members, clean, at))
            at += sum(c.size for c in clean)
        if at != flat.size:
            raise ValueError(
                f"{out}: {flat.size} values where the taps that took the masking branch make {at}"
            )
        for own, members, clean, start in cuts:
            at = start
            for m, c in zip(members, clean):
                self[m] = flat[at : at + c.size].astype(c.dtype).reshape(c.shape)
                self.overridden.add(m)
                at += c.size
            self[own] = flat[start:at]

    def _tap_sample(self, out: str, start: int, shape: str) -> np.ndarray:
        """The sample at the end of a branch tap's vector: as long as the tap's shape says (empty when its
        branch did not run)."""
        flat = np.asarray(self[out])
        dims = np.asarray(self[shape]).ravel()
        if not dims.size:
            return flat[:0]
        n = int(self._lengths([math.prod(dims[1:].tolist())])[0])
        if start + n != flat.size:
            raise ValueError(f"{out}: {flat.size} values where its scalars and its sample make {start + n}")
        return flat[start:]

    def _unpack_copied(self, out: str) -> None:
        """Every copied tensor of pack `out`, each in its shape (a view); of a branch that did not run,
        empty tensors of shape [0, ..., 0], as their own outputs were. Where each lies depends on the
        pack's dims alone (`copied_cuts`, kept per dims)."""
        self._assign(out, self._cuts_of(out))

    def _unpack_stream(self, k: int) -> None:
        """Every member of stream `k` (`branches`): of each graph whose id it holds, cut out in turn; of
        a graph that did not run, empty (a copied tensor of shape [0, ...], a tap's shape and vector [0]).
        Where each lies depends on the ids alone (`stream_cuts`, kept per id sequence)."""
        out = self.layout.streams[k][0]
        self._assign(out, self._cuts_of(out))

    def cuts_of(self, out: str) -> tuple[int, list[tuple]]:
        """(the values' length, (member, start, stop, shape or None) of each member) of copied pack or stream
        `out` in this run, not cut out: the decode sketches small copied tensors as one block
        (`decode._Plan._copied`)."""
        size, pieces, _ = self._cuts_of(out)
        return size, pieces

    def _cuts_of(self, out: str) -> tuple:
        """Where the members of pack or stream `out` lie in this run (`copied_cuts`, `stream_cuts`), kept on
        the layout per (output, dims or ids): a model's runs give each a handful, cut apart in Python once."""
        key = np.asarray(super().__getitem__(self.layout.key_of(out)))
        at = (out, key.tobytes())
        cuts = self.layout.cuts.get(at)
        if cuts is None:
            make = copied_cuts if out in self.layout.copied else stream_cuts
            cuts = make(self.layout, out, key.tolist())
            if len(self.layout.cuts) >= CUTS:
                self.layout.cuts.pop(next(iter(self.layout.cuts)))
            self.layout.cuts[at] = cuts
        return cuts

    def _assign(self, out: str, cuts: tuple) -> None:
        """Each member of `out` as its cuts say, a view of its values (checked against their length)."""
        size, pieces, given = cuts
        flat = np.asarray(super().__getitem__(out))
        if size != flat.size:
            raise ValueError(f"{out}: {flat.size} values where its members make {size}")
        for member, start, stop, shape in pieces:
            v = flat[start:stop]
            self[member] = v if shape is None else v.reshape(shape)
        self.update(given)

    def _lengths(self, numels: list[int]) -> np.ndarray:
        """The sample lengths of tensors of `numels` elements."""
        return sample_lengths(np.array(numels, np.int64), self.layout.sample_size)

    def _sample_lengths(self) -> np.ndarray:
        shapes = self.layout.samples[2]
        return self._lengths([math.prod(self[s][1:].tolist()) for s in shapes])

    def _unpack_samples(self) -> None:
        out, members, _ = self.layout.samples
        ends = np.cumsum(self._sample_lengths()).tolist()
        flat = np.asarray(super().__getitem__(out))
        if ends and ends[-1] != flat.size:
            raise ValueError(f"{out}: {flat.size} values where its members' shapes make {ends[-1]}")
        for member, start, stop in zip(members, [0, *ends[:-1]], ends):
            self[member] = flat[start:stop]


CUTS = 32
"""Cuts a layout keeps (`Unpacked._cuts_of`): per pack or stream, its shapes or branch combinations seen
(silero_vad_v6 at one sample rate gives one)."""


def copied_cuts(layout: PackLayout, out: str, dims: list[int]) -> tuple:
    """Where the copied tensors of pack `out` lie when its dims read `dims` (each member's rank, then its
    dims; none when their branch did not run): as `stream_cuts` gives them."""
    _, members, ranks = layout.copied[out]
    if not dims:
        return 0, [(member, 0, 0, (0,) * rank) for member, rank in zip(members, ranks)], {}
    pieces, at, d = [], 0, 0
    for member in members:
        if d >= len(dims):
            break
        rank = dims[d]
        shape = tuple(dims[d + 1 : d + 1 + rank])
        n = math.prod(shape)
        pieces.append((member, at, at + n, shape))
        at, d = at + n, d + 1 + rank
    if d != len(dims) or len(pieces) != len(members):
        raise ValueError(f"{out}: {len(dims)} dims where its {len(members)} members make {d}")
    return at, pieces, {}


def stream_cuts(layout: PackLayout, out: str, got: list[int]) -> tuple:
    """Where the members of the stream whose values are `out` lie when its ids read `got`: (the values'
    length, (member, start, stop, its shape, None for a vector) per member, {a tap's shape member: its
    dims, read-only}). A member of a graph that did not run is empty: a copied tensor of shape [0, ...], a
    tap's vector and dims [0]."""
    graphs = next(g for values, _, g in layout.streams if values == out)
    ran = [False] * len(graphs)
    records = []  # (member, its record) of the graphs that ran, in order
    d = 0
    while d < len(got):
        g, d = got[d], d + 1
        if not 0 <= g < len(graphs) or ran[g]:
            raise ValueError(f"{out}: graph id {g} where the stream has {len(graphs)} graphs, each once")
        ran[g] = True
        for member in graphs[g]:
            if d >= len(got):
                break
            records.append((member, got[d + 1 : d + 1 + got[d]]))
            d += 1 + got[d]
    if d != len(got) or len(records) != sum(len(graphs[g]) for g, r in enumerate(ran) if r):
        raise ValueError(f"{out}: {len(got)} ids where its members make {d}")
    sampled = [math.prod(r[1:]) for m, r in records if m[0] == "tap" and m[4]]
    lengths = iter(
        sample_lengths(np.array(sampled, np.int64), layout.sample_size).tolist() if sampled else ()
    )
    pieces, given, at = [], {}, 0
    for member, record in records:
        if member[0] == "copied":
            size = math.prod(record)
            pieces.append((member[1], at, at + size, tuple(record)))
        else:
            _, vector, shape, scalars, has_sample = member
            dims = np.array(record, np.int64)
            dims.flags.writeable = False  # one array for every run with these ids
            given[shape] = dims
            size = scalars + (next(lengths) if has_sample else 0)
            pieces.append((vector, at, at + size, None))
        at += size
    none = np.zeros(0, np.int64)
    none.flags.writeable = False
    for g in (g for g, r in enumerate(ran) if not r):
        for member in graphs[g]:
            if member[0] == "copied":
                pieces.append((member[1], 0, 0, (0,) * member[2]))
            else:
                pieces.append((member[1], 0, 0, None))
                given[member[2]] = none
    return at, pieces, given


def unpacked(manifest: Manifest, outputs: Mapping) -> Mapping:
    """`outputs` with the packed members readable by name (as is when nothing is packed, or done)."""
    if not manifest.packed or isinstance(outputs, Unpacked):
        return outputs
    return Unpacked(outputs, manifest.layout)
