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
through a next-node array. On the 160k-node chain of `scripts/bench_analyze.py` that is 3.4 s
of CPU on top of the 10.6 s `analyze` took on the same loaded 2-core machine: 1.9 s reading
the nodes' inputs and outputs from the protobuf, 1.2 s numpy, 0.3 s the costs.
Order is deterministic: by score, then count, then the pattern's text.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
from onnx import ModelProto, TensorProto

from ..errors import OpscopeError
from ..files import write_document
from ..graph.index import GraphEntry, ModelIndex
from ..graph.io import ModelLike, file_sha256, load_model, model_sha256
from ..graph.proto import DEFAULT_DOMAINS, constant_value, op_set
from ..shapes.symbolic import Poly, to_text
from .costs import OpCost, Report, analyze
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
        table = pa.Table.from_pylist(rows, schema=schema) if rows else schema.empty_table()
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
    proto = load_model(model)
    if report is None:
        report = analyze(proto, shapes, dims, symbolic=symbolic)
        name = str(model) if not isinstance(model, ModelProto) else (proto.graph.name or "<model>")
        sha = model_sha256(proto) if isinstance(model, ModelProto) else file_sha256(model)
    else:
        name, sha = report.model, report.model_sha256
    index = ModelIndex(proto)
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


class _Collector:
    """One pass over the protobuf into flat lists (state: the lists, filled graph by graph). Per input of
    each node: its producer (-1 for a leaf) and its leaf code; the rest is numpy in `_flatten`."""

    def __init__(self, index: ModelIndex):
        self.index = index
        self.ids: list[str] = []
        self.kind_of: dict[str, int] = {}
        self.kind: list[int] = []
        self.folded: list[int] = []  # per node: the leaf code of its outputs when it is folded, else -1
        self.arity: list[int] = []
        self.prod: list[int] = []  # per input, all nodes' inputs end to end
        self.code: list[int] = []
        self.rank0: list[int] = []  # rank of input 0 when it is a constant (an expert gather's stack)
        self.weight: list[int] = []  # a linear node's first weight, numbered; else -1
        self.weight_of: dict[str, int] = {}
        self.edge_p: list[int] = []  # (producer, compute consumer) pairs
        self.edge_c: list[int] = []
        self.ends: list[int] = []  # nodes that make a graph output
        self.made: dict[str, dict[str, int]] = {}  # graph path -> its `where` (see graph)
        self.outer: list[tuple[GraphEntry, str]] = []  # (subgraph, name it reads from a graph around it)
        self.ranks: dict[str, int] = {}  # constants of rank 3+ (an expert gather reads such a stack)
        self.base: dict[str, int] = {}  # graph path -> number of its first node

    def graph(self, entry: GraphEntry, ids: list[str]) -> None:
        base = self.base[entry.path] = len(self.ids)
        self.ids.extend(ids)
        nodes = entry.graph.node
        # name -> its producer's number (>= 0), or ~leaf code for a constant or an input (< 0)
        where: dict[str, int] = {}
        for i, node in enumerate(nodes):
            for o in node.output:
                if o and o not in where:
                    where[o] = base + i
        self.ends.extend(where[o] for o in entry.outputs if o in where)
        for i in entry.graph.input:
            where.setdefault(i.name, ~INPUT)
        ranks = self.ranks
        for name, c in entry.constants.items():
            code, rank = _leaf(c)
            where[name] = ~code
            if rank >= 3:
                ranks[name] = rank
        self.made[entry.path] = where
        for i, node in enumerate(nodes):
            self.node(base + i, node, where, entry)

    def node(self, gid: int, node, where: dict[str, int], entry: GraphEntry) -> None:
        op = node.op_type
        domain = node.domain
        kind_of = self.kind_of
        self.kind.append(
            kind_of.setdefault(op if domain in DEFAULT_DOMAINS else f"{domain}.{op}", len(kind_of))
        )
        folded, prod, code = self.folded, self.prod, self.code
        data_in = weight_in = False
        first_weight = None
        rank0 = n = 0
        for x in node.input:
            if not x:
                continue
            n += 1
            w = where.get(x)
            if w is None:  # a value of a graph around this one (or, in the main graph, undefined)
                c = None
                if entry.parent is not None:
                    self.outer.append((entry, x))
                    c = self.index.constant(entry.parent, x)
                leaf, rank = _leaf(c) if c is not None else (INPUT, 0)
                w = where[x] = ~leaf
                if rank >= 3:
                    self.ranks[x] = rank
            if w >= 0 and (
                w > gid or folded[w] < 0
            ):  # (a producer after its consumer: not topological, data)
                data_in = True
                prod.append(w)
                code.append(CUT)
                continue
            leaf = ~w if w < 0 else folded[w]
            if leaf == INPUT:
                data_in = True
            elif leaf == WEIGHT:
                weight_in = True
                first_weight = first_weight or x
            if n == 1:
                rank0 = self.ranks.get(x, 0)
            prod.append(-1)
            code.append(leaf)
        if op in SHAPE_SOURCES:
            folded.append(CONSTANT)
        elif n and not data_in and op not in CONTROL_FLOW:
            folded.append(WEIGHT if weight_in else CONSTANT)
        else:
            folded.append(-1)
        self.arity.append(n)
        self.rank0.append(rank0)
        if folded[-1] < 0 and op != "Constant":
            for p in prod[len(prod) - n :]:
                if p >= 0:
                    self.edge_p.append(p)
                    self.edge_c.append(gid)
        linear = op in LINEAR and first_weight is not None
        self.weight.append(self.weight_of.setdefault(first_weight, len(self.weight_of)) if linear else -1)

    def outer_reads(self) -> None:
        """A value read inside a subgraph is consumed, in the graph that makes it, by the subgraph's owner."""
        for entry, name in self.outer:
            self._edge_to_owner(entry, name)

    def _edge_to_owner(self, entry: GraphEntry, name: str) -> None:
        while entry.parent is not None:
            parent = self.index[entry.parent]
            p = self.made[parent.path].get(name)
            if p is not None and p >= 0:
                if self.folded[p] < 0:
                    self.edge_p.append(p)
                    self.edge_c.append(self.base[parent.path] + entry.owner_index)
                return
            if p is not None and (p != ~INPUT or any(i.name == name for i in parent.graph.input)):
                return  # a constant, or an input of that graph: no node consumes from
            entry = parent


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
    kind = np.asarray(col.kind, np.int64)
    compute = (np.asarray(col.folded, np.int64) < 0) & (kind != col.kind_of.get("Constant", -1))
    arity = np.asarray(col.arity, np.int64)
    prod = np.asarray(col.prod, np.int64)
    code = np.asarray(col.code, np.int64)
    start = np.concatenate([[0], np.cumsum(arity)[:-1]]).astype(np.int64)
    node_of = np.repeat(np.arange(n), arity)  # the node of each input
    # the consumers: distinct (producer, compute consumer) pairs; one of them and no graph output -> next
    nxt = np.full(n, -1, np.int64)
    if col.edge_p:
        pairs = _distinct(np.asarray(col.edge_p, np.int64) * n + np.asarray(col.edge_c, np.int64))
        producer, first, counts = _runs(pairs // n)
        sole = counts == 1
        nxt[producer[sole]] = pairs[first[sole]] % n
    nxt[np.asarray(col.ends, np.int64)] = -1
    buckets = {}
    for a in np.unique(arity).tolist():
        nodes = np.flatnonzero(arity == a)
        at = start[nodes][:, None] + np.arange(a)
        buckets[a] = (nodes, prod[at], code[at])
    made = prod >= 0
    counts = np.bincount(node_of[made], minlength=n)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    weight = np.asarray(col.weight, np.int64)
    rank0 = np.asarray(col.rank0, np.int64)
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
    """The kept groups of one kind, and the (group, node) pairs their sites cover (duplicates allowed)."""

    kind: str
    texts: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    examples: list[tuple[str, ...]] = field(default_factory=list)
    first: list[np.ndarray] = field(default_factory=list)  # the nodes of each group's first site
    cover_g: list[np.ndarray] = field(default_factory=list)
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
    """Each row's number among the distinct rows (lexicographic order), and one row index per number: one
    column at a time, 20x faster than np.unique(axis=0) on 160k rows."""
    code = np.zeros(len(rows), np.int64)
    for j in range(rows.shape[1]):
        col = rows[:, j]
        _, code = np.unique(code * (int(col.max()) + 1) + col, return_inverse=True)
        code = code.reshape(-1)
    _, first, inv = np.unique(code, return_index=True, return_inverse=True)
    return inv.reshape(-1), first


def _keep(code: np.ndarray, min_count: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Group rows by `code`: each row's kept group (-1: seen fewer than `min_count` times), the kept
    groups' counts, and each kept group's first `EXAMPLES` rows (rows are in node order)."""
    _, inv, counts = np.unique(code, return_inverse=True, return_counts=True)
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
        fam.cover_g.append(np.repeat(row_group[sel] + base, length))
        fam.cover_n.append(path[sel].ravel())
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
    g, nodes = row_group[sel] + base, roots[sel]
    cover_g, cover_n = [g], [nodes]
    for _ in range(d - 1):  # the ops of each level below the root, each (group, node) once per level
        g, nodes = _children(g, nodes, flat.indptr, flat.children)
        key = _distinct(g * len(flat.ids) + nodes)
        g, nodes = key // len(flat.ids), key % len(flat.ids)
        cover_g.append(g)
        cover_n.append(nodes)
    fam.cover_g.extend(cover_g)
    fam.cover_n.extend(cover_n)


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
        """groups x monomials: the cost of each group's nodes."""
        cols = [
            np.bincount(g, weights=self.values[nodes, t], minlength=groups) for t in range(len(self.monos))
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


def _column(values: list[tuple]) -> _Column:
    """Per node, the sum of a tuple of costs (any None makes it unknown). The parts are added into the
    matrix, not as Polys: Poly sums were 2.8 s of 6.6 on a symbolic 160k-node graph."""
    n = len(values)
    unknown = np.fromiter((any(x is None for x in v) for v in values), bool, n)
    if not any(isinstance(x, Poly) for v in values for x in v):
        col = np.fromiter((0.0 if u else float(sum(v)) for v, u in zip(values, unknown)), np.float64, n)
        return _Column(col[:, None], [()], unknown)
    monos: dict = {(): 0}
    rows, cols, coefs = [], [], []
    for i, v in enumerate(values):
        if unknown[i]:
            continue
        for x in v:
            for m, c in x.terms.items() if isinstance(x, Poly) else (((), x),):
                rows.append(i)
                cols.append(monos.setdefault(m, len(monos)))
                coefs.append(c)
    mat = np.zeros((n, len(monos)))
    np.add.at(mat, (np.asarray(rows, np.int64), np.asarray(cols, np.int64)), np.asarray(coefs, np.float64))
    return _Column(mat, list(monos), unknown)


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
    flops = [((r.flops if r.modelled else None),) if r.counted else (0,) for r in records]
    nbytes = [(r.bytes_read, r.bytes_weights, r.bytes_written) if r.counted else (0,) for r in records]
    return _column(flops), _column(nbytes)


def _patterns(flat: _Flat, fam: _Family, flops: _Column, nbytes: _Column) -> list[Pattern]:
    groups = len(fam.counts)
    if not groups:
        return []
    n = len(flat.ids)
    key = _distinct(np.concatenate(fam.cover_g) * n + np.concatenate(fam.cover_n))
    g, nodes = key // n, key % n  # each covered node once per group, groups in order
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
