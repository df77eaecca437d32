"""The report's plots, drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display).

The histogram of every (site, role) as a heatmap, per-channel max|x| of the sites with the
strongest channel outliers, density and score per site, and the analyzer's roofline scatter
when per-op costs (flops, bytes, intensity) are given. Each is a PNG in a `Plot`.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..findings import Costs, Finding, MineConfig, Series

MAX_ROWS = 40  # rows in the heatmap and the bar charts
TOP_CHANNEL_SITES = 4

RULE_COLORS = {
    "nonfinite": "#7f7f7f", "sparse": "#1f77b4", "outlier": "#d62728", "levels": "#9467bd",
    "heavy_tail": "#e377c2", "concentrated": "#8c564b", "coherent": "#2ca02c", "positional": "#ff7f0e",
    "dense": "#c7c7c7", "steps": "#17becf", "concentrated_attention": "#bcbd22", "cold_experts": "#aec7e8",
    "hot_expert": "#ffbb78", "weak_residual_branch": "#98df8a",
}  # fmt: skip
"""Colour per rule; rules that name no exploit (dense, spread attention, balanced experts, ...) are grey."""


@dataclass
class Plot:
    name: str
    title: str
    caption: str
    png: bytes


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(
        buf, format="png", dpi=100, metadata={"Software": None}
    )  # constrained layout: no tight bbox pass
    return buf.getvalue()


def _figure(w: float, h: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), layout="constrained")


def _key(x: Finding | Series) -> tuple:
    return (x.run_id, x.provider, x.dist, x.site, x.role)


def label(f: Finding, multi: bool) -> str:
    return f"{f.site}/{f.role}" + (f" [{f.dist}]" if multi else "")


def multi_run(findings: Sequence[Finding]) -> bool:
    return len({(f.run_id, f.provider, f.dist) for f in findings}) > 1


def plot_histograms(findings: Sequence[Finding], series: dict[tuple, Series]) -> Plot | None:
    """Mean histogram shares over steps, one row per (site, role), in rank order."""
    from matplotlib.colors import PowerNorm

    rows, labels = [], []
    multi = multi_run(findings)
    for f in findings:
        s = series.get(_key(f))
        if s is None:
            continue
        shares = []
        for step in s.steps:
            h = np.nan_to_num(s.stat(step, "hist"))
            if h.size and h.sum() > 0:
                shares.append(h / h.sum())
        if shares and len({len(x) for x in shares}) == 1:
            rows.append(np.mean(shares, axis=0))
            labels.append(label(f, multi))
        if len(rows) >= MAX_ROWS:
            break
    if not rows or len({len(r) for r in rows}) != 1:
        return None
    data = np.vstack(rows)
    fig = _figure(8, 1.2 + 0.28 * len(rows))
    ax = fig.add_subplot()
    im = ax.imshow(data, aspect="auto", cmap="viridis", norm=PowerNorm(0.5, vmin=0, vmax=max(data.max(), 1e-9)),
                   extent=(-1, 1, len(rows) - 0.5, -0.5), interpolation="nearest")  # fmt: skip
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xlabel("x / max|x|  (bins)")
    fig.colorbar(im, ax=ax, label="share of elements (sqrt scale)")
    caption = ("Each row is one tapped tensor's histogram (shares, averaged over steps). Spikes at 0 mean "
               "sparsity or heavy tails; combs of empty bins mean a few discrete levels.")  # fmt: skip
    return Plot("histograms", "Histogram per site", caption, _png(fig))


def plot_channels(findings: Sequence[Finding], series: dict[tuple, Series], cfg: MineConfig) -> Plot | None:
    """Per-channel max|x| (max over steps) of the tensors with the largest channel-outlier ratio."""
    cands = [f for f in findings if f.signals.get("outlier") is not None and _key(f) in series]
    cands.sort(key=lambda f: -(f.signals["outlier"] or 0.0))
    picked = []
    for f in cands:
        s = series[_key(f)]
        vals = [s.stat(step, "chan_maxabs") for step in s.steps]
        vals = [v for v in vals if v.size]
        if vals and len({v.size for v in vals}) == 1:
            picked.append((f, np.nanmax(np.vstack(vals), axis=0)))
        if len(picked) >= TOP_CHANNEL_SITES:
            break
    if not picked:
        return None
    multi = multi_run(findings)
    fig = _figure(8, 2.0 * len(picked) + 0.4)
    axes = fig.subplots(len(picked), 1, squeeze=False)[:, 0]
    for ax, (f, v) in zip(axes, picked):
        mean = float(np.nanmean(v))
        color = "#d62728" if f.rule == "outlier" else "#1f77b4"
        ax.stairs(
            np.nan_to_num(v), np.arange(v.size + 1) - 0.5, fill=True, color=color
        )  # one patch, not N bars
        ax.axhline(mean, color="black", lw=0.8, ls="--", label="mean")
        ax.axhline(
            mean * cfg.outlier_min, color="#d62728", lw=0.8, ls=":", label=f"{cfg.outlier_min:g} x mean"
        )
        ax.set_title(f"{label(f, multi)}: max/mean = {f.signals['outlier']:.3g}", fontsize=9)
        ax.set_ylabel("max|x|", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("channel")
    caption = (f"Per-channel max|x| of the {len(picked)} tensors with the largest max/mean ratio; a ratio above "
               f"{cfg.outlier_min:g} calls for per-channel scales.")  # fmt: skip
    return Plot("channels", "Per-channel max|x| (top outlier sites)", caption, _png(fig))


def plot_density_score(findings: Sequence[Finding]) -> Plot | None:
    """Density and score per (site, role), in rank order, coloured by the rule that fired."""
    shown = list(findings)[:MAX_ROWS]
    if not shown:
        return None
    multi = multi_run(findings)
    labels = [label(f, multi) for f in shown]
    y = np.arange(len(shown))
    fig = _figure(9, 1.0 + 0.28 * len(shown))
    ax_d, ax_s = fig.subplots(1, 2, sharey=True)
    dens = [f.signals.get("density") for f in shown]
    ax_d.barh(y, [d if d is not None else 0.0 for d in dens], color="#1f77b4")
    ax_d.axvline(0.5, color="black", lw=0.8, ls=":")
    ax_d.set_xlim(0, 1.05)
    ax_d.set_xlabel("density = nnz / numel")
    ax_d.set_yticks(y, labels, fontsize=8)
    ax_d.invert_yaxis()
    kinds = [("steps" if f.temporal and f.temporal.score > f.score else f.rule) for f in shown]
    kinds = [k if k in RULE_COLORS else "dense" for k in kinds]
    colors = [RULE_COLORS[k] for k in kinds]
    ax_s.barh(y, [f.rank_score for f in shown], color=colors)
    ax_s.set_xlim(0, 1.05)
    ax_s.set_xlabel("score (the better of per-batch and across-steps)")
    from matplotlib.patches import Patch

    used = sorted(set(kinds), key=list(RULE_COLORS).index)
    ax_s.legend(handles=[Patch(color=RULE_COLORS[r], label=r) for r in used], fontsize=7, loc="lower right")
    caption = (
        "Density (the dotted line is the sparse-GEMM threshold) and score per tapped tensor, best first; "
        "'steps' marks a score that comes from the across-steps rules (memoize, delta, prepack)."
    )
    return Plot("density_score", "Density and score per site", caption, _png(fig))


def plot_roofline(costs: Costs, findings: Sequence[Finding]) -> Plot | None:
    """The analyzer's ops on a roofline: FLOPs against arithmetic intensity, sites marked."""
    pts = []
    for r in costs.ops:
        try:
            fl, ai = float(r.get("flops")), float(r.get("intensity"))
        except (TypeError, ValueError):
            continue
        if np.isfinite(fl) and np.isfinite(ai) and fl > 0 and ai > 0:
            pts.append((ai, fl, str(r.get("roofline") or "unknown"), str(r.get("node") or "")))
    if not pts:
        return None
    fig = _figure(7, 4.5)
    ax = fig.add_subplot()
    palette = {"compute": "#d62728", "memory": "#1f77b4"}
    for cls in sorted({p[2] for p in pts}):
        sel = [p for p in pts if p[2] == cls]
        ax.scatter([p[0] for p in sel], [p[1] for p in sel], s=14, alpha=0.7, label=cls,
                   color=palette.get(cls.split("-")[0], "#7f7f7f"))  # fmt: skip
    sites = {f.site for f in findings if f.rule != "dense" or (f.temporal and f.temporal.rule != "drifting")}
    marked = [p for p in pts if p[3] in sites]
    if marked:
        ax.scatter([p[0] for p in marked], [p[1] for p in marked], s=60, facecolors="none", edgecolors="black",
                   label="site with a finding")  # fmt: skip
    if costs.ridge:
        ax.axvline(costs.ridge, color="black", lw=0.8, ls=":", label=f"ridge {costs.ridge:.3g} FLOP/B")
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = [p[0] for p in pts] + ([costs.ridge] if costs.ridge else [])
    ys = [p[1] for p in pts]
    ax.set_xlim(min(xs) / 3, max(xs) * 3)  # context around the points even for a single op
    ax.set_ylim(min(ys) / 3, max(ys) * 3)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOPs")
    ax.legend(fontsize=7)
    caption = (
        "Every op the analyzer priced; left of the ridge an op is memory-bound, right of it compute-bound."
    )
    return Plot("roofline", "Roofline (static analysis)", caption, _png(fig))


def make_plots(
    findings: Sequence[Finding], series: list[Series], costs: Costs, cfg: MineConfig
) -> list[Plot]:
    by_key = {_key(s): s for s in series}
    plots = [
        plot_histograms(findings, by_key),
        plot_channels(findings, by_key, cfg),
        plot_density_score(findings),
        plot_roofline(costs, findings),
    ]
    return [p for p in plots if p is not None]
