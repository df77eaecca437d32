"""Repeated sub-graphs: where a model repeats itself, so one fused or tuned kernel serves many sites.

`find_motifs(model)` finds two kinds of pattern in every graph of the model (If branches,
Loop and Scan bodies included) and merges their counts:

- **chains**: from each compute node, walk forward while the node has exactly one consumer
  (fan-out, or a value that is a graph output, ends a chain) and count every prefix of
  `min_len..max_len` ops as an op-kind n-gram (`MatMul→Add→Gelu`); score = count × length.
- **cones**: the input tree of each node to depth d (d = 2..`max_depth`), leaves labelled
  `input` (a graph input or a value from outside the cone's graph), `weight` (a constant
  with 2+ elements that is not int64/int32/bool: learned or quantized parameters),
  `constant` (scalars, axes, shapes, indices) and `*` (made by an op below the cut). The
  signature is canonical: operands of commutative ops are sorted. A node's tree counts at
  depth d only when it is new there (its depth d-1 tree was cut), so a tree that ends at
  depth 3 is not counted again at 4, 5 and 6. Score = count × (internal nodes + 1), the
  internal nodes being the ops below the root: the ops one site covers, the unit a chain's
  length is in.

What is folded is not a compute node: shape arithmetic (Shape / Size and what is computed
from them and constants only: exporters repeat it at every layer, it moves no data, and it
would top every list with 0 FLOPs) and anything else computed from constants only (a Slice or
Transpose of a weight, a DequantizeLinear of a quantized one), which onnxruntime folds or
prepacks once. A Shape read is no consumer; a folded value is a `weight` leaf when a weight
went into it, else a `constant` one.

Each pattern carries the FLOP and byte share of the nodes its sites cover (each node once:
overlapping sites do not double count), priced by `analyze` with the same rules (If branches
that are not counted add 0, Loop bodies their trip count), and a hint: MoE block (TopK, or a
gather from a stacked expert weight), attention block (Softmax or an attention op), shared
projection (two covered GEMMs read the same weight: prepack it once), linear + bias +
activation (and its residual form), else "decompose once, reuse".

Everything after one pass over the protobuf is numpy over flat arrays: the cone signature at
depth d numbers the distinct rows [op kind, child signatures at d-1], the chains are paths
through a next-node array, and each (pattern, node) a site covers is marked once in a
patterns x nodes table. Only the constant folding walks the nodes in Python, over ints. On
`wide_graph(160000)` (symbolic) that is 4.6 s of CPU given its report (was 6.0), on the loaded
2-core machine: 1.6 s reading the graph (0.5 s of it the protobuf's names), 1.1 s the cost
columns (a key per Poly: 0.25 s a part), 1.3 s numpy; the 160k-node chain 4.4 s (was 5.4).
Order is deterministic: by score, then count, then the pattern's text.
"""

from __future__ import annotations

import bisect
import gc
import json
import math
import operator
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, count, repeat
from pathlib import Path
from typing import IO

import numpy as np
from onnx import TensorProto

from ..errors import OpscopeError
from ..files import write_document
from ..graph.index import GraphEntry, ModelIndex
from ..graph.io import ModelLike, load_model
from ..graph.proto import DEFAULT_DOMAINS, constant_value, op_set
from ..shapes.symbolic import Poly, to_text
from .costs import OpCost, Report, costs_of, model_identity, roll_up
from .opcosts import CONTROL_FLOW

DEFAULT_MIN_LEN, DEFAULT_MAX_LEN, DEFAULT_MIN_COUNT, DEFAULT_MAX_DEPTH = 2, 6, 2, 6
EXAMPLES = 4
"""Example sites kept per pattern (node ids: a chain's first node, a cone's root)."""

INPUT, WEIGHT, CONSTANT, CUT = 0, 1, 2, 3
LEAVES = ("input", "weight", "constant", "*")
"""Leaf labels of a cone; child signature s is coded len(LEAVES) + s."""

HINTS = {
    "MoE block": "route once, run the experts as one grouped GEMM",
    "attention block": "one fused attention kernel (com.microsoft Attention / MultiHeadAttention)",
    "shared projection": "one weight read by several GEMMs: prepack it once, reuse the packed copy",
    "linear+bias+activation+residual": "one GEMM with a bias, activation and residual-add epilogue",
    "linear+bias+activation": "one GEMM with a bias + activation epilogue",
    "decompose once, reuse": "build or tune one kernel for the pattern, reuse it at every site",
}
"""Hint -> what to do about it, most specific first (the first that matches is the pattern's hint)."""

COMMUTATIVE = op_set("Add Mul Sum Max Min Mean And Or Xor Equal BitwiseAnd BitwiseOr BitwiseXor")
LINEAR = op_set(
    "MatMul Gemm Conv ConvTranspose MatMulInteger QLinearMatMul ConvInteger QLinearConv FusedMatMul "
    "FusedGemm FusedConv MatMulNBits QGemm DynamicQuantizeMatMul"
)
BIAS_INSIDE = {"Gemm": 3, "Conv": 3, "ConvTranspose": 3, "FusedGemm": 3, "FusedConv": 3, "QLinearConv": 9}
"""Linear ops that add a bias themselves, and the input count that means one is given."""
ACTIVATIONS = op_set(
    "Relu LeakyRelu PRelu Elu Selu Celu Gelu FastGelu BiasGelu QuickGelu Tanh Sigmoid HardSigmoid "
    "HardSwish Softplus Softsign Mish Clip Erf ThresholdedRelu"
)
SHAPE_SOURCES = frozenset({"Shape", "Size"})
_NOT_WEIGHT_DTYPES = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL, TensorProto.STRING})
_F_ATTN, _F_MOE = 1, 2


@dataclass(slots=True)
class Pattern:
    """One repeated chain or cone. Costs are numbers, or None with the expression in `*_expr`."""

    kind: str  # "chain" or "cone"
    pattern: str  # "MatMul→Add→Relu", or "Relu(Add(MatMul(*, weight), weight))"
    size: int  # a chain's length, a cone's depth
    ops: int  # ops per site: the length, or the cone's internal nodes + 1
    count: int  # sites
    score: int  # count x ops
    nodes: int  # distinct nodes the sites cover
    flops: float | None
    flops_expr: str
    flops_share: float | None
    bytes: float | None
    bytes_expr: str
    bytes_share: float | None
    unknown_nodes: int  # covered nodes whose FLOPs or bytes are unknown (left out of the sums)
    hint: str
    examples: tuple[str, ...]

    @property
    def action(self) -> str:
        return HINTS[self.hint]

    def to_dict(self) -> dict:
        return {
            **{f: getattr(self, f) for f in self.__slots__},
            "action": self.action,
            "examples": list(self.examples),
        }


@dataclass
class Motifs:
    """The result of `find_motifs`: repeated chains and cones, best first, ready to print or save."""

    model: str
    model_sha256: str
    settings: dict
    totals: dict  # nodes, graphs, and the model's counted FLOPs and bytes the shares are of
    chains: list[Pattern] = field(default_factory=list)
    cones: list[Pattern] = field(default_factory=list)

    @property
    def patterns(self) -> list[Pattern]:
        return [*self.chains, *self.cones]

    def to_records(self) -> list[dict]:
        """One flat dict per pattern (chains first), examples joined by '; ': what CSV and Parquet hold."""
        return [{**p.to_dict(), "examples": "; ".join(p.examples)} for p in self.patterns]

    def to_arrow(self):
        """The patterns as a pyarrow Table, every row naming the model it came from."""
        import pyarrow as pa

        schema = _arrow_schema()
        rows = [{**r, "model_sha256": self.model_sha256} for r in self.to_records()]
        columns = [_arrow_column([r[f.name] for r in rows], f.type) for f in schema]
        table = pa.Table.from_arrays(columns, schema=schema) if rows else schema.empty_table()
        meta = {"settings": self.settings, "totals": self.totals, "model": self.model}
        return table.replace_schema_metadata({b"opscope.motifs": json.dumps(meta).encode()})

    def to_pandas(self):
        return self.to_arrow().to_pandas()

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "model_sha256": self.model_sha256,
            "settings": self.settings,
            "totals": self.totals,
            "chains": [p.to_dict() for p in self.chains],
            "cones": [p.to_dict() for p in self.cones],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def write(self, path: str | os.PathLike, fmt: str | None = None) -> Path:
        """Save as json (one document), csv or parquet (one row per pattern), whole or not at all."""
        return write_document(path, fmt, self.to_arrow, lambda: self.to_json(indent=1))


def find_motifs(
    model: ModelLike,
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    min_len: int = DEFAULT_MIN_LEN,
    max_len: int = DEFAULT_MAX_LEN,
    min_count: int = DEFAULT_MIN_COUNT,
    max_depth: int = DEFAULT_MAX_DEPTH,
    symbolic: bool | str = "auto",
    report: Report | None = None,
) -> Motifs:
    """Repeated chains (n-grams of `min_len..max_len` ops) and cones (input trees of depth 2..`max_depth`)
    seen at least `min_count` times, subgraphs included, with the FLOP and byte share they cover.

    Costs come from `analyze(model, shapes, dims, symbolic=symbolic)`, or from `report` when one is
    given for the same model (it saves a second analysis).
    """
    _check_settings(min_len, max_len, min_count, max_depth)
    with _gc_paused():
        return _find_motifs(model, shapes, dims, min_len, max_len, min_count, max_depth, symbolic, report)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while the flat arrays are built: the passes it starts as 160k nodes'
    lists are allocated re-walk every live object (the model's wrappers, the report's records), 0.7 s of
    the 1.0 s reading a 160k-node graph's names. Nothing here makes cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _find_motifs(model, shapes, dims, min_len, max_len, min_count, max_depth, symbolic, report) -> Motifs:
    proto = load_model(model)
    index = ModelIndex(proto)
    if report is None:  # analyze's, over this index: the graph's names are read once for both
        report = roll_up(
            costs_of(proto, index, model_identity(model, proto), shapes, dims, symbolic=symbolic)
        )
    name, sha = report.model, report.model_sha256
    records = _records_by_graph(report, index)
    flat = _flatten(index, {path: [r.node for r in recs] for path, recs in records.items()})
    flops, nbytes = _cost_columns([r for recs in records.values() for r in recs])
    share_dims = _share_dims((flops, nbytes), report, dims)
    flops.evaluate_at(share_dims)
    nbytes.evaluate_at(share_dims)
    families = [_chains(flat, min_len, max_len, min_count), _cones(flat, max_depth, min_count)]
    chains, cones = (_patterns(flat, fam, flops, nbytes) for fam in families)
    settings = {
        "min_len": min_len, "max_len": max_len, "min_count": min_count, "max_depth": max_depth,
        "share_dims": share_dims,
    }  # fmt: skip
    totals = {
        "nodes": len(flat.ids),
        "graphs": flat.graphs,
        "flops": flops.total_number,
        "flops_expr": flops.total_text,
        "bytes": nbytes.total_number,
        "bytes_expr": nbytes.total_text,
        "flops_at_share_dims": flops.total_at,
        "bytes_at_share_dims": nbytes.total_at,
        "unknown_nodes": int((flops.unknown | nbytes.unknown).sum()),
    }
    return Motifs(name, sha, settings, totals, chains, cones)


def _check_settings(min_len: int, max_len: int, min_count: int, max_depth: int) -> None:
    if min_len < 1 or max_len < min_len:
        raise OpscopeError(
            f"chain lengths {min_len}..{max_len}: need 1 <= min_len <= max_len",
            hint="e.g. 2..6 (the defaults)",
        )
    if min_count < 1:
        raise OpscopeError(
            f"min_count {min_count}: need at least 1", hint="2 (the default) keeps repeats only"
        )
    if max_depth < 2:
        raise OpscopeError(f"cone depth {max_depth}: need at least 2", hint="cones of depth 2..6 by default")


# -- the model as flat arrays ------------------------------------------------------------------


@dataclass
class _Flat:
    """Every node of every graph under one global number, in `ModelIndex` order."""

    ids: list[str]
    kinds: list[str]  # op kind names, by kind number
    kind: np.ndarray  # kind number per node
    compute: np.ndarray  # bool: not a Constant, not folded
    commutative: np.ndarray  # bool: operands may be sorted
    flags: np.ndarray  # _F_* bits per node (hints)
    lba: np.ndarray  # an activation over a bias over a linear: that linear node's number, else -1
    residual: np.ndarray  # the same for x + act(linear + b) at the Add, and act(linear + b + x) at the act
    weight: np.ndarray  # a linear node's first weight (a number per weight name), else -1
    nxt: np.ndarray  # the one compute consumer, -1 when none, several or a graph output
    buckets: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]  # arity -> nodes, producers, leaf codes
    indptr: np.ndarray  # CSR of each node's compute producers (the cone's children)
    children: np.ndarray
    graphs: int


def _leaf(value) -> tuple[int, int]:
    """(label, rank) of a constant: `weight` for a multi-element tensor that is not int64/int32/bool, else
    `constant`."""
    t = value if isinstance(value, TensorProto) else constant_value(value)
    if t is None:
        return CONSTANT, 0
    dims = t.dims
    weight = t.data_type not in _NOT_WEIGHT_DTYPES and math.prod(dims) > 1
    return (WEIGHT if weight else CONSTANT), len(dims)


def _leaves(values: list) -> tuple[np.ndarray, np.ndarray]:
    """`_leaf` of many constants at once, with no Python call per tensor (a 160k-node chain has 160k
    initializers: 0.5 s one by one)."""
    tensors = values
    if not all(map(isinstance, values, repeat(TensorProto))):
        tensors = [v if isinstance(v, TensorProto) else _tensor_of(v) for v in values]
    k = len(tensors)
    dims = list(map(_DIMS, tensors))
    multi = np.fromiter(map((1).__lt__, map(math.prod, dims)), bool, k)
    weight = multi & ~np.fromiter(map(_NOT_WEIGHT_DTYPES.__contains__, map(_DTYPE, tensors)), bool, k)
    return np.where(weight, WEIGHT, CONSTANT), np.fromiter(map(len, dims), np.int64, k)


def _tensor_of(node) -> TensorProto:
    t = constant_value(node)
    return _NO_TENSOR if t is None else t


_DIMS, _DTYPE = operator.attrgetter("dims"), operator.attrgetter("data_type")
_NO_TENSOR = TensorProto()
"""What a Constant without a tensor value (value_float, ...) reads as: a scalar, a `constant` leaf."""


class _Collector:
    """The protobuf read once, graph by graph, into flat arrays (state: what later graphs and the outer reads
    look up: kind and weight numbers, each graph's name map, constants of rank 3+). Per input of each node:
    its producer (-1 for a leaf) and its leaf code; the rest is numpy in `_flatten`.

    Only the constant folding walks the nodes one by one in Python (a node is folded when no input is data,
    which depends on its producers), over ints. The names come out of the protobuf by slicing
    (`node.input[:]`), 4x faster than list(node.input) under upb."""

    def __init__(self, index: ModelIndex):
        self.index = index
        self.ids: list[str] = []
        self.kind_of: dict[str, int] = {}
        self.weight_of: dict[str, int] = {}
        self.folded: list[int] = []  # per node: the leaf code of its outputs when it is folded, else -1
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in _PARTS}  # per graph, then concatenated
        self.edge_p: list[np.ndarray] = []  # (producer, compute consumer) pairs
        self.edge_c: list[np.ndarray] = []
        self.ends: list[int] = []  # nodes that make a graph output
        self.made: dict[str, dict[str, int]] = {}  # graph path -> its `where` (see graph)
        self.outer: list[tuple[GraphEntry, str]] = []  # (subgraph, name it reads from a graph around it)
        self.ranks: dict[str, int] = {}  # constants of rank 3+ (an expert gather reads such a stack)
        self.base: dict[str, int] = {}  # graph path -> number of its first node

    def graph(self, entry: GraphEntry, ids: list[str]) -> None:
        base = self.base[entry.path] = len(self.ids)
        self.ids.extend(ids)
        nodes = entry.graph.node
        ops, domains = [n.op_type for n in nodes], [n.domain for n in nodes]
        ins, outs = (list(c) for c in zip(*entry.io, strict=True)) if ops else ([], [])  # names read once
        where = self._names(entry, base, outs)
        flat = list(chain.from_iterable(ins))
        arity = list(map(len, ins))
        ws = list(map(where.get, flat))
        if None in ws:  # an optional input left out (""), or a name this graph does not define
            if "" in flat:
                flat = [x for x in flat if x]
                arity = [len(xs) - xs.count("") for xs in ins]
            self._outer_names(entry, where, sorted({x for x in flat if x not in where}))
            ws = list(map(where.__getitem__, flat))
        self._fold(base, ops, arity, ws)
        pairs = dict.fromkeys(zip(ops, domains, strict=True))  # (op, domain) -> its number, in node order
        for j, pair in enumerate(pairs):
            pairs[pair] = j
        kind_of = self.kind_of
        kind = [
            kind_of.setdefault(op if d in DEFAULT_DOMAINS else f"{d}.{op}", len(kind_of)) for op, d in pairs
        ]
        pair = np.fromiter(map(pairs.__getitem__, zip(ops, domains, strict=True)), np.int64, len(ops))
        self._arrays(
            base, flat, np.asarray(arity, np.int64), np.asarray(ws, np.int64),
            np.asarray(kind, np.int64)[pair], np.asarray([op in LINEAR for op, _ in pairs], bool)[pair],
            np.asarray([op == "Constant" for op, _ in pairs], bool)[pair],
        )  # fmt: skip

    def _names(self, entry: GraphEntry, base: int, outs: list[list[str]]) -> dict[str, int]:
        """name -> its producer's number (>= 0), or ~leaf code for a constant or an input (< 0)."""
        flat_out = list(chain.from_iterable(outs))
        owner = np.repeat(np.arange(base, base + len(outs)), list(map(len, outs))).tolist()
        where = dict(zip(reversed(flat_out), reversed(owner), strict=True))  # the first producer wins
        where.pop("", None)
        self.ends.extend(where[o] for o in entry.outputs if o in where)
        for i in entry.graph.input:
            where.setdefault(i.name, ~INPUT)
        constants = entry.constants
        if constants:
            names = list(constants)
            codes, ranks = _leaves(list(constants.values()))
            where.update(zip(names, (~codes).tolist(), strict=True))
            self.ranks.update((names[i], int(ranks[i])) for i in np.flatnonzero(ranks >= 3).tolist())
        where.pop("", None)  # an empty name is an input left out, never looked up
        self.made[entry.path] = where
        return where

    def _outer_names(self, entry: GraphEntry, where: dict[str, int], missing: list[str]) -> None:
        """Names read but not defined here: a value of a graph around this one (or, in the main graph,
        undefined: an input)."""
        for x in missing:
            c = None
            if entry.parent is not None:
                self.outer.append((entry, x))
                c = self.index.constant(entry.parent, x)
            leaf, rank = _leaf(c) if c is not None else (INPUT, 0)
            where[x] = ~leaf
            if rank >= 3:
                self.ranks[x] = rank

    def _fold(self, base: int, ops: list[str], arity: list[int], ws: list[int]) -> None:
        """Append each node's folded leaf code: shape arithmetic and what is computed from constants only. A
        producer after its consumer (not topological) counts as data."""
        folded = self.folded
        pos = 0
        for gid, op, a in zip(range(base, base + len(ops)), ops, arity, strict=True):
            f = -1
            if op in SHAPE_SOURCES:
                f = CONSTANT
            elif a and op not in CONTROL_FLOW:
                f = CONSTANT
                for w in ws[pos : pos + a]:
                    leaf = ~w if w < 0 else (folded[w] if w < gid else -1)
                    if leaf == WEIGHT:
                        f = WEIGHT
                    elif leaf < 0 or leaf == INPUT:
                        f = -1
                        break
            folded.append(f)
            pos += a

    def _arrays(
        self, base: int, flat: list[str], arity: np.ndarray, ws: np.ndarray, kind: np.ndarray,
        linear: np.ndarray, constant_op: np.ndarray,
    ) -> None:  # fmt: skip
        """One graph's per-node and per-input arrays, from the name map's numbers `ws` and the folding."""
        m = len(kind)
        local = np.repeat(np.arange(m), arity)  # the node of each input, numbered in this graph
        folded = np.asarray(self.folded[base:], np.int64)
        produced = ws >= 0
        back = produced & (ws < base + local)
        leaf_of = np.full(len(ws), -1, np.int64)  # a folded producer's leaf code
        leaf_of[back] = folded[ws[back] - base]
        data = produced & (leaf_of < 0)
        prod = np.where(data, ws, -1)
        code = np.where(data, CUT, np.where(produced, leaf_of, ~ws))
        start = np.cumsum(arity) - arity
        rank0 = np.zeros(m, np.int64)  # rank of input 0 when it is a constant (an expert gather's stack)
        if self.ranks:
            has = np.flatnonzero(arity > 0)
            has = has[~data[start[has]]]
            rank0[has] = [self.ranks.get(flat[j], 0) for j in start[has].tolist()]
        first = np.flatnonzero((code == WEIGHT) & linear[local])
        first = (
            first[np.concatenate([[True], local[first][1:] != local[first][:-1]])] if len(first) else first
        )
        weight = np.full(m, -1, np.int64)  # a linear node's first weight, numbered; else -1
        weight_of = self.weight_of
        weight[local[first]] = [weight_of.setdefault(flat[j], len(weight_of)) for j in first.tolist()]
        consumer = (folded < 0) & ~constant_op
        edge = data & consumer[local]
        self.edge_p.append(ws[edge])
        self.edge_c.append(base + local[edge])
        for name, value in zip(_PARTS, (kind, arity, prod, code, rank0, weight), strict=True):
            self.parts[name].append(value)

    def outer_reads(self) -> None:
        """A value read inside a subgraph is consumed, in the graph that makes it, by the subgraph's owner."""
        pairs = [pair for entry, name in self.outer if (pair := self._edge_to_owner(entry, name))]
        if pairs:
            p, c = zip(*pairs, strict=True)
            self.edge_p.append(np.asarray(p, np.int64))
            self.edge_c.append(np.asarray(c, np.int64))

    def _edge_to_owner(self, entry: GraphEntry, name: str) -> tuple[int, int] | None:
        while entry.parent is not None:
            parent = self.index[entry.parent]
            p = self.made[parent.path].get(name)
            if p is not None and p >= 0:
                return (p, self.base[parent.path] + entry.owner_index) if self.folded[p] < 0 else None
            if p is not None and (p != ~INPUT or any(i.name == name for i in parent.graph.input)):
                return None  # a constant, or an input of that graph: no node consumes from
            entry = parent
        return None

    def array(self, name: str) -> np.ndarray:
        parts = self.parts[name]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


_PARTS = ("kind", "arity", "prod", "code", "rank0", "weight")


def _kind_table(kinds: list[str], test) -> np.ndarray:
    """One value per kind number: `test(op)` of the op's name without its domain."""
    return np.asarray([test(k.rsplit(".", 1)[-1]) for k in kinds] or [0])


def _flatten(index: ModelIndex, ids: Mapping[str, list[str]]) -> _Flat:
    """`ids`: the node ids of each graph (the cost report has them: naming 160k nodes again cost 0.5 s)."""
    col = _Collector(index)
    for entry in index.graphs.values():
        col.graph(entry, ids[entry.path])
    col.outer_reads()
    n = len(col.ids)
    kinds = list(col.kind_of)
    kind, arity, prod, code, rank0, weight = (col.array(name) for name in _PARTS)
    compute = (np.asarray(col.folded, np.int64) < 0) & (kind != col.kind_of.get("Constant", -1))
    start = np.concatenate([[0], np.cumsum(arity)[:-1]]).astype(np.int64)
    node_of = np.repeat(np.arange(n), arity)  # the node of each input
    # the consumers: distinct (producer, compute consumer) pairs; one of them and no graph output -> next
    nxt = np.full(n, -1, np.int64)
    edge_p, edge_c = np.concatenate(col.edge_p), np.concatenate(col.edge_c)
    if len(edge_p):
        pairs = _distinct(edge_p * n + edge_c)
        producer, first, counts = _runs(pairs // n)
        sole = counts == 1
        nxt[producer[sole]] = pairs[first[sole]] % n
    nxt[np.asarray(col.ends, np.int64)] = -1
    buckets = {}
    for a in _distinct(arity).tolist():
        nodes = np.flatnonzero(arity == a)
        at = start[nodes][:, None] + np.arange(a)
        buckets[a] = (nodes, prod[at], code[at])
    made = prod >= 0
    counts = np.bincount(node_of[made], minlength=n)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    flags, lba, residual = _hint_arrays(kinds, kind, arity, code, node_of, rank0, prod, weight >= 0)
    commutative = _kind_table(kinds, COMMUTATIVE.__contains__)[kind].astype(bool)
    return _Flat(
        col.ids, kinds, kind, compute, commutative, flags * compute, lba, residual, weight, nxt, buckets,
        indptr, prod[made], len(index.graphs),
    )  # fmt: skip


def _hint_arrays(kinds, kind, arity, code, node_of, rank0, prod, linear) -> tuple[np.ndarray, ...]:
    """The hint facts of every node: _F_* bits, and where a linear + bias + activation (residual form) ends."""
    n = len(kind)

    def per_kind(test) -> np.ndarray:
        return _kind_table(kinds, test)[kind].astype(bool)

    attention = per_kind(lambda op: op == "Softmax" or op.endswith("Attention"))
    moe = per_kind(lambda op: op in ("TopK", "MoE", "QMoE")) | (
        per_kind(lambda op: op.startswith("Gather")) & (rank0 >= 3)
    )
    flags = np.where(attention, _F_ATTN, 0) | np.where(moe, _F_MOE, 0)
    made = prod >= 0
    parent, child = node_of[made], prod[made]

    def below(root: np.ndarray) -> np.ndarray:
        """Per node: the largest `root` among its producers (-1 when none has one)."""
        out = np.full(n, -1, np.int64)
        np.maximum.at(out, parent, root[child])
        return out

    weight_in, constant_in = (np.bincount(node_of[code == c], minlength=n) > 0 for c in (WEIGHT, CONSTANT))
    add = per_kind(lambda op: op == "Add")
    residual_add = add & ~weight_in & ~constant_in
    act = per_kind(lambda op: op in ACTIVATIONS)
    own_bias = linear & (arity >= _kind_table(kinds, lambda op: BIAS_INSIDE.get(op, 1 << 30))[kind])
    lin = np.where(linear, np.arange(n), -1)
    biased = np.where(own_bias, lin, np.where(add & weight_in, below(lin), -1))
    lba = np.where(act, np.where(per_kind(lambda op: op == "BiasGelu"), below(lin), below(biased)), -1)
    after = np.where(residual_add, below(lba), -1)  # x + act(linear + b)
    before = np.where(act, below(np.where(residual_add, below(biased), -1)), -1)  # act(linear + b + x)
    return flags.astype(np.int64), lba, np.maximum(after, before)


# -- chains and cones --------------------------------------------------------------------------


@dataclass
class _Family:
    """The kept groups of one kind, and the (group, node) pairs their sites cover, each once."""

    kind: str
    texts: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    examples: list[tuple[str, ...]] = field(default_factory=list)
    first: list[np.ndarray] = field(default_factory=list)  # the nodes of each group's first site
    cover_g: list[np.ndarray] = field(
        default_factory=list
    )  # blocks of distinct pairs, sorted, groups in order
    cover_n: list[np.ndarray] = field(default_factory=list)


def _sorted(a: np.ndarray) -> np.ndarray:
    return np.sort(a, kind="stable")


def _runs(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values, first positions and lengths of the runs of equal values in a sorted array."""
    if not len(a):
        return a, a, a
    first = np.flatnonzero(np.concatenate([[True], a[1:] != a[:-1]]))
    return a[first], first, np.diff(np.append(first, len(a)))


def _distinct(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values of an int array. np.unique's hash path (numpy 2.3+) took 2.4 s on the 3M
    coverage keys of a 160k-node graph, a sort 0.03 s."""
    return _runs(_sorted(a))[0]


def _dense_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's number among the distinct rows (lexicographic order), and its first row per number: the
    columns as the digits of one int64 key when their ranges allow (one sort), else made dense one column
    at a time; either is 20x faster than np.unique(axis=0) on 160k rows."""
    radix = [int(rows[:, j].max()) + 1 for j in range(rows.shape[1])]
    if math.prod(radix) < 1 << 62:
        code = rows[:, 0].copy()
        for j in range(1, rows.shape[1]):
            code = code * radix[j] + rows[:, j]
    else:
        code = np.zeros(len(rows), np.int64)
        for j in range(rows.shape[1]):
            _, code = np.unique(code * radix[j] + rows[:, j], return_inverse=True)
            code = code.reshape(-1)
    _, first, inv = np.unique(code, return_index=True, return_inverse=True)
    return inv.reshape(-1), first


def _dense(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(code, return_inverse=True, return_counts=True) without its values, by counting when the
    codes are small non-negative ints (signatures and kind numbers are), else by sorting."""
    if len(code) and code.min() >= 0 and code.max() < 4 * len(code) + 1024:
        counts = np.bincount(code)
        present = counts > 0
        return (np.cumsum(present) - 1)[code], counts[present]
    _, inv, counts = np.unique(code, return_inverse=True, return_counts=True)
    return inv.reshape(-1), counts


def _distinct_pairs(g: np.ndarray, nodes: np.ndarray, groups: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (group, node) pairs, sorted: marked in a groups x n table when it is not much larger than
    the pairs (a sort of the 3M coverage keys of a 160k-node graph took 0.2 s), else sorted."""
    if groups * n <= max(8 * len(g), 1 << 20):
        table = np.zeros((groups, n), bool)
        table[g, nodes] = True
        return np.nonzero(table)
    key = _distinct(g * n + nodes)
    return key // n, key % n


def _keep(code: np.ndarray, min_count: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Group rows by `code`: each row's kept group (-1: seen fewer than `min_count` times), the kept
    groups' counts, and each kept group's first `EXAMPLES` rows (rows are in node order)."""
    inv, counts = _dense(code)
    keep = counts >= min_count
    row_group = np.where(keep, np.cumsum(keep) - 1, -1)[inv.reshape(-1)]
    rows = np.flatnonzero(row_group >= 0)
    order = rows[np.argsort(row_group[rows], kind="stable")]
    kept = counts[keep]
    bounds = np.concatenate([[0], np.cumsum(kept)])
    return row_group, kept, [order[b : min(b + EXAMPLES, e)] for b, e in zip(bounds[:-1], bounds[1:])]


def _chains(flat: _Flat, min_len: int, max_len: int, min_count: int) -> _Family:
    """Op-kind n-grams along single-consumer paths: row r of `path` is one walk from a compute node."""
    fam = _Family("chain")
    path = np.flatnonzero(flat.compute)[:, None]
    code = flat.kind[path[:, 0]]
    n_kinds = len(flat.kinds)
    for length in range(1, max_len + 1):
        if length > 1:
            nxt = flat.nxt[path[:, -1]]
            alive = nxt >= 0
            path = np.column_stack([path[alive], nxt[alive]])
            # re-number the codes densely so code * n_kinds never overflows, however long the chain
            _, code = np.unique(code[alive] * n_kinds + flat.kind[nxt[alive]], return_inverse=True)
            code = code.reshape(-1)
        if not len(path):
            break
        if length < min_len:
            continue
        row_group, kept, firsts = _keep(code, min_count)
        base = len(fam.counts)
        for j, rows in enumerate(firsts):
            fam.texts.append("→".join(flat.kinds[k] for k in flat.kind[path[rows[0]]]))
            fam.sizes.append(length)
            fam.ops.append(length)
            fam.counts.append(int(kept[j]))
            fam.examples.append(tuple(flat.ids[i] for i in path[rows, 0]))
            fam.first.append(path[rows[0]])
        sel = row_group >= 0
        g, nodes = _distinct_pairs(
            np.repeat(row_group[sel], length), path[sel].ravel(), len(kept), len(flat.ids)
        )
        fam.cover_g.append(g + base)
        fam.cover_n.append(nodes)
    return fam


def _cones(flat: _Flat, max_depth: int, min_count: int) -> _Family:
    """Input trees to depth 2..max_depth. At depth d a node's signature is the row [kind, child codes] made
    unique, child codes being leaf labels or the children's depth d-1 signatures."""
    fam = _Family("cone")
    n = len(flat.ids)
    sig = np.zeros(n, np.int64)
    cut = np.zeros(n, bool)  # the tree at the previous depth was cut: some producer left out
    ops = np.ones(n, np.int64)
    tables: list[list[tuple[int, np.ndarray]]] = [[]]  # per depth: (first signature, unique rows) per arity
    texts: dict[tuple[int, int], str] = {}
    for d in range(1, max_depth + 1):
        new_sig, new_cut, new_ops = np.zeros(n, np.int64), np.zeros(n, bool), np.ones(n, np.int64)
        table, offset = [], 0
        for nodes, prod, leaf in flat.buckets.values():
            made = prod >= 0
            safe = np.where(made, prod, 0)
            codes = np.where(made, len(LEAVES) + sig[safe], leaf) if d > 1 else leaf
            comm = flat.commutative[nodes]
            if prod.shape[1] > 1 and comm.any():
                codes = codes.copy()
                codes[comm] = np.sort(codes[comm], axis=1)
            rows = np.column_stack([flat.kind[nodes], codes])
            inv, first = _dense_rows(rows)
            new_sig[nodes] = offset + inv
            table.append((offset, rows[first]))
            offset += len(first)
            new_cut[nodes] = (made & cut[safe]).any(axis=1) if d > 1 else made.any(axis=1)
            if d > 1:
                new_ops[nodes] = 1 + np.where(made, ops[safe], 0).sum(axis=1)
        tables.append(table)
        roots = np.flatnonzero(flat.compute & cut) if d > 1 else np.empty(0, np.int64)
        if len(roots):
            _add_cones(fam, flat, d, roots, new_sig, new_ops, min_count, tables, texts)
        sig, cut, ops = new_sig, new_cut, new_ops
    return fam


def _add_cones(fam, flat, d, roots, sig, ops, min_count, tables, texts) -> None:
    row_group, kept, firsts = _keep(sig[roots], min_count)
    base = len(fam.counts)
    for j, rows in enumerate(firsts):
        root = roots[rows[0]]
        fam.texts.append(_cone_text(flat, tables, d, int(sig[root]), texts))
        fam.sizes.append(d)
        fam.ops.append(int(ops[root]))
        fam.counts.append(int(kept[j]))
        fam.examples.append(tuple(flat.ids[i] for i in roots[rows]))
        fam.first.append(_tree(flat, root, d))
    sel = row_group >= 0
    n, groups = len(flat.ids), len(kept)
    g, nodes = row_group[sel], roots[sel]
    cover_g, cover_n = [g], [nodes]
    for _ in range(d - 1):  # the ops of each level below the root, each (group, node) once per level
        g, nodes = _distinct_pairs(*_children(g, nodes, flat.indptr, flat.children), groups, n)
        cover_g.append(g)
        cover_n.append(nodes)
    g, nodes = _distinct_pairs(np.concatenate(cover_g), np.concatenate(cover_n), groups, n)
    fam.cover_g.append(g + base)
    fam.cover_n.append(nodes)


def _tree(flat: _Flat, root: int, depth: int) -> np.ndarray:
    """The ops of one cone: `root` and its compute producers, `depth` levels in all."""
    g, nodes = np.zeros(1, np.int64), np.asarray([root], np.int64)
    out = [nodes]
    for _ in range(depth - 1):
        g, nodes = _children(g, nodes, flat.indptr, flat.children)
        out.append(nodes)
    return np.unique(np.concatenate(out))


def _children(g: np.ndarray, nodes: np.ndarray, indptr: np.ndarray, children: np.ndarray):
    """(group, child) for every compute producer of every (group, node): a CSR gather."""
    deg = indptr[nodes + 1] - indptr[nodes]
    first = np.repeat(indptr[nodes], deg)
    within = np.arange(int(deg.sum())) - np.repeat(np.cumsum(deg) - deg, deg)
    return np.repeat(g, deg), children[first + within]


def _cone_text(flat: _Flat, tables, d: int, s: int, memo: dict[tuple[int, int], str]) -> str:
    """`Relu(Add(MatMul(*, weight), weight))`: signature `s` of depth `d` decoded from its unique row."""
    key = (d, s)
    if key not in memo:
        table = tables[d]
        offset, uniq = table[bisect.bisect_right([o for o, _ in table], s) - 1]
        row = uniq[s - offset]
        args = [
            LEAVES[c] if c < len(LEAVES) else _cone_text(flat, tables, d - 1, int(c) - len(LEAVES), memo)
            for c in row[1:]
        ]
        kind = flat.kinds[row[0]]
        memo[key] = f"{kind}({', '.join(args)})" if args else kind
    return memo[key]


# -- costs, shares and hints ----------------------------------------------------------------------


@dataclass
class _Column:
    """One cost per node as a matrix over monomials (one column, the constant, when all are numbers)."""

    values: np.ndarray  # nodes x monomials
    monos: list  # the monomial of each column; () is the constant
    unknown: np.ndarray  # bool per node: the cost is None (left out of every sum)
    at: np.ndarray = field(default_factory=lambda: np.ones(1))  # each monomial's value at the share dims
    total: np.ndarray = field(init=False)  # the model's cost: what the shares are of

    def __post_init__(self) -> None:
        self.total = self.values.sum(axis=0)

    @property
    def total_number(self) -> float | None:
        return self.number(self.total)

    @property
    def total_text(self) -> str:
        return self.text(self.total)

    @property
    def total_at(self) -> float:
        return float(self.total @ self.at)

    def sums(self, g: np.ndarray, nodes: np.ndarray, groups: int) -> np.ndarray:
        """groups x monomials: the cost of each group's nodes (a column of zeros sums to zeros)."""
        cols = [
            np.bincount(g, weights=np.ascontiguousarray(col)[nodes], minlength=groups)
            if col.any()
            else np.zeros(groups)
            for col in self.values.T
        ]
        return np.stack(cols, axis=1)

    def number(self, vec: np.ndarray) -> float | None:
        return float(vec[0]) if not vec[1:].any() else None

    def text(self, vec: np.ndarray) -> str:
        if not vec[1:].any():
            return to_text(_exact(vec[0]))
        return to_text(Poly({m: _exact(c) for m, c in zip(self.monos, vec, strict=True)}))

    def share(self, vec: np.ndarray) -> float | None:
        """part / total, symbols at the share dims (exact whenever part and total are proportional)."""
        whole = float(self.total @ self.at)
        part = float(vec @ self.at) / whole if whole else math.nan
        return part if math.isfinite(part) else None

    def evaluate_at(self, share_dims: dict[str, int]) -> None:
        self.at = np.asarray([_number_at(m, share_dims) for m in self.monos], np.float64)


def _number_at(mono, share_dims: Mapping[str, int]) -> float:
    v = Poly({mono: 1}).evaluate(share_dims) if mono else 1
    return float(v) if not isinstance(v, Poly) else float("nan")


def _share_dims(columns: Sequence[_Column], report: Report, dims: Mapping[str, int] | None) -> dict[str, int]:
    """The value each free symbol takes in the shares: 1 for a symbol on axis 0 of some input, else 64,
    as `record` and `--profile` feed the model (`run.feeds.resolve_shapes`)."""
    syms: set[str] = set()
    for c in columns:
        for m in c.monos:
            if m:
                syms |= Poly({m: 1}).symbols()
    if not syms:
        return {}
    from ..run.feeds import DEFAULT_BATCH, DEFAULT_DIM  # only here: run brings onnxruntime and pyarrow

    given = dict(dims or {})
    return {
        s: given.get(s, DEFAULT_BATCH if report.symbols.get(s, "").endswith("[0]") else DEFAULT_DIM)
        for s in sorted(syms)
    }


def _exact(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def _column(parts: list[list]) -> _Column:
    """Per node, the sum of its costs, one list per part (any None makes the node unknown). The parts are
    added into the matrix, not as Polys: Poly sums were 2.8 s of 6.6 on a symbolic 160k-node graph. Each
    distinct value is split into its terms once, the values told apart by C-level maps: a symbolic 160k-node
    graph has a handful of distinct costs in 480k Poly objects, and a Python call per object took 1.5 s."""
    n = len(parts[0])
    types = [set(map(type, part)) for part in parts]
    unknown = np.zeros(n, bool)
    for part, ts in zip(parts, types, strict=True):
        if type(None) in ts:
            unknown |= np.fromiter(map(operator.is_, part, repeat(None)), bool, n)
    if not any(issubclass(t, Poly) for ts in types for t in ts):
        rows = zip(*parts, strict=True)
        if not unknown.any():
            return _Column(np.fromiter(map(float, map(sum, rows)), np.float64, n)[:, None], [()], unknown)
        sums = (0.0 if u else float(sum(v)) for v, u in zip(rows, unknown.tolist(), strict=True))
        return _Column(np.fromiter(sums, np.float64, n)[:, None], [()], unknown)
    keys = [_value_keys(part, ts) for part, ts in zip(parts, types, strict=True)]
    first: dict = {}  # value -> where it is first given: part p, node i at p * n + i
    pos = np.stack(
        [np.fromiter(map(first.setdefault, k, count(p * n)), np.int64, n) for p, k in enumerate(keys)], 1
    )
    uniq, vid = np.unique(pos, return_inverse=True)
    vid = vid.reshape(n, len(parts))
    seen = vid[~unknown].ravel()  # the monomials are numbered in the order the known nodes give them
    order = np.argsort(seen, kind="stable")
    monos: dict = {(): 0}
    at, cols, coefs = [], [], []
    for j in seen[np.sort(order[_runs(seen[order])[1]])].tolist():
        p, i = divmod(int(uniq[j]), n)
        value = keys[p][i]
        for m, c in value if isinstance(value, tuple) else () if value is None else (((), value),):
            at.append(j)
            cols.append(monos.setdefault(m, len(monos)))
            coefs.append(c)
    terms = np.zeros((len(uniq), len(monos)))
    terms[np.asarray(at, np.int64), np.asarray(cols, np.int64)] = np.asarray(coefs, np.float64)
    mat = np.zeros((n, len(monos)))
    for p in range(len(parts)):  # part by part, in the order the sums add them
        mat += terms[vid[:, p]]
    mat[unknown] = 0.0
    return _Column(mat, list(monos), unknown)


def _value_keys(part: list, types: set) -> list:
    """Each cost as a dict key: a Poly by its terms in order (a tuple hashes and compares in C), a number or
    None as it is."""
    if types == {Poly}:
        return list(map(tuple, map(dict.items, map(_TERMS, part))))
    if not any(issubclass(t, Poly) for t in types):
        return part
    return [tuple(x.terms.items()) if isinstance(x, Poly) else x for x in part]


_TERMS = operator.attrgetter("terms")


def _records_by_graph(report: Report, index: ModelIndex) -> dict[str, list[OpCost]]:
    """The report's records of each graph, in node order: the ids and costs of the flat numbering."""
    out: dict[str, list[OpCost]] = {path: [] for path in index.graphs}
    for r in report.records:
        if r.graph not in out:
            break
        out[r.graph].append(r)
    if any(len(recs) != len(index[path].graph.node) for path, recs in out.items()):
        raise OpscopeError(
            f"the cost report ({report.model}) does not price this model node for node",
            hint="pass the report `analyze` gave for the same model, or none",
        )
    return out


def _cost_columns(records: list[OpCost]) -> tuple[_Column, _Column]:
    """FLOPs and bytes per node from the analyzer's records (repeat applied; a branch not counted is 0)."""
    counted, modelled = (list(map(operator.attrgetter(f), records)) for f in ("counted", "modelled"))
    flops = list(map(operator.attrgetter("flops"), records))
    nbytes = [
        list(map(operator.attrgetter(f), records)) for f in ("bytes_read", "bytes_weights", "bytes_written")
    ]
    if not all(modelled):
        flops = [f if m else None for f, m in zip(flops, modelled, strict=True)]
    if not all(counted):
        flops, *nbytes = (
            [v if c else 0 for v, c in zip(part, counted, strict=True)] for part in (flops, *nbytes)
        )
    return _column([flops]), _column(nbytes)


def _patterns(flat: _Flat, fam: _Family, flops: _Column, nbytes: _Column) -> list[Pattern]:
    groups = len(fam.counts)
    if not groups:
        return []
    g, nodes = np.concatenate(fam.cover_g), np.concatenate(fam.cover_n)  # each covered node once per group
    covered = np.bincount(g, minlength=groups)
    f, b = flops.sums(g, nodes, groups), nbytes.sums(g, nodes, groups)
    unknown = np.bincount(g, weights=(flops.unknown | nbytes.unknown)[nodes], minlength=groups)
    flags = np.bitwise_or.reduceat(flat.flags[nodes], np.concatenate([[0], np.cumsum(covered)[:-1]]))
    shared = _shared_weights(flat.weight[nodes], g, groups)
    out = []
    for j in range(groups):
        site = fam.first[j]
        hint = _hint(int(flags[j]), bool(shared[j]), _closed(flat.lba, site), _closed(flat.residual, site))
        out.append(
            Pattern(
                kind=fam.kind,
                pattern=fam.texts[j],
                size=fam.sizes[j],
                ops=fam.ops[j],
                count=fam.counts[j],
                score=fam.counts[j] * fam.ops[j],
                nodes=int(covered[j]),
                flops=flops.number(f[j]),
                flops_expr=flops.text(f[j]),
                flops_share=flops.share(f[j]),
                bytes=nbytes.number(b[j]),
                bytes_expr=nbytes.text(b[j]),
                bytes_share=nbytes.share(b[j]),
                unknown_nodes=int(unknown[j]),
                hint=hint,
                examples=fam.examples[j],
            )
        )
    out.sort(key=lambda p: (-p.score, -p.count, p.pattern))
    return out


def _shared_weights(weight: np.ndarray, g: np.ndarray, groups: int) -> np.ndarray:
    """Per group: whether two of its covered linear nodes read the same weight."""
    has = weight >= 0
    out = np.zeros(groups, bool)
    if has.any():
        span = int(weight.max()) + 1
        key, _, counts = _runs(_sorted(g[has] * span + weight[has]))
        out[key[counts > 1] // span] = True
    return out


def _closed(root: np.ndarray, site: np.ndarray) -> bool:
    """Whether a node of the site ends a linear + bias + activation whose linear node (`root`) is in the site
    too. One site decides for all: they have the same structure, and unions over sites would join the tail
    of one layer to the head of the next."""
    ends = root[site]
    return bool(np.isin(ends[ends >= 0], site).any())


def _hint(flags: int, shared: bool, lba: bool, residual: bool) -> str:
    if flags & _F_MOE:
        return "MoE block"
    if flags & _F_ATTN:
        return "attention block"
    if shared:
        return "shared projection"
    if residual:
        return "linear+bias+activation+residual"
    if lba:
        return "linear+bias+activation"
    return "decompose once, reuse"


# -- output ------------------------------------------------------------------------------------


def _arrow_schema():
    import pyarrow as pa

    s, i, f = pa.string(), pa.int64(), pa.float64()
    return pa.schema(
        [
            ("kind", s), ("pattern", s), ("size", i), ("ops", i), ("count", i), ("score", i), ("nodes", i),
            ("flops", f), ("flops_expr", s), ("flops_share", f), ("bytes", f), ("bytes_expr", s),
            ("bytes_share", f), ("unknown_nodes", i), ("hint", s), ("action", s), ("examples", s),
            ("model_sha256", s),
        ]
    )  # fmt: skip


def _arrow_column(values: list, kind):
    """One column from its Python values (None is null) by its buffers: pa.array and Table.from_pylist
    import pandas, 0.5 s of writing a table of a few hundred rows."""
    import pyarrow as pa

    n = len(values)
    if kind == pa.string():
        enc = [v.encode() for v in values]
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum([len(e) for e in enc], out=offsets[1:])
        return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(enc))])
    missing = np.fromiter((v is None for v in values), bool, n)
    data = np.asarray([0 if v is None else v for v in values], np.int64 if kind == pa.int64() else np.float64)
    valid = pa.py_buffer(np.packbits(~missing, bitorder="little")) if missing.any() else None
    return pa.Array.from_buffers(kind, n, [valid, pa.py_buffer(data)], null_count=int(missing.sum()))


def print_motifs(
    motifs: Motifs, top: int = 15, file: IO[str] | None = None, width: int | None = None
) -> None:
    """Print the best `top` chains and cones as rich tables to `file` (stdout by default)."""
    from rich.console import Console
    from rich.table import Table

    from .table import si

    con = Console(file=file, highlight=False)
    if width or not con.is_terminal:
        con.width = width or 150
    t, s = motifs.totals, motifs.settings
    at = f" at {', '.join(f'{k}={v}' for k, v in s['share_dims'].items())}" if s["share_dims"] else ""
    con.print(
        f"[bold]{motifs.model}[/bold]: {t['nodes']} nodes in {t['graphs']} graph(s), "
        f"{si(t['flops_at_share_dims'], 'FLOP')} and {si(t['bytes_at_share_dims'], 'B')} moved{at}; "
        f"chains of {s['min_len']}..{s['max_len']} ops, cones of depth 2..{s['max_depth']}, "
        f"kept when seen {s['min_count']}+ times"
    )
    if at:
        con.print("(free symbols at the sizes `record` feeds them; give --dim NAME=V or --shape for others)")
    if t["unknown_nodes"]:
        con.print(
            f"[yellow]{t['unknown_nodes']} nodes of unknown cost[/yellow] are left out of the FLOP and byte shares"
        )
    for title, pats, size in (("chains", motifs.chains, "len"), ("cones", motifs.cones, "depth")):
        tab = Table(
            title=f"repeated {title}: top {min(top, len(pats))} of {len(pats)} by score", title_justify="left"
        )
        for col in ("pattern", "count", size, "ops", "score", "FLOP %", "byte %", "hint", "examples"):
            right = col not in ("pattern", "hint", "examples")
            tab.add_column(col, justify="right" if right else "left", overflow="fold")
        for p in pats[:top]:
            tab.add_row(
                _clip(p.pattern, 90), str(p.count), str(p.size), str(p.ops), si(p.score), _pct(p.flops_share),
                _pct(p.bytes_share), p.hint, _clip(", ".join(p.examples[:2]), 40),
            )  # fmt: skip
        con.print(tab)
    for h in sorted({p.hint for p in motifs.chains[:top] + motifs.cones[:top]}, key=list(HINTS).index):
        con.print(f"{h}: {HINTS[h]}")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"
