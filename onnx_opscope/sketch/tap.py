"""One tap subgraph per tensor: the chosen sketches built through one shared context (`context`).

OUTER-stage sketches are built once on the tensor as it is. FINITE-stage sketches are built
in both branches of an If on the finite check, slow (masking) and fast (no masking); both
branches yield the same raw outputs in the same order, and every finite-stage tap has the
raws `nan` and `inf` (what n_finite is made of). A raw that both branches take from the
outer graph (the sample) leaves as it is; everything else is an output of the If, made
inside each branch (an Identity where a branch only forwards a constant or an outer tensor).
Scalars come back as rank-0 tensors (no Reshape per statistic), everything else as 1-D.
"""

from __future__ import annotations

from onnx import TensorProto, helper

from ..graph.build import Builder
from .base import FINITE, OUTER, Sketch
from .context import SampleIndex, TapContext
from .histogram import index_dtype
from .options import SketchOptions, TapInfo

CONTEXT_SCALARS = frozenset({"nan", "inf", "min", "max", "ynorm", "ysum", "yss"})
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


def build_tap(
    b: Builder,
    x: str,
    info: TapInfo,
    sketches: list[Sketch],
    o: SketchOptions,
    sample: SampleIndex | None = None,
) -> dict[str, str]:
    """Append to `b` the nodes computing `sketches` of tensor `x`; returns raw name -> tensor name.
    `sample`: a sample index shared with other taps of x's shape (else the tap computes its own)."""
    outer = TapContext.for_tensor(b, x, info, o, sample)
    out = {"shape": outer.shape}
    for sk in sketches:
        if sk.stage == OUTER:
            out.update(sk.build(outer))
    finite = [sk for sk in sketches if sk.stage == FINITE]
    if not finite:
        return out
    split = outer.split(
        uses_rows=any(sk.uses_rows for sk in finite), uses_channels=any(sk.uses_channels for sk in finite)
    )
    branches = []
    for slow in (True, False):
        sub = b.child()
        ctx = split.branch(sub, slow)
        raws = {"nan": ctx.nan, "inf": ctx.inf}
        for sk in finite:
            raws.update(sk.build(ctx))
        branches.append((sub, raws))
    slow_raws, fast_raws = branches[0][1], branches[1][1]
    if list(slow_raws) != list(fast_raws):
        raise AssertionError(
            f"the branches of a tap built different raws: {list(slow_raws)} vs {list(fast_raws)}"
        )
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
    b.nodes.append(
        helper.make_node(
            "If", [split.bad], outs, name=b.fresh("n_If_finite"), then_branch=graphs[0], else_branch=graphs[1]
        )
    )
    out.update(zip(through_if, outs))
    return out
