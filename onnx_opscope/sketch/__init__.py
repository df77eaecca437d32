"""Sketches: what is measured on a tapped tensor, in the graph, and how to check it in numpy.

One module per family: `moments` (min, max, mean, sumsq, l1, nnz, nan_count, inf_count,
kurtosis), `histogram` (hist, elemsig), `channels` (chan_maxabs, chan_outlier), `rows`
(pos_sumsq, adj_sumsq), `attention` (attn_qmax, attn_krecv), `routing` (route_load), `heads`
(head_min, head_max, head_sumsq, head_chan_maxabs: per KV head). Each
sketch is one `Sketch` value holding its graph builder, host finalize, numpy reference,
merge rule, tolerance and cost. The pieces several sketches share (the cast, the finite
check and masks, min and max, the scale, the sample) come from the tap context
(`context.TapContext`), built once per tensor; `tap.build_tap` lays out the subgraph.

Adding a sketch: write its `Sketch` in the module of its family (a builder that asks the
context for what it shares and returns its raw outputs by name, a finalize over those raws,
a reference from the definition, a merge from `merge`, a tolerance), add it to `REGISTRY`
below, and give it a test against its reference on real tensors (tests/test_sketches.py
does that for every registered sketch). Opt-in sketches stay out of DEFAULT_SKETCHES.

Every sketch is built at the tapped model's own opset, 7 and up: a builder reaches the ops
that changed across opsets only through the `graph.build.Builder` helpers (`b.where`,
`b.isnan`, `b.isinf`, `b.nonfinite`, `b.arange`, `b.clip`, `b.slice`, `b.reduce`, ...), never
by testing an opset itself (tests/test_old_opsets.py checks each sketch at opsets 7 to 10).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import OpscopeError, did_you_mean, listing
from .attention import ATTN_KRECV, ATTN_QMAX
from .base import FINITE, OUTER, OnFinite, Raw, Sketch, Tolerance, finite_values
from .batched import SHAPED, segmented, stacked
from .channels import CHAN_MAXABS, CHAN_OUTLIER
from .context import SampleIndex, sample_index
from .heads import HEAD_CHAN_MAXABS, HEAD_MAX, HEAD_MIN, HEAD_SUMSQ
from .histogram import ELEMSIG, HIST, reads_samples, sample_blocks, sample_positions
from .merge import Derived, Merge
from .moments import INF_COUNT, KURTOSIS, L1, MAX, MEAN, MIN, NAN_COUNT, NNZ, SUMSQ
from .options import HIST_MODES, SketchOptions, TapInfo, for_opset, for_providers
from .routing import ROUTE_LOAD
from .rows import ADJ_SUMSQ, POS_SUMSQ
from .streamed import streamable
from .streamed import streamed_references as _streamed
from .tap import Built, build_tap, raw_dtype, raw_rank

REGISTRY: dict[str, Sketch] = {
    s.name: s
    for s in (
        MIN,
        MAX,
        MEAN,
        L1,
        SUMSQ,
        NNZ,
        NAN_COUNT,
        INF_COUNT,
        KURTOSIS,
        HIST,
        ELEMSIG,
        CHAN_MAXABS,
        CHAN_OUTLIER,
        POS_SUMSQ,
        ADJ_SUMSQ,
        ATTN_QMAX,
        ATTN_KRECV,
        ROUTE_LOAD,
        HEAD_MIN,
        HEAD_MAX,
        HEAD_SUMSQ,
        HEAD_CHAN_MAXABS,
    )
}

ALL_SKETCHES: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if not s.kinds)
# Always on: whole-tensor reductions and small gathers only, what fits the <= 1.5x-plain goal on
# CPU (bert_like, every MatMul, 1 thread; BENCHMARKS.md). The rest are opt-in by name or with
# "all": l1 is one more pass (+0.05x plain there), the others need a full elementwise pass
# first (x*x per row, |x|, a bool cast, (x-mean)^2) and cost +0.15 to +0.5x each.
DEFAULT_SKETCHES: tuple[str, ...] = (
    "min",
    "max",
    "mean",
    "sumsq",
    "nan_count",
    "inf_count",
    "hist",
    "elemsig",
)
SKETCH_SETS = {"default": DEFAULT_SKETCHES, "all": ALL_SKETCHES}


def resolve(names: Sequence[str] | None) -> list[str]:
    """Validate sketch names (None: the default set; "default" and "all" name sets), in registry order."""
    if not names:
        return list(DEFAULT_SKETCHES)
    known = {**REGISTRY, **SKETCH_SETS}
    for n in names:
        if n not in known:
            raise OpscopeError(f"unknown sketch {n!r}{did_you_mean(n, known)}; known: {listing(known)}")
    chosen = {m for n in names for m in SKETCH_SETS.get(n, (n,))}
    return [n for n in REGISTRY if n in chosen]


def describe() -> list[tuple[str, str, str, str, str]]:
    """(name, set, what it is, merge rule, cost) of every sketch, for --help and the docs."""
    rows = []
    for name, s in REGISTRY.items():
        group = (
            "default" if name in DEFAULT_SKETCHES else (f"{'/'.join(s.kinds)} sites" if s.kinds else "all")
        )
        rows.append((name, group, s.doc, s.merge.name, s.cost))
    return rows


def applicable(names: Sequence[str], info: TapInfo) -> list[str]:
    """`names` without the per-channel / per-row sketches when the tensor's rank is unknown or 0."""
    return [n for n in names if not (REGISTRY[n].needs_rank and info.axes() is None)]


def finalize(name: str, raw: Raw, o: SketchOptions) -> np.ndarray:
    return np.asarray(REGISTRY[name].finalize(raw, o), dtype=np.float64).ravel()


def reference(name: str, x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    return np.asarray(REGISTRY[name].reference(x, info, o), dtype=np.float64).ravel()


def references(names: Sequence[str], x: np.ndarray, info: TapInfo, o: SketchOptions) -> dict[str, np.ndarray]:
    """`reference` of each of `names` on x, the scalar ones sharing one float64 view of the finite
    values: each alone converts and masks the whole tensor twice, which made the default set ~1 s
    on one 4096 x 4096 weight."""
    finite = None
    out = {}
    for name in names:
        ref = REGISTRY[name].reference
        if isinstance(ref, OnFinite):
            finite = finite_values(x) if finite is None else finite
            out[name] = np.asarray(ref.of(finite), dtype=np.float64).ravel()
        else:
            out[name] = reference(name, x, info, o)
    return out


def batched_references(
    names: Sequence[Sequence[str]], arrays: Sequence[np.ndarray], infos: Sequence[TapInfo], o: SketchOptions
) -> list[dict[str, np.ndarray]]:
    """`references(names[i], arrays[i], infos[i], o)` for every i, the segmented sketches of all the
    small tensors computed together (`batched`); the rest through `grouped_references`."""
    small = [i for i, a in enumerate(arrays) if 0 < a.size <= o.sample_size]
    out: list[dict[str, np.ndarray]] = [{} for _ in arrays]
    if small:
        together = segmented([arrays[i] for i in small], {n for i in small for n in names[i]}, o)
        for j, i in enumerate(small):
            out[i] = {n: together[n][j] for n in names[i] if n in together}
    rest = [[n for n in names[i] if n not in out[i]] for i in range(len(arrays))]
    for i, values in enumerate(grouped_references(rest, arrays, infos, o)):
        out[i].update(values)
    return out


def grouped_references(
    names: Sequence[Sequence[str]], arrays: Sequence[np.ndarray], infos: Sequence[TapInfo], o: SketchOptions
) -> list[dict[str, np.ndarray]]:
    """`references(names[i], arrays[i], infos[i], o)` for every i, in each one's order of `names[i]`: the
    per-channel and per-row sketches (`batched.SHAPED`) of the non-empty tensors of one shape, dtype
    and TapInfo stacked and computed together (`batched.stacked`), the rest tensor by tensor."""
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(arrays):
        shaped = tuple(n for n in names[i] if n in SHAPED)
        if shaped and a.size:
            groups.setdefault((a.shape, a.dtype.str, infos[i], shaped), []).append(i)
    found: list[dict[str, np.ndarray]] = [{} for _ in arrays]
    for (_, _, info, shaped), members in groups.items():
        for i, values in zip(members, stacked(list(shaped), [arrays[i] for i in members], info, o)):
            found[i] = values
    out = []
    for i, a in enumerate(arrays):
        rest = [n for n in names[i] if n not in found[i]]
        values = references(rest, a, infos[i], o) if rest else {}
        out.append({n: np.asarray(found[i].get(n, values.get(n)), np.float64).ravel() for n in names[i]})
    return out


def streamed_references(
    names: Sequence[str], chunks: Iterable[np.ndarray], n: int, info: TapInfo, o: SketchOptions
) -> dict[str, np.ndarray]:
    """`references(names, x, info, o)` for the tensor x of `n` elements given as flat pieces in order
    (`graph.chunks.tensor_chunks`), holding one piece at a time; `streamable(names, o)` must hold."""
    return _streamed(names, chunks, n, info, o, references, merge_parts)


def with_sources(names: Sequence[str]) -> list[str]:
    """`names` plus the sources of its derived sketches (what merging them needs), in registry order."""
    need = set(names) | {r.source for n in names if isinstance(r := REGISTRY[n].merge, Derived)}
    return [n for n in REGISTRY if n in need]


def merge_parts(
    names: Sequence[str], parts: Sequence[dict[str, np.ndarray]], numels: Sequence[int]
) -> dict[str, np.ndarray]:
    """Each sketch of `names` merged over `parts` (Loop iterations, say) with its own rule. A derived
    sketch is recomputed from its source's merged values, so `names` must hold the sources too
    (`with_sources`)."""
    merged = {}
    for name in names:
        rule = REGISTRY[name].merge
        if isinstance(rule, Merge):
            merged[name] = rule([p[name] for p in parts], numels)
    for name in names:
        rule = REGISTRY[name].merge
        if isinstance(rule, Derived):
            merged[name] = rule.of(merged[rule.source])
    return merged


__all__ = [
    "ALL_SKETCHES",
    "DEFAULT_SKETCHES",
    "FINITE",
    "HIST_MODES",
    "OUTER",
    "REGISTRY",
    "SKETCH_SETS",
    "Built",
    "Derived",
    "Merge",
    "Sketch",
    "SketchOptions",
    "TapInfo",
    "Tolerance",
    "applicable",
    "build_tap",
    "describe",
    "finalize",
    "for_opset",
    "for_providers",
    "batched_references",
    "grouped_references",
    "merge_parts",
    "raw_dtype",
    "raw_rank",
    "reference",
    "references",
    "resolve",
    "SampleIndex",
    "reads_samples",
    "sample_blocks",
    "sample_index",
    "sample_positions",
    "streamable",
    "streamed_references",
    "with_sources",
]
