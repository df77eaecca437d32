"""Decoding: one run's outputs of an instrumented model -> sketch values per tap -> tidy rows.

A tap whose subgraph did not run (an If branch not taken) returns an empty shape and is left
out. A copied tap (`TapRecord.copied`: a small main-graph tensor) returns the tensor itself; all
of a run's are sketched together on the host (`sketch.batched_references`). A tap inside a Loop
or Scan body comes back once per iteration, stacked on leading axes, and its iterations are
merged with each sketch's own rule (`sketch.merge_parts`). Weight taps (`TapRecord.constant`)
have no outputs: their values come from `host.host_values`, computed once, and follow the graph
they are in (left out when its other taps say it did not run). The rows carry per-site GEMM dims
M, K, N resolved from the run-time shapes.

`decode_taps` + `rows_of` is the plain path, a tap and a chunk at a time; `decode` gives the same
rows bit for bit the fast way (`_Plan` below: 5-10x less host time a batch on many-tap models)."""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from operator import ne
from typing import NamedTuple

import numpy as np

from .. import sketch as sk
from ..errors import OpscopeError
from ..sketch import batched as sk_batched
from .manifest import Manifest, SiteRecord, TapRecord
from .packing import Unpacked, unpacked
from .rows import Coded, RowLayout, Rows

HostValues = dict[str, tuple[dict[str, np.ndarray], list[int]]]  # what host.host_values returns


def decode_tap(
    tap: TapRecord, raw_out: dict[str, np.ndarray], opts: sk.SketchOptions
) -> tuple[dict[str, np.ndarray], list[int] | None]:
    """Sketch values of one tap (merged over Loop/Scan iterations) and its run-time shape.

    Returns ({}, None) when the tap's subgraph did not run (an If branch not taken). Not for
    weight taps (`tap.constant`): they have no outputs, `decode_taps` takes them from the host.
    """
    if tap.constant:
        raise OpscopeError(
            f"tap {tap.id} ({tap.tensor!r}) is a weight: it has no graph outputs to decode",
            hint="its values come from host_values(); decode() and decode_taps() take them as host=",
        )
    if tap.copied:  # the tensor itself: its sketches are the numpy references
        try:
            if not _copied_ran(tap, raw_out):
                return {}, None
            x = np.asarray(raw_out[tap.outputs["tensor"]])
        except KeyError as exc:
            raise OpscopeError(
                f"copied tap {tap.id} ({tap.tensor!r}): {exc.args[0]!r} is not among the run's outputs",
                hint="copied tensors are packed: read the outputs through unpacked(manifest, outputs) "
                "(onnx_opscope.instrument); decode() and decode_taps() do that themselves",
            ) from None
        return sk.references(tap.sketches, x, tap.info(), opts), list(x.shape)
    try:
        parts = _split_iterations(tap, raw_out)
    except KeyError as exc:
        raise OpscopeError(
            f"tap {tap.id} ({tap.tensor!r}): {exc.args[0]!r} is not among the run's outputs",
            hint="a main-graph tap's raws are packed: read the outputs through unpacked(manifest, outputs) "
            "(onnx_opscope.instrument); decode() and decode_taps() do that themselves",
        ) from None
    if not parts:
        return {}, None
    shapes = [raw["shape"][1:].astype(np.int64).tolist() for raw in parts]
    if len(parts) == 1:
        return {name: sk.finalize(name, parts[0], opts) for name in tap.sketches}, shapes[0]
    names = sk.with_sources(tap.sketches)
    values = [{name: sk.finalize(name, raw, opts) for name in names} for raw in parts]
    numels = [math.prod(s) for s in shapes]
    merged = sk.merge_parts(names, values, numels)
    return {name: merged[name] for name in tap.sketches}, shapes[-1]


def _copied_ran(tap: TapRecord, raw_out: dict[str, np.ndarray]) -> bool:
    """Whether a copied tap ran: always in the main graph; in an If branch, the branch not taken returns
    an empty tensor of shape [0, ..., 0] (a tensor that ran with every dim 0 reads the same: it has no
    value to sketch), or, for a scalar or a tensor of unknown rank outside a pack, an empty [1, *shape]
    marker (in a pack, `Unpacked` gives a member of a branch not run as [0, ...] too)."""
    if "shape" in tap.outputs:
        return np.asarray(raw_out[tap.outputs["shape"]]).size > 0
    shape = np.shape(raw_out[tap.outputs["tensor"]])
    return not tap.graph or not shape or any(shape)


def _split_iterations(tap: TapRecord, raw_out: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    arrays = {raw: np.asarray(raw_out[name]) for raw, name in tap.outputs.items() if raw != "slow"}
    if tap.stacked == 0:
        return [] if arrays["shape"].size == 0 else [{k: _raw_values(k, v) for k, v in arrays.items()}]
    parts = []
    lead = arrays["shape"].shape[: tap.stacked]
    for i in np.ndindex(*lead):
        part = {k: _raw_values(k, np.asarray(v[i])) for k, v in arrays.items()}
        if part["shape"].size:
            parts.append(part)
    return parts


def _raw_values(raw: str, v: np.ndarray) -> np.ndarray:
    """A raw output as the host side reads it: float64, but bin indices stay small integers."""
    return v.ravel() if raw == "hidx" else v.astype(np.float64).ravel()


def gemm_dims(site: SiteRecord, shapes: dict[str, list[int]]) -> tuple[int | None, int | None, int | None]:
    """(M, K, N) of a site as an implicit GEMM, from its roles' run-time shapes (None if unknown).

    MatMul-like: lhs [..., M, K] @ rhs [..., K, N], M counts the batch dims too. Gemm honours
    transA/transB. Conv: M = batch x output positions, K = Cin/group x kernel, N = Cout.
    ConvTranspose: M = batch x input positions, K = Cin, N = Cout/group x kernel. LSTM/GRU/RNN:
    M = seq x batch, K = input size, N = gates x hidden.
    """
    op, a = site.op_type, site.attrs
    prod = math.prod  # of Python ints: np.prod costs ~10 us a call, per site and role of every batch
    try:
        if op in ("MatMul", "MatMulInteger", "QLinearMatMul"):
            lhs, rhs = shapes["lhs"], shapes["rhs"]
            m = prod(lhs[:-1]) if len(lhs) > 1 else 1
            return m, lhs[-1], rhs[-1] if len(rhs) > 1 else 1
        if op == "MatMulNBits":  # the packed weight is not tapped: K and N are the node's
            lhs = shapes["lhs"]
            return prod(lhs[:-1]), a.get("K", lhs[-1]), a.get("N")
        if op == "Gemm":
            sa, sb = shapes["a"], shapes["b"]
            m, k = (sa[1], sa[0]) if a.get("transA") else (sa[0], sa[1])
            n = sb[0] if a.get("transB") else sb[1]
            return m, k, n
        if op == "Conv":
            w, y = shapes["weight"], shapes["out"]
            return y[0] * prod(y[2:]), prod(w[1:]), w[0]
        if op == "ConvTranspose":
            x, w = shapes["in"], shapes["weight"]
            return x[0] * prod(x[2:]), w[0], prod(w[1:])
        if op in ("LSTM", "GRU", "RNN"):
            x, w = shapes["x"], shapes["w"]
            return x[0] * x[1], x[2], w[1]
    except (KeyError, IndexError):
        pass
    return None, None, None


def decode_taps(
    manifest: Manifest, outputs: dict[str, np.ndarray], host: HostValues | None = None
) -> dict[str, tuple[dict[str, np.ndarray], list[int] | None]]:
    """tap id -> (sketch values, run-time shape) for one run; ({}, None) for a tap that did not run.

    Taps with graph outputs are decoded from `outputs` (`decode_tap`); constant taps (weights)
    have none and take their values from `host` (`host.host_values`), computed once. A weight
    tap in a subgraph follows the subgraph: ({}, None) when the other taps of its graph, or of
    a graph around it, say it did not run (an If branch not taken, a Loop run zero times). In a
    subgraph where only weights are tapped there is nothing to tell: the weight's values are given.
    """
    const = [t for t in manifest.taps if t.constant]
    if const and host is None:
        raise OpscopeError(
            f"the manifest has {len(const)} weight taps, computed on the host, not in the graph: "
            "pass host=host_values(manifest, model) (onnx_opscope.instrument) to decode",
            hint="host_values reads the weights once from the source or the instrumented model",
        )
    opts = manifest.sketch_options()
    outputs = unpacked(manifest, outputs)
    decoded = {t.id: decode_tap(t, outputs, opts) for t in manifest.taps if not (t.constant or t.copied)}
    copied = [t for t in manifest.taps if t.copied]
    decoded.update({t.id: ({}, None) for t in copied})  # until they are known to have run
    ran = [t for t in copied if _copied_ran(t, outputs)]
    if ran:  # all together: one numpy pass per statistic over every copied tensor of the run
        arrays = [np.asarray(outputs[t.outputs["tensor"]]) for t in ran]
        values = sk.batched_references([t.sketches for t in ran], arrays, [t.info() for t in ran], opts)
        decoded.update({t.id: (v, list(a.shape)) for t, a, v in zip(ran, arrays, values)})
    if not const:
        return decoded
    ran: dict[str, bool] = {}  # graph -> whether its live taps ran (they all run, or none)
    for t in manifest.taps:
        if not t.constant:
            ran[t.graph] = ran.get(t.graph, False) or decoded[t.id][1] is not None
    skipped = [g for g, r in ran.items() if g and not r]
    for t in const:
        if any(t.graph == g or t.graph.startswith(g + "/") for g in skipped):
            decoded[t.id] = ({}, None)
            continue
        if t.id not in host:
            raise OpscopeError(
                f"host values have no entry for weight tap {t.id} ({t.tensor!r})",
                hint="compute them with host_values() for this manifest",
            )
        values, shape = host[t.id]
        decoded[t.id] = ({name: values[name] for name in t.sketches}, list(shape))
    return decoded


def decode(manifest: Manifest, outputs: dict[str, np.ndarray], host: HostValues | None = None) -> Rows:
    """Tidy rows for one run: every (site, role, sketch, element) that ran.

    `host`: the weight taps' values, `host.host_values(manifest, model)` computed once and
    passed to every decode; needed when the manifest has weight taps (`TapRecord.constant`).
    The rows are those of `rows_of(manifest, decode_taps(...))`, built the fast way (`_Plan`).
    """
    return _plan_of(manifest).rows(unpacked(manifest, outputs), host)


def decode_many(
    manifest: Manifest, batches: list[dict[str, np.ndarray]], host: HostValues | None = None
) -> list[Rows]:
    """`decode` of several runs, in order: the same rows, the small copied tensors of all of them
    sketched together (what `record` does with the batches that pile up while it decodes)."""
    return _plan_of(manifest).rows_group([unpacked(manifest, b) for b in batches], host)


def rows_of(manifest: Manifest, decoded: dict[str, tuple[dict[str, np.ndarray], list[int] | None]]) -> Rows:
    """The tidy rows of `decode_taps`'s values, chunk by chunk: the plain path `decode` takes a faster
    way to, and the reference it is held to (tests/test_decode_plan.py)."""
    rows = Rows()
    for site in manifest.sites:
        shapes = {
            role: decoded[tid][1]
            for role, tid in {**site.shape_roles, **site.roles}.items()
            if decoded[tid][1] is not None
        }
        m, k, n = gemm_dims(site, shapes)
        for role, tid in site.roles.items():
            values, shape = decoded[tid]
            if shape is None:
                continue
            numel = math.prod(shape)
            for stat, vals in values.items():
                rows.add((site.id, site.op_type, role, stat, numel, m, k, n), vals)
    return rows


# --------------------------------------------------------------------------------------------
# the fast way: a plan per manifest, a row layout per set of run-time shapes
#
# `rows_of(decode_taps(...))` spends ~70 µs of Python per tap and batch (a dict per tap, a finalize
# call and a chunk per (site, role, stat), a label tuple per chunk): 30 ms a batch on 256 taps of
# a 0.15 ms model. Here what depends on the manifest only is worked out once (`_Plan`: which taps
# are copied, in the graph or weights; the sketches finalized for many taps at once), what depends
# on the run-time shapes once per shapes (`_Layout`: the chunks, their label and GEMM columns, and
# where each chunk's values lie), and a batch is a few numpy calls per sketch over all its taps
# (`sketch.batched`), one concatenation and one gather into the value column.

Group = tuple[str, list[int], np.ndarray]  # (sketch, tap indices, values per tap): one piece of the pool


class _Layout:
    """The rows of one set of run-time shapes: their `RowLayout`, and the value column's positions in
    the batch's pool of values."""

    def __init__(self, layout: RowLayout, gather: np.ndarray):
        self.layout, self.gather = layout, gather


class _Weights(NamedTuple):
    """The weight taps' values for one `host` and set of graphs that did not run, as one pool piece."""

    host: HostValues
    skipped: tuple[str, ...]
    pool: np.ndarray
    where: dict[tuple[int, str], tuple[int, int]]  # (tap index, sketch) -> (start in pool, count)
    shapes: dict[int, tuple]
    serial: int  # which one: part of a layout's key


class _Piece(NamedTuple):
    """One site's chunks at one set of shapes: tap index and sketch code per chunk (where its values
    lie), and its row labels as `Coded` arrays (codes, ints, missing)."""

    taps: np.ndarray
    stats: np.ndarray
    codes: np.ndarray
    ints: np.ndarray
    missing: np.ndarray


class _Chunks(NamedTuple):
    """What a site's chunks are while the same roles ran and its copied taps stayed small or big: tap
    index, sketch code and label codes per chunk, and which of the roles that ran each chunk is of."""

    taps: np.ndarray
    stats: np.ndarray
    codes: np.ndarray
    role: np.ndarray


class _Labels:
    """The distinct site, op_type, role and stat labels seen, each with its code. State is real (they
    grow as pieces are made), hence a class."""

    def __init__(self) -> None:
        self.values: tuple[list[str], list[str], list[str], list[str]] = ([], [], [], [])  # codes index these
        self._codes: tuple[dict[str, int], ...] = ({}, {}, {}, {})

    def code(self, j: int, label: str) -> int:
        c = self._codes[j].get(label)
        if c is None:
            c = self._codes[j][label] = len(self.values[j])
            self.values[j].append(label)
        return c


@dataclass
class _Batch:
    """One run on its way to rows: its taps' shapes, the pool's pieces so far (`Group`s and values), its
    small copied tensors (tap indices and arrays), whose segmented groups `rows_group` adds last, and its
    copied tensors' other sketches (tap index, names, array), which `rows_group` computes for all runs."""

    shapes: list[tuple | None]
    groups: list[Group]
    pieces: list[np.ndarray]
    small: list[int]
    arrays: list[np.ndarray]
    rest: list[tuple[int, list[str], np.ndarray]]


class _Plan:
    """Decoding of one manifest's outputs, its manifest-only work done once. State is real (the
    layouts and the weight values seen so far), hence a class."""

    LAYOUTS = 4  # row layouts kept (distinct run-time shapes, e.g. sequence lengths; each ~MBs of labels)

    def __init__(self, manifest: Manifest):
        self.manifest = weakref.ref(manifest)
        self.fingerprint = _fingerprint(manifest)
        self.opts = o = manifest.sketch_options()
        self.taps = taps = list(manifest.taps)
        self.index = {t.id: i for i, t in enumerate(taps)}
        self.copied = [i for i, t in enumerate(taps) if t.copied]
        self.in_graph = [i for i, t in enumerate(taps) if not (t.constant or t.copied) and t.stacked == 0]
        self.looped = [i for i, t in enumerate(taps) if not (t.constant or t.copied) and t.stacked]
        self.const = [i for i, t in enumerate(taps) if t.constant]
        self.branch_taps = [(i, t.graph) for i, t in enumerate(taps) if t.graph and not t.constant]
        self.branch_graphs = list(dict.fromkeys(g for _, g in self.branch_taps))
        self.wanted = {n for i in self.copied for n in taps[i].sketches}
        # per copied tap, as `_copied_ran` reads it: (index, its tensor's output, an output empty when it did
        # not run or None, whether a tensor with every dim 0 says so too). A packed tap's is its pack's shapes,
        # empty when its branch did not run: its members are then not cut out of the pack at all
        packs = manifest.layout if manifest.packed else None
        self.copied_io = []
        # a copied pack's or a stream's values -> its copied members' entries, in its order
        blocks: dict[str, list] = {}
        for i in self.copied:
            t = taps[i]
            pack = packs.copied_in.get(t.outputs["tensor"]) if packs is not None else None
            marker = t.outputs.get("shape") or (packs.copied[pack][0] if pack is not None else None)
            io = (i, t.outputs["tensor"], marker, bool(t.graph) and "shape" not in t.outputs)
            k = packs.stream_of.get(t.outputs["tensor"]) if packs is not None and pack is None else None
            source = pack if pack is not None else packs.streams[k][0] if k is not None else None
            (self.copied_io if source is None else blocks.setdefault(source, [])).append(io)
        # per copied pack and stream: (its values, its shapes or ids: empty when it did not run, its copied
        # members' entries in its order)
        self.copied_blocks = [(out, packs.key_of(out), ios) for out, ios in blocks.items()]
        self.blocks: dict[tuple[str, bytes], tuple] = {}  # (values, the bytes of its dims or ids) -> `_block`
        self.infos = {i: taps[i].info() for i in self.copied}
        # per copied tap, its sketches with no segmented form: listed once, not every batch (~2 µs a tap)
        self.unsegmented = {
            i: [n for n in taps[i].sketches if n not in sk_batched.SEGMENTED] for i in self.copied
        }
        fast = sk_batched.stacked_names(o)
        by_names: dict[tuple[str, ...], list[int]] = {}  # in-graph taps with the same fast sketches
        for j, i in enumerate(self.in_graph):
            by_names.setdefault(tuple(n for n in taps[i].sketches if n in fast), []).append(j)
        self.fast_groups = [(names, np.array(js, np.int64)) for names, js in by_names.items() if names]
        self.slow = [[n for n in taps[i].sketches if n not in fast] for i in self.in_graph]
        self.layouts: dict[tuple, _Layout] = {}
        # per site: (role, tap index) of its shape and sketched roles, and its chunks at the last shapes seen
        self.site_taps = [
            [(role, self.index[tid]) for role, tid in {**s.shape_roles, **s.roles}.items()]
            for s in manifest.sites
        ]
        self.pieces: dict[int, tuple[tuple, _Piece]] = {}
        # per tap: the sites it gives a shape or values to (a tap whose shapes changed remakes their pieces)
        self.tap_sites: list[list[int]] = [[] for _ in taps]
        for k, pairs in enumerate(self.site_taps):
            for _, i in pairs:
                self.tap_sites[i].append(k)
        self.last_shapes: list[tuple | None] | None = None  # of the last layout made
        self.labels = _Labels()
        self.role_taps = [[(role, self.index[tid]) for role, tid in s.roles.items()] for s in manifest.sites]
        self.chunks: dict[tuple[int, tuple], _Chunks] = {}  # (site, which roles ran and how) -> its chunks
        self.stat_code = {name: c for c, name in enumerate(sorted({n for t in taps for n in t.sketches}))}
        self.cells: tuple[int, tuple[np.ndarray, ...]] | None = None  # the weights' cells, by serial
        self.weights: _Weights | None = None

    def rows(self, outputs: dict[str, np.ndarray], host: HostValues | None) -> Rows:
        return self.rows_group([outputs], host)[0]

    def rows_group(self, batches: list[dict[str, np.ndarray]], host: HostValues | None) -> list[Rows]:
        """The rows of several runs' outputs: each as `rows` makes it, but the small copied tensors of all
        of them sketched in one segmented pass (its fixed cost, ~50 µs, once a group)."""
        if self.const and host is None:
            decode_taps(self.manifest(), batches[0], host)  # raises its error
        states = [self._start(outputs) for outputs in batches]
        rest = [r for st in states for r in st.rest]
        if rest:  # per shape, the runs' tensors stacked together: silero_vad_v6's 26 per run, 8 shapes
            infos = [self.infos[i] for i, _, _ in rest]
            got = iter(
                sk.grouped_references([n for _, n, _ in rest], [a for _, _, a in rest], infos, self.opts)
            )
            for st in states:
                _add_by_stat(st, [(i, next(got)) for i, _, _ in st.rest])
        arrays = [a for st in states for a in st.arrays]
        if arrays:
            flat = sk_batched.segmented_flat(arrays, self.wanted, self.opts)
            ends = {stat: np.concatenate([[0], np.cumsum(counts)]) for stat, (_, counts) in flat.items()}
            first = 0
            for st in states:
                last = first + len(st.small)
                if st.small:
                    for stat, (values, counts) in flat.items():
                        st.groups.append((stat, st.small, counts[first:last]))
                        st.pieces.append(values[ends[stat][first] : ends[stat][last]])
                first = last
        return [self._finish(st, host) for st in states]

    def _start(self, outputs: dict[str, np.ndarray]) -> _Batch:
        """A run's values but for its small copied tensors' segmented sketches (`rows_group` adds them)."""
        taps, o = self.taps, self.opts
        st = _Batch([None] * len(taps), [], [], [], [], [])

        def one(values: list[tuple[int, dict[str, np.ndarray]]]) -> None:
            _add_by_stat(st, values)

        self._copied(outputs, st)
        self._in_graph(outputs, st.shapes, st.groups, st.pieces, one)
        looped = []
        for i in self.looped:
            values, shape = decode_tap(taps[i], outputs, o)
            if shape is not None:
                st.shapes[i] = tuple(shape)
                looped.append((i, values))
        one(looped)
        return st

    def _finish(self, st: _Batch, host: HostValues | None) -> Rows:
        shapes, groups, pieces = st.shapes, st.groups, st.pieces
        weights = self._weights(shapes, host) if self.const else None
        if weights is not None:
            pieces.append(weights.pool)
        serial = None if weights is None else weights.serial
        key = (tuple(shapes), b"".join(c.tobytes() for _, _, c in groups), serial)
        layout = self.layouts.get(key)
        if layout is None:
            layout = self._layout(shapes, groups, weights)
            if len(self.layouts) >= self.LAYOUTS:
                self.layouts.pop(next(iter(self.layouts)))
            self.layouts[key] = layout
        pool = np.concatenate(pieces) if pieces else np.zeros(0)
        return Rows.of_layout(layout.layout, pool[layout.gather])

    def _copied(self, outputs, st: _Batch) -> None:
        """The copied taps that ran: the small ones kept for the segmented pass, their other sketches (and a
        larger one's) for `rows_group` to compute through `sketch.grouped_references`. The copied tensors of
        a pack or an `If` stream that are all small go to the segmented pass as one block of values (a
        pack's as it is, a stream's gathered), never cut into one array each."""
        for out, key, ios in self.copied_blocks:
            ids = np.asarray(outputs[key])
            if not ids.size:  # a pack whose branch did not run, a stream of no branch
                continue
            size, gather, sizes, at, small, rest = self._block(outputs, out, ids, ios)
            if sizes is None:  # a member too big, or empty: each on its own
                self._copied_one_by_one(outputs, st, ios)
                continue
            flat = np.asarray(outputs[out])
            if flat.size != size:
                raise ValueError(f"{out}: {flat.size} values where its members make {size}")
            for i, shape in at:
                st.shapes[i] = shape
            if small:
                st.small.extend(small)
                st.arrays.append((flat if gather is None else flat[gather], sizes))
            for i, start, stop, shape, names in rest:  # their sketches with no segmented form
                st.rest.append((i, names, flat[start:stop].reshape(shape)))
        self._copied_one_by_one(outputs, st, self.copied_io)

    def _block(self, outputs, out: str, ids: np.ndarray, ios: list) -> tuple:
        """The copied members of pack or stream `out` when its dims or ids read `ids`, worked out once per
        ids: (its values' length, the positions of its members' values when they are not all of them (a
        stream) else None, their sizes (None: a member that ran is empty or larger than a sample, so each
        goes on its own), (tap index, shape) of each member that ran, their tap indices, (tap index, start,
        stop, shape, sketches) of those with sketches the segmented pass has no form for)."""
        key = (out, ids.tobytes())
        got = self.blocks.get(key)
        if got is None:
            size, pieces = outputs.cuts_of(out)
            where = {member: (start, stop, shape) for member, start, stop, shape in pieces}
            ran = []
            for i, tensor, _, by_dims in ios:  # as `_copied_one_by_one` reads them
                start, stop, shape = where[tensor]
                if not (by_dims and shape and not any(shape)):
                    ran.append((i, start, stop, shape))
            starts = np.array([start for _, start, _, _ in ran], np.int64)
            sizes = np.array([stop - start for _, start, stop, _ in ran], np.int64)
            small = bool(((sizes > 0) & (sizes <= self.opts.sample_size)).all())
            laid = np.cumsum(sizes) - sizes  # where each would start were they all of the values, in order
            gather = None  # they are: the values as they are
            if not (np.array_equal(starts, laid) and sizes.sum() == size):
                gather = np.arange(sizes.sum()) + np.repeat(starts - laid, sizes)
            rest = [
                (i, start, stop, shape, self.unsegmented[i])
                for i, start, stop, shape in ran
                if self.unsegmented[i]
            ]
            got = (
                size,
                gather,
                sizes if small else None,
                [(i, shape) for i, _, _, shape in ran],
                [i for i, *_ in ran],
                rest,
            )
            if len(self.blocks) >= 4 * len(self.copied_blocks):
                self.blocks.pop(next(iter(self.blocks)))
            self.blocks[key] = got
        return got

    def _copied_one_by_one(self, outputs, st: _Batch, ios: list) -> None:
        """The copied taps of `ios` that ran, each its own array (`_copied`)."""
        most, unsegmented, taps, shapes = self.opts.sample_size, self.unsegmented, self.taps, st.shapes
        ran: dict[str, bool] = {}  # a pack's shapes: one marker for all its members
        for i, tensor, marker, by_dims in ios:  # `_copied_ran`, its names looked up once
            if marker is not None:
                went = ran.get(marker)
                if went is None:
                    went = ran[marker] = np.asarray(outputs[marker]).size > 0
                if not went:
                    continue
            a = outputs[tensor]
            if by_dims and a.ndim and not any(a.shape):
                continue
            shapes[i] = a.shape
            if 0 < a.size <= most:
                st.small.append(i)
                st.arrays.append(a)
                names = unsegmented[i]
            else:
                names = taps[i].sketches
            if names:
                st.rest.append((i, names, a))

    def _in_graph(self, outputs, shapes, groups, pieces, one) -> None:
        """The in-graph taps that ran: the hot sketches finalized for all of them at once (`STACKED`)."""
        taps, o = self.taps, self.opts
        ran = np.zeros(len(self.in_graph), bool)
        for j, i in enumerate(self.in_graph):
            s = np.asarray(outputs[taps[i].outputs["shape"]])
            if s.size:
                ran[j] = True
                shapes[i] = tuple(s.ravel()[1:].astype(np.int64).tolist())
        if not ran.any():
            return
        for names, js in self.fast_groups:
            idx = [self.in_graph[j] for j in js[ran[js]].tolist()]
            if not idx:
                continue
            stacked = _stacked_raws(taps, idx, names, outputs, shapes)
            if stacked is None:  # a raw of an unexpected shape: one by one, as finalize does
                raws = [(i, _Raws(taps[i], outputs)) for i in idx]
                one([(i, {n: sk.finalize(n, raw, o) for n in names}) for i, raw in raws])
                continue
            for name in names:
                got = sk_batched.STACKED[name][1](stacked, o)
                values, counts = got if isinstance(got, tuple) else (got, np.ones(len(idx), np.int64))
                groups.append((name, idx, counts))
                pieces.append(np.asarray(values, np.float64))
        rest = []
        for j in np.flatnonzero(ran).tolist():
            if self.slow[j]:
                i = self.in_graph[j]
                raw = _Raws(taps[i], outputs)
                rest.append((i, {n: sk.finalize(n, raw, o) for n in self.slow[j]}))
        one(rest)

    def _weights(self, shapes: list[tuple | None], host: HostValues) -> _Weights:
        """The weight taps' values, as `decode_taps` gives them: one pool piece, kept while `host` and the
        graphs that did not run stay the same."""
        taps = self.taps
        ran = {graph for i, graph in self.branch_taps if shapes[i] is not None}
        skipped = tuple(g for g in self.branch_graphs if g not in ran)
        w = self.weights
        if w is not None and w.host is host and w.skipped == skipped:
            return w
        where: dict[tuple[int, str], tuple[int, int]] = {}
        weight_shapes: dict[int, tuple] = {}
        values, at = [], 0
        for i in self.const:
            t = taps[i]
            if any(t.graph == g or t.graph.startswith(g + "/") for g in skipped):
                continue
            if t.id not in host:
                raise OpscopeError(
                    f"host values have no entry for weight tap {t.id} ({t.tensor!r})",
                    hint="compute them with host_values() for this manifest",
                )
            got, shape = host[t.id]
            weight_shapes[i] = tuple(shape)
            for name in t.sketches:
                v = np.asarray(got[name], np.float64).ravel()
                where[(i, name)] = (at, v.size)
                values.append(v)
                at += v.size
        pool = np.concatenate(values) if values else np.zeros(0)
        serial = w.serial + 1 if w is not None else 0
        self.weights = _Weights(host, skipped, pool, where, weight_shapes, serial)
        return self.weights

    def _layout(self, shapes: list[tuple | None], groups: list[Group], weights: _Weights | None) -> _Layout:
        """Chunks in `rows_of`'s order for these shapes and value counts, and where their values lie:
        each site's chunks come from `_piece` (kept while its shapes are), their start and count in the
        pool from two [tap, sketch] tables, so a step whose attention rows grew costs no Python per chunk."""
        code = self.stat_code
        start = np.zeros((len(self.taps), len(code)), np.int64)
        count = np.zeros_like(start)
        at = 0
        if groups:  # every group's cells at once: ~300 groups a decode step, most of them one tap's
            counts = np.concatenate([c for _, _, c in groups])
            cells = (np.fromiter(itertools.chain.from_iterable(idx for _, idx, _ in groups), np.int64, len(counts)),
                     np.repeat([code[stat] for stat, _, _ in groups], [len(idx) for _, idx, _ in groups]))  # fmt: skip
            start[cells] = np.cumsum(counts) - counts
            count[cells] = counts
            at = int(counts.sum())
        if weights is not None:
            wi, wk, ws, wc = self._weight_cells(weights)
            start[wi, wk], count[wi, wk] = ws + at, wc
            shapes = [weights.shapes.get(i, s) for i, s in enumerate(shapes)]
        sites = self.manifest().sites
        last, self.last_shapes = self.last_shapes, shapes
        if last is None or len(last) != len(shapes):
            redo = range(len(sites))
        else:  # only the sites of taps whose shapes changed (a decode step: the attention's few)
            redo = sorted(
                {
                    k
                    for i in itertools.compress(range(len(shapes)), map(ne, shapes, last))
                    for k in self.tap_sites[i]
                }
            )
        for k in redo:
            key = tuple(shapes[i] for _, i in self.site_taps[k])
            hit = self.pieces.get(k)
            if hit is None or hit[0] != key:
                self.pieces[k] = (key, self._piece(sites[k], k, shapes))
        pieces = [self.pieces[k][1] for k in range(len(sites))]

        def joined(field: str) -> np.ndarray:
            return np.concatenate([getattr(p, field) for p in pieces])

        if not pieces or not sum(len(p.taps) for p in pieces):
            return _Layout(RowLayout([], np.zeros(0, np.int64)), np.zeros(0, np.int64))
        cell = joined("taps"), joined("stats")
        c, s = count[cell], start[cell]
        keep = c > 0
        c, s = c[keep], s[keep]
        offsets = np.cumsum(c) - c
        gather = np.arange(int(c.sum()), dtype=np.int64) + np.repeat(s - offsets, c)
        coded = Coded(
            self.labels.values, joined("codes")[keep], joined("ints")[keep], joined("missing")[keep]
        )
        return _Layout(RowLayout(None, c, coded), gather)

    def _weight_cells(self, weights: _Weights) -> tuple[np.ndarray, ...]:
        """The weight taps' (tap, sketch, start, count) cells as arrays, once per `_Weights`."""
        if self.cells is None or self.cells[0] != weights.serial:
            cells = [(i, self.stat_code[name], s, c) for (i, name), (s, c) in weights.where.items()]
            arrays = (
                tuple(np.array(col, np.int64) for col in zip(*cells))
                if cells
                else (np.zeros(0, np.int64),) * 4
            )
            self.cells = (weights.serial, arrays)
        return self.cells[1]

    def _piece(self, site: SiteRecord, k: int, shapes: list[tuple | None]) -> _Piece:
        """One site's chunks at these shapes. The same while its taps' shapes are (a decode step's
        projections keep theirs while the attention rows grow); where only sizes changed, the chunks
        (`_Chunks`) are kept and only the M, K, N and numel columns are made anew."""
        taps, o = self.taps, self.opts
        dims = {role: list(shapes[i]) for role, i in self.site_taps[k] if shapes[i] is not None}
        m, kk, n = gemm_dims(site, dims)
        numels, how = [], []
        for _, i in self.role_taps[k]:
            if shapes[i] is None:
                how.append(0)
                continue
            numel = math.prod(shapes[i])
            numels.append(numel)
            how.append(2 if taps[i].copied and 0 < numel <= o.sample_size else 1)
        chunks = self.chunks.get((k, tuple(how)))
        if chunks is None:
            chunks = self.chunks[(k, tuple(how))] = self._chunks(site, k, how)
        rows = len(chunks.taps)
        ints = np.empty((rows, 4), np.int64)  # M, K, N, numel: `Coded`'s order
        missing = np.zeros((rows, 4), bool)
        for j, v in enumerate((m, kk, n)):
            ints[:, j] = 0 if v is None else v
            missing[:, j] = v is None
        ints[:, 3] = np.array(numels, np.int64)[chunks.role] if rows else 0
        return _Piece(chunks.taps, chunks.stats, chunks.codes, ints, missing)

    def _chunks(self, site: SiteRecord, k: int, how: list[int]) -> _Chunks:
        """A site's chunks in `rows_of`'s order, `how` saying per role whether it ran (0 not) and whether
        its values come in `decode_taps`' order for a small copied tap (2) or its sketches' (1)."""
        taps, lab = self.taps, self.labels
        tap_of, stat_of, codes, role_of = [], [], [], []
        ran = 0
        for (role, i), h in zip(self.role_taps[k], how):
            if not h:
                continue
            stats = list(taps[i].sketches)
            if h == 2:  # the order decode_taps gives the values in
                seg = sk_batched.SEGMENTED
                stats = [x for x in stats if x in seg] + [x for x in stats if x not in seg]
            for stat in stats:
                tap_of.append(i)
                stat_of.append(self.stat_code[stat])
                codes.append(
                    [lab.code(0, site.id), lab.code(1, site.op_type), lab.code(2, role), lab.code(3, stat)]
                )
                role_of.append(ran)
            ran += 1
        return _Chunks(np.array(tap_of, np.int64), np.array(stat_of, np.int64),
                       np.array(codes, np.int64).reshape(-1, 4), np.array(role_of, np.int64))  # fmt: skip


def _add_by_stat(st: _Batch, values: list[tuple[int, dict[str, np.ndarray]]]) -> None:
    """The values of taps (tap index, sketch -> values) as one group and one pool piece per sketch: a
    group per tap and sketch made the layout key and `_layout` cost per group (~1,600 a batch for
    captcha_crnn's 162 copied taps with `--sketch all`)."""
    by: dict[str, tuple[list[int], list[int], list[np.ndarray]]] = {}
    for i, got in values:
        for stat, v in got.items():
            v = np.asarray(v, np.float64).ravel()
            idx, counts, pieces = by.setdefault(stat, ([], [], []))
            idx.append(i)
            counts.append(v.size)
            pieces.append(v)
    for stat, (idx, counts, pieces) in by.items():
        st.groups.append((stat, idx, np.array(counts, np.int64)))
        st.pieces.append(pieces[0] if len(pieces) == 1 else np.concatenate(pieces))


def _fingerprint(manifest: Manifest) -> tuple:
    return id(manifest.taps), len(manifest.taps), id(manifest.sites), len(manifest.sites), manifest.options


_PLANS: dict[int, _Plan] = {}


def _plan_of(manifest: Manifest) -> _Plan:
    """The manifest's plan, made on its first decode (a manifest whose tap or site list was replaced or
    resized since gets a new one)."""
    plan = _PLANS.get(id(manifest))
    if plan is None or plan.manifest() is not manifest or plan.fingerprint != _fingerprint(manifest):
        plan = _PLANS[id(manifest)] = _Plan(manifest)
        weakref.finalize(manifest, _PLANS.pop, id(manifest), None)
    return plan


class _Raws(dict):
    """A tap's raws as a finalize reads them (`_raw_values`), each one read out of the outputs when first
    asked for: the sketches finalized tap by tap read a few of a tap's dozen raws (ppocrv4_det's
    `--sketch all`: chan_abs, pos, adj and ynorm of 13), and a packed raw costs a slice to read."""

    def __init__(self, tap: TapRecord, outputs: dict[str, np.ndarray]):
        super().__init__()
        self.names, self.outputs = tap.outputs, outputs

    def __missing__(self, raw: str) -> np.ndarray:
        if raw == "slow" or raw not in self.names:  # the masking vector is read through `Unpacked`
            raise KeyError(raw)
        v = self[raw] = _raw_values(raw, np.asarray(self.outputs[self.names[raw]]))
        return v


def _stacked_raws(
    taps: list[TapRecord], idx: list[int], names: tuple[str, ...], outputs: dict, shapes: list
) -> dict | None:
    """The raws `names` read, of the taps `idx`: scalars as [T] float64, samples as (values as made, counts),
    the other vectors (`batched.VECTOR_RAWS`) as (float64 values, counts); None when a scalar raw is not
    one value per tap."""
    need = {r for n in names for r in sk_batched.STACKED[n][0]}
    got: dict = {"numel": np.array([math.prod(shapes[i]) for i in idx], np.float64)}
    for raw in need:
        if any(raw not in taps[i].outputs for i in idx):
            return None
        if isinstance(outputs, Unpacked):  # packed: one gather, or the samples pack as it is
            members = [taps[i].outputs[raw] for i in idx]
            got[raw] = outputs.samples(members) if raw == "samples" else outputs.scalars(members)
            if got[raw] is not None:
                continue
        arrays = [outputs[taps[i].outputs[raw]] for i in idx]
        if raw == "samples" or raw in sk_batched.VECTOR_RAWS:  # one after another, and their lengths
            flat = [np.asarray(a).ravel() for a in arrays]
            values = np.concatenate(flat)  # samples in float32 as made: the histogram bins them so
            got[raw] = (
                values if raw == "samples" else values.astype(np.float64),
                np.array([a.size for a in flat], np.int64),
            )
            continue
        try:
            v = np.array(arrays, np.float64)
        except ValueError:  # ragged
            return None
        if v.size != len(idx):
            return None
        got[raw] = v.ravel()
    return got


def tap_samples(manifest: Manifest, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """tap id -> the tensor's sample as flat float64, for the taps of one run that have one and ran: the
    raw `samples` of an in-graph tap (Loop/Scan iterations one after another), the `histogram.sample_positions`
    of a copied tensor (the whole tensor when it is small). `histogram.elemsig_of` of it is the table's
    elemsig (but for Loop/Scan taps, whose elemsig merges the iterations'). Weights have none: they do
    not change between runs. What online sketches (`record(online=True)`) read; `decode` is untouched."""
    opts = manifest.sketch_options()
    outputs = unpacked(manifest, outputs)
    out: dict[str, np.ndarray] = {}
    for t in manifest.taps:
        if t.constant:
            continue
        if t.copied:
            if _copied_ran(t, outputs):
                flat = np.asarray(outputs[t.outputs["tensor"]]).ravel()
                if flat.size:
                    out[t.id] = flat[sk.sample_positions(flat.size, opts.sample_size)].astype(np.float64)
            continue
        if "samples" not in t.outputs:
            continue
        if t.stacked == 0:
            if np.asarray(outputs[t.outputs["shape"]]).size:
                out[t.id] = _raw_values("samples", np.asarray(outputs[t.outputs["samples"]]))
            continue
        parts = [p["samples"] for p in _split_iterations(t, outputs)]
        if parts:
            out[t.id] = np.concatenate(parts)
    return out
