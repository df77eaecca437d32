"""Parity: does a rewritten model (or another execution provider) keep the outputs, and where does it drift?

Two models (original vs rewritten) or one model on two providers run the same feeds. The
outputs are compared (max abs, max rel = max|a-b| / max|a|, cosine, top-1 agreement when an
output looks like logits or probabilities). Layer by layer, both sides get the *same* taps
(the sites chosen on A, kept where B still has their tensors), so only small statistics
leave the session, never the intermediate tensors themselves: memory stays constant
however deep the model, unlike marking every tensor as an output. Each (site, role, stat)
gets a divergence, max|Δ| over a scale:

- min / max: over the tensor's max|x| on A (so a min near 0 does not inflate it);
- nan_count / inf_count: infinite as soon as the counts differ;
- every other statistic (sumsq, attn_qmax, route_load, ...): over max|value| on A;

and the report names the first site, in execution order, whose divergence exceeds the
layer tolerance. Parity passes when every output's max rel is within `tol` and no output
gains NaN/Inf where the other has a finite value; the layer walk says where it broke.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto

from .data import FeedSpec, input_signature, iter_feeds
from .errors import OpscopeError
from .inference_taps import SHADOW_SUFFIX
from .inject import inject
from .manifest import HostValues, Manifest, decode
from .model import ModelLike, load_model
from .runtime import RuntimeConfig, make_session, resolve_providers, run
from .sites import Selection, Site, find_sites, select
from .weights import host_values

DEFAULT_TOL = 1e-3
LAYER_SKETCHES = ("min", "max", "sumsq", "nan_count", "inf_count")
_LOGIT_NAMES = re.compile(r"logit|prob|score|softmax|class|cls|pred", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# outputs


def looks_like_logits(name: str, x: np.ndarray) -> bool:
    """Float, rank >= 2, classes on the last axis, and a telling name or rows that are distributions."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating) or x.ndim < 2 or x.shape[-1] < 2 or x.size == 0:
        return False
    if _LOGIT_NAMES.search(name):
        return True
    v = x.astype(np.float64)
    return bool(np.all((v >= 0) & (v <= 1)) and np.allclose(v.sum(-1), 1.0, atol=1e-3))


def _metrics(name: str, a: np.ndarray, b: np.ndarray) -> dict:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return {"shape_a": list(a.shape), "shape_b": list(b.shape), "max_abs": float("inf"),
                "max_rel": float("inf"), "cosine": float("nan"), "top1": None, "nonfinite_mismatch": 0}  # fmt: skip
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    fx, fy = np.isfinite(x), np.isfinite(y)
    same_bad = ~fx & ~fy & ((np.isnan(x) & np.isnan(y)) | (x == y))
    mismatch = int(np.count_nonzero((fx != fy) | (~fx & ~fy & ~same_bad)))
    both = fx & fy
    d = np.abs(x[both] - y[both])
    max_abs = float(d.max()) if d.size else 0.0
    scale = float(np.abs(x[both]).max()) if d.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    nx, ny = np.linalg.norm(x[both]), np.linalg.norm(y[both])
    cosine = float(x[both] @ y[both] / (nx * ny)) if nx > 0 and ny > 0 else (1.0 if nx == ny else 0.0)
    top1 = None
    if looks_like_logits(name, a):
        top1 = float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))
    if mismatch:
        max_abs = max_rel = float("inf")
    return {
        "max_abs": max_abs,
        "max_rel": max_rel,
        "cosine": cosine,
        "top1": top1,
        "nonfinite_mismatch": mismatch,
    }


def compare_outputs(a: Mapping[str, np.ndarray] | Sequence, b: Mapping[str, np.ndarray] | Sequence) -> dict:
    """name -> {max_abs, max_rel, cosine, top1 (None unless logits-like), nonfinite_mismatch}.

    Dicts are matched by name (names in only one side are left out; with no name in common
    and as many outputs, by position); sequences by position, named `output_<i>`.
    """
    if not isinstance(a, Mapping):
        a = {f"output_{i}": v for i, v in enumerate(a)}
    if not isinstance(b, Mapping):
        b = {f"output_{i}": v for i, v in enumerate(b)}
    common = [n for n in a if n in b]
    if not common and len(a) == len(b):
        return {f"{na}|{nb}": _metrics(na, a[na], b[nb]) for na, nb in zip(a, b)}
    return {n: _metrics(n, a[n], b[n]) for n in common}


def _merge_metrics(acc: dict | None, new: dict, rows: int) -> dict:
    """Worst case over batches: max of max_abs/max_rel, min cosine, top-1 weighted by rows."""
    if acc is None:
        return {**new, "_rows": rows, "_top1_hits": (new["top1"] or 0.0) * rows}
    out = dict(acc)
    out["max_abs"] = max(acc["max_abs"], new["max_abs"])
    out["max_rel"] = max(acc["max_rel"], new["max_rel"])
    out["cosine"] = min(acc["cosine"], new["cosine"])
    out["nonfinite_mismatch"] = acc["nonfinite_mismatch"] + new["nonfinite_mismatch"]
    out["_rows"] = acc["_rows"] + rows
    if new["top1"] is not None and acc["top1"] is not None:
        out["_top1_hits"] = acc["_top1_hits"] + new["top1"] * rows
        out["top1"] = out["_top1_hits"] / out["_rows"]
    for k in ("shape_a", "shape_b"):
        if k in new:
            out[k] = new[k]
    return out


# --------------------------------------------------------------------------------------------
# report


@dataclass
class ParityReport:
    """What `parity_models` / `parity_providers` found; `passed` is the verdict, `format()` prints it."""

    a: str
    b: str
    tol: float
    layer_tol: float
    batches: int = 0
    outputs: dict[str, dict] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)  # one per (site, role, stat), execution order
    first_divergent: dict | None = None
    sites_compared: int = 0
    sites_only_in_a: list[str] = field(default_factory=list)
    runtime: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(
            m["max_rel"] <= self.tol and not m["nonfinite_mismatch"] for m in self.outputs.values()
        )

    def summary(self) -> dict:
        """The worst output: max_abs, max_rel, cosine, top1 (min over the logits-like outputs)."""
        ms = list(self.outputs.values())
        tops = [m["top1"] for m in ms if m["top1"] is not None]
        return {
            "max_abs": max((m["max_abs"] for m in ms), default=float("nan")),
            "max_rel": max((m["max_rel"] for m in ms), default=float("nan")),
            "cosine": min((m["cosine"] for m in ms), default=float("nan")),
            "top1": min(tops) if tops else None,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        d["summary"] = self.summary()
        d["outputs"] = {
            k: {a: b for a, b in v.items() if not a.startswith("_")} for k, v in self.outputs.items()
        }
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=float)

    def format(self, top: int = 5) -> str:
        lines = [f"parity: {self.a}  vs  {self.b}  ({self.batches} batches, tol {self.tol:g})"]
        lines.append(f"  {'output':<28} {'max abs':>10} {'max rel':>10} {'cosine':>10} {'top-1':>7}  status")
        for name, m in self.outputs.items():
            ok = m["max_rel"] <= self.tol and not m["nonfinite_mismatch"]
            top1 = "-" if m["top1"] is None else f"{m['top1']:.1%}"
            extra = f"  ({m['nonfinite_mismatch']} NaN/Inf mismatches)" if m["nonfinite_mismatch"] else ""
            shape = f"  (shapes {m['shape_a']} vs {m['shape_b']})" if "shape_a" in m else ""
            lines.append(
                f"  {name[:28]:<28} {m['max_abs']:>10.3g} {m['max_rel']:>10.3g} {m['cosine']:>10.6f} "
                f"{top1:>7}  {'ok' if ok else 'DIFF'}{extra}{shape}"
            )
        if self.layers or self.sites_compared:
            lines.append(
                f"  layers: {self.sites_compared} sites, {len(self.layers)} statistics compared "
                f"(layer tol {self.layer_tol:g})"
            )
            if self.first_divergent:
                f = self.first_divergent
                lines.append(
                    f"  first divergent site: {f['site']} ({f['op_type']}, {f['role']}, {f['stat']}): "
                    f"divergence {f['divergence']:.3g}"
                )
                worst = sorted(self.layers, key=lambda r: -r["divergence"])[:top]
                lines.append("  largest divergences: " + ", ".join(
                    f"{r['site']}:{r['role']}:{r['stat']} {r['divergence']:.3g}" for r in worst))  # fmt: skip
            else:
                lines.append("  no site diverges beyond the layer tolerance")
        if self.sites_only_in_a:
            lines.append(f"  sites removed in B: {', '.join(self.sites_only_in_a[:top])}"
                         + (f", ...and {len(self.sites_only_in_a) - top} more" if len(self.sites_only_in_a) > top else ""))  # fmt: skip
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# layer-wise comparison


def _by_key(rows) -> dict[tuple[str, str, str], np.ndarray]:
    out: dict[tuple[str, str, str], list[float]] = {}
    for site, role, stat, v in zip(rows.site, rows.role, rows.stat, rows.value):
        out.setdefault((site, role, stat), []).append(v)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def _divergence(stat: str, va: np.ndarray, vb: np.ndarray, absmax: float | None) -> float:
    if va.shape != vb.shape:
        return float("inf")
    if stat in ("nan_count", "inf_count"):
        return 0.0 if np.array_equal(va, vb) else float("inf")
    fa, fb = np.isfinite(va), np.isfinite(vb)
    if np.any(fa != fb):
        return float("inf")
    if not fa.any():
        return 0.0
    d = float(np.max(np.abs(va[fa] - vb[fa])))
    scale = absmax if stat in ("min", "max") and absmax else float(np.max(np.abs(va[fa])))
    return d / scale if scale > 0 else (0.0 if d == 0 else float("inf"))


def _layer_divergences(manifest: Manifest, rows_a, rows_b) -> dict[tuple[str, str, str], float]:
    ka, kb = _by_key(rows_a), _by_key(rows_b)
    out = {}
    for key, va in ka.items():
        if key not in kb:
            continue
        site, role, stat = key
        lo, hi = ka.get((site, role, "min")), ka.get((site, role, "max"))
        absmax = None
        if lo is not None and hi is not None and np.isfinite(lo).all() and np.isfinite(hi).all():
            absmax = float(max(np.abs(lo).max(), np.abs(hi).max()))
        out[key] = _divergence(stat, va, kb[key], absmax)
    return out


def _graph_names(model: ModelProto) -> dict[str, tuple[set[str], str | None]]:
    """path -> (names defined in that graph, parent path), with sites' path scheme."""
    out: dict[str, tuple[set[str], str | None]] = {}

    def walk(g, path: str, parent: str | None) -> None:
        names = {i.name for i in g.input} | {t.name for t in g.initializer}
        names |= {o for n in g.node for o in n.output}
        out[path] = (names, parent)
        for i, node in enumerate(g.node):
            for attr in node.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for j, sub in enumerate(subs):
                    suffix = attr.name if len(subs) == 1 else f"{attr.name}{j}"
                    walk(sub, f"{path}/{node.name or f'{node.op_type}_{i}'}/{suffix}".lstrip("/"), path)

    walk(model.graph, "", None)
    return out


def _sites_in(model: ModelProto, sites: list[Site]) -> tuple[list[Site], list[str]]:
    """The sites of A whose tensors B still has (outer scopes included); the ids of those it lost."""
    graphs = _graph_names(model)

    def has(site: Site, tensor: str) -> bool:
        base = tensor[: -len(SHADOW_SUFFIX)] if tensor.endswith(SHADOW_SUFFIX) else tensor
        path: str | None = site.graph
        while path is not None:
            names, path_up = graphs.get(path, (set(), None))
            if base in names:
                return True
            path = path_up
        return False

    kept, lost = [], []
    for s in sites:
        if s.graph not in graphs:
            lost.append(s.id)
            continue
        taps = tuple(t for t in s.taps if has(s, t.tensor))
        if not taps:
            lost.append(s.id)
            continue
        rest = tuple(t for t in s.shape_only if has(s, t.tensor))
        kept.append(Site(s.id, s.op_type, s.node, s.graph, s.order, taps, s.attrs, rest))
    return kept, lost


# --------------------------------------------------------------------------------------------
# drivers


def _label(model: ModelLike) -> str:
    return "<in-memory>" if isinstance(model, ModelProto) else str(model)


def _base_dir(model: ModelLike, base_dir: str | os.PathLike | None) -> Path | None:
    if base_dir is not None:
        return Path(base_dir)
    return None if isinstance(model, ModelProto) else Path(model).parent


def _session_runner(model: ModelProto, cfg: RuntimeConfig, base_dir):
    sess = make_session(model, cfg, base_dir=base_dir)
    names = [o.name for o in sess.get_outputs()]
    return lambda feeds: dict(zip(names, run(sess, feeds))), sess


def _compare(
    report: ParityReport,
    feeds_iter,
    run_a,
    run_b,
    manifest_a: Manifest | None,
    manifest_b: Manifest | None,
    original_outputs: list[str],
    host_a: HostValues | None = None,
    host_b: HostValues | None = None,
) -> ParityReport:
    """Run every batch on both sides, keeping only per-output metrics and per-statistic divergences.

    `host_*`: each side's weight-tap values (`weights.host_values`), computed once.
    """
    merged: dict[str, dict] = {}
    worst: dict[tuple[str, str, str], float] = {}
    for feeds in feeds_iter:
        oa, ob = run_a(feeds), run_b(feeds)
        outs_a = {n: oa[n] for n in original_outputs if n in oa}
        outs_b = {n: ob[n] for n in original_outputs if n in ob}
        for name, m in compare_outputs(outs_a, outs_b).items():
            lead = np.shape(outs_a.get(name.split("|")[0], np.zeros(1)))
            rows = int(np.prod(lead[:-1])) if len(lead) > 1 else 1
            merged[name] = _merge_metrics(merged.get(name), m, rows)
        if manifest_a is not None and manifest_b is not None:
            for key, d in _layer_divergences(
                manifest_a, decode(manifest_a, oa, host_a), decode(manifest_b, ob, host_b)
            ).items():
                worst[key] = max(worst.get(key, 0.0), d)
        report.batches += 1
    report.outputs = merged
    if manifest_a is not None:
        order = {s.id: (s.order, s.op_type) for s in manifest_a.sites}
        layers = [
            {
                "site": site,
                "op_type": order[site][1],
                "role": role,
                "stat": stat,
                "order": order[site][0],
                "divergence": d,
            }  # fmt: skip
            for (site, role, stat), d in worst.items()
        ]
        layers.sort(key=lambda r: (r["order"], r["role"], r["stat"]))
        report.layers = layers
        report.sites_compared = len({r["site"] for r in layers})
        report.first_divergent = next((r for r in layers if r["divergence"] > report.layer_tol), None)
    return report


def parity_models(
    model_a: ModelLike,
    model_b: ModelLike,
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
    *,
    tol: float = DEFAULT_TOL,
    layer_tol: float | None = None,
    selection: Selection | None = None,
    layers: bool = True,
    base_dir_a: str | os.PathLike | None = None,
    base_dir_b: str | os.PathLike | None = None,
) -> ParityReport:
    """Original vs rewritten model on the same feeds (drawn from A's signature, `feeds` options).

    `layers`: also inject the same sites (A's, by `selection`; those B lost are listed) in
    both and report the first divergent one. `base_dir_*`: where in-memory models' external
    weights live (paths find their own).
    """
    runtime = runtime or RuntimeConfig()
    feeds = feeds or FeedSpec()
    a, b = load_model(model_a), load_model(model_b)
    sig_a = {s.name for s in input_signature(a)}
    sig_b = {s.name for s in input_signature(b)}
    if sig_a != sig_b:
        raise OpscopeError(
            f"the models take different inputs: {sorted(sig_a)} vs {sorted(sig_b)}",
            hint="parity compares a model with a rewrite of it that keeps its inputs",
        )
    report = ParityReport(_label(model_a), _label(model_b), tol, tol if layer_tol is None else layer_tol)
    outputs = [o.name for o in a.graph.output]
    man_a = man_b = host_a = host_b = None
    dir_a, dir_b = _base_dir(model_a, base_dir_a), _base_dir(model_b, base_dir_b)
    if layers:
        sites_a = select(find_sites(a), selection or Selection())
        sites_b, report.sites_only_in_a = _sites_in(b, sites_a)
        kept = {s.id for s in sites_b}
        a, man_a = inject(a, [s for s in sites_a if s.id in kept], list(LAYER_SKETCHES))
        b, man_b = inject(b, sites_b, list(LAYER_SKETCHES))
        host_a, host_b = host_values(man_a, a, dir_a), host_values(man_b, b, dir_b)
    run_a, sess = _session_runner(a, runtime, dir_a)
    run_b, _ = _session_runner(b, runtime, dir_b)
    report.runtime = runtime.to_record(sess)
    return _compare(report, iter_feeds(model_a, feeds), run_a, run_b, man_a, man_b, outputs, host_a, host_b)


def parity_providers(
    model: ModelLike,
    providers: str | Sequence[str],
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
    *,
    tol: float = DEFAULT_TOL,
    layer_tol: float | None = None,
    selection: Selection | None = None,
    layers: bool = True,
    base_dir: str | os.PathLike | None = None,
) -> ParityReport:
    """One model on two execution providers ('cpu,cuda'): the first is the reference.

    Each side runs on its provider alone (plus onnxruntime's own CPU fallback for nodes the
    provider lacks); an unavailable provider is an error before anything runs.
    """
    items = providers.split(",") if isinstance(providers, str) else list(providers)
    items = [p.strip() for p in items if p.strip()]
    if len(items) != 2:
        raise OpscopeError(
            f"--providers needs exactly two providers to compare, got {len(items)}: {','.join(items) or '-'}",
            hint="e.g. --providers cpu,cuda (the first is the reference)",
        )
    for p in items:
        resolve_providers(p)  # unknown / unavailable: one clear line now, not after a long run
    runtime = runtime or RuntimeConfig()
    feeds = feeds or FeedSpec()
    m = load_model(model)
    outputs = [o.name for o in m.graph.output]
    man = host = None
    if layers:
        m, man = inject(m, selection or Selection(), list(LAYER_SKETCHES))
        host = host_values(man, m, _base_dir(model, base_dir))  # the same weights on both sides
    cfgs = [RuntimeConfig(p, runtime.graph_opt, runtime.threads, False) for p in items]
    report = ParityReport(
        f"{_label(model)} on {items[0]}", items[1], tol, tol if layer_tol is None else layer_tol
    )
    run_a, sess = _session_runner(m, cfgs[0], _base_dir(model, base_dir))
    run_b, sess_b = _session_runner(m, cfgs[1], _base_dir(model, base_dir))
    report.runtime = {"a": cfgs[0].to_record(sess), "b": cfgs[1].to_record(sess_b)}
    return _compare(report, iter_feeds(model, feeds), run_a, run_b, man, man, outputs, host, host)


def validate_skips(
    model: ModelLike,
    adds: Sequence[str],
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
    base_dir: str | os.PathLike | None = None,
) -> dict[str, dict]:
    """site id -> output quality (max_abs, max_rel, cosine, top1) of skipping that block alone.

    What `inference_taps.residual_findings(table, skip_quality=...)` takes to validate its candidates.
    """
    from .rewrite import residual_sites, resolve_blocks, skip_blocks

    src = load_model(model)
    out = {}
    for site in resolve_blocks(residual_sites(src), list(adds)):
        skipped, _ = skip_blocks(src, [site.id])
        rep = parity_models(src, skipped, feeds, runtime, layers=False,
                            base_dir_a=_base_dir(model, base_dir), base_dir_b=_base_dir(model, base_dir))  # fmt: skip
        out[site.id] = rep.summary()
    return out
