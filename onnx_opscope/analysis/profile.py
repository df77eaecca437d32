"""Measured time per node, on the provider and optimization level the model ships with.

`profile_nodes` (in `costs`, beside `analyze`) runs the model under onnxruntime's profiler
(`events`) over seeded synthetic feeds (U(-1, 1) floats, valid indices for integer inputs,
`run.feeds`), at the optimization level asked for (default "all", onnxruntime's own default)
on any provider. What runs is then not the model's graph: onnxruntime folds constants,
fuses MatMul+Add into Gemm or FusedMatMul, Conv+BatchNorm+activation into one Conv, inserts
layout reorders (NCHWc on CPU) and copies between devices. So the session also saves the graph it runs, and every
kernel is mapped back onto the nodes it stands for, by the tensors it produces:

- a node whose output an optimized node still produces is *anchored* to that kernel;
- a node none of whose outputs survive was fused: it belongs to the one kernel its outputs
  flow into (through other fused nodes); if they flow into several, it was eliminated
  (an Identity) and has no kernel; a node whose outputs became initializers was folded;
- a kernel no node is anchored to was inserted by onnxruntime: it is charged to the node
  of the same name, else to the node whose output its own output's name extends
  (`conv_out_nchwc` -> `conv_out`), else to the first mapped kernel it feeds (or is fed by).

On ppocrv4_det at level "all" that maps all 395 kernels (57 fused, 103 inserted NCHWc convs
and reorders), on captcha_crnn all 690, with no time left unmapped.

A kernel's time is split over its nodes in proportion to their roofline time at the measured
bandwidth and peak (an Identity fused into a Conv gets nothing), so per-node time, FLOPs and
bytes line up and the node times add up to the kernel times exactly. If / Loop / Scan
kernels count only their own time: onnxruntime's event includes their bodies' kernels.

Per node: achieved FLOP/s and bytes/s (static FLOPs and bytes at the fed shapes over the
measured time) and a verdict against the measured roofline (`bandwidth.measure`):
bandwidth-bound when it reaches BANDWIDTH_BOUND of the measured bandwidth, compute-bound
when its intensity is above the measured ridge, else latency / overhead-bound (too small
to reach either roof: launch, threading and framework cost dominate).

On asynchronous providers (CUDA, ...) onnxruntime's node times may be launch times; when the
kernels cover much less than the runs' wall time, a note says so.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto

from ..errors import OpscopeError
from ..graph.index import GraphEntry, ModelIndex
from ..graph.io import ModelLike, load_model
from ..run.feeds import FeedSpec, synthetic_feeds
from ..run.session import CPU, RuntimeConfig
from ..shapes.symbolic import to_number
from .bandwidth import Measured, measure
from .events import Trace, profile_session
from .regions import Blocks, RegionTimes, find_blocks, region_times

BANDWIDTH_BOUND = 0.5  # share of the measured bandwidth from which a node is bandwidth-bound
_WALK_LIMIT = 256  # nodes visited when following a fused or inserted node to its kernel
_CONTROL_FLOW = ("If", "Loop", "Scan")
UNMAPPED = "(unmapped)"


@dataclass
class Kernel:
    """One kernel onnxruntime ran (a node of the optimized graph) and the model's nodes it stands for."""

    name: str
    op_type: str
    provider: str
    time_s: float  # mean seconds per run (own time: bodies of If / Loop / Scan excluded)
    nodes: tuple[str, ...]  # model index ids of the original nodes
    how: str  # same (stands for one node), fused (several), unmapped (none)
    inserted: bool = False  # added by onnxruntime (a layout reorder, a copy): no node's output is its own


@dataclass
class NodeTime:
    """One node of the model: its share of the kernels' time, its static cost, and what bounds it."""

    node: str
    op_type: str
    graph: str
    region: str
    time_s: float  # seconds per run
    kernels: tuple[str, ...]
    flops: float | None
    bytes: float | None
    intensity: float | None
    flops_per_s: float | None
    bytes_per_s: float | None
    verdict: str  # bandwidth, compute, latency, not run, unknown
    counted: bool = True  # in the FLOP / byte totals (the If branch the static analysis counts)


@dataclass
class NodeProfile:
    """The result of `profile_nodes`: per-kernel and per-node times, the measured roofline, roll-ups."""

    model: str
    providers: list[str]
    opt_level: str
    threads: int | None
    runs: int
    feeds: dict[str, list[int]]
    measured: Measured
    kernels: list[Kernel]
    nodes: list[NodeTime]
    wall_s: float  # mean wall seconds per run
    flops_total: float | None = None
    bytes_total: float | None = None
    regions: RegionTimes | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def kernel_s(self) -> float:
        return sum(k.time_s for k in self.kernels)

    @property
    def unmapped_s(self) -> float:
        return sum(k.time_s for k in self.kernels if not k.nodes)

    def seconds_by_op(self) -> dict[str, float]:
        """Seconds per run per original op kind (time onnxruntime could not map is UNMAPPED)."""
        out: dict[str, float] = {}
        for n in self.nodes:
            if n.time_s:
                out[n.op_type] = out.get(n.op_type, 0.0) + n.time_s
        if self.unmapped_s:
            out[UNMAPPED] = self.unmapped_s
        return out

    def by_op(self) -> list[dict]:
        """Per op kind: time, FLOP and byte shares side by side, by time."""
        return self._rollup(lambda n: n.op_type)

    def by_region(self) -> list[dict]:
        """Per region (attention, mlp, other; see `regions`): time, FLOP and byte shares."""
        return self._rollup(lambda n: n.region)

    def _rollup(self, key) -> list[dict]:
        groups: dict[str, list[NodeTime]] = {}
        for n in self.nodes:
            groups.setdefault(key(n), []).append(n)
        total = self.kernel_s
        rows = []
        for name, members in groups.items():
            t = sum(n.time_s for n in members)
            f = sum(n.flops for n in members if n.flops is not None and n.counted)
            b = sum(n.bytes for n in members if n.bytes is not None and n.counted)
            rows.append(
                {
                    "name": name,
                    "nodes": len(members),
                    "time_s": t,
                    "time_share": t / total if total else None,
                    "flops": f,
                    "flops_share": f / self.flops_total if self.flops_total else None,
                    "bytes": b,
                    "bytes_share": b / self.bytes_total if self.bytes_total else None,
                }
            )
        if self.unmapped_s:
            rows.append(
                {
                    "name": UNMAPPED,
                    "nodes": 0,
                    "time_s": self.unmapped_s,
                    "time_share": self.unmapped_s / total if total else None,
                    "flops": 0.0,
                    "flops_share": 0.0,
                    "bytes": 0.0,
                    "bytes_share": 0.0,
                }
            )
        return sorted(rows, key=lambda r: (-r["time_s"], r["name"]))

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "providers": self.providers,
            "opt_level": self.opt_level,
            "threads": self.threads,
            "runs": self.runs,
            "feeds": self.feeds,
            "measured": {**asdict(self.measured), "ridge": self.measured.ridge},
            "wall_s": self.wall_s,
            "kernel_s": self.kernel_s,
            "unmapped_s": self.unmapped_s,
            "by_op": self.by_op(),
            "by_region": self.by_region(),
            "regions": self.regions.to_dict() if self.regions else None,
            "kernels": [asdict(k) for k in self.kernels],
            "nodes": [asdict(n) for n in self.nodes],
            "notes": self.notes,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_records(self) -> list[dict]:
        """One flat dict per node (for pandas: `pd.DataFrame(profile.to_records())`)."""
        return [{**asdict(n), "kernels": ",".join(n.kernels)} for n in self.nodes]


def profile_feeds(
    model: ModelLike,
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """The seeded synthetic feeds a profile runs on (U(-1, 1) floats; symbols from `shapes` / `dims`,
    else the feeds' defaults: 1 on axis 0, 64 elsewhere)."""
    dims = dict(dims or {})
    spec = FeedSpec(dist="uniform", seed=seed, shapes=_numeric_shapes(shapes or {}, dims), dims=dims)
    return synthetic_feeds(model, spec)


def measure_nodes(
    model: ModelLike,
    feeds: Mapping[str, np.ndarray],
    static: Any,
    *,
    config: RuntimeConfig | None = None,
    runs: int = 3,
    regions: bool = False,
    measured: Measured | None = None,
) -> NodeProfile:
    """Time `model` on `feeds` and put each kernel's time on the nodes it stands for (the module doc).

    `static`: the model's `costs.Report` at the shapes of `feeds` (`costs.profile_nodes` makes both).
    """
    config = config or RuntimeConfig()
    proto = load_model(model)
    fed = {k: list(np.shape(v)) for k, v in feeds.items()}
    with tempfile.TemporaryDirectory(prefix="opscope-opt-") as tmp:
        saved = Path(tmp) / "optimized.onnx"
        trace = profile_session(model, feeds, config, runs=runs, optimized_model=str(saved))
        optimized = onnx.load(str(saved), load_external_data=False) if saved.is_file() else None
    measured = measured or measure(config)
    blocks = find_blocks(proto)  # static and cheap: the per-region roll-up always has its regions
    result = _assemble(model, proto, optimized, trace, static, measured, blocks, config, runs, fed)
    if regions:
        result.regions = region_times(model, feeds, config, blocks=blocks)
    return result


def _numeric_shapes(
    shapes: Mapping[str, Sequence[int | str]], dims: Mapping[str, int]
) -> dict[str, list[int]]:
    out = {}
    for name, shape in shapes.items():
        resolved = []
        for axis, d in enumerate(shape):
            if isinstance(d, str):
                if d not in dims:
                    raise OpscopeError(
                        f"--profile runs the model: dim {axis} of {name!r} is the symbol {d!r}, give it a size",
                        hint=f"--dim {d}=N, or a number in --shape",
                    )
                d = dims[d]
            resolved.append(int(d))
        out[name] = resolved
    return out


# -- kernels -> nodes -----------------------------------------------------------------------------


def map_kernels(source: ModelProto, optimized: ModelProto | None) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Optimized node name -> (the source node ids it stands for, whether onnxruntime inserted it).

    Without the optimized graph (a provider that compiles its kernels cannot save it), a kernel
    maps only to the source node of its own name.
    """
    src = ModelIndex(source)
    if optimized is None:
        return {
            n.name: ((nid,), False)
            for e in src.graphs.values()
            for nid, n in zip(e.ids, e.graph.node)
            if n.name
        }
    opt = ModelIndex(optimized)
    out: dict[str, tuple[tuple[str, ...], bool]] = {}
    for path, z in opt.graphs.items():
        s = src.graphs.get(path)
        members = _members(s, z) if s is not None else [[] for _ in z.graph.node]
        names = {n.name: nid for nid, n in zip(s.ids, s.graph.node) if n.name} if s is not None else {}
        anchored = [bool(m) for m in members]
        for i, node in enumerate(z.graph.node):  # inserted nodes: a name, an output name, a neighbour
            if not members[i]:
                hit = names.get(node.name) or (_by_output_name(s, node) if s is not None else None)
                if hit:
                    members[i] = [hit]
        for i in range(len(z.graph.node)):
            if not members[i]:
                members[i] = _neighbour(z, i, members)
        for i, node in enumerate(z.graph.node):
            m = tuple(dict.fromkeys(members[i]))
            if node.name in out:  # a name used twice: the time cannot be told apart, it goes to both
                m = tuple(dict.fromkeys(out[node.name][0] + m))
            out[node.name] = (m, not anchored[i])
    return out


def _members(s: GraphEntry, z: GraphEntry) -> list[list[str]]:
    """Per optimized node of `z`: the source nodes of `s` anchored to it or fused into it."""
    members: list[list[str]] = [[] for _ in z.graph.node]
    anchor: dict[int, int] = {}
    pending = []
    for i, node in enumerate(s.graph.node):
        j = next((z.producer_index(o) for o in node.output if o and z.producer_index(o) is not None), None)
        if j is not None:
            anchor[i] = j
            members[j].append(s.ids[i])
        elif node.op_type != "Constant" and not all(o in z.constants for o in node.output if o):
            pending.append(i)
    for i in pending:
        targets: set[int] = set()
        seen, stack = {i}, [i]
        while stack and len(seen) < _WALK_LIMIT:
            k = stack.pop()
            for o in s.graph.node[k].output:
                for c in s.consumer_indices(o) if o else ():
                    if c in anchor:
                        targets.add(anchor[c])
                    elif c not in seen:
                        seen.add(c)
                        stack.append(c)
        if len(targets) == 1:
            members[targets.pop()].append(s.ids[i])
    return members


def _by_output_name(s: GraphEntry, node) -> str | None:
    """The source node whose output name this inserted node's output extends (`x_nchwc` -> `x`)."""
    for o in node.output:
        base = o
        for _ in range(3):
            cut = max(base.rfind("_"), base.rfind("/"))
            if cut <= 0:
                break
            base = base[:cut]
            i = s.producer_index(base)
            if i is not None:
                return s.ids[i]
    return None


def _neighbour(z: GraphEntry, i: int, members: list[list[str]]) -> list[str]:
    """The nodes of the first mapped kernel `i` feeds (breadth first), else of the first that feeds it."""
    for forward in (True, False):
        seen, frontier = {i}, [i]
        while frontier and len(seen) < _WALK_LIMIT:
            nxt = []
            for k in frontier:
                node = z.graph.node[k]
                if forward:
                    near = [c for o in node.output if o for c in z.consumer_indices(o)]
                else:
                    near = [p for x in node.input if x and (p := z.producer_index(x)) is not None]
                for c in near:
                    if c in seen:
                        continue
                    if members[c]:
                        return list(members[c])
                    seen.add(c)
                    nxt.append(c)
            frontier = nxt
    return []


def _own_times(trace: Trace, graph_model: ModelProto | None) -> list[dict[str, float]]:
    """Per-run kernel seconds with If / Loop / Scan kernels reduced to their own time (their
    event spans their bodies' kernels)."""
    if graph_model is None:
        return trace.runs
    index = ModelIndex(graph_model)
    inner: dict[str, list[str]] = {}
    for path, entry in index.graphs.items():
        for i, node in enumerate(entry.graph.node):
            if node.op_type in _CONTROL_FLOW and node.name:
                inner[node.name] = [n.name for c in index.children(path, i) for n in c.graph.node if n.name]
    out = []
    for r in trace.runs:
        own = dict(r)
        for owner, names in inner.items():
            if owner in r:
                own[owner] = max(0.0, r[owner] - sum(r.get(n, 0.0) for n in names))
        out.append(own)
    return out


def _assemble(
    model: ModelLike,
    proto: ModelProto,
    optimized: ModelProto | None,
    trace: Trace,
    report,
    measured: Measured,
    blocks: Blocks,
    config: RuntimeConfig,
    runs: int,
    fed: dict[str, list[int]],
) -> NodeProfile:
    mapping = map_kernels(proto, optimized)
    runs_own = _own_times(trace, optimized if optimized is not None else proto)
    times = Trace(runs_own, trace.wall).mean()
    costs = {r.node: r for r in report.records}
    dev = measured.device()

    def weight(nid: str) -> float:
        r = costs.get(nid)
        f = to_number(r.flops) if r else None
        b = to_number(r.bytes_total) if r else None
        if f is None or b is None:
            return 0.0
        return max(f / dev.peak_flops, b / dev.bandwidth)

    node_time: dict[str, float] = {}
    node_kernels: dict[str, list[str]] = {}
    kernels = []
    for name, secs in sorted(times.items(), key=lambda kv: -kv[1]):  # a node lists its biggest kernel first
        members, inserted = mapping.get(name, ((), False))
        how = "unmapped" if not members else ("fused" if len(members) > 1 else "same")
        kernels.append(
            Kernel(
                name,
                trace.op_types.get(name, "?"),
                trace.providers.get(name, ""),
                secs,
                members,
                how,
                inserted,
            )
        )
        if not members:
            continue
        w = [weight(m) for m in members]
        if not sum(w):
            w = [1.0] * len(members)
        for m, wm in zip(members, w):
            node_time[m] = node_time.get(m, 0.0) + secs * wm / sum(w)
            node_kernels.setdefault(m, []).append(name)
    nodes = []
    flops_total = bytes_total = 0.0
    for r in report.records:
        f, b = to_number(r.flops), to_number(r.bytes_total)
        if r.counted:
            flops_total += f or 0.0
            bytes_total += b or 0.0
        t = node_time.get(r.node, 0.0)
        nodes.append(
            _node_time(r, t, tuple(node_kernels.get(r.node, ())), f, b, measured, blocks.region(r.node))
        )
    wall = float(np.mean(trace.wall)) if trace.wall else 0.0
    prof = NodeProfile(
        model=str(model) if not isinstance(model, ModelProto) else (proto.graph.name or "<model>"),
        providers=trace.session_providers,
        opt_level=config.graph_opt,
        threads=config.threads,
        runs=runs,
        feeds=fed,
        measured=measured,
        kernels=sorted(kernels, key=lambda k: -k.time_s),
        nodes=nodes,
        wall_s=wall,
        flops_total=flops_total,
        bytes_total=bytes_total,
    )
    if optimized is None:
        prof.notes.append("onnxruntime could not save the optimized graph: kernels map by name only")
    if prof.unmapped_s:
        prof.notes.append(
            f"{prof.unmapped_s / prof.kernel_s:.1%} of kernel time maps to no node of the model"
        )
    if trace.session_providers and trace.session_providers[0] != CPU and wall and prof.kernel_s < 0.5 * wall:
        prof.notes.append(
            f"kernels cover {prof.kernel_s / wall:.0%} of the run's wall time: on {trace.session_providers[0]} "
            "onnxruntime's node times may be launch times, not device times"
        )
    return prof


def _node_time(r, t: float, kernels: tuple[str, ...], f, b, measured: Measured, region: str) -> NodeTime:
    ai = f / b if f is not None and b else None
    fps = f / t if t and f is not None else None
    bps = b / t if t and b is not None else None
    if not t:
        verdict = "not run"
    elif bps is None:
        verdict = "unknown"
    elif bps >= BANDWIDTH_BOUND * measured.bandwidth:
        verdict = "bandwidth"
    elif ai is not None and ai > measured.ridge:
        verdict = "compute"
    else:
        verdict = "latency"
    return NodeTime(r.node, r.op_type, r.graph, region, t, kernels, f, b, ai, fps, bps, verdict, r.counted)
