"""The taps in If branches leave the model as one stream: two outputs for all of them.

Every output of an If branch is an output of each If above it, with an empty "not run" marker from
each branch not taken, and every graph output costs ~2-3 µs a run. silero_vad_v6 taps 20 tensors
in its 8 and 16 kHz decoders, two Ifs deep: as a vector and a shape each (or a pack of values and
shapes a graph) they made 20 outputs, 2 a branch not taken. Instead, each branch graph lays what
its taps made end to end, and both branches of an If hand theirs to the same two If outputs (only
one branch runs):

- a float vector: each member's values (a copied tensor flattened; an in-graph tap's vector of
  scalars and sample, `packing.pack_branch_raws`), then the streams of the Ifs inside the branch;
- an int64 vector: the graph's id, then per member its record (a length, then that many values: a
  copied tensor's dims, an in-graph tap's [1, *shape]), then the inner Ifs' streams.

The main graph concatenates its Ifs' streams into the model's two outputs. The host reads the ids
of the branches that ran and cuts each member out (`packing.Unpacked`); a member whose graph's id is
absent did not run. Members: copied float32 tensors of any rank, and in-graph taps whose raws all
travel in their vector but their shape. Taps under a Loop or Scan, other raws (per-channel vectors,
bin indices) and models before opset 11 (whose If branches must agree on shapes) keep their outputs.
"""

from __future__ import annotations

from onnx import NodeProto, TensorProto

from ..graph.build import Builder
from ..graph.expose import add_output, not_run
from ..graph.index import GraphEntry, ModelIndex, Names
from .manifest import TapRecord

MIN_OPSET = 11  # If branches may return vectors of different lengths


def members_of(taps: list[TapRecord], branch_packs: dict[str, tuple[str, list[str]]]) -> list[TapRecord]:
    """The taps of If branches that travel in the stream, in tap order (their graphs are reached through
    If branches alone: the caller passes only such taps and their `branch_packs`)."""
    got = []
    for tap in taps:
        if not tap.graph or tap.constant:
            continue
        if tap.copied:
            if tap.elem_type == TensorProto.FLOAT:
                got.append(tap)
        elif tap.id in branch_packs and set(tap.outputs) - set(branch_packs[tap.id][1]) == {"shape"}:
            got.append(tap)
    return got


def build_stream(
    index: ModelIndex,
    b: Builder,
    members: list[TapRecord],
    branch_packs: dict[str, tuple[str, list[str]]],
    inserts: dict[str, dict[int, list[NodeProto]]],
) -> dict | None:
    """Lay `members` out as the stream: nodes at the end of each graph on the way (into `inserts`), two
    outputs on each If and branch above them, two model outputs. Returns the manifest's entry (None when
    there is no member): {"output", "pack": "branches", "shapes", "graphs": [[graph path, [[tap id,
    its vector or None for a copied tensor]]]]}, a graph's id being its position in that list."""
    if not members:
        return None
    own: dict[str, list[TapRecord]] = {}
    for tap in members:
        own.setdefault(tap.graph, []).append(tap)
    graphs = list(own)
    depth = {p: sum(1 for _ in index.scopes(p)) for p in {s.path for g in graphs for s in index.scopes(g)}}
    nested: dict[str, list[tuple[str, str]]] = {}  # graph -> the streams of the Ifs inside it
    done: dict[str, tuple[str, str]] = {}  # branch graph -> its stream
    for path in sorted(depth, key=lambda p: -depth[p]):
        if not path:
            continue
        nodes_b = b.child()
        floats: list[str] = []
        ints: list[str] = [nodes_b.i64([graphs.index(path)])] if path in own else []
        for tap in own.get(path, []):
            if tap.copied:
                x = tap.outputs["tensor"]
                floats.append(nodes_b.op("Reshape", [x, nodes_b.i64([-1])]))
                dims = nodes_b.op("Shape", [x])
                ints += [nodes_b.op("Shape", [dims]), dims]
            else:
                floats.append(branch_packs[tap.id][0])
                ints += [nodes_b.op("Shape", [tap.outputs["shape"]]), tap.outputs["shape"]]
        for f, s in nested.get(path, []):
            floats.append(f)
            ints.append(s)
        done[path] = (
            _concat(nodes_b, floats, "opscope_stream"),
            _concat(nodes_b, ints, "opscope_stream_ids"),
        )
        entry = index[path]  # after every other node of the branch, the Ifs inside it included
        inserts.setdefault(path, {}).setdefault(len(entry.graph.node) - 1, []).extend(nodes_b.nodes)
        siblings = [index[s.path] for s in index.children(entry.parent, entry.owner_index)]
        if any(s.path not in done and s.path in depth for s in siblings):
            continue  # the If's other branch has members too: its stream comes first
        nested.setdefault(entry.parent, []).append(_through_if(entry.owner, siblings, done, b.opset, b.names))
    top = nested.get("", [])
    main = b.child()
    f = _concat(main, [f for f, _ in top], "opscope_branches")
    s = _concat(main, [s for _, s in top], "opscope_branches_ids")
    inserts.setdefault("", {}).setdefault(len(index.main.graph.node) - 1, []).extend(main.nodes)
    add_output(index.main.graph, f, TensorProto.FLOAT, 1)
    add_output(index.main.graph, s, TensorProto.INT64, 1)
    listed = [[g, [[t.id, None if t.copied else branch_packs[t.id][0]] for t in own[g]]] for g in graphs]
    return {"output": f, "pack": "branches", "shapes": s, "graphs": listed}


def _concat(b: Builder, parts: list[str], hint: str) -> str:
    """`parts` end to end (one part is itself)."""
    if len(parts) == 1:
        return parts[0]
    out = b.fresh(hint)
    b.op("Concat", parts, out=out, axis=0)
    return out


def _through_if(
    owner: NodeProto, branches: list[GraphEntry], done: dict[str, tuple[str, str]], opset: int, names: Names
) -> tuple[str, str]:
    """Two new outputs of If `owner`: each branch's stream, or empty vectors from a branch without one."""
    got = []
    for elem, k in ((TensorProto.FLOAT, 0), (TensorProto.INT64, 1)):
        for entry in branches:
            if entry.path in done:
                name = done[entry.path][k]
            else:
                name = names.fresh("opscope_x_not_run")
                entry.graph.node.extend(not_run(name, elem, 1, owner.input[0], opset, names))
            add_output(entry.graph, name, elem, 1)
        out = names.fresh("opscope_x_stream_up" if k == 0 else "opscope_x_stream_ids_up")
        owner.output.append(out)
        got.append(out)
    return got[0], got[1]
