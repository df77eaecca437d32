"""fp16 / bf16 headroom: which float32 tensors a half-precision model cannot hold, and what to keep in fp32.

Every float32 tensor of the model is tapped, whatever op makes it (LayerNormalization, Pow,
ReduceMean, Softmax, Add inputs: the site kinds of `sites` cover none of these), in the main
graph and in `If` / `Loop` / `Scan` bodies, with one small reduction per tensor built in the
graph (`_build_tap`): max |x| and min nonzero |x| over the finite values, and exact int64
counts of NaN, ±Inf, values above the target's largest finite value (overflow: they become
±Inf or saturate), values below its smallest subnormal (underflow: they flush to zero or
lose all precision) and subnormal values. Only 2 floats and 6 int64 leave the device per
tensor and batch; batches merge on the host by max / min / sum, so memory is flat in the
number of batches. Weights (initializers, Constant values) are checked on the host with numpy
(`host_stats`, also the numpy reference of the graph reduction), one tensor at a time.

The block list answers "which nodes must stay float32 so the converted model stays finite",
for onnxconverter-common's `convert_float_to_float16(model, node_block_list=...)`, which keeps
a blocked node in fp32 by casting its inputs up and its outputs back *down* to fp16. Keeping
only the producer of an overflowing tensor is therefore not enough: the cast after it makes the
Inf. So the list holds the producer of every overflowing tensor *and every node reading it*
(the owner `If` / `Loop` / `Scan` when it is read inside a body), so the tensor never passes a
Cast to fp16; a reader whose own output is in range casts that down, which is safe. Weights
that overflow get their readers blocked, which keeps them in fp32 (the converter would clip
them). The same set is the TensorRT per-layer list (`trtexec_args`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, numpy_helper

from ..errors import OpscopeError, did_you_mean
from ..graph.build import Builder, Constants
from ..graph.expose import expose
from ..graph.index import GraphEntry, ModelIndex, iter_graphs
from ..graph.io import ModelLike, load_model, opset_version, without_weight_data
from ..graph.opset import MIN_TAP_OPSET
from ..graph.proto import constant_value, is_external, subgraphs
from ..graph.wire import splice
from ..run.feeds import FeedSpec, iter_feeds
from ..run.session import RuntimeConfig, for_tapped, make_session, run
from ..shapes import infer_shapes


@dataclass(frozen=True)
class Limits:
    """What a target float type can hold: its largest finite, smallest subnormal and smallest normal magnitude."""

    max: float
    tiny: float  # smallest subnormal: nonzero values below it are lost
    normal: float  # smallest normal: values in [tiny, normal) keep fewer mantissa bits


TARGETS: dict[str, Limits] = {
    "fp16": Limits(65504.0, 2.0**-24, 2.0**-14),  # IEEE binary16
    # bfloat16: float32's 8-bit exponent, a 7-bit mantissa
    "bf16": Limits(float(np.float32(3.3895313892515355e38)), 2.0**-133, 2.0**-126),
}
COUNTS = ("numel", "nan", "inf", "overflow", "underflow", "subnormal")
"""The int64 counts of each tap, in this order."""


@dataclass
class TensorStat:
    """One float32 tensor, merged over every batch (and Loop iteration) that made it.

    `producer`: the node id (`graph.index`) of the node making it, "" for a graph input or an
    initializer; `kind`: "activation", "input" or "weight". `max_abs` is 0 and `min_abs` inf
    when the tensor held no finite (nonzero) value; `runs` is 0 when it never ran (a branch not taken).
    """

    tensor: str
    graph: str
    producer: str
    op_type: str
    kind: str
    max_abs: float = 0.0
    min_abs: float = math.inf
    numel: int = 0
    nan: int = 0
    inf: int = 0
    overflow: int = 0
    underflow: int = 0
    subnormal: int = 0
    runs: int = 0

    def add(self, max_abs: float, min_abs: float, counts: Iterable[int]) -> None:
        """Merge one observation: max of maxima, min of minima, sums of counts."""
        if max_abs > self.max_abs:
            self.max_abs = float(max_abs)
        if min_abs < self.min_abs:
            self.min_abs = float(min_abs)
        for name, c in zip(COUNTS, counts):
            setattr(self, name, getattr(self, name) + int(c))
        self.runs += 1

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PrecisionReport:
    """What `check_precision` found: one TensorStat per float32 tensor, and the graph facts the lists need."""

    target: str
    limits: Limits
    tensors: list[TensorStat]
    batches: int
    readers: dict[tuple[str, str], list[str]] = field(repr=False)  # (graph, tensor) -> reading node ids
    node_names: dict[str, str] = field(repr=False)  # node id -> the name block lists use
    unnamed: set[str] = field(default_factory=set, repr=False)  # ids of nodes without a name of their own
    untyped: list[str] = field(default_factory=list)  # node outputs of unknown element type: not checked

    def __getitem__(self, tensor: str) -> TensorStat:
        for t in self.tensors:
            if t.tensor == tensor:
                return t
        names = [t.tensor for t in self.tensors]
        raise KeyError(f"{tensor!r} is not a checked tensor{did_you_mean(tensor, names)}")

    def overflowing(self, headroom: float = 1.0) -> list[TensorStat]:
        """Tensors with a value above the target's max (or, with `headroom` h > 1, above max / h), or
        non-finite ones that the float32 model did not have in its inputs. Largest first."""
        bound = self.limits.max / headroom
        hit = [t for t in self.tensors if t.overflow or t.max_abs > bound]
        return sorted(hit, key=lambda t: -t.max_abs)

    def underflowing(self) -> list[TensorStat]:
        """Tensors with nonzero values below the target's smallest subnormal (they flush to zero)."""
        return sorted((t for t in self.tensors if t.underflow), key=lambda t: -t.underflow / max(t.numel, 1))

    def blocked_ids(self, headroom: float = 1.0, weights: bool = True) -> list[str]:
        """Node ids to keep in float32: producers and readers of every overflowing tensor, in model order."""
        ids: set[str] = set()
        for t in self.overflowing(headroom):
            if t.kind == "weight" and not weights:
                continue
            if t.producer:
                ids.add(t.producer)
            ids.update(self.readers.get((t.graph, t.tensor), []))
        order = {nid: i for i, nid in enumerate(self.node_names)}
        return sorted(ids, key=lambda n: order.get(n, len(order)))

    def block_list(self, headroom: float = 1.0, weights: bool = True) -> list[str]:
        """`node_block_list` for onnxconverter-common's `convert_float_to_float16`.

        Names are the nodes' own names; a node without one is listed by its id, which it gets as
        its name from `name_nodes(model)`: convert that model (`convert_fp16` does it for you).
        Use `keep_io_types=True` when a model output overflows, or the output itself is fp16.
        """
        return [self.node_names[n] for n in self.blocked_ids(headroom, weights)]

    def layer_precisions(self, headroom: float = 1.0) -> list[str]:
        """TensorRT layers to pin to FP32: the block list (the ONNX parser names layers after nodes)."""
        return self.block_list(headroom)

    def trtexec_args(self, headroom: float = 1.0) -> list[str]:
        """trtexec flags building a half-precision engine with the blocked layers in FP32:
        `--fp16` (or `--bf16`), `--precisionConstraints=obey`, `--layerPrecisions=a:fp32,b:fp32`
        and `--layerOutputTypes=a:fp32,...` (outputs too, or TensorRT may store them in fp16)."""
        names = self.layer_precisions(headroom)
        args = [f"--{self.target}"]
        if names:
            spec = ",".join(f"{n}:fp32" for n in names)
            args += ["--precisionConstraints=obey", f"--layerPrecisions={spec}", f"--layerOutputTypes={spec}"]
        return args

    def overflowing_inputs(self) -> list[str]:
        """Graph inputs that overflow: no block list helps, the converter casts every float input to fp16."""
        return [t.tensor for t in self.overflowing() if t.kind == "input"]

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per tensor (for pandas / JSON), with the target and the limit."""
        return [{"target": self.target, "limit": self.limits.max, **t.to_dict()} for t in self.tensors]

    def summary(self, limit: int = 10) -> str:
        """A few lines for a terminal: the worst tensors and the size of the block list."""
        over, under = self.overflowing(), self.underflowing()
        lines = [
            f"{self.target}: {len(self.tensors)} float tensors over {self.batches} batches; "
            f"{len(over)} overflow (> {self.limits.max:.6g}), {len(under)} underflow (< {self.limits.tiny:.3g}); "
            f"block list: {len(self.block_list())} nodes"
        ]
        for t in over[:limit]:
            where = t.producer or t.kind
            lines.append(
                f"  overflow  {t.tensor} ({t.op_type} {where}): max|x| {t.max_abs:.4g}, {t.overflow} values"
            )
        lines += [
            f"  warning: input {n} overflows; no block list keeps it finite"
            for n in self.overflowing_inputs()
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The statistic: graph builder and its numpy reference


def _build_tap(b: Builder, x: str, lim: Limits) -> tuple[str, str]:
    """Nodes computing (float32 [max|x|, min nonzero |x|], int64 counts in COUNTS order) of x.

    Non-finite values are zeroed out of |x| first (IsNaN(x - x) marks NaN and ±Inf), so the
    range and the over / under counts are over finite values; ReduceMax of an empty tensor is -inf.
    """
    i64 = TensorProto.INT64
    a = b.op("Abs", [x])
    zero = b.const(0.0)
    af = b.where(b.nonfinite(x), zero, a)
    positive = b.op("Greater", [af, zero])
    mx = b.reduce("ReduceMax", af, keepdims=1, hint="maxabs")
    mn = b.reduce("ReduceMin", b.where(positive, af, b.const(np.inf)), keepdims=1, hint="minabs")
    floats = b.op("Concat", [b.flat(mx), b.flat(mn)], "range", axis=0)

    def count(mask: str) -> str:
        return b.flat(b.reduce("ReduceSum", b.cast(mask, i64), keepdims=1))

    below_tiny = b.op("Less", [af, b.const(lim.tiny)])
    parts = [
        b.flat(b.op("Size", [x])),
        count(b.isnan(x)),
        count(b.isinf(x)),
        count(b.op("Greater", [af, b.const(lim.max)])),
        count(b.op("And", [positive, below_tiny])),
        count(b.op("And", [b.op("Not", [below_tiny]), b.op("Less", [af, b.const(lim.normal)])])),
    ]
    return floats, b.op("Concat", parts, "counts", axis=0)


def host_stats(x: np.ndarray, target: str = "fp16") -> tuple[float, float, list[int]]:
    """(max |x|, min nonzero |x|, counts in COUNTS order) of float32 `x` on the host: what `_build_tap`
    computes in the graph (its numpy reference), and how weights are checked."""
    lim = _limits(target)
    x = np.asarray(x, np.float32)
    finite = np.isfinite(x)
    a = np.abs(np.where(finite, x, np.float32(0)))
    nz = a[a > 0]
    counts = [
        x.size,
        int(np.isnan(x).sum()),
        int(np.isinf(x).sum()),
        int((a > np.float32(lim.max)).sum()),
        int(((a > 0) & (a < np.float32(lim.tiny))).sum()),
        int(((a >= np.float32(lim.tiny)) & (a < np.float32(lim.normal))).sum()),
    ]
    return (float(a.max()) if a.size else 0.0), (float(nz.min()) if nz.size else math.inf), counts


# ---------------------------------------------------------------------------------------------
# Instrumenting every float tensor


@dataclass
class _Tap:
    stat: TensorStat
    floats: str = ""  # main-graph output names, set by expose
    counts: str = ""


def _limits(target: str) -> Limits:
    if target not in TARGETS:
        raise OpscopeError(
            f"unknown precision target {target!r}{did_you_mean(target, TARGETS)}; choose one of: {', '.join(TARGETS)}"
        )
    return TARGETS[target]


def _implicit_reads(index: ModelIndex, entry: GraphEntry, i: int) -> set[str]:
    """Names read inside the subgraphs of node i of `entry` (outer-scope reads included, nested too)."""
    names: set[str] = set()
    for child in index.children(entry.path, i):
        for _, _, node in index.nodes(child.path):
            names.update(x for x in node.input if x)
    return names


def _readers(index: ModelIndex) -> dict[tuple[str, str], list[str]]:
    """(graph path, tensor) -> ids of the nodes of that graph reading it, directly or inside their subgraphs."""
    out: dict[tuple[str, str], list[str]] = {}
    for entry in index.graphs.values():
        for i, node in enumerate(entry.graph.node):
            reads = {x for x in node.input if x}
            if node.attribute and subgraphs(node):
                reads |= _implicit_reads(index, entry, i)
            for name in reads:
                # a tensor read here belongs to the innermost scope defining it
                owner = next((e.path for e in index.scopes(entry.path) if e.defines(name)), None)
                if owner is not None:
                    out.setdefault((owner, name), []).append(entry.ids[i])
    return out


def _float_tensors(index: ModelIndex, dtypes: Mapping[str, int]) -> tuple[list[TensorStat], list[str]]:
    """Every float32 tensor computed at run time: main-graph inputs and every node output, all graphs.
    Returns (them, node outputs whose element type is unknown)."""
    found: list[TensorStat] = []
    untyped: list[str] = []
    main = index.main
    inits = {t.name for t in main.graph.initializer}
    for vi in main.graph.input:
        if vi.name not in inits and vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            found.append(TensorStat(vi.name, "", "", "input", "input"))
    for entry, i, node in index.nodes():
        if node.op_type == "Constant":  # a weight: checked on the host
            continue
        for out in node.output:
            if not out:
                continue
            elem = dtypes.get(out, 0)
            if elem == TensorProto.FLOAT:
                found.append(TensorStat(out, entry.path, entry.ids[i], node.op_type, "activation"))
            elif elem == 0:
                untyped.append(out)
    return found, untyped


def _instrument(model: ModelProto, lim: Limits) -> tuple[ModelProto, ModelIndex, list[_Tap], list[str]]:
    """A copy of `model` with every float32 tensor tapped; returns it, its index (of the source ids),
    the taps and the untyped tensors."""
    opset = opset_version(model)
    if opset < MIN_TAP_OPSET:
        raise OpscopeError(f"model uses opset {opset}; tapping needs opset {MIN_TAP_OPSET} or newer")
    m = ModelProto()
    m.CopyFrom(model)
    dtypes = infer_shapes(without_weight_data(m)).dtypes
    index = ModelIndex(m)
    stats, untyped = _float_tensors(index, dtypes)
    names = index.names()
    constants = Constants(names) if m.ir_version >= 4 else None
    taps = [_Tap(s) for s in stats]
    inserts: dict[str, dict[int, list[NodeProto]]] = {}
    raw: list[tuple[str, str]] = []
    for k, tap in enumerate(taps):
        entry = index[tap.stat.graph]
        b = Builder(opset, names, f"opscope_h{k}_", constants)
        raw.append(_build_tap(b, tap.stat.tensor, lim))
        pos = entry.producer_index(tap.stat.tensor)
        inserts.setdefault(entry.path, {}).setdefault(-1 if pos is None else pos, []).extend(b.nodes)
    for tap, (floats, counts) in zip(taps, raw):  # expose before splice: see graph.expose
        tap.floats = expose(index, tap.stat.graph, floats, TensorProto.FLOAT, 1, names)[0]
        tap.counts = expose(index, tap.stat.graph, counts, TensorProto.INT64, 1, names)[0]
    readers = ModelIndex(model)  # ids and readers from the untouched source
    for path in sorted(inserts, key=lambda p: -p.count("/")):
        splice(index[path].graph, inserts[path])
    if constants is not None:
        m.graph.initializer.extend(constants.tensors)
    return m, readers, taps, untyped


# ---------------------------------------------------------------------------------------------
# Weights on the host


def _weights(index: ModelIndex, target: str, base_dir: Path | None) -> list[TensorStat]:
    """Stats of every float32 initializer and Constant value, one tensor in memory at a time."""
    out: list[TensorStat] = []
    for entry in index.graphs.values():
        for t in entry.graph.initializer:
            if t.data_type == TensorProto.FLOAT:
                out.append(_weight_stat(t, entry.path, "", "initializer", target, base_dir))
        for i, node in enumerate(entry.graph.node):
            value = constant_value(node) if node.op_type == "Constant" else None
            if value is not None and value.data_type == TensorProto.FLOAT and node.output:
                v = TensorProto()
                v.CopyFrom(value)
                v.name = node.output[0]
                out.append(_weight_stat(v, entry.path, entry.ids[i], "Constant", target, base_dir))
    return out


def _weight_stat(
    t: TensorProto, graph: str, producer: str, op_type: str, target: str, base_dir: Path | None
) -> TensorStat:
    if is_external(t) and base_dir is None:
        raise OpscopeError(
            f"weight {t.name!r} is stored in an external file and the model's folder is unknown",
            hint="pass base_dir=<folder of the .onnx file>",
        )
    arr = numpy_helper.to_array(t, str(base_dir) if base_dir is not None else "")
    stat = TensorStat(t.name, graph, producer, op_type, "weight")
    stat.add(*host_stats(arr, target))
    return stat


# ---------------------------------------------------------------------------------------------
# The check


Feeds = FeedSpec | Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]] | None


def check_precision(
    model: ModelLike,
    feeds: Feeds = None,
    *,
    target: str = "fp16",
    runtime: RuntimeConfig | None = None,
    base_dir: str | Path | None = None,
) -> PrecisionReport:
    """Measure every float32 tensor of `model` against `target` ("fp16" or "bf16") on `feeds`.

    `feeds`: a FeedSpec (synthetic or `data`, as `record` takes), one feed dict, or any iterable
    of feed dicts (e.g. a list, a generator, onnxruntime CalibrationDataReader.get_next wrapped
    in `iter(reader.get_next, None)`); None: the default synthetic batches. Batches run one at a
    time on `runtime`'s providers and are merged on the host. `base_dir`: the folder external
    weights are relative to (default: the model file's folder). The model is not changed.
    """
    lim = _limits(target)
    source = load_model(model)
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    base = Path(base_dir) if base_dir is not None else None
    tapped, index, taps, untyped = _instrument(source, lim)
    session = make_session(tapped, for_tapped(runtime or RuntimeConfig()), base_dir=base)
    del tapped
    wanted = [n for tap in taps for n in (tap.floats, tap.counts)]
    batches = 0
    for feed in _batches(source, feeds):
        outs = run(session, feed, wanted)
        for k, tap in enumerate(taps):
            _merge(tap.stat, outs[2 * k], outs[2 * k + 1])
        batches += 1
    if batches == 0:
        raise OpscopeError("no feeds: the feed iterable was empty")
    stats = [t.stat for t in taps] + _weights(index, target, base)
    names, unnamed = _node_names(index)
    return PrecisionReport(target, lim, stats, batches, _readers(index), names, unnamed, untyped)


def _batches(model: ModelProto, feeds: Feeds) -> Iterable[Mapping[str, np.ndarray]]:
    if feeds is None or isinstance(feeds, FeedSpec):
        return iter_feeds(model, feeds)
    if isinstance(feeds, Mapping):
        return [feeds]
    return feeds


def _merge(stat: TensorStat, floats: np.ndarray, counts: np.ndarray) -> None:
    """Fold one batch's raws into `stat`: Loop / Scan taps come stacked per iteration, a branch
    not taken returns an empty tensor (nothing to fold)."""
    if floats.size == 0:
        return
    f = floats.reshape(-1, 2)
    c = counts.reshape(-1, len(COUNTS)).astype(np.int64)
    for row_f, row_c in zip(f, c):
        stat.add(max(float(row_f[0]), 0.0), float(row_f[1]), row_c)


def _node_names(index: ModelIndex) -> tuple[dict[str, str], set[str]]:
    """Node id -> the name a block list gives it (its own name, else its id: see `name_nodes`)."""
    names: dict[str, str] = {}
    unnamed: set[str] = set()
    for entry, i, node in index.nodes():
        nid = entry.ids[i]
        names[nid] = node.name or nid
        if not node.name:
            unnamed.add(nid)
    return names, unnamed


def name_nodes(model: ModelLike) -> ModelProto:
    """A copy of `model` where every unnamed node is named by its id (`graph.index`; full id in a
    subgraph), so block lists can name it. Named nodes and every id stay as they were."""
    m = ModelProto()
    m.CopyFrom(load_model(model))
    index = ModelIndex(m)
    for entry, i, node in index.nodes():
        if not node.name:
            node.name = entry.ids[i]
    return m


def convert_fp16(
    model: ModelLike,
    report: PrecisionReport | None,
    *,
    keep_io_types: bool = True,
    headroom: float = 1.0,
    **kwargs,
) -> ModelProto:
    """onnxconverter-common's fp16 conversion of `model` keeping `report`'s block list in float32
    (None: a plain conversion), unnamed nodes named first (`name_nodes`).

    Two converter gaps are closed in both cases, so a plain and a blocked conversion differ only
    by the report: the model's own `Cast(to=FLOAT)` nodes are blocked too (the converter types
    their outputs fp16 but leaves `to` at FLOAT, which onnxruntime rejects), and weights are
    clipped at 65504, what the check measured against, not at the converter's default 1e4.
    Other `kwargs` go to `convert_float_to_float16` unchanged.
    """
    if report is not None and report.target != "fp16":
        raise OpscopeError(f"convert_fp16 needs an fp16 report, this one is for {report.target}")
    try:
        from onnxconverter_common import float16
    except ImportError:
        raise OpscopeError(
            "the fp16 conversion needs onnxconverter-common", hint="pip install 'onnx-opscope[fp16]'"
        ) from None
    named = name_nodes(model)
    casts = [n.name for _, _, n in ModelIndex(named).nodes() if n.op_type == "Cast" and _casts_to_float(n)]
    blocked = (report.block_list(headroom) if report is not None else []) + casts
    _split_shared_weights(named, set(blocked))
    kwargs.setdefault("max_finite_val", TARGETS["fp16"].max)
    return float16.convert_float_to_float16(
        named, keep_io_types=keep_io_types, node_block_list=blocked, **kwargs
    )


def _split_shared_weights(model: ModelProto, blocked: set[str]) -> None:
    """Give blocked readers of an initializer that unblocked nodes read too their own copy, in place.

    The converter keeps an initializer in float32 when any blocked node reads it, so an unblocked
    reader then mixes fp16 and fp32 inputs and onnxruntime rejects the model (magika's LayerNorm
    scale is shared by both LayerNorms: blocking one breaks the other).
    """
    for _, graph in iter_graphs(model.graph):
        inits = {t.name: t for t in graph.initializer if t.data_type == TensorProto.FLOAT}
        readers: dict[str, list[NodeProto]] = {}
        for node in graph.node:
            for x in set(node.input) & inits.keys():
                readers.setdefault(x, []).append(node)
        for name, nodes in readers.items():
            mine = [n for n in nodes if n.name in blocked]
            if not mine or len(mine) == len(nodes):
                continue
            copy = graph.initializer.add()
            copy.CopyFrom(inits[name])
            copy.name = f"{name}_opscope_fp32"
            for n in mine:
                n.input[:] = [copy.name if x == name else x for x in n.input]


def _casts_to_float(node: NodeProto) -> bool:
    return any(a.name == "to" and a.i == TensorProto.FLOAT for a in node.attribute)
