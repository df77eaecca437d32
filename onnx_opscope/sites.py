"""Which tensors to tap: op sites, their roles, and the user's selection.

A *site* is one node of a kind we know (MatMul, Gemm, Conv, ConvTranspose, LSTM, GRU, RNN,
MatMulInteger, QLinearMatMul), anywhere in the model, `If` branches and `Loop` / `Scan`
bodies included. Each of its *roles* names one tensor (`lhs`, `rhs`, `out`, ...) and says
which axis is its feature ("channel") axis and which axis its rows are adjacent along
("seq"), so that per-channel and per-row sketches mean the same thing for every op: for a
Gemm with transA=1 the channel of `a` is axis 0, for a Conv it is axis 1, for an LSTM input
the rows run along time (axis 0).

Quantized matmuls are tapped on their integer operands (cast to float for the sketches) and,
when the operand comes out of a QuantizeLinear / DynamicQuantizeLinear or the output goes
into a DequantizeLinear, on the float tensor next to it (`lhs_float`, `out_float`).

Inference sites (`inference_taps`): Softmax and fused attention (`attn`), TopK / ArgMax
routers (`route`) and residual Adds (`residual_a`, `residual_b`); `Site.kind` says which
kind a site is (`gemm` for the ops above) and `Selection.kinds` picks kinds.

Site ids are stable and unique: the node name when it has one and it is unique, otherwise
`<op_type>_<k>` (k counts that op type in walk order), prefixed with the subgraph path.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import onnx
from onnx import GraphProto, ModelProto, NodeProto

from . import inference_taps as it
from .errors import OpscopeError, did_you_mean, listing


@dataclass(frozen=True)
class Tap:
    role: str
    tensor: str
    channel_axis: int = -1
    seq_axis: int = -2
    bins: int | None = None  # route taps: the number of experts E (None: not static)


@dataclass(frozen=True)
class Site:
    id: str
    op_type: str
    node: str  # the node's own name, may be empty
    graph: str  # subgraph path, "" for the main graph
    order: int  # position in a depth-first walk: execution order within a graph
    taps: tuple[Tap, ...]
    attrs: dict = field(default_factory=dict, compare=False, hash=False)
    shape_only: tuple[Tap, ...] = ()  # roles left out by the selection: only their shape is taken (M, K, N)

    def role(self, name: str) -> Tap | None:
        return next((t for t in self.taps if t.role == name), None)

    @property
    def kind(self) -> str:
        """gemm, attn (Softmax, fused attention), route (TopK / ArgMax router) or residual (Add)."""
        return it.kind_of(self.op_type)


SITE_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "LSTM", "GRU", "RNN", "MatMulInteger", "QLinearMatMul")
TAPPABLE_OPS = SITE_OPS + tuple(it.KINDS)  # inference_taps adds attn / route / residual sites
_SUBGRAPH_OWNERS = ("If", "Loop", "Scan")


def _attr(node: NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _roles(
    node: NodeProto, producers: dict[str, NodeProto], consumers: dict[str, list[NodeProto]]
) -> list[Tap]:
    op, ins, outs = node.op_type, list(node.input), list(node.output)

    def get(i):
        return ins[i] if len(ins) > i and ins[i] else None

    taps: list[Tap] = []

    def add(role, name, ch=-1, seq=-2):
        if name:
            taps.append(Tap(role, name, ch, seq))

    if op == "MatMul":
        add("lhs", get(0)), add("rhs", get(1)), add("out", outs[0])
    elif op == "Gemm":
        ta, tb = _attr(node, "transA", 0), _attr(node, "transB", 0)
        add("a", get(0), 0 if ta else 1, 1 if ta else 0)
        add("b", get(1), 0 if tb else 1, 1 if tb else 0)
        add("out", outs[0], 1, 0)
    elif op in ("Conv", "ConvTranspose"):
        add("in", get(0), 1, -1)
        add("weight", get(1), 0 if op == "Conv" else 1, -1)
        add("out", outs[0], 1, -1)
    elif op in ("LSTM", "GRU", "RNN"):
        t = 1 if _attr(node, "layout", 0) else 0
        add("x", get(0), -1, t), add("w", get(1), 1, -1), add("r", get(2), 1, -1)
        if outs and outs[0]:
            add("y", outs[0], -1, t)
    elif op in ("MatMulInteger", "QLinearMatMul"):
        b_idx = 2 if op == "MatMulInteger" else 3
        add("lhs", get(0)), add("rhs", get(1 if op == "MatMulInteger" else b_idx)), add("out", outs[0])
        q = producers.get(get(0) or "")
        if q is not None and q.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"):
            add("lhs_float", q.input[0])
        dq = [c for c in consumers.get(outs[0], []) if c.op_type == "DequantizeLinear"]
        if dq:
            add("out_float", dq[0].output[0])
    return taps


def _walk(
    graph: GraphProto,
    path: str,
    counter: Counter,
    order: list[int],
    names: Counter,
    out: list[Site],
    skipped: list[str],
    view: it.GraphView,
    dims: dict,
) -> None:
    producers, consumers = view.producers, view.consumers
    for i, node in enumerate(graph.node):
        found = None
        if node.op_type in SITE_OPS and node.domain in ("", "ai.onnx"):
            found = tuple(_roles(node, producers, consumers)), {}
        elif node.op_type in it.KINDS and (extra := it.find_taps(node, view)) is not None:
            found = tuple(Tap(*t) for t in extra[0]), extra[1]
        if found is not None:
            counter[node.op_type] += 1
            base = (
                node.name
                if node.name and names[(path, node.name)] == 1
                else f"{node.op_type}_{counter[node.op_type] - 1}"
            )
            sid = f"{path}/{base}" if path else base
            out.append(
                Site(
                    sid,
                    node.op_type,
                    node.name,
                    path,
                    order[0],
                    found[0],
                    {
                        **{
                            a.name: onnx.helper.get_attribute_value(a)
                            for a in node.attribute
                            if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT)
                        },
                        **found[1],
                    },
                )
            )
            order[0] += 1
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            if not subs:
                continue
            owner = node.name or f"{node.op_type}_{i}"
            if node.op_type not in _SUBGRAPH_OWNERS or node.domain not in ("", "ai.onnx"):
                skipped.append(f"{path}/{owner}".lstrip("/"))
                continue
            for j, sub in enumerate(subs):
                suffix = attr.name if len(subs) == 1 else f"{attr.name}{j}"
                sub_path = f"{path}/{owner}/{suffix}".lstrip("/")
                for n in sub.node:
                    if n.name:
                        names[(sub_path, n.name)] += 1
                sub_view = it.graph_view(sub, sub_path, view.opset, dims, view)
                _walk(sub, sub_path, counter, order, names, out, skipped, sub_view, dims)


def find_sites(model: ModelProto) -> list[Site]:
    """Every site of a known kind, main graph and If/Loop/Scan bodies, in depth-first order.

    Subgraphs of other ops (e.g. contrib BeamSearch) cannot carry outputs out, so their
    nodes are not sites; `subgraphs_not_tappable(model)` names them.
    """
    return _find(model)[0]


def subgraphs_not_tappable(model: ModelProto) -> list[str]:
    return _find(model)[1]


def _find(model: ModelProto) -> tuple[list[Site], list[str]]:
    names: Counter = Counter(("", n.name) for n in model.graph.node if n.name)
    out: list[Site] = []
    skipped: list[str] = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    dims = it.infer_dims(model)
    view = it.graph_view(model.graph, "", opset, dims)
    _walk(model.graph, "", Counter(), [0], names, out, skipped, view, dims)
    seen: Counter = Counter()
    for i, site in enumerate(out):  # a named node may look like another's generated id: keep ids unique
        seen[site.id] += 1
        if seen[site.id] > 1:
            out[i] = Site(
                f"{site.id}#{seen[site.id]}",
                site.op_type,
                site.node,
                site.graph,
                site.order,
                site.taps,
                site.attrs,
            )
    return out, skipped


@dataclass(frozen=True)
class Selection:
    """What to tap. Empty fields select everything; an unmatched pattern is an error."""

    op_types: tuple[str, ...] = ()
    names: tuple[str, ...] = ()  # globs over node names and site ids
    roles: tuple[str, ...] = ()
    min_numel: int = 0
    max_sites: int | None = None
    kinds: tuple[str, ...] = ()  # gemm, attn, route, residual


def select(sites: list[Site], sel: Selection, numel: dict[str, int] | None = None) -> list[Site]:
    """Apply `sel` to `sites`; `numel` maps tensor -> static element count where known.

    `min_numel` drops roles whose tensor is known to be smaller (unknown sizes stay); a site
    with no role left is dropped. `max_sites` keeps the first N in execution order.
    """
    numel = numel or {}
    chosen = sites
    if sel.kinds:
        for k in sel.kinds:
            if k not in it.SITE_KINDS:
                raise OpscopeError(
                    f"--kind {k!r} is not a site kind{did_you_mean(k, it.SITE_KINDS)}; "
                    f"kinds: {', '.join(it.SITE_KINDS)}"
                )
        chosen = [s for s in chosen if s.kind in sel.kinds]
        if not chosen and sites:
            raise OpscopeError(
                f"--kind {','.join(sel.kinds)} matches no site; the model has: "
                f"{listing(f'{a} ({b})' for a, b in Counter(s.kind for s in sites).items())}"
            )
    if sel.op_types:
        present = {s.op_type for s in sites}
        wanted = {o.lower(): o for o in TAPPABLE_OPS}
        for op in sel.op_types:
            canon = wanted.get(op.lower())
            if canon is None:
                raise OpscopeError(
                    f"--op {op!r} is not an op we can tap{did_you_mean(op, TAPPABLE_OPS)}; "
                    f"tappable: {listing(TAPPABLE_OPS, limit=20)}"
                )
            if canon not in present:
                raise OpscopeError(
                    f"--op {op!r} matches no node; the model has: "
                    f"{listing(f'{k} ({v})' for k, v in Counter(s.op_type for s in sites).items())}"
                )
        keep = {wanted[o.lower()] for o in sel.op_types}
        chosen = [s for s in chosen if s.op_type in keep]
    if sel.names:
        for pat in sel.names:
            if not any(_name_match(s, pat) for s in chosen):
                ids = [s.id for s in chosen]
                raise OpscopeError(
                    f"--name {pat!r} matches no site{did_you_mean(pat, ids)}; sites: {listing(ids)}"
                )
        chosen = [s for s in chosen if any(_name_match(s, p) for p in sel.names)]
    if sel.roles:
        present_roles = {t.role for s in chosen for t in s.taps}
        for r in sel.roles:
            if r not in present_roles:
                raise OpscopeError(
                    f"--role {r!r} matches no tap{did_you_mean(r, present_roles)}; "
                    f"roles here: {listing(present_roles)}"
                )
    result = []
    for s in chosen:
        taps = tuple(
            t
            for t in s.taps
            if (not sel.roles or t.role in sel.roles) and numel.get(t.tensor, sel.min_numel) >= sel.min_numel
        )
        if taps:
            rest = tuple(t for t in s.taps if t not in taps)
            result.append(Site(s.id, s.op_type, s.node, s.graph, s.order, taps, s.attrs, rest))
    if not result and sites:
        raise OpscopeError(
            f"the selection leaves no tensor to tap (min size {sel.min_numel} elements)",
            hint="lower --min-numel or widen --op/--name/--role",
        )
    if sel.max_sites is not None:
        result = result[: sel.max_sites]
    return result


def _name_match(site: Site, pattern: str) -> bool:
    return fnmatch.fnmatchcase(site.id, pattern) or (
        bool(site.node) and fnmatch.fnmatchcase(site.node, pattern)
    )


def all_roles(sites: Iterable[Site]) -> list[str]:
    return sorted({t.role for s in sites for t in s.taps})
