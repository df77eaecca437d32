"""Instrument a model: the pipeline plan -> build -> expose -> splice -> manifest.

`inject` copies the model (the input is left untouched; external weights are referenced,
never loaded), appends one tap subgraph per tapped tensor and exposes its raw outputs as
extra graph outputs after the original ones, whose names and order do not change.

1. `_prepare`: check and load the model, infer shapes once on a weightless copy
   (`graph.io.without_weight_data`), index it, find and select the sites;
2. `plan.plan_taps`: one tap per tensor with the union of its sites' sketches;
3. `build`: each live tap's nodes (`sketch.build_tap`, through `templates`), one sample index
   per tensor shape that the taps share (`samples`), shadow softmaxes of fused attention ops
   (`shadow`), and where they go in their graph;
4. `expose_all`: every raw output carried up to the model's outputs through If branches and
   Loop / Scan bodies (`graph.expose`), but the main graph's small raws, which `packing` joins
   into four outputs (each output costs ~2 µs a run, more than a small tap's nodes);
5. `splice_all`: the nodes inserted, deepest graphs first (`graph.wire.splice`);
6. the `Manifest`, which says what every extra output means.

Expose comes before splice on purpose: splicing rebuilds a graph's node list from bytes,
which makes every object taken from it stale, while exposing only appends; so every graph is
edited through the one index built in step 1, with no re-walk.

Placement: by default each tap's nodes go right after the node producing the tensor
(`placement="producer"`), so onnxruntime can free the intermediate as early as it would
without the tap; `placement="end"` appends them after every original node instead (what
naive instrumentation does: it keeps intermediates alive to the end of the run).
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from onnx import ModelProto, NodeProto, TensorProto, helper

from .. import sketch as sk
from ..errors import OpscopeError
from ..files import atomic_path, check_writable
from ..graph.build import Builder, Constants
from ..graph.expose import expose
from ..graph.index import ModelIndex, Names
from ..graph.io import (
    ModelLike,
    file_sha256,
    load_model,
    model_sha256,
    opset_version,
    save_model,
    without_weight_data,
)
from ..graph.opset import MIN_TAP_OPSET
from ..graph.wire import Chunk, splice
from ..shapes import ShapeTable, infer_shapes
from ..shapes.symbolic import evaluate
from ..sites import SHADOW_SUFFIX, Selection, Site, find_sites, select
from . import branches
from .manifest import Manifest, TapRecord, manifest_path_for
from .packing import branch_raws, copied_groups, pack_branch_raws, pack_copied, pack_of, pack_outputs
from .plan import plan_taps, tensor_type
from .qdq import converts_s8_to_u8, dequantize, unsigned_pairs
from .samples import shared_sample_indices
from .shadow import build_shadow
from .templates import TapTemplates

PLACEMENTS = ("producer", "end")
CPU = "CPUExecutionProvider"
# the shapes of the batches the model will run on, or how to get them from the (weightless) model
InputShapes = Mapping[str, Sequence[int]] | Callable[[ModelProto], Mapping[str, Sequence[int]]]

Inserts = dict[str, dict[int, list[NodeProto | Chunk]]]  # graph path -> position -> nodes after it


class Instrumented(NamedTuple):
    """What `inject` returns: the new model and what every extra output of it means."""

    model: ModelProto
    manifest: Manifest


@dataclass
class _Target:
    """The model being instrumented and what every step reads of it."""

    model: ModelProto
    index: ModelIndex
    table: ShapeTable
    names: Names
    opset: int
    constants: Constants | None
    light: ModelProto  # the weightless copy the shapes were inferred on
    sites: list[Site] = field(default_factory=list)


def inject(
    model: ModelLike,
    sites: list[Site] | Selection | None = None,
    sketches: list[str] | None = None,
    options: sk.SketchOptions | None = None,
    placement: str = "producer",
    providers: list[str] | None = None,
    input_shapes: InputShapes | None = None,
) -> Instrumented:
    """Instrument `model`: returns (a new instrumented ModelProto, its Manifest); the input is not changed.

    `sites`: a list from `find_sites`/`select`, a `Selection`, or None for every site.
    `sketches`: names from the registry (None: the default set). External weights stay where
    they are: save the result with `save_model(..., base_dir=<source folder>)`.
    `providers`: the onnxruntime providers the model will run on (None: CPU); taps on QDQ
    models adapt to what their graph optimizers do (`instrument.qdq`).
    `input_shapes`: the input shapes of the batches it will run on (a mapping, or a function of the
    weightless model giving one): a main-graph tensor of at most `options.copy_out_max` elements
    at those shapes (or static ones) is copied out whole and sketched on the host at decode.
    """
    options = options or sk.SketchOptions()
    if options.copy_out_max is None:
        cpu = all(p == CPU for p in providers or [CPU])
        options = replace(options, copy_out_max=options.sample_size if cpu else 0)
    if placement not in PLACEMENTS:
        raise OpscopeError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    names = sk.resolve(sketches)
    target = _prepare(model, sites)
    options = sk.for_opset(options, target.opset)
    n_original = len(target.model.graph.output)
    site_records, taps = plan_taps(target.sites, names, target.table, target.index)
    if converts_s8_to_u8(providers):
        unsigned_pairs(target.index, taps, target.constants)
    if options.copy_out_max:
        shapes = _shapes_of(input_shapes, target)
        mark_copied(taps, target.table, options.copy_out_max, shapes, target.index, target.light)
    branched = [t for t in taps if t.graph and _in_if_branches(target.index, t.graph)]
    streams = target.opset >= branches.MIN_OPSET  # before, an If's branches must agree on shapes
    # the copied tensors of If branches join the stream as they are; an in-graph tap once built
    stream_copies = {t.id for t in branches.members_of(branched, {})} if streams else set()
    groups = copied_groups([t for t in taps if t.id not in stream_copies])
    packed_copies = stream_copies | {t.id for g in groups.values() for t in g}
    inserts, branch_packs = build(target, taps, options, placement, packed_copies)
    in_stream = branches.members_of(branched, branch_packs) if streams else []
    b = Builder(target.opset, target.names, "opscope_b_", target.constants)
    stream = branches.build_stream(target.index, b, in_stream, branch_packs, inserts)
    copied = {}
    for graph, members in groups.items():  # after every other node of their graph
        b = Builder(target.opset, target.names, "opscope_c_", target.constants)
        nodes, values, shapes = pack_copied(members, b, target.names)
        inserts.setdefault(graph, {}).setdefault(len(target.index[graph].graph.node) - 1, []).extend(nodes)
        copied[graph] = (values, shapes, members)
    in_branches = expose_all(target, taps, options, branch_packs, copied, {t.id for t in in_stream})
    in_branches += [stream] if stream else []
    main = target.index.main.graph
    pack_nodes, packed = pack_outputs(main, target.opset, target.names, target.constants, taps, options)
    packed = in_branches + packed
    inserts.setdefault("", {}).setdefault(len(main.node) - 1, []).extend(pack_nodes)  # after all else
    splice_all(target.index, inserts)
    if target.constants is not None:
        target.model.graph.initializer.extend(target.constants.tensors)
    manifest = Manifest(
        str(model) if not isinstance(model, ModelProto) else "<in-memory>",
        file_sha256(model) if not isinstance(model, ModelProto) else model_sha256(model),
        target.opset,
        [o.name for o in target.model.graph.output[:n_original]],
        names,
        options.to_dict(),
        placement,
        site_records,
        taps,
        packed=packed,
    )
    return Instrumented(target.model, manifest)


def _prepare(model: ModelLike, sites: list[Site] | Selection | None) -> _Target:
    """Load and check `model`, copy it when it is the caller's, infer its shapes and pick its sites."""
    source = load_model(model)
    opset = opset_version(source)
    if opset < MIN_TAP_OPSET:
        raise OpscopeError(
            f"model uses opset {opset}; tapping needs opset {MIN_TAP_OPSET} or newer (what onnxruntime runs)",
            hint=f"convert it with onnx.version_converter.convert_version(model, {MIN_TAP_OPSET})",
        )
    if isinstance(model, ModelProto):  # the caller's model is not changed
        m = ModelProto()
        m.CopyFrom(source)
    else:  # loaded here for this call alone: no second copy of the weights
        m = source
    light = without_weight_data(m)  # shape inference and site finding need no weight values
    table = infer_shapes(light)
    index = ModelIndex(m)
    sites = _choose(light, table, sites)
    names = index.names()
    # IR 3 wants every initializer listed as a graph input too: keep Constant nodes there.
    constants = Constants(names) if m.ir_version >= 4 else None
    return _Target(m, index, table, names, opset, constants, light, list(sites))


def _choose(light: ModelProto, table: ShapeTable, sites: list[Site] | Selection | None) -> list[Site]:
    if sites is not None and not isinstance(sites, Selection):
        return list(sites)
    found = find_sites(light, table)
    if not found:
        raise OpscopeError(
            "the model has no tappable site (MatMul, Gemm, Conv, ConvTranspose, LSTM, GRU, RNN, MatMulInteger, "
            "QLinearMatMul, ConvInteger, QLinearConv, Softmax, fused attention, TopK router, residual Add), "
            "subgraphs included"
        )
    numel = {
        t.tensor: ti.numel for s in found for t in s.taps if (ti := table.type_of(t.tensor)) and ti.numel
    }
    return select(found, sites or Selection(), numel)


def sites_of(model: ModelLike, sites: list[Site] | Selection | None = None) -> list[Site]:
    """The sites `inject(model, sites)` would tap: a `Selection` (or None: every site) resolved to a list."""
    light = without_weight_data(load_model(model))
    return _choose(light, infer_shapes(light), sites)


def _shapes_of(input_shapes: InputShapes | None, target: _Target) -> Mapping[str, Sequence[int]]:
    if input_shapes is None:
        return {}
    if callable(input_shapes):
        return input_shapes(target.light)
    return input_shapes


def mark_copied(
    taps: list[TapRecord],
    table: ShapeTable,
    limit: int,
    input_shapes: Mapping[str, Sequence[int]],
    index: ModelIndex,
    light: ModelProto | None = None,
) -> None:
    """Mark the taps copied out whole: activations (no weight, no QDQ read, no shadow softmax) of the
    main graph or of If branches (not Loop / Scan bodies, whose outputs stack) of at most `limit`
    elements at `input_shapes`, every sketch of which has a reference.

    A tensor whose size the symbolic table leaves open (behind an `If` whose branches disagree on
    its shape, decided by the input shapes alone) is sized by inferring `light`'s shapes once more
    with the inputs fixed at `input_shapes`: silero_vad_v6's decoder LSTM sits behind two such Ifs.
    A later batch of other shapes may take the other branch; the tensor is still copied and
    sketched right, only perhaps bigger than `limit`.
    """
    where = (re.fullmatch(r"(.*)\[(\d+)\]", w) for w in table.symbols.values())
    values = {}
    for sym, m in zip(table.symbols, where):
        shape = input_shapes.get(m.group(1)) if m else None
        if shape is not None and int(m.group(2)) < len(shape):
            values[sym] = int(shape[int(m.group(2))])

    @functools.cache  # inferred at the first tap that needs it, once
    def concrete() -> ShapeTable | None:
        return _concrete_table(light, input_shapes)

    for tap in taps:
        if (
            tap.constant or not _in_if_branches(index, tap.graph) or tap.dequant is not None or not tap.sketches
            or tap.tensor.endswith(SHADOW_SUFFIX) or any(sk.REGISTRY[n].reference is None for n in tap.sketches)
        ):  # fmt: skip
            continue
        numel = tap.numel if tap.numel is not None else _numel_at(table.shape(tap.tensor), values)
        if numel is None and light is not None and input_shapes and (at_inputs := concrete()) is not None:
            numel = _numel_at(at_inputs.shape(tap.tensor), {})
        tap.copied = numel is not None and numel <= limit


def _concrete_table(light: ModelProto, input_shapes: Mapping[str, Sequence[int]]) -> ShapeTable | None:
    """`light`'s shapes with its inputs fixed at `input_shapes` (onnx's inference and the per-node rules,
    which decide If conditions made from shapes); None when those shapes do not fit the model."""
    try:
        return infer_shapes(light, shapes=input_shapes, symbolic=False)
    except OpscopeError:
        return None


def _in_if_branches(index: ModelIndex, path: str) -> bool:
    """Whether the graph at `path` is the main graph or reached through If branches alone."""
    while path:
        entry = index[path]
        if entry.owner is None or entry.owner.op_type != "If" or not entry.carried:
            return False
        path = entry.parent or ""
    return True


def _numel_at(shape: tuple | None, values: Mapping[str, int]) -> int | None:
    """The element count of a (symbolic) shape with its symbols set to `values`; None if it stays unknown."""
    if shape is None:
        return None
    dims = [evaluate(d, values) for d in shape]
    if not all(isinstance(d, int | float) and float(d).is_integer() for d in dims):
        return None
    return math.prod(int(d) for d in dims)


def build(
    target: _Target,
    taps: list[TapRecord],
    options: sk.SketchOptions,
    placement: str,
    packed_copies: set[str] = frozenset(),
) -> tuple[Inserts, dict[str, tuple[str, list[str]]]]:
    """Build the nodes of every live tap (and of the shadow softmaxes they read); returns where they go,
    and per tap in If branches that packs its raws (`packing.pack_branch_raws`) the pack and its raws.
    `packed_copies`: the copied taps that leave in their graph's pack (`packing.copied_groups`).

    Fills each TapRecord's `outputs` (raw -> tensor name inside its graph).
    """
    inserts: Inserts = {}
    shadow_at: dict[tuple[str, str], int] = {}
    for tap in taps:
        if tap.tensor.endswith(SHADOW_SUFFIX) and (tap.graph, tap.tensor) not in shadow_at:
            b = Builder(target.opset, target.names, f"opscope_s{len(shadow_at)}_", target.constants)

            def type_of(name: str) -> tuple[int, int | None]:
                ti = tensor_type(target.table, name)
                return (ti.elem_type, ti.rank) if ti else (0, None)

            pos = build_shadow(b, target.index[tap.graph], tap.tensor, type_of)
            inserts.setdefault(tap.graph, {}).setdefault(pos, []).extend(b.nodes)
            shadow_at[(tap.graph, tap.tensor)] = pos
    live = []  # (number, record, source, reads, prelude, position) of every tap that gets nodes
    for k, tap in enumerate(taps):
        if tap.constant:  # a weight's sketches are computed on the host (host.host_values)
            continue
        entry = target.index[tap.graph]
        source, reads, prelude = tap.tensor, [tap.tensor], []
        if tap.dequant is not None:  # QDQ: dequantize a copy of the quantized tensor (sites.qdq)
            source, prelude = _dequantize(target, k, tap)
            reads += [n for n in (tap.dequant["scale"], tap.dequant["zero_point"]) if n]
        if placement == "end":
            pos = len(entry.graph.node) - 1
        else:
            pos = shadow_at.get((tap.graph, tap.tensor))
            if pos is None:  # after the last producer of what the tap reads (-1: graph inputs, outer tensors)
                pos = max(-1 if (p := entry.producer_index(r)) is None else p for r in reads)
        live.append((k, tap, source, reads, prelude, pos))
    shared, index_nodes = shared_sample_indices(
        [(k, tap, pos) for k, tap, *_, pos in live if not tap.copied],
        target.table,
        target.opset,
        target.names,
        target.constants,
        options,
    )
    for graph, at in index_nodes.items():  # before the taps at the same position: they read them
        for pos, nodes in at.items():
            inserts.setdefault(graph, {}).setdefault(pos, []).extend(nodes)
    templates = TapTemplates(target.opset, options, target.names, target.constants)
    branch_packs: dict[str, tuple[str, list[str]]] = {}
    for k, tap, source, _, prelude, pos in live:
        if tap.copied:  # the tensor itself, under a name of ours (it may be an input or an output already)
            copy = target.names.fresh(f"opscope_t{k}_tensor")
            nodes, tap.outputs = [helper.make_node("Identity", [source], [copy], name=copy)], {"tensor": copy}
            if tap.graph and not tap.rank and tap.id not in packed_copies:  # an If branch's scalar or
                # tensor of unknown rank alone: its shape tells a branch not taken (empty) from a tensor that
                # ran; of known rank >= 1, the branch not taken's [0, ..., 0] tells it alone
                # (`decode._copied_ran`); in a pack, the pack's shapes tell it for all
                marker, built = templates.build(f"opscope_t{k}_", source, tap.info(), [])
                nodes, tap.outputs = [*marker, *nodes], {**built.outputs, "tensor": copy}
        else:
            nodes, built = templates.build(
                f"opscope_t{k}_", source, tap.info(), tap.sketches, shared.get(k), packed=not tap.graph
            )
            tap.outputs, tap.slow = built.outputs, list(built.slow)
            members = (
                branch_raws(tap, options) if tap.graph and _in_if_branches(target.index, tap.graph) else []
            )
            if members:
                b = Builder(target.opset, target.names, f"opscope_t{k}_pack_", target.constants)
                pack, out = pack_branch_raws(tap, members, b, target.names)
                nodes, branch_packs[tap.id] = [*nodes, *pack], (out, members)
        inserts.setdefault(tap.graph, {}).setdefault(pos, []).extend([*prelude, *nodes])
    return inserts, branch_packs


def _dequantize(target: _Target, k: int, tap: TapRecord) -> tuple[str, list[NodeProto]]:
    """(the dequantized tensor, the nodes making it) for a QDQ tap (`qdq.dequantize`)."""
    b = Builder(target.opset, target.names, f"opscope_q{k}_", target.constants)
    return dequantize(b, target.index, tap), b.nodes


def expose_all(
    target: _Target,
    taps: list[TapRecord],
    options: sk.SketchOptions,
    branch_packs: dict[str, tuple[str, list[str]]],
    copied: dict[str, tuple[str, str, list[TapRecord]]] | None = None,
    streamed: set[str] = frozenset(),
) -> list[dict]:
    """Make every raw output of every tap a model output; fills `outputs` with the model-level names
    and `stacked` with the Loop / Scan levels each tap's outputs gained. Raws that go into a pack
    (`packing.pack_of`) are left to `packing.pack_outputs`; those of a tap in If branches that packs its
    raws leave in its vector, and the copied tensors of a graph in `copied` (graph -> its values' pack,
    its shapes', its taps) in theirs: this returns those packs' manifest entries (`Manifest.packed`). The
    taps in `streamed` leave in the branches' stream (`branches.build_stream`); their vectors' entries
    name the vectors inside their graphs."""
    entries = []
    in_pack = set()
    for graph, (values, shapes, members) in (copied or {}).items():
        out, _ = expose(target.index, graph, values, TensorProto.FLOAT, 1, target.names)
        dims, _ = expose(target.index, graph, shapes, TensorProto.INT64, 1, target.names)
        raws = [[t.id, "tensor"] for t in members]
        entries.append({"output": out, "pack": "copied", "shapes": dims, "raws": raws})
        in_pack.update(t.id for t in members)
    for tap in taps:
        if tap.id in in_pack:
            continue
        if tap.id in streamed:
            if not tap.copied:
                pack, members = branch_packs[tap.id]
                entries.append({"output": pack, "pack": "tap", "raws": [[tap.id, raw] for raw in members]})
            continue
        if tap.copied:
            if "shape" in tap.outputs:
                tap.outputs["shape"], _ = expose(
                    target.index,
                    tap.graph,
                    tap.outputs["shape"],
                    sk.raw_dtype("shape", options),
                    1,
                    target.names,
                )
            tap.outputs["tensor"], tap.stacked = expose(
                target.index, tap.graph, tap.outputs["tensor"], tap.elem_type, tap.rank, target.names
            )
            continue
        chosen = [sk.REGISTRY[n] for n in tap.sketches]
        pack, members = branch_packs.get(tap.id, ("", []))
        if pack:
            out, _ = expose(target.index, tap.graph, pack, TensorProto.FLOAT, 1, target.names)
            entries.append({"output": out, "pack": "tap", "raws": [[tap.id, raw] for raw in members]})
        for raw, name in list(tap.outputs.items()):
            if raw in members or pack_of(tap, raw, options) is not None:
                continue
            tap.outputs[raw], tap.stacked = expose(
                target.index,
                tap.graph,
                name,
                sk.raw_dtype(raw, options),
                sk.raw_rank(raw, chosen),
                target.names,
            )
    return entries


def splice_all(index: ModelIndex, inserts: Inserts) -> None:
    """Insert the built nodes, deepest graphs first: splicing a graph re-encodes the subgraphs inside it,
    so what is inside must be spliced before it."""
    for path in sorted(inserts, key=lambda p: -p.count("/")):
        splice(index[path].graph, inserts[path])


def inject_file(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    sites: list[Site] | Selection | None = None,
    sketches: list[str] | None = None,
    options: sk.SketchOptions | None = None,
    placement: str = "producer",
    copy_external: bool = False,
    providers: list[str] | None = None,
    left_out: list[dict] | None = None,
) -> tuple[Path, Path, Manifest]:
    """Inject into the model at `src` and write `out` plus `<out stem>.manifest.json` beside it: both are
    checked before any work, and the manifest is renamed into place right after the model.
    `left_out`: taps the caller left out (`run.kernels`), recorded in the manifest."""
    mpath = manifest_path_for(out)
    for path in (out, mpath):
        check_writable(path, inputs=[src])
    instrumented, manifest = inject(src, sites, sketches, options, placement, providers)
    manifest.left_out = list(left_out or [])
    with atomic_path(mpath) as manifest_tmp:  # a failed model write leaves the earlier manifest too
        manifest.save(manifest_tmp)
        path = save_model(instrumented, out, base_dir=Path(src).parent, copy_external=copy_external)
    return path, mpath, manifest
