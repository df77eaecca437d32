"""Parity runs: a model against its rewrite, or one model on two execution providers.

Both sides run the same feeds; their outputs go through the one comparator
(`compare.output_metrics`) and, layer by layer, both sides get the *same* taps (the sites
chosen on A, kept where B still has their tensors) so that only small statistics leave the
session (`compare.layers`). The report names the first site, in execution order, whose
statistics diverge beyond the layer tolerance. Parity passes when every output is within
`tol` of A's and no output gains NaN/Inf where the other has a finite value.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from onnx import ModelProto

from ..compare import DEFAULT_TOL, LAYER_SKETCHES, ParityReport, compare_outputs, layer_divergences, worst_of
from ..errors import OpscopeError
from ..graph.index import ModelIndex
from ..graph.io import ModelLike, load_model
from ..instrument import HostValues, Manifest, decode, host_values, inject
from ..sites import SHADOW_SUFFIX, Selection, Site, find_sites, select
from ..transform import residual_sites, resolve_blocks, skip_blocks
from .feeds import FeedSpec, input_signature, iter_feeds
from .session import RuntimeConfig, make_session, resolve_providers, run


def parity(
    model_a: ModelLike,
    model_b: ModelLike | None = None,
    *,
    providers: str | Sequence[str] | None = None,
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
    tol: float = DEFAULT_TOL,
    layer_tol: float | None = None,
    selection: Selection | None = None,
    layers: bool = True,
) -> ParityReport:
    """A against B on the same feeds, or A on two providers (`providers="cpu,cuda"`, the first is the reference)."""
    if (model_b is None) == (providers is None):
        raise OpscopeError(
            "give either a second model to compare with, or providers to compare (not both)",
            hint="opscope parity A.onnx B.onnx  |  opscope parity A.onnx --providers cpu,cuda",
        )
    common = dict(
        feeds=feeds, runtime=runtime, tol=tol, layer_tol=layer_tol, selection=selection, layers=layers
    )
    if providers is not None:
        return parity_providers(model_a, providers, **common)
    return parity_models(model_a, model_b, **common)


def _sites_in(model: ModelProto, sites: list[Site]) -> tuple[list[Site], list[str]]:
    """The sites of A whose tensors B still has (outer scopes included); the ids of those it lost."""
    index = ModelIndex(model)

    def has(site: Site, tensor: str) -> bool:
        return index.defines(site.graph, tensor.removesuffix(SHADOW_SUFFIX))

    kept, lost = [], []
    for s in sites:
        taps = tuple(t for t in s.taps if has(s, t.tensor)) if s.graph in index else ()
        if not taps:
            lost.append(s.id)
            continue
        kept.append(s.with_taps(taps, tuple(t for t in s.shape_only if has(s, t.tensor))))
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

    `host_*`: each side's weight-tap values (`instrument.host_values`), computed once.
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
            merged[name] = worst_of(merged.get(name), m, rows)
        if manifest_a is not None and manifest_b is not None:
            for key, d in layer_divergences(
                decode(manifest_a, oa, host_a), decode(manifest_b, ob, host_b)
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
    weights = _base_dir(model, base_dir)
    if layers:
        m, man = inject(m, selection or Selection(), list(LAYER_SKETCHES))
        host = host_values(man, m, weights)  # the same weights on both sides
    cfgs = [RuntimeConfig(p, runtime.graph_opt, runtime.threads, False) for p in items]
    report = ParityReport(
        f"{_label(model)} on {items[0]}", items[1], tol, tol if layer_tol is None else layer_tol
    )
    run_a, sess = _session_runner(m, cfgs[0], weights)
    run_b, sess_b = _session_runner(m, cfgs[1], weights)
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

    What `findings.mine(table, skip_quality=...)` takes to validate its skip candidates.
    """
    src, weights = load_model(model), _base_dir(model, base_dir)
    out = {}
    for site in resolve_blocks(residual_sites(src), list(adds)):
        skipped = skip_blocks(src, [site.id]).model
        rep = parity_models(
            src, skipped, feeds, runtime, layers=False, base_dir_a=weights, base_dir_b=weights
        )
        out[site.id] = rep.summary()
    return out
