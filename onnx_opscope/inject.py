"""Apply sketches at sites: the instrumented model and its manifest.

`inject` copies the model (the input is left untouched; external weights are referenced,
never loaded), appends one tap subgraph per tapped tensor and exposes its raw outputs as
extra graph outputs after the original ones, whose names and order do not change.

Placement: by default each tap's nodes go right after the node producing the tensor
(`placement="producer"`), so onnxruntime can free the intermediate as early as it would
without the tap; `placement="end"` appends them after every original node instead (what
naive instrumentation does: it keeps intermediates alive to the end of the run).

Weights: a tap on a constant tensor (an initializer or a `Constant` node's output, outer
scopes included) gets no nodes and no outputs. Its `TapRecord` says `constant`; its values
do not change between batches, so `weights.host_values` computes them once on the host from
the model (the source or the instrumented one: both hold the initializers) and
`manifest.decode(..., host=...)` takes them from there. Folding them in the graph instead
cost onnxruntime hundreds of MB at session creation.

Subgraphs: a tap inside an `If` branch becomes a new output of that branch (the other
branch returns an empty tensor, which decodes as "did not run") and of the `If` node; a tap
inside a `Loop` or `Scan` body becomes a new scan output, so its values come back once per
iteration, stacked on a leading axis, and are merged across iterations on the host with
each sketch's merge rule (min of mins, sums of sums, per-iteration means weighted by size).
Nested subgraphs repeat this up to the main graph.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

from . import inference_taps as it
from . import sketches as sk
from .errors import OpscopeError
from .manifest import Manifest, SiteRecord, TapRecord
from .model import ModelLike, file_sha256, load_model, model_sha256, opset_version, without_weight_data
from .ops import MIN_OPSET, Builder, Constants
from .sites import Selection, Site, find_sites, select

PLACEMENTS = ("producer", "end")


@dataclass
class _GraphCtx:
    graph: GraphProto
    owner: NodeProto | None
    attr: str | None
    parent: str | None
    index: int | None = None  # the owner's position in its parent graph


def _contexts(model: ModelProto) -> dict[str, _GraphCtx]:
    """Path -> graph, with the node that owns it; paths match sites.find_sites."""
    out = {"": _GraphCtx(model.graph, None, None, None)}

    def walk(graph: GraphProto, path: str) -> None:
        for i, node in enumerate(graph.node):
            for attr in node.attribute:
                if attr.type != onnx.AttributeProto.GRAPH:
                    continue
                owner = node.name or f"{node.op_type}_{i}"
                sub_path = f"{path}/{owner}/{attr.name}".lstrip("/")
                out[sub_path] = _GraphCtx(attr.g, node, attr.name, path, i)
                walk(attr.g, sub_path)

    walk(model.graph, "")
    return out


@dataclass
class _TypeInfo:
    elem_type: int
    rank: int | None
    numel: int | None


def _type_table(model: ModelProto) -> dict[str, dict[str, _TypeInfo]]:
    """Per graph path, tensor -> (elem type, rank, static numel), from onnx shape inference."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # shape inference is best effort: fall back to what the model declares
        inferred = model
    table: dict[str, dict[str, _TypeInfo]] = {}
    for path, ctx in _contexts(inferred).items():
        types: dict[str, _TypeInfo] = {}
        g = ctx.graph
        for vi in [*g.input, *g.output, *g.value_info]:
            tt = vi.type.tensor_type
            if not vi.type.HasField("tensor_type"):
                continue
            rank = len(tt.shape.dim) if tt.HasField("shape") else None
            dims = (
                [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
                if rank is not None
                else None
            )
            numel = int(np.prod(dims)) if dims is not None and all(d is not None for d in dims) else None
            types[vi.name] = _TypeInfo(tt.elem_type, rank, numel)
        for init in g.initializer:
            types[init.name] = _TypeInfo(init.data_type, len(init.dims), int(np.prod(init.dims)))
        for node in g.node:
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                        types[node.output[0]] = _TypeInfo(
                            a.t.data_type, len(a.t.dims), int(np.prod(a.t.dims))
                        )
        table[path] = types
    return table


def _lookup(
    table: dict[str, dict[str, _TypeInfo]], ctxs: dict[str, _GraphCtx], path: str, name: str
) -> _TypeInfo | None:
    while path is not None:
        if name in table.get(path, {}):
            return table[path][name]
        path = ctxs[path].parent if path in ctxs else None
    return None


def _constants(ctxs: dict[str, _GraphCtx]) -> dict[str, set[str]]:
    out = {}
    for path, ctx in ctxs.items():
        names = {i.name for i in ctx.graph.initializer}
        names |= {n.output[0] for n in ctx.graph.node if n.op_type == "Constant"}
        out[path] = names
    return out


def _all_names(model: ModelProto, ctxs: dict[str, _GraphCtx]) -> set[str]:
    names: set[str] = set()
    for ctx in ctxs.values():
        g = ctx.graph
        names.update(i.name for i in g.input)
        names.update(i.name for i in g.initializer)
        for n in g.node:
            names.update(n.output)
            names.update(n.input)
            names.add(n.name)
    return names


def inject(
    model: ModelLike,
    sites: list[Site] | Selection | None = None,
    sketches: list[str] | None = None,
    options: sk.SketchOptions | None = None,
    placement: str = "producer",
) -> tuple[ModelProto, Manifest]:
    """Instrument `model`: returns (a new instrumented ModelProto, its Manifest); the input is not changed.

    `sites`: a list from `find_sites`/`select`, a `Selection`, or None for every site.
    `sketches`: names from the registry (None: the default set). External weights stay where
    they are: save the result with `model.save_model(..., base_dir=<source folder>)`.
    """
    options = options or sk.SketchOptions()
    if placement not in PLACEMENTS:
        raise OpscopeError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    names = sk.resolve(sketches)
    source = load_model(model)
    src_label = str(model) if not isinstance(model, ModelProto) else "<in-memory>"
    src_hash = file_sha256(model) if not isinstance(model, ModelProto) else model_sha256(source)
    opset = opset_version(source)
    if opset < MIN_OPSET:
        raise OpscopeError(
            f"model uses opset {opset}; tapping needs opset {MIN_OPSET} or newer",
            hint="convert it with onnx.version_converter.convert_version(model, 13)",
        )
    if isinstance(model, ModelProto):  # the caller's model is not changed
        m = ModelProto()
        m.CopyFrom(source)
    else:  # loaded here for this call alone: no second copy of the weights
        m = source
    ctxs = _contexts(m)
    light = without_weight_data(m)  # shape inference and site finding need no weight values
    types = _type_table(light)
    found = find_sites(light) if sites is None or isinstance(sites, Selection) else []
    del light
    if sites is None or isinstance(sites, Selection):
        if not found:
            raise OpscopeError(
                "the model has no tappable site (MatMul, Gemm, Conv, ConvTranspose, LSTM, GRU, "
                "RNN, MatMulInteger, QLinearMatMul, Softmax, fused attention, TopK router, residual "
                "Add), subgraphs included"
            )
        numel = {
            t.tensor: ti.numel
            for s in found
            for t in s.taps
            if (ti := _lookup(types, ctxs, s.graph, t.tensor)) is not None and ti.numel is not None
        }
        sites = select(found, sites or Selection(), numel)
    constants = _constants(ctxs)
    taken = _all_names(m, ctxs)
    # IR 3 wants every initializer listed as a graph input too: keep Constant nodes there.
    shared = Constants(taken) if m.ir_version >= 4 else None
    n_original = len(m.graph.output)

    taps: dict[tuple, TapRecord] = {}
    inserts: dict[str, dict[int, list[NodeProto]]] = {}
    # Each site kind has its own sketches; a tensor tapped by several sites gets their union.
    wanted: dict[tuple, set[str]] = {}
    for site in sites:
        for tap in site.taps:
            key = (site.graph, tap.tensor, tap.channel_axis, tap.seq_axis, False)
            wanted.setdefault(key, set()).update(sk.for_site(site.kind, names))
    # Fused attention sites tap a shadow softmax, built next to the fused op from its inputs.
    shadow_at: dict[tuple[str, str], int] = {}
    for site in sites:
        for tap in site.taps:
            if tap.tensor.endswith(it.SHADOW_SUFFIX) and (site.graph, tap.tensor) not in shadow_at:
                path = site.graph

                def type_of(name: str, path: str = path) -> tuple[int, int | None]:
                    ti = _lookup(types, ctxs, path, name)
                    return (ti.elem_type, ti.rank) if ti else (TensorProto.UNDEFINED, None)

                b = Builder(opset, f"opscope_s{len(shadow_at)}_", taken, shared)
                pos = it.build_shadow(b, ctxs[path].graph, tap.tensor, type_of)
                inserts.setdefault(path, {}).setdefault(pos, []).extend(b.nodes)
                shadow_at[(path, tap.tensor)] = pos
                types.setdefault(path, {})[tap.tensor] = _TypeInfo(TensorProto.FLOAT, 4, None)
    site_records = []
    producer_pos: dict[str, dict[str, int]] = {}  # per graph: tensor -> index of its producer
    templates = _TapTemplates(opset, options, taken, shared)
    for site in sites:
        roles: dict[str, str] = {}
        shape_roles: dict[str, str] = {}
        for tap, only_shape in [(t, False) for t in site.taps] + [(t, True) for t in site.shape_only]:
            ti = _lookup(types, ctxs, site.graph, tap.tensor)
            elem = ti.elem_type if ti and ti.elem_type else TensorProto.UNDEFINED
            info = sk.TapInfo(ti.rank if ti else None, elem, tap.channel_axis, tap.seq_axis, tap.bins)
            key = (site.graph, tap.tensor, tap.channel_axis, tap.seq_axis, only_shape)
            if key not in taps:
                own = [n for n in sk.REGISTRY if n in wanted.get(key, ())]
                chosen = [] if only_shape else sk.sketches_for(own, info)
                raws = ["shape"] if only_shape else sk.raws_for(chosen, info, options)
                is_const = _is_constant(constants, ctxs, site.graph, tap.tensor)
                out: dict[str, str] = {}
                if not is_const:  # a weight's sketches are computed on the host (weights.host_values)
                    nodes, out = templates.build(f"opscope_t{len(taps)}_", tap.tensor, info, raws)
                    pos = shadow_at.get((site.graph, tap.tensor))
                    if pos is None or placement == "end":
                        index = producer_pos.setdefault(site.graph, {})
                        pos = _insert_position(ctxs[site.graph].graph, tap.tensor, placement, index)
                    inserts.setdefault(site.graph, {}).setdefault(pos, []).extend(nodes)
                taps[key] = TapRecord(
                    f"t{len(taps)}",
                    tap.tensor,
                    site.graph,
                    info.rank,
                    elem,
                    tap.channel_axis,
                    tap.seq_axis,
                    ti.numel if ti else None,
                    is_const,
                    0,
                    chosen,
                    out,
                    tap.bins,
                )
            (shape_roles if only_shape else roles)[tap.role] = taps[key].id
        site_records.append(
            SiteRecord(
                site.id, site.op_type, site.node, site.graph, site.order, roles, shape_roles, dict(site.attrs)
            )
        )

    # Deepest graphs first: splicing a graph copies its nodes, subgraphs included, so an
    # outer graph must be spliced after everything inside it; then look the graphs up again.
    moved = {
        path: _splice(ctxs[path].graph, inserts[path])
        for path in sorted(inserts, key=lambda p: -p.count("/"))
    }
    ctxs = _relocate(m, ctxs, moved)
    if shared is not None:
        m.graph.initializer.extend(shared.tensors)
    for tap in taps.values():
        for raw, name in list(tap.outputs.items()):
            elem = sk.raw_dtype(raw, options)
            tap.outputs[raw], tap.stacked = _expose(
                ctxs, tap.graph, name, elem, sk.raw_rank(raw), taken, opset
            )

    manifest = Manifest(
        src_label,
        src_hash,
        opset,
        [o.name for o in m.graph.output[:n_original]],
        names,
        _options_dict(options),
        placement,
        site_records,
        list(taps.values()),
    )
    return m, manifest


def _options_dict(o: sk.SketchOptions) -> dict:
    d = asdict(o)
    if d["hist_range"] is not None:
        d["hist_range"] = list(d["hist_range"])
    return d


def _is_constant(
    constants: dict[str, set[str]], ctxs: dict[str, _GraphCtx], path: str | None, name: str
) -> bool:
    while path is not None:
        if name in constants.get(path, set()):
            return True
        path = ctxs[path].parent
    return False


def _insert_position(graph: GraphProto, tensor: str, placement: str, index: dict[str, int]) -> int:
    """Index of the node after which the tap goes: its producer, -1 for inputs, the last node for 'end'.

    `index` caches tensor -> producer position for `graph`, filled on first use: scanning the
    nodes once per tap made injection quadratic (minutes on a 40k-node graph).
    """
    if placement == "end":
        return len(graph.node) - 1
    if not index:
        for i, node in enumerate(graph.node):
            for o in node.output:
                index.setdefault(o, i)
    return index.get(tensor, -1)


class _Chunk(NamedTuple):
    """`n` nodes already encoded as GraphProto.node entries."""

    data: bytes
    n: int


class _TapTemplates:
    """Builds tap subgraphs: each signature once, then copies with the names swapped.

    Two taps with the same signature (TapInfo, raws, and the byte lengths of the
    tap prefix and tensor name) differ only in those names. The first is built with
    placeholder names of the same byte lengths and serialized; each later one is two byte
    replacements, exact because no protobuf length changes. Building ~150 nodes one by one
    in Python costs ~2.5 ms a tap (a minute for the 20k taps of a 40k-node graph); a copy
    costs ~0.07 ms. Tap names (`opscope_t<k>_...`) are then not added to `taken`: the prefix
    is reserved, and a model already using it gets the node-by-node build.
    """

    def __init__(self, opset: int, options: sk.SketchOptions, taken: set[str], constants: Constants | None):
        self.opset, self.options, self.taken, self.constants = opset, options, taken, constants
        self.enabled = not any(n.startswith("opscope_t") for n in taken)
        self.cache: dict[tuple, tuple[_Chunk, bytes, bytes, dict[str, str]] | None] = {}

    def build(
        self, prefix: str, tensor: str, info: sk.TapInfo, raws: list[str]
    ) -> tuple[list[NodeProto] | list[_Chunk], dict[str, str]]:
        """(the tap's nodes, as NodeProtos or as one encoded `_Chunk`; raw -> output name)."""
        pb, tb = prefix.encode(), tensor.encode()
        key = (info, tuple(raws), len(pb), len(tb))
        if self.enabled and key not in self.cache:
            self.cache[key] = self._template(info, raws, len(pb), len(tb))
        tpl = self.cache.get(key)
        if tpl is None:
            b = Builder(self.opset, prefix, self.taken, self.constants)
            return b.nodes, sk.build_tap(b, tensor, info, raws, self.options)
        chunk, p, t, out = tpl
        ps, ts = p.decode(), t.decode()
        names = {r: n.replace(ps, prefix).replace(ts, tensor) for r, n in out.items()}
        return [_Chunk(chunk.data.replace(p, pb).replace(t, tb), chunk.n)], names

    def _template(
        self, info: sk.TapInfo, raws: list[str], n_prefix: int, n_tensor: int
    ) -> tuple[_Chunk, bytes, bytes, dict[str, str]] | None:
        # ASCII control characters no name uses; the first byte differs from the rest, so an
        # occurrence cannot overlap another one.
        p, t = "\x1e" + "\x1d" * (n_prefix - 1), "\x1c" + "\x1b" * (n_tensor - 1)
        b = Builder(self.opset, p, set(), self.constants)
        out = sk.build_tap(b, t, info, raws, self.options)
        g = GraphProto()
        g.node.extend(b.nodes)
        data = g.SerializeToString()
        # Every placeholder in the bytes must be inside a name: one in, say, a constant's raw
        # bytes would be renamed too. Then this signature is built node by node.
        counts = _count_in_strings(g, (p, t))
        if data.count(p.encode()) != counts[0] or data.count(t.encode()) != counts[1]:
            return None
        return _Chunk(data, len(b.nodes)), p.encode(), t.encode(), out


def _count_in_strings(msg, words: tuple[str, ...]) -> list[int]:
    """How often each of `words` occurs in the string fields of `msg`, nested messages included."""
    counts = [0] * len(words)
    stack = [msg]
    while stack:
        m = stack.pop()
        for fd, value in m.ListFields():
            if fd.type == fd.TYPE_STRING:
                for v in [value] if isinstance(value, str) else value:
                    for i, w in enumerate(words):
                        counts[i] += v.count(w)
            elif fd.type == fd.TYPE_MESSAGE:
                stack.extend([value] if isinstance(value, Message) else value)
    return counts


def _splice(graph: GraphProto, by_pos: dict[int, list]) -> list[int]:
    """Rebuild `graph.node` with the taps in place; returns each original node's new position.

    Done at the wire level: repeated fields concatenate, so the new node list is the original
    nodes' encodings with the taps' nodes (NodeProtos, or `_Chunk`s already encoded) between
    them, parsed back once in C; copying millions of NodeProtos one by one took seconds.
    """
    parts: list[bytes] = []
    moved: list[int] = []
    count = 0

    def add(items: list) -> None:
        nonlocal count
        for x in items:
            if isinstance(x, _Chunk):
                parts.append(x.data)
                count += x.n
            else:
                parts.append(_node_entry(x.SerializeToString()))
                count += 1

    add(by_pos.get(-1, []))
    for i, node in enumerate(graph.node):
        moved.append(count)
        add([node])
        add(by_pos.get(i, []))
    del graph.node[:]
    graph.MergeFromString(b"".join(parts))
    return moved


def _relocate(
    model: ModelProto, old: dict[str, _GraphCtx], moved: dict[str, list[int]]
) -> dict[str, _GraphCtx]:
    """`old`'s paths in the spliced model, each owner found at its original index moved past the taps.

    Re-walking the model would name unnamed owners by their new index (`If_57` for `If_1`)
    and would also walk every tap's own If branches.
    """
    out = {"": _GraphCtx(model.graph, None, None, None)}
    for path in sorted(old, key=lambda p: p.count("/")):  # a parent path has fewer "/" than its children
        ctx = old[path]
        if ctx.parent is None:
            continue
        parent = out[ctx.parent].graph
        i = moved[ctx.parent][ctx.index] if ctx.parent in moved else ctx.index
        owner = parent.node[i]
        sub = next(a.g for a in owner.attribute if a.name == ctx.attr)
        out[path] = _GraphCtx(sub, owner, ctx.attr, ctx.parent, i)
    return out


def _node_entry(data: bytes) -> bytes:
    """`data` (a serialized NodeProto) as one entry of GraphProto.node (field 1, length-delimited)."""
    head = bytearray(b"\x0a")
    n = len(data)
    while n >= 0x80:
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + data


def _expose(
    ctxs: dict[str, _GraphCtx], path: str, name: str, elem: int, rank: int, taken: set[str], opset: int
) -> tuple[str, int]:
    """Carry output `name` of subgraph `path` up to the main graph; returns (main name, Loop/Scan levels)."""
    stacked = 0
    b = Builder(opset, "opscope_x_", taken)
    while path:
        ctx = ctxs[path]
        _add_output(ctx.graph, name, elem, rank + stacked)
        owner = ctx.owner
        if owner.op_type == "If":
            other_attr = "else_branch" if ctx.attr == "then_branch" else "then_branch"
            other = next(a.g for a in owner.attribute if a.name == other_attr)
            dummy = b.fresh("not_run")
            dtype = helper.tensor_dtype_to_np_dtype(elem)
            r = rank + stacked
            empty = (
                np.full((), np.nan if dtype.kind == "f" else 0, dtype) if r == 0 else np.zeros([0] * r, dtype)
            )
            other.node.append(
                helper.make_node(
                    "Constant",
                    [],
                    [dummy],
                    name=b.fresh("n_not_run"),
                    value=numpy_helper.from_array(empty, dummy),
                )
            )
            _add_output(other, dummy, elem, rank + stacked)
        elif owner.op_type in ("Loop", "Scan"):
            stacked += 1
            if owner.op_type == "Scan":
                for a in owner.attribute:
                    if a.name in ("scan_output_axes", "scan_output_directions"):
                        a.ints.append(0)
        else:  # sites.find_sites never descends into other subgraph owners
            raise OpscopeError(f"cannot carry a tap out of a {owner.op_type} subgraph ({path})")
        new = b.fresh(name.split("/")[-1] + "_up")
        owner.output.append(new)
        name, path = new, ctx.parent
    _add_output(ctxs[""].graph, name, elem, rank + stacked)
    return name, stacked


@functools.cache
def _tensor_type(elem: int, rank: int) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(elem, [None] * rank)


def _add_output(graph: GraphProto, name: str, elem: int, rank: int) -> None:
    """Append output `name` (of unknown dims): a tap has ~17 of them, a big model 300k+."""
    vi = graph.output.add()
    vi.name = name
    vi.type.CopyFrom(_tensor_type(elem, rank))


def inject_file(
    src: str | Path,
    out: str | Path,
    *,
    sites: list[Site] | Selection | None = None,
    sketches: list[str] | None = None,
    options: sk.SketchOptions | None = None,
    placement: str = "producer",
    copy_external: bool = False,
) -> tuple[Path, Path, Manifest]:
    """Inject into the model at `src` and write `out` plus `<out stem>.manifest.json` beside it."""
    from .manifest import manifest_path_for
    from .model import save_model

    instrumented, manifest = inject(src, sites, sketches, options, placement)
    path = save_model(instrumented, out, base_dir=Path(src).parent, copy_external=copy_external)
    mpath = manifest.save(manifest_path_for(path))
    return path, mpath, manifest
