"""Decoding: one run's outputs of an instrumented model -> sketch values per tap -> tidy rows.

A tap whose subgraph did not run (an If branch not taken) returns an empty shape and is left
out. A copied tap (`TapRecord.copied`: a small main-graph tensor) returns the tensor itself; all
of a run's are sketched together on the host (`sketch.batched_references`). A tap inside a Loop or Scan body comes back once per iteration, stacked on leading axes,
and its iterations are merged with each sketch's own rule (`sketch.merge_parts`). Weight taps
(`TapRecord.constant`) have no outputs: their values come from `host.host_values`, computed
once, and follow the graph they are in (left out when its other taps say it did not run).
The rows carry per-site GEMM dims M, K, N resolved from the run-time shapes.
"""

from __future__ import annotations

import math

import numpy as np

from .. import sketch as sk
from ..errors import OpscopeError
from .manifest import Manifest, SiteRecord, TapRecord
from .rows import Rows

HostValues = dict[str, tuple[dict[str, np.ndarray], list[int]]]  # what host.host_values returns


def decode_tap(
    tap: TapRecord, raw_out: dict[str, np.ndarray], opts: sk.SketchOptions
) -> tuple[dict[str, np.ndarray], list[int] | None]:
    """Sketch values of one tap (merged over Loop/Scan iterations) and its run-time shape.

    Returns ({}, None) when the tap's subgraph did not run (an If branch not taken). Not for
    weight taps (`tap.constant`): they have no outputs, `decode_taps` takes them from the host.
    """
    if tap.constant:
        raise OpscopeError(
            f"tap {tap.id} ({tap.tensor!r}) is a weight: it has no graph outputs to decode",
            hint="its values come from host_values(); decode() and decode_taps() take them as host=",
        )
    if tap.copied:  # the tensor itself: its sketches are the numpy references
        if not _copied_ran(tap, raw_out):
            return {}, None
        x = np.asarray(raw_out[tap.outputs["tensor"]])
        return sk.references(tap.sketches, x, tap.info(), opts), list(x.shape)
    parts = _split_iterations(tap, raw_out)
    if not parts:
        return {}, None
    shapes = [raw["shape"][1:].astype(np.int64).tolist() for raw in parts]
    if len(parts) == 1:
        return {name: sk.finalize(name, parts[0], opts) for name in tap.sketches}, shapes[0]
    names = sk.with_sources(tap.sketches)
    values = [{name: sk.finalize(name, raw, opts) for name in names} for raw in parts]
    numels = [math.prod(s) for s in shapes]
    merged = sk.merge_parts(names, values, numels)
    return {name: merged[name] for name in tap.sketches}, shapes[-1]


def _copied_ran(tap: TapRecord, raw_out: dict[str, np.ndarray]) -> bool:
    """A copied tap in an If branch carries the [1, *shape] marker, empty when the branch did not run."""
    return "shape" not in tap.outputs or np.asarray(raw_out[tap.outputs["shape"]]).size > 0


def _split_iterations(tap: TapRecord, raw_out: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    arrays = {raw: np.asarray(raw_out[name]) for raw, name in tap.outputs.items()}
    if tap.stacked == 0:
        return [] if arrays["shape"].size == 0 else [{k: _raw_values(k, v) for k, v in arrays.items()}]
    parts = []
    lead = arrays["shape"].shape[: tap.stacked]
    for i in np.ndindex(*lead):
        part = {k: _raw_values(k, np.asarray(v[i])) for k, v in arrays.items()}
        if part["shape"].size:
            parts.append(part)
    return parts


def _raw_values(raw: str, v: np.ndarray) -> np.ndarray:
    """A raw output as the host side reads it: float64, but bin indices stay small integers."""
    return v.ravel() if raw == "hidx" else v.astype(np.float64).ravel()


def gemm_dims(site: SiteRecord, shapes: dict[str, list[int]]) -> tuple[int | None, int | None, int | None]:
    """(M, K, N) of a site as an implicit GEMM, from its roles' run-time shapes (None if unknown).

    MatMul-like: lhs [..., M, K] @ rhs [..., K, N], M counts the batch dims too. Gemm honours
    transA/transB. Conv: M = batch x output positions, K = Cin/group x kernel, N = Cout.
    ConvTranspose: M = batch x input positions, K = Cin, N = Cout/group x kernel. LSTM/GRU/RNN:
    M = seq x batch, K = input size, N = gates x hidden.
    """
    op, a = site.op_type, site.attrs
    prod = math.prod  # of Python ints: np.prod costs ~10 us a call, per site and role of every batch
    try:
        if op in ("MatMul", "MatMulInteger", "QLinearMatMul"):
            lhs, rhs = shapes["lhs"], shapes["rhs"]
            m = prod(lhs[:-1]) if len(lhs) > 1 else 1
            return m, lhs[-1], rhs[-1] if len(rhs) > 1 else 1
        if op == "MatMulNBits":  # the packed weight is not tapped: K and N are the node's
            lhs = shapes["lhs"]
            return prod(lhs[:-1]), a.get("K", lhs[-1]), a.get("N")
        if op == "Gemm":
            sa, sb = shapes["a"], shapes["b"]
            m, k = (sa[1], sa[0]) if a.get("transA") else (sa[0], sa[1])
            n = sb[0] if a.get("transB") else sb[1]
            return m, k, n
        if op == "Conv":
            w, y = shapes["weight"], shapes["out"]
            return y[0] * prod(y[2:]), prod(w[1:]), w[0]
        if op == "ConvTranspose":
            x, w = shapes["in"], shapes["weight"]
            return x[0] * prod(x[2:]), w[0], prod(w[1:])
        if op in ("LSTM", "GRU", "RNN"):
            x, w = shapes["x"], shapes["w"]
            return x[0] * x[1], x[2], w[1]
    except (KeyError, IndexError):
        pass
    return None, None, None


def decode_taps(
    manifest: Manifest, outputs: dict[str, np.ndarray], host: HostValues | None = None
) -> dict[str, tuple[dict[str, np.ndarray], list[int] | None]]:
    """tap id -> (sketch values, run-time shape) for one run; ({}, None) for a tap that did not run.

    Taps with graph outputs are decoded from `outputs` (`decode_tap`); constant taps (weights)
    have none and take their values from `host` (`host.host_values`), computed once. A weight
    tap in a subgraph follows the subgraph: ({}, None) when the other taps of its graph, or of
    a graph around it, say it did not run (an If branch not taken, a Loop run zero times). In a
    subgraph where only weights are tapped there is nothing to tell: the weight's values are given.
    """
    const = [t for t in manifest.taps if t.constant]
    if const and host is None:
        raise OpscopeError(
            f"the manifest has {len(const)} weight taps, computed on the host, not in the graph: "
            "pass host=host_values(manifest, model) (onnx_opscope.instrument) to decode",
            hint="host_values reads the weights once from the source or the instrumented model",
        )
    opts = manifest.sketch_options()
    decoded = {t.id: decode_tap(t, outputs, opts) for t in manifest.taps if not (t.constant or t.copied)}
    copied = [t for t in manifest.taps if t.copied]
    decoded.update({t.id: ({}, None) for t in copied})  # until they are known to have run
    ran = [t for t in copied if _copied_ran(t, outputs)]
    if ran:  # all together: one numpy pass per statistic over every copied tensor of the run
        arrays = [np.asarray(outputs[t.outputs["tensor"]]) for t in ran]
        values = sk.batched_references([t.sketches for t in ran], arrays, [t.info() for t in ran], opts)
        decoded.update({t.id: (v, list(a.shape)) for t, a, v in zip(ran, arrays, values)})
    if not const:
        return decoded
    ran: dict[str, bool] = {}  # graph -> whether its live taps ran (they all run, or none)
    for t in manifest.taps:
        if not t.constant:
            ran[t.graph] = ran.get(t.graph, False) or decoded[t.id][1] is not None
    skipped = [g for g, r in ran.items() if g and not r]
    for t in const:
        if any(t.graph == g or t.graph.startswith(g + "/") for g in skipped):
            decoded[t.id] = ({}, None)
            continue
        if t.id not in host:
            raise OpscopeError(
                f"host values have no entry for weight tap {t.id} ({t.tensor!r})",
                hint="compute them with host_values() for this manifest",
            )
        values, shape = host[t.id]
        decoded[t.id] = ({name: values[name] for name in t.sketches}, list(shape))
    return decoded


def decode(manifest: Manifest, outputs: dict[str, np.ndarray], host: HostValues | None = None) -> Rows:
    """Tidy rows for one run: every (site, role, sketch, element) that ran.

    `host`: the weight taps' values, `host.host_values(manifest, model)` computed once and
    passed to every decode; needed when the manifest has weight taps (`TapRecord.constant`).
    """
    decoded = decode_taps(manifest, outputs, host)
    rows = Rows()
    for site in manifest.sites:
        shapes = {
            role: decoded[tid][1]
            for role, tid in {**site.shape_roles, **site.roles}.items()
            if decoded[tid][1] is not None
        }
        m, k, n = gemm_dims(site, shapes)
        for role, tid in site.roles.items():
            values, shape = decoded[tid]
            if shape is None:
                continue
            numel = math.prod(shape)
            for stat, vals in values.items():
                rows.add((site.id, site.op_type, role, stat, numel, m, k, n), vals)
    return rows
