"""Static cost analysis: where the work of a model goes, without running it.

`analyze(model)` infers every shape (`shapes.py`), prices every node (`opcosts.py` has the
FLOP formulas), splits its memory traffic into weights, graph I/O and intermediates, places
it on a roofline (`roofline.py`) and rolls the nodes up by op kind, GEMM shape, traffic
class, boundedness and fusion. Nothing is executed and external weights are never read:
initializer dims and dtypes are in the protobuf.

Bytes: an op reads each input once and writes each output once, dtype-aware (4-bit types
count half a byte). Inputs that are initializers or Constant outputs are "weights"; reads
of the top graph's inputs and writes of its outputs are "graph I/O"; everything else is an
intermediate an optimizer could keep on chip by fusing producer and consumer. Gather and
Slice read only what they return (plus their indices); views (Reshape, Squeeze, Identity,
Shape, Constant, ...) move nothing.

Symbols: a dim that stays symbolic (`batch`, `seq`) makes costs polynomials
(`symbolic.Poly`) that `Report.evaluate({"batch": 4})` turns into numbers; a dim nothing
is known about makes the cost None ("unknown"). Neither is ever read as 0.

Subgraphs: If reports both branches and counts the one its condition selects when the
condition is a constant (shape tests often are), else the one with more FLOPs (compared
with symbols set to 64 when they are still symbolic); the other branch's rows have
counted = False. Loop bodies are multiplied by a constant trip count (`repeat`), otherwise counted
once and noted "per-iteration". Scan bodies are multiplied by the scanned axis length.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from onnx import ModelProto, NodeProto

from ..files import write_document
from ..graph.index import GraphEntry, ModelIndex
from ..graph.io import ModelLike, file_sha256, load_model, model_sha256
from ..graph.proto import attr as get_attr
from ..shapes import Dim, ShapeTable, dtype_size, infer_shapes
from ..shapes.rules import shape_key
from ..shapes.symbolic import Poly, add_all, evaluate, prod, to_number, to_text
from ..shapes.symbolic import add as _add
from .opcosts import ATTRIBUTE_FREE, CONTROL_FLOW, FORMULAS, PARTIAL_READS, VIEWS, Gemm, op_count
from .roofline import Device, classify, est_time, get_device, intensity

if TYPE_CHECKING:  # they bring onnxruntime, which the static analysis does not need
    from ..run.session import RuntimeConfig
    from .bandwidth import Measured
    from .profile import NodeProfile

_RANK_SYMBOL_VALUE = 64  # symbols still free are set to this only to compare If branches


@dataclass(slots=True)
class OpCost:
    """One node's cost. Dim fields are numbers, `Poly` expressions in symbols, or None (unknown).

    `flops` and the byte fields already include `repeat` (a Loop trip count or Scan length).
    """

    node: str  # the node id of the model index (a site id is the same id)
    op_type: str
    domain: str
    graph: str  # subgraph path ("" for the main graph), as the model index writes it
    flops: Dim
    bytes_read: Dim  # activations read (inputs that are not weights)
    bytes_weights: Dim  # initializer / Constant inputs read
    bytes_written: Dim
    bytes_io: Dim  # the part of read + written that is top-graph input or output
    bytes_intermediate: Dim  # the rest of read + written activations: fusible
    fusion_saved_bytes: Dim = 0  # fused contrib ops: traffic the unfused chain would add
    gemms: tuple[Gemm, ...] = ()
    repeat: Dim = 1
    counted: bool = True
    modelled: bool = True
    note: str = ""
    intensity: float | None = None
    roofline: str = "unknown"
    est_time_s: float | None = None

    @property
    def bytes_total(self) -> Dim:
        return _add(self.bytes_read, self.bytes_weights, self.bytes_written)


@dataclass
class Report:
    """The result of `analyze`: per-node records plus roll-ups, ready to print or save."""

    model: str
    device: Device
    records: list[OpCost]
    symbols: dict[str, str]  # unresolved input symbols -> where they appear
    shape_sources: dict[str, str]
    notes: list[str] = field(default_factory=list)
    weights_unique_bytes: Dim = 0
    params: Dim = 0
    profile: dict[str, float] | None = None  # op kind -> measured seconds per run (analyze(profile=True))
    node_profile: NodeProfile | None = None  # the measured time per node behind `profile`
    totals: dict = field(default_factory=dict)
    by_op: list[dict] = field(default_factory=list)
    gemm_shapes: list[dict] = field(default_factory=list)
    traffic: dict = field(default_factory=dict)
    boundedness: dict = field(default_factory=dict)
    fusion: list[dict] = field(default_factory=list)
    unmodelled: dict[str, int] = field(default_factory=dict)
    model_sha256: str = ""  # of the model file (of the serialised proto when analyzed in memory)

    @property
    def ridge(self) -> float:
        return self.device.ridge

    def evaluate(self, values: Mapping[str, int]) -> Report:
        """The same report with symbols replaced by `values` (no re-inference)."""
        recs = [_evaluate_record(r, values) for r in self.records]
        syms = {k: v for k, v in self.symbols.items() if k not in values}
        out = replace(self, records=recs, symbols=syms, notes=list(self.notes))
        out.weights_unique_bytes = evaluate(self.weights_unique_bytes, values)
        return roll_up(out)

    def to_records(self) -> list[dict]:
        """One flat dict per node: numbers as floats (None when unknown or symbolic), plus *_expr text."""
        return [_record_dict(r) for r in self.records]

    def to_arrow(self):
        """The per-node table as a pyarrow Table (roll-ups in the schema metadata as JSON)."""
        import pyarrow as pa

        rows = self.to_records()
        table = pa.Table.from_pylist(rows, schema=_arrow_schema()) if rows else _arrow_schema().empty_table()
        # every row names the model it prices, so a CSV (which keeps no metadata) still says it
        sha = pa.array([self.model_sha256] * table.num_rows, pa.string())
        table = table.append_column("model_sha256", sha)
        meta = {b"opscope.rollups": json.dumps(self.rollups_dict(), default=_json_default).encode()}
        return table.replace_schema_metadata(meta)

    def to_pandas(self):
        """The per-node table as a pandas DataFrame (pandas must be installed)."""
        return self.to_arrow().to_pandas()

    def rollups_dict(self) -> dict:
        return {
            "totals": self.totals,
            "by_op": self.by_op,
            "gemm_shapes": self.gemm_shapes,
            "traffic": self.traffic,
            "boundedness": self.boundedness,
            "fusion": self.fusion,
            "unmodelled": self.unmodelled,
        }

    def to_dict(self) -> dict:
        """Everything as one JSON-ready dict: model, device, records and roll-ups."""
        return {
            "model": self.model,
            "model_sha256": self.model_sha256,
            "device": {
                "name": self.device.name,
                "peak_flops": self.device.peak_flops,
                "bandwidth": self.device.bandwidth,
                "ridge": self.ridge,
                "dtype": self.device.dtype,
                "source": self.device.source,
            },
            "symbols": self.symbols,
            "shape_sources": self.shape_sources,
            "notes": self.notes,
            "records": self.to_records(),
            **self.rollups_dict(),
            **({"profile": self.node_profile.to_dict()} if self.node_profile is not None else {}),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    def write(self, path: str | os.PathLike, fmt: str | None = None) -> Path:
        """Save as json, csv or parquet (chosen by `fmt` or the file suffix), whole or not at all."""
        return write_document(path, fmt, self.to_arrow, lambda: self.to_json(indent=1))


# -- analysis ---------------------------------------------------------------------------------


def analyze(
    model: ModelLike,
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    device: str = "cpu",
    ridge: float | None = None,
    symbolic: bool | str = "auto",
    profile: bool = False,
    profile_runs: int = 3,
    seed: int = 0,
    runtime: RuntimeConfig | None = None,
    regions: bool = False,
) -> Report:
    """Per-node FLOPs, bytes, intensity and roofline class, with roll-ups.

    `shapes` fixes input shapes ({"x": [1, 3, 224, 224]}), `dims` fixes input symbols
    ({"batch": 4}); symbols left free stay symbols in the costs. `device` picks a roofline
    preset (roofline.DEVICES) and `ridge` overrides its ridge point. `symbolic` controls
    onnxruntime's symbolic shape inference ("auto", True, False). `profile` also runs the
    model over a seeded synthetic feed on `runtime`'s provider and optimization level (default
    CPU, "all") and adds measured time per node and op kind (`profile_nodes`; `regions`:
    also the time of the attention and MLP blocks, measured with the skip rewrite).
    """
    proto = load_model(model)
    report = costs_of(
        proto, ModelIndex(proto), model_identity(model, proto), shapes, dims, device=device, ridge=ridge,
        symbolic=symbolic,
    )  # fmt: skip
    if profile:
        report.node_profile = profile_nodes(
            model, shapes, dims, config=runtime, runs=profile_runs, seed=seed, regions=regions
        )
        report.profile = report.node_profile.seconds_by_op()
    return roll_up(report)


def model_identity(model: ModelLike, proto: ModelProto) -> tuple[str, str]:
    """(name, sha256) a report carries: the path and the file's hash, or the graph's name and the proto's."""
    if isinstance(model, ModelProto):
        return proto.graph.name or "<model>", model_sha256(proto)
    return str(model), file_sha256(model)


def costs_of(
    proto: ModelProto,
    index: ModelIndex,
    identity: tuple[str, str],
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    device: str = "cpu",
    ridge: float | None = None,
    symbolic: bool | str = "auto",
) -> Report:
    """`analyze`'s report of a loaded model before its roll-ups (`roll_up`), over an index the caller keeps:
    `find_motifs` reads the same graph again, and reuses the index and the node names read here."""
    dev = get_device(device, ridge)
    table = infer_shapes(proto, shapes, dims, symbolic=symbolic, index=index)
    walker = _Walker(table, proto, index)
    walker.walk("", 1, True, "")
    wbytes, params = _unique_weights(table)
    return Report(
        model=identity[0],
        device=dev,
        records=walker.records,
        symbols=dict(table.symbols),
        shape_sources=dict(table.sources),
        notes=walker.notes,
        weights_unique_bytes=wbytes,
        params=params,
        model_sha256=identity[1],
    )


def profile_nodes(
    model: ModelLike,
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    config: RuntimeConfig | None = None,
    runs: int = 3,
    seed: int = 0,
    regions: bool = False,
    measured: Measured | None = None,
) -> NodeProfile:
    """Measured seconds per node on `config`'s provider and optimization level (default CPU, "all"),
    fused kernels mapped back onto the nodes they replaced, against a measured roofline.

    Runs on seeded synthetic feeds; the static costs are priced at the fed shapes, so time, FLOPs and
    bytes line up per node (`profile.measure_nodes`). `regions`: also time the model with its
    attention / MLP blocks skipped. `measured`: a roofline already probed on this provider.
    """
    from .profile import measure_nodes, profile_feeds  # runs the model: onnxruntime only when asked

    feeds = profile_feeds(model, shapes, dims, seed)
    static = analyze(model, {k: list(np.shape(v)) for k, v in feeds.items()})
    return measure_nodes(model, feeds, static, config=config, runs=runs, regions=regions, measured=measured)


def site_flops(model: ModelLike, shapes: Mapping[str, Sequence[int | str]] | None = None) -> dict[str, float]:
    """FLOPs of one execution of each node, keyed by node id (`graph.index`; a site id is the same id).

    Loop/Scan bodies are per iteration (not multiplied). Unknown or still-symbolic costs
    are NaN, never 0. Ops that are not modelled are left out.
    """
    proto = load_model(model)
    table = infer_shapes(proto, shapes, None, symbolic="auto")
    out: dict[str, float] = {}
    for entry in ModelIndex(proto).graphs.values():
        for nid, node in zip(entry.ids, entry.graph.node, strict=True):
            c = op_count(node, _shapes_of(table, node.input), _shapes_of(table, node.output))
            if c is not None:
                v = to_number(c.flops)
                out[nid] = math.nan if v is None else v
    return out


def _shapes_of(table: ShapeTable, names: Sequence[str]) -> list:
    get = table.shapes.get
    return [get(n) if n else None for n in names]


class _Walker:
    """Walks graphs and subgraphs, pricing each node; state: the records, a bytes cache and the pricing memo."""

    def __init__(self, table: ShapeTable, model: ModelProto, index: ModelIndex | None = None):
        self.table = table
        self.index = ModelIndex(model) if index is None else index
        self.records: list[OpCost] = []
        self.notes: list[str] = []
        gin = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
        gout = {o.name for o in model.graph.output}
        # A view (Reshape, Squeeze, ...) moves no data: what it passes on keeps its graph I/O status.
        nodes = model.graph.node
        for n in nodes:
            if n.op_type in VIEWS and n.input and n.input[0] in gin and n.op_type not in ("Shape", "Size"):
                gin.update(o for o in n.output if o)
        for n in reversed(nodes):
            if (
                n.op_type in VIEWS
                and n.op_type not in ("Shape", "Size")
                and n.input
                and any(o in gout for o in n.output)
            ):
                gout.add(n.input[0])
        self.graph_inputs, self.graph_outputs = gin, gout
        self._bytes: dict[str, Dim] = {}
        self._sig: dict[str, int] = {}  # value name -> its signature's number
        self._sigs: dict[tuple, int] = {}
        self._shape_ids: dict[int, int] = {}  # id of a shape tuple of the table -> its shape_key's number
        self._shape_nums: dict[tuple | None, int] = {}
        self._memo: dict[tuple, tuple] = {}  # node signature -> `_fields`

    def value_bytes(self, name: str) -> Dim:
        if not name:
            return None
        b = self._bytes.get(name, False)
        if b is False:
            shape = self.table.shapes.get(name)
            size = dtype_size(self.table.dtypes.get(name, 0))
            n = None if shape is None else prod(shape)
            b = None if n is None or size is None else n * size
            if isinstance(b, float) and b.is_integer():
                b = int(b)
            self._bytes[name] = b
        return b

    def walk(self, path: str, repeat: Dim, counted: bool, note: str) -> None:
        entry = self.index[path]
        ids, io = entry.ids, entry.io
        price, append = self.price, self.records.append
        if len(self.index.graphs) == 1:  # no subgraphs anywhere
            for i, node in enumerate(entry.graph.node):
                append(price(node, io[i], ids[i], path, repeat, counted, note))
            return
        for i, node in enumerate(entry.graph.node):
            append(price(node, io[i], ids[i], path, repeat, counted, note))
            children = self.index.children(path, i) if node.attribute else []
            if children:
                self.walk_subgraphs(node, children, ids[i], repeat, counted, note)

    def walk_subgraphs(
        self, node: NodeProto, children: list[GraphEntry], nid: str, repeat: Dim, counted: bool, note: str
    ) -> None:
        op = node.op_type
        if op == "If":
            branches = []
            for child in children:
                start = len(self.records)
                self.walk(child.path, repeat, counted, note)
                branches.append((child.attr, start, len(self.records)))
            if len(branches) == 2:
                self._count_one_branch(node, nid, branches)
            return
        if op in ("Loop", "Scan"):
            iters = self._trip_count(node) if op == "Loop" else self._scan_length(node)
            body_repeat, body_note = _mul(repeat, iters), note
            if iters is None:
                what = "trip count not constant" if op == "Loop" else "scan length unknown"
                body_repeat, body_note = repeat, _join(note, "per-iteration")
                self.notes.append(f"{op} {nid}: {what}; its body is counted once (per-iteration)")
            for child in children:
                self.walk(child.path, body_repeat, counted, body_note)
            return
        for child in children:  # any other op with a graph attribute: price the body once
            self.walk(child.path, repeat, counted, note)

    def _count_one_branch(self, node: NodeProto, nid: str, branches: list[tuple[str, int, int]]) -> None:
        """An If counts the branch its constant condition selects, else the one with more FLOPs."""
        cond = self.table.const_of(node.input[0]) if self.table.const_of else None
        if cond is not None and cond.size == 1:
            keep = 0 if bool(cond.reshape(-1)[0]) == (branches[0][0] == "then_branch") else 1
            why = "condition is constant"
        else:
            totals = [self._rank(self.records[s:e]) for _, s, e in branches]
            keep = 0 if totals[0] >= totals[1] else 1
            why = "more FLOPs"
        _, s, e = branches[1 - keep]
        for r in self.records[s:e]:
            r.counted = False
            r.note = _join(r.note, "if-branch not counted")
        self.notes.append(
            f"If {nid}: {branches[keep][0]} counted ({why}), {branches[1 - keep][0]} reported but not counted"
        )

    def _trip_count(self, node: NodeProto) -> Dim:
        if not node.input or not node.input[0]:
            return None
        value_of = getattr(self.table, "value_of", None)
        v = value_of(node.input[0]) if value_of else None
        if v and len(v) == 1 and v[0] is not None:
            return v[0]
        return None

    def _scan_length(self, node: NodeProto) -> Dim:
        body = get_attr(node, "body")
        n_scan = get_attr(node, "num_scan_inputs", 0)
        if body is None or n_scan <= 0:
            return None
        n_state = len(node.input) - n_scan
        axes = get_attr(node, "scan_input_axes") or [0] * n_scan
        shape = self.table.shapes.get(node.input[n_state])
        if shape is None:
            return None
        ax = axes[0] + len(shape) if axes[0] < 0 else axes[0]
        return shape[ax] if 0 <= ax < len(shape) else None

    @staticmethod
    def _rank(recs: list[OpCost]) -> float:
        total = 0.0
        for r in recs:
            if r.counted and r.flops is not None:
                total += rank_value(r.flops)
        return total

    def price(
        self,
        node: NodeProto,
        io: tuple[tuple[str, ...], tuple[str, ...]],
        nid: str,
        path: str,
        repeat: Dim,
        counted: bool,
        note: str,
    ) -> OpCost:
        """One node's cost record: the analyzer's inner loop (160k nodes).

        Nodes whose formula reads no attribute are priced once per signature (op, domain and each
        input's and output's `_signature`): what `_fields` computes depends on nothing else, and big
        graphs repeat a few signatures, so most nodes cost a key and a lookup.
        """
        op, domain = node.op_type, node.domain
        in_names, out_names = io  # the node's names, read once per model (`GraphEntry.io`)
        formula = FORMULAS.get(op)
        fields = key = None
        if formula is None or formula in ATTRIBUTE_FREE or not node.attribute:
            sig, new_sig = self._sig, self._new_signature
            key = (
                op,
                domain,
                *[sig[n] if n in sig else new_sig(n) for n in in_names],
                None,
                *[sig[n] if n in sig else new_sig(n) for n in out_names],
            )
            fields = self._memo.get(key)
        if fields is None:
            fields = self._fields(node, op, formula, in_names, out_names)
            if key is not None:
                self._memo[key] = fields
        flops, gemms, act, wts, out_b, io, inter, saved, modelled = fields
        rec = OpCost(
            nid, op, domain, path, flops, act, wts, out_b, io, inter, saved, gemms,
            repeat=repeat, counted=counted, modelled=modelled, note=note,
        )  # fmt: skip
        return rec if repeat == 1 else _scaled(rec, repeat)

    def _new_signature(self, name: str) -> int:
        """A small int per distinct (shape, dtype, weight?, graph input?, graph output?) of a value.

        Shapes compare by `shape_key` (int dims by value, others by identity) and are looked up by
        the id of their tuple: the table holds them all and does not change during the walk. "" (an
        omitted input) is -1.
        """
        if not name:
            s = -1
        else:
            table = self.table
            shape = table.shapes.get(name)
            shapes = self._shape_ids
            k = shapes.get(id(shape))
            if k is None:  # numbered once per shape tuple: interned shapes (big graphs) come back often
                key = None if shape is None else shape_key(shape)
                k = shapes[id(shape)] = self._shape_nums.setdefault(key, len(self._shape_nums))
            sig = (
                k,
                table.dtypes.get(name, 0),
                name in table.weights,
                name in self.graph_inputs,
                name in self.graph_outputs,
            )
            s = self._sigs.setdefault(sig, len(self._sigs))
        self._sig[name] = s
        return s

    def _fields(
        self, node: NodeProto, op: str, formula, in_names: tuple[str, ...], out_names: tuple[str, ...]
    ) -> tuple[Dim, tuple, Dim, Dim, Dim, Dim, Dim, Dim, bool]:
        """(flops, gemms, read, weights, written, io, intermediate, fusion saved, modelled) of one node,
        with the None-propagating sums inlined (None = unknown, never 0)."""
        table = self.table
        count = None
        if formula is not None:
            sget = table.shapes.get
            count = formula(
                node, [sget(n) if n else None for n in in_names], [sget(n) if n else None for n in out_names]
            )
        flops, gemms = (None, ()) if count is None else (count.flops, count.gemms)
        if op in VIEWS or op in CONTROL_FLOW:
            return flops, gemms, 0, 0, 0, 0, 0, 0, count is not None
        weights, gin, gout = table.weights, self.graph_inputs, self.graph_outputs
        cache, vb = self._bytes, self.value_bytes
        act: Dim = 0
        wts: Dim = 0
        io: Dim = 0
        inter: Dim = 0
        partial = op in PARTIAL_READS
        for k, name in enumerate(in_names):
            if not name:
                continue
            key = (out_names[0] if out_names else "") if partial and k == 0 else name
            b = cache[key] if key in cache else vb(key)
            if name in weights:
                wts = None if wts is None or b is None else wts + b
            else:
                act = None if act is None or b is None else act + b
                if name in gin:
                    io = None if io is None or b is None else io + b
                else:
                    inter = None if inter is None or b is None else inter + b
        out_b: Dim = 0
        for name in out_names:
            if not name:
                continue
            b = cache[name] if name in cache else vb(name)
            out_b = None if out_b is None or b is None else out_b + b
            if name in gout:
                io = None if io is None or b is None else io + b
            else:
                inter = None if inter is None or b is None else inter + b
        saved: Dim = 0
        if count is not None and count.saved_elems:
            size = dtype_size(table.dtypes.get(out_names[0], 0)) if out_names else None
            saved = _mul(count.saved_elems, size)
        return flops, gemms, act, wts, out_b, io, inter, saved, count is not None


_COST_FIELDS = (
    "flops", "bytes_read", "bytes_weights", "bytes_written", "bytes_io", "bytes_intermediate", "fusion_saved_bytes"
)  # fmt: skip
"""The OpCost fields that scale with a Loop / Scan repeat and take symbol values."""


def _scaled(rec: OpCost, repeat: Dim) -> OpCost:
    if repeat is None or repeat == 1:
        return rec
    for f in _COST_FIELDS:
        setattr(rec, f, _mul(getattr(rec, f), repeat))
    return rec


def _mul(*xs: Dim) -> Dim:
    return prod(xs)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def rank_value(x: Dim) -> float:
    """A number to sort by: the value, symbols set to 64 when still symbolic, -1 when unknown."""
    if x is None:
        return -1.0
    if isinstance(x, Poly):
        v = x.evaluate(dict.fromkeys(x.symbols(), _RANK_SYMBOL_VALUE))
        return float(v) if not isinstance(v, Poly) else 0.0
    return float(x)


def _unique_weights(table: ShapeTable) -> tuple[Dim, Dim]:
    """Bytes and element count of all initializers and Constant values (each counted once)."""
    counts: list[Dim] = []
    sizes: list[Dim] = []
    shapes, dtypes = table.shapes, table.dtypes
    for name in table.weights:
        shape = shapes.get(name)
        n = None if shape is None else prod(shape)
        size = dtype_size(dtypes.get(name, 0))
        counts.append(n)
        sizes.append(None if n is None or size is None else n * size)
    params = None if any(n is None for n in counts) else add_all(counts)
    nbytes = None if any(b is None for b in sizes) else add_all(sizes)
    return nbytes, params


# -- roll-ups -----------------------------------------------------------------------------------


def roll_up(report: Report) -> Report:
    """Derive per-record intensity/roofline/time and all roll-ups from the raw records.

    Each record's byte total is summed once here (once per distinct cost objects) and handed to
    the roll-ups (`totals`, by record id): on symbolic graphs every such sum is a new polynomial.
    """
    dev = report.device
    ridge = dev.ridge
    peak, bw = dev.peak_flops, dev.bandwidth
    num = (int, float)
    totals: dict[int, Dim] = {}
    # symbolic records priced from one signature share their cost objects: derive once per such tuple
    derived: dict[tuple, tuple] = {}
    polys: dict[int, Poly] = {}
    for r in report.records:
        f, rd, w, wr = r.flops, r.bytes_read, r.bytes_weights, r.bytes_written
        if type(f) in num and type(rd) in num and type(w) in num and type(wr) in num:  # fast path: numbers
            total = rd + w + wr
            totals[id(r)] = total
            r.intensity = f / total if total else None
            if not r.modelled:
                r.roofline = "unmodelled"
            elif f == 0:
                r.roofline = "none" if total == 0 else "memory"
            else:
                r.roofline = "compute" if total == 0 or f / total >= ridge else "memory"
            r.est_time_s = max(f / peak, total / bw)
            continue
        key = (id(f), id(rd), id(w), id(wr), r.modelled)  # the records keep these objects alive
        hit = derived.get(key)
        if hit is None:
            total = r.bytes_total
            hit = derived[key] = (
                total,
                intensity(f, total),
                classify(f, total, ridge) if r.modelled else "unmodelled",
                est_time(to_number(f), to_number(total), dev),
            )
        totals[id(r)], r.intensity, r.roofline, r.est_time_s = hit
        if r.counted:  # only this path meets polynomials: collect each one once, for the symbols
            for x in (f, hit[0]):
                if type(x) is Poly:
                    polys[id(x)] = x
    counted = [r for r in report.records if r.counted]
    report.totals, flops, nbytes = _totals(report, counted, totals)
    report.by_op = _by_op(counted, totals, flops, nbytes, ridge, report.profile)
    report.gemm_shapes = _gemm_hist(counted)
    report.traffic = _traffic(counted, report)
    report.boundedness = _boundedness(counted)
    report.fusion = _fusion(counted, totals)
    report.unmodelled = dict(Counter(_kind(r) for r in report.records if not r.modelled).most_common())
    syms: set[str] = set()
    for x in polys.values():
        syms |= x.symbols()
    report.totals["symbols"] = sorted(syms)
    return report


def _kind(r: OpCost) -> str:
    return r.op_type if r.domain in ("", "ai.onnx") else f"{r.domain}.{r.op_type}"


def _sum(xs: list[Dim]) -> tuple[Dim, int]:
    """Sum of the known values and the number of unknown ones (never folded in as 0)."""
    known = [x for x in xs if x is not None]
    return add_all(known), len(xs) - len(known)


def _num(x: Dim) -> dict:
    return {"value": to_number(x), "expr": to_text(x)}


def _share(part: Dim, whole: Dim) -> float | None:
    if part is None or whole is None:
        return None
    if isinstance(part, Poly) or isinstance(whole, Poly):
        if part == 0:
            return 0.0
        if isinstance(part, Poly) and isinstance(whole, Poly):
            return part.ratio_to(whole)
        return None
    return float(part) / float(whole) if whole else None


def _totals(report: Report, counted: list[OpCost], totals: dict[int, Dim]) -> tuple[dict, Dim, Dim]:
    flops, unk_f = _sum([r.flops for r in counted if r.modelled])
    nbytes, unk_b = _sum([totals[id(r)] for r in counted])
    return (
        {
            "nodes": len(report.records),
            "nodes_counted": len(counted),
            "flops": to_number(flops),
            "flops_expr": to_text(flops),
            "flops_unknown_nodes": unk_f,
            "bytes": to_number(nbytes),
            "bytes_expr": to_text(nbytes),
            "bytes_unknown_nodes": unk_b,
            "intensity": intensity(flops, nbytes),
            "weights_unique_bytes": to_number(report.weights_unique_bytes),
            "params": to_number(report.params),
            "unmodelled_nodes": sum(1 for r in report.records if not r.modelled),
        },
        flops,
        nbytes,
    )


def _by_op(
    counted: list[OpCost],
    totals: dict[int, Dim],
    all_flops: Dim,
    all_bytes: Dim,
    ridge: float,
    profile: dict[str, float] | None,
) -> list[dict]:
    groups: dict[str, list[OpCost]] = {}
    for r in counted:
        groups.setdefault(_kind(r), []).append(r)
    time_total = sum(profile.values()) if profile else 0.0
    rows = []
    for kind, recs in groups.items():
        flops, unk = _sum([r.flops for r in recs])
        nbytes, unk_b = _sum([totals[id(r)] for r in recs])
        row = {
            "op_type": kind,
            "count": len(recs),
            "flops": to_number(flops),
            "flops_expr": to_text(flops),
            "flops_unknown": unk,
            "flops_share": _share(flops, all_flops),
            "bytes": to_number(nbytes),
            "bytes_expr": to_text(nbytes),
            "bytes_share": _share(nbytes, all_bytes),
            "intensity": intensity(flops, nbytes),
            "roofline": classify(flops, nbytes, ridge)
            if recs[0].modelled and not unk and not unk_b
            else ("unmodelled" if not recs[0].modelled else "unknown"),
            "_rank": rank_value(flops) if not unk else -1.0,
        }
        if profile is not None:
            secs = profile.get(recs[0].op_type, 0.0)
            row["time_s"] = secs
            row["time_share"] = secs / time_total if time_total else None
        rows.append(row)
    if profile is not None:
        for op, secs in profile.items():
            if not any(row["op_type"] == op for row in rows):
                rows.append(
                    {
                        "op_type": op,
                        "count": 0,
                        "flops": None,
                        "flops_expr": "",
                        "flops_unknown": 0,
                        "flops_share": None,
                        "bytes": None,
                        "bytes_expr": "",
                        "bytes_share": None,
                        "intensity": None,
                        "roofline": "runtime-only",
                        "_rank": -1.0,
                        "time_s": secs,
                        "time_share": secs / time_total if time_total else None,
                    }
                )
    rows.sort(key=lambda row: (-row["_rank"], row["op_type"]))
    for row in rows:
        del row["_rank"]
    return rows


def _gemm_hist(counted: list[OpCost]) -> list[dict]:
    hist: dict[tuple, dict] = {}
    # ids of (GEMM, repeat) -> (text key, FLOPs): records priced from one signature share their GEMM
    # tuples, so a big graph computes each product and text once (the records keep the objects alive).
    seen: dict[tuple[int, int], tuple[tuple, Dim]] = {}
    for r in counted:
        rep = 1 if r.repeat is None else r.repeat
        for g in r.gemms:
            if any(d is None for d in g):
                continue
            hit = seen.get((id(g), id(rep)))
            if hit is None:
                b, m, k, n = g
                hit = seen[id(g), id(rep)] = tuple(to_text(d) for d in g), _mul(2, b, m, k, n, rep)
            key, flops = hit
            e = hist.get(key)
            if e is None:
                e = hist[key] = {
                    "batch": key[0],
                    "M": key[1],
                    "K": key[2],
                    "N": key[3],
                    "count": 0,
                    "_flops": 0,
                    "op_types": set(),
                }
            e["count"] += rep
            e["_flops"] = _add(e["_flops"], flops)
            e["op_types"].add(r.op_type)
    rows = []
    for e in hist.values():
        f = e.pop("_flops")
        c = e["count"]
        e.update(
            count=to_number(c) if not isinstance(c, Poly) else str(c),
            flops=to_number(f),
            flops_expr=to_text(f),
            op_types=sorted(e["op_types"]),
            _rank=rank_value(f),
        )
        rows.append(e)
    rows.sort(key=lambda e: -e["_rank"])
    for e in rows:
        del e["_rank"]
    return rows


def _traffic(counted: list[OpCost], report: Report) -> dict:
    w, uw = _sum([r.bytes_weights for r in counted])
    io, uio = _sum([r.bytes_io for r in counted])
    inter, ui = _sum([r.bytes_intermediate for r in counted])
    total = _add(w, io, inter)
    return {
        "weights": to_number(w),
        "weights_expr": to_text(w),
        "weights_share": _share(w, total),
        "io": to_number(io),
        "io_expr": to_text(io),
        "io_share": _share(io, total),
        "intermediate": to_number(inter),
        "intermediate_expr": to_text(inter),
        "intermediate_share": _share(inter, total),
        "unknown_nodes": max(uw, uio, ui),
        "weights_unique_bytes": to_number(report.weights_unique_bytes),
    }


def _boundedness(counted: list[OpCost]) -> dict:
    groups: dict[str, list[Dim]] = {}
    for r in counted:
        if r.flops is None or not r.modelled:
            continue
        groups.setdefault(r.roofline, []).append(r.flops)
    by = {cls: add_all(fs) for cls, fs in groups.items()}
    total, _ = _sum(list(by.values()))
    return {
        cls: {"flops": to_number(v), "flops_expr": to_text(v), "share": _share(v, total)}
        for cls, v in sorted(by.items())
    }


def _fusion(counted: list[OpCost], totals: dict[int, Dim]) -> list[dict]:
    groups: dict[str, list[OpCost]] = {}
    for r in counted:
        if r.fusion_saved_bytes != 0:
            groups.setdefault(_kind(r), []).append(r)
    rows = []
    for kind, recs in sorted(groups.items()):
        flops, _ = _sum([r.flops for r in recs])
        nbytes, _ = _sum([totals[id(r)] for r in recs])
        saved, _ = _sum([r.fusion_saved_bytes for r in recs])
        rows.append(
            {
                "op_type": kind,
                "count": len(recs),
                "flops": to_number(flops),
                "bytes_fused": to_number(nbytes),
                "saved_bytes": to_number(saved),
                "saved_bytes_expr": to_text(saved),
                "intensity_fused": intensity(flops, nbytes),
                "intensity_unfused": intensity(flops, _add(nbytes, saved)),
            }
        )
    return rows


def _evaluate_record(r: OpCost, values: Mapping[str, int]) -> OpCost:
    out = replace(r)
    for f in (*_COST_FIELDS, "repeat"):
        setattr(out, f, evaluate(getattr(r, f), values))
    out.gemms = tuple(tuple(evaluate(d, values) for d in g) for g in r.gemms)
    return out


# -- flat records -------------------------------------------------------------------------------

_NUMERIC = (
    "flops",
    "bytes_read",
    "bytes_weights",
    "bytes_written",
    "bytes_io",
    "bytes_intermediate",
    "fusion_saved_bytes",
)


def _record_dict(r: OpCost) -> dict:
    total = r.bytes_total
    g = r.gemms[0] if r.gemms else None
    return {
        "node": r.node,
        "op_type": r.op_type,
        "domain": r.domain,
        "graph": r.graph,
        **{f: to_number(getattr(r, f)) for f in _NUMERIC},
        "bytes": to_number(total),
        "intensity": r.intensity,
        "roofline": r.roofline,
        "est_time_s": r.est_time_s,
        "flops_expr": to_text(r.flops),
        "bytes_expr": to_text(total),
        "gemm": "" if g is None else "x".join(to_text(d) for d in g),
        "repeat": to_number(r.repeat),
        "counted": r.counted,
        "modelled": r.modelled,
        "note": r.note,
    }


def _arrow_schema():
    import pyarrow as pa

    s, f64, b = pa.string(), pa.float64(), pa.bool_()
    cols = [
        ("node", s),
        ("op_type", s),
        ("domain", s),
        ("graph", s),
        *((n, f64) for n in _NUMERIC),
        ("bytes", f64),
        ("intensity", f64),
        ("roofline", s),
        ("est_time_s", f64),
        ("flops_expr", s),
        ("bytes_expr", s),
        ("gemm", s),
        ("repeat", f64),
        ("counted", b),
        ("modelled", b),
        ("note", s),
    ]
    return pa.schema(cols)


def _json_default(x):
    if isinstance(x, Poly):
        return str(x)
    if isinstance(x, set):
        return sorted(x)
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
