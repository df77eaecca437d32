"""One tap subgraph per tensor: the chosen sketches built through one shared context (`context`).

OUTER-stage sketches are built once on the tensor as it is. FINITE-stage sketches are built
in both branches of an If on the finite check, slow (masking) and fast (no masking); both
branches yield the same raw outputs in the same order, and every finite-stage tap has the
raws `nan` and `inf` (what n_finite is made of). A raw that both branches take from the
outer graph (the sample) leaves as it is; everything else is an output of the If, made
inside each branch (an Identity where a branch only forwards a constant or an outer tensor).
Scalars come back as rank-0 tensors (no Reshape per statistic), everything else as 1-D.

A main-graph tap (`packed`, its raws go into `instrument.packing`'s packs) is laid out
otherwise: its clean branch is built in the graph itself and runs every time, and the If's
one output is the masking branch's raws in one vector (empty from the clean branch). An If
output costs about as much as an output of the model (~1 µs each in onnxruntime), and a
default tap had seven; taps in subgraphs keep both branches, because a Loop stacks its
outputs and a vector empty in one iteration but not in another cannot be stacked.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from onnx import TensorProto, helper

from ..graph.build import Builder
from .base import FINITE, OUTER, Sketch
from .context import F, SampleIndex, Split, TapContext
from .histogram import index_dtype
from .options import SketchOptions, TapInfo

CONTEXT_SCALARS = frozenset({"nan", "inf", "min", "max", "ynorm", "ysum", "yss", "check"})
"""The tap context's shared raws that are scalars; every sketch lists its own (`Sketch.scalars`)."""


def raw_dtype(raw: str, o: SketchOptions) -> int:
    """The element type of a raw output: float32 but for the shape and the histogram's bin indices."""
    if raw == "shape":
        return TensorProto.INT64
    if raw == "hidx":
        return index_dtype(o)
    return TensorProto.FLOAT


def raw_rank(raw: str, sketches: list[Sketch]) -> int:
    """Scalars come back as rank-0 tensors (no Reshape per statistic), everything else as 1-D."""
    return 0 if raw in CONTEXT_SCALARS or any(raw in sk.scalars for sk in sketches) else 1


class Built(NamedTuple):
    """A tap's raws (raw name -> tensor name) and, for a packed tap, the raws its masking branch's vector
    holds in order (`build_tap`); () for a tap built with both branches as outputs."""

    outputs: dict[str, str]
    slow: tuple[str, ...] = ()


def build_tap(
    b: Builder,
    x: str,
    info: TapInfo,
    sketches: list[Sketch],
    o: SketchOptions,
    sample: SampleIndex | None = None,
    packed: bool = False,
) -> Built:
    """Append to `b` the nodes computing `sketches` of tensor `x`.
    `sample`: a sample index shared with other taps of x's shape (else the tap computes its own).
    `packed`: a main-graph tap, whose raws go into packs: its clean branch is built outside the If where
    `_packs_clean_branch` allows."""
    outer = TapContext.for_tensor(b, x, info, o, sample)
    out = {"shape": outer.shape}
    for sk in sketches:
        if sk.stage == OUTER:
            out.update(sk.build(outer))
    finite = [sk for sk in sketches if sk.stage == FINITE]
    if not finite:
        return Built(out)
    split = outer.split(
        uses_rows=any(sk.uses_rows for sk in finite), uses_channels=any(sk.uses_channels for sk in finite)
    )
    if packed and _packs_clean_branch(b.opset, finite, o):
        return _build_packed(b, split, finite, o, out)
    branches = []
    for slow in (True, False):
        sub = b.child()
        raws = _branch_raws(split.branch(sub, slow), finite)
        branches.append((sub, raws))
    slow_raws, fast_raws = branches[0][1], branches[1][1]
    _same_raws(slow_raws, fast_raws)
    made_outside = {name for n in b.nodes for name in n.output}
    through_if = [r for r in slow_raws if not (slow_raws[r] == fast_raws[r] and slow_raws[r] in made_outside)]
    out.update({r: slow_raws[r] for r in slow_raws if r not in through_if})
    graphs = []
    for (sub, raws), label in zip(branches, ("slow", "fast")):
        made = {name for n in sub.nodes for name in n.output}
        # A branch output must be made inside the branch: shared constants and outer tensors are not.
        names = {r: raws[r] if raws[r] in made else sub.op("Identity", [raws[r]], r) for r in through_if}
        outputs = [
            helper.make_tensor_value_info(names[r], raw_dtype(r, o), [None] * raw_rank(r, sketches))
            for r in through_if
        ]
        graphs.append(helper.make_graph(sub.nodes, b.fresh(label), [], outputs))
    outs = [b.fresh(r) for r in through_if]
    _append_if(b, split, outs, graphs)
    out.update(zip(through_if, outs))
    return Built(out)


def _packs_clean_branch(opset: int, finite: list[Sketch], o: SketchOptions) -> bool:
    """Whether a main-graph tap's clean branch may run outside its If: not before opset 11 (an If's
    branches must then return outputs of one shape), nor when the tap counts histogram bins in the
    graph (it scatters at indices made from the values: a NaN's would fail the run)."""
    counts = o.hist_mode == "exact" and o.exact_counts == "graph" and any(sk.name == "hist" for sk in finite)
    return opset >= 11 and not counts


def _branch_raws(ctx: TapContext, finite: list[Sketch]) -> dict[str, str]:
    raws = {"nan": ctx.nan, "inf": ctx.inf}
    for sk in finite:
        raws.update(sk.build(ctx))
    return raws


def _build_packed(b: Builder, split: Split, finite: list[Sketch], o: SketchOptions, out: dict) -> Built:
    """The clean branch's raws built in the graph itself, every run (no If outputs to hand them out: ~1 µs
    each, and the clean branch is nearly always the one taken); the If's masking branch returns the raws
    that differ, flat, cast to float and concatenated into one vector (raw "slow"), and its clean branch
    an empty one. The host reads the check Σx² (raw "check") to know which taps took the masking branch,
    and the clean raws' sizes to cut their vector (`packing.Unpacked`)."""
    first = len(b.nodes)
    fast = _branch_raws(split.branch(b, False), finite)
    sub = b.child()
    slow = _branch_raws(split.branch(sub, True), finite)
    _same_raws(slow, fast)
    parts = tuple(r for r in slow if slow[r] != fast[r])
    made = {name for n in b.nodes[first:] for name in n.output}
    # each part a tensor of this tap's own, named for its raw (members are read and overridden by name):
    # renamed where the clean branch made it for this raw alone, else an Identity
    taken = set(out.values()) | {fast[r] for r in fast if r not in parts}
    rename: dict[str, str] = {}
    for r in parts:
        if fast[r] in made and fast[r] not in taken:
            taken.add(fast[r])
            new = rename[fast[r]] = b.fresh(r)
            fast[r] = new
        else:
            fast[r] = b.op("Identity", [rename.get(fast[r], fast[r])], r)
        taken.add(fast[r])
    for n in [*b.nodes[first:], *sub.nodes]:  # the masking branch may read an outer piece renamed here
        n.input[:] = [rename.get(i, i) for i in n.input]
        n.output[:] = [rename.get(i, i) for i in n.output]
    out.update(fast)
    out["check"] = split.check
    flat = [
        sub.flat(slow[r] if raw_dtype(r, o) == TensorProto.FLOAT else sub.cast(slow[r], F)) for r in parts
    ]
    vec = sub.op("Concat", flat, "slow", axis=0) if len(flat) > 1 else flat[0]
    empty = b.child()
    none = empty.op("Identity", [b.const(np.zeros(0, np.float32))], "slow")
    graphs = [
        helper.make_graph(g.nodes, b.fresh(label), [], [helper.make_tensor_value_info(v, F, [None])])
        for g, v, label in ((sub, vec, "slow"), (empty, none, "fast"))
    ]
    out["slow"] = b.fresh("slow")
    _append_if(b, split, [out["slow"]], graphs)
    return Built(out, parts)


def _same_raws(slow: dict[str, str], fast: dict[str, str]) -> None:
    if list(slow) != list(fast):
        raise AssertionError(f"the branches of a tap built different raws: {list(slow)} vs {list(fast)}")


def _append_if(b: Builder, split: Split, outs: list[str], graphs: list) -> None:
    b.nodes.append(
        helper.make_node(
            "If", [split.bad], outs, name=b.fresh("n_If_finite"), then_branch=graphs[0], else_branch=graphs[1]
        )
    )
