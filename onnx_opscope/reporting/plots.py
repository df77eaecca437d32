"""The report's plots, drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display).

The histogram of every (site, role) as a heatmap, per-channel max|x| of the sites with the
strongest channel outliers, the findings by what they are ranked by (impact), and a roofline
of the ops the analyzer priced. Each is a PNG in a `Plot` with its title in the image, axis
labels with units and a legend; a plot that cannot be drawn is a `Missing` that says why in
one line, and a panel that would carry no information (a density of 1.0 everywhere) is left
out with a sentence in the caption instead.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..analysis.roofline import Device, attainable
from ..findings import Finding, MineConfig, Series

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..analysis.profile import NodeProfile

MAX_ROWS = 40  # rows in the heatmap and the bar charts
TOP_CHANNEL_SITES = 4
ROOF_LABELS = 10  # labelled points on the roofline: the sites with findings, then the top ops by FLOPs
ROOFLINE = "Roofline"
DENSE_ENOUGH = 0.99  # a density panel whose every bar is above this says nothing

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


@dataclass
class Missing:
    """A plot the report could not draw, and the one-line reason it gives instead."""

    name: str
    title: str
    reason: str


@dataclass
class RoofPoint:
    """One op on the roofline: its intensity and the FLOP/s the device can reach there."""

    node: str
    op_type: str
    flops: float
    nbytes: float
    intensity: float  # FLOP / byte
    attainable: float  # FLOP/s: min(peak, bandwidth x intensity)


@dataclass
class Roofline:
    """What the roofline is drawn from: per-op records (flops, bytes), the device, and where the
    costs come from (the analysis, or the shapes the recording used)."""

    device: Device
    records: list[dict] = field(default_factory=list)
    shapes: str = "the analysis"


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


def _short(name: str, width: int = 30) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def plot_histograms(findings: Sequence[Finding], series: dict[tuple, Series]) -> Plot | Missing:
    """Mean histogram shares over steps, one row per (site, role), in rank order."""
    from matplotlib.colors import PowerNorm

    title = "Histogram per site"
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
    if not rows:
        return Missing(
            "histograms", title, "no tapped tensor has a histogram (the hist sketch was not recorded)"
        )
    if len({len(r) for r in rows}) != 1:
        return Missing("histograms", title, "the tensors' histograms have different bin counts")
    data = np.vstack(rows)
    fig = _figure(8, 1.6 + 0.28 * len(rows))
    ax = fig.add_subplot()
    im = ax.imshow(data, aspect="auto", cmap="viridis", norm=PowerNorm(0.5, vmin=0, vmax=max(data.max(), 1e-9)),
                   extent=(-1, 1, len(rows) - 0.5, -0.5), interpolation="nearest")  # fmt: skip
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xlabel(f"x / max|x|  ({data.shape[1]} bins over [-1, 1])")
    ax.set_ylabel("tapped tensor (site/role), best first")
    ax.set_title("Histogram of each tapped tensor (shares averaged over steps)", fontsize=10)
    fig.colorbar(im, ax=ax, label="share of elements (sqrt scale)")
    caption = ("Each row is one tapped tensor's histogram (shares, averaged over steps), in rank order. Spikes at "
               "0 mean sparsity or heavy tails; combs of empty bins mean a few discrete levels.")  # fmt: skip
    return Plot("histograms", title, caption, _png(fig))


def plot_channels(
    findings: Sequence[Finding], series: dict[tuple, Series], cfg: MineConfig
) -> Plot | Missing:
    """Per-channel max|x| (max over steps) of the tensors with the largest channel-outlier ratio."""
    title = "Per-channel max|x| (top outlier sites)"
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
        return Missing(
            "channels",
            title,
            "no tensor has per-channel max|x| (record with --sketch chan_maxabs, or --sketch all)",
        )
    multi = multi_run(findings)
    fig = _figure(8, 2.0 * len(picked) + 0.8)
    axes = fig.subplots(len(picked), 1, squeeze=False)[:, 0]
    for ax, (f, v) in zip(axes, picked):
        mean = float(np.nanmean(v))
        color = "#d62728" if f.rule == "outlier" else "#1f77b4"
        ax.stairs(np.nan_to_num(v), np.arange(v.size + 1) - 0.5, fill=True, color=color,
                  label="outlier rule fired" if f.rule == "outlier" else "max|x| of the channel")  # fmt: skip
        ax.axhline(mean, color="black", lw=0.8, ls="--", label="mean over channels")
        ax.axhline(mean * cfg.outlier_min, color="#d62728", lw=0.8, ls=":",
                   label=f"outlier threshold: {cfg.outlier_min:g} x mean")  # fmt: skip
        ax.set_title(f"{label(f, multi)}: max/mean = {f.signals['outlier']:.3g}", fontsize=9)
        ax.set_ylabel("max|x| (tensor units)", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("channel index (last axis)")
    fig.suptitle("Per-channel max|x|, max over steps", fontsize=10)
    caption = (f"Per-channel max|x| of the {len(picked)} tensors with the largest max/mean ratio; a ratio above "
               f"{cfg.outlier_min:g} calls for per-channel scales.")  # fmt: skip
    return Plot("channels", title, caption, _png(fig))


def _kind(f: Finding) -> str:
    k = "steps" if f.temporal and f.temporal.score > f.score else f.rule
    return k if k in RULE_COLORS else "dense"


def plot_ranking(findings: Sequence[Finding]) -> Plot | Missing:
    """The findings shown, best first, by what they are ranked by: impact (score x FLOP share), or the
    score when no FLOP share is known; a density panel beside it only when some tensor has zeros."""
    from matplotlib.patches import Patch

    title = "Findings by impact"
    shown = list(findings)[:MAX_ROWS]
    if not shown:
        return Missing("ranking", title, "no actionable finding to rank (`--all` lists every tensor)")
    multi = multi_run(findings)
    labels = [label(f, multi) for f in shown]
    y = np.arange(len(shown))
    by_impact = any(f.impact is not None for f in shown)
    dens = [f.signals.get("density") for f in shown]
    known = [d for d in dens if d is not None]
    with_density = any(d < DENSE_ENOUGH for d in known)
    fig = _figure(11 if with_density else 9, 1.4 + 0.3 * len(shown))
    if with_density:
        ax, ax_d = fig.subplots(1, 2, sharey=True, width_ratios=[2, 1])
    else:
        ax, ax_d = fig.add_subplot(), None
    values = [(f.impact or 0.0) if by_impact else f.rank_score for f in shown]
    kinds = [_kind(f) for f in shown]
    ax.barh(y, values, color=[RULE_COLORS[k] for k in kinds])
    top = max(max(values), 1e-9)
    for yi, v, f in zip(y, values, shown):
        saves = "" if f.saves is None else f", saves {100 * f.saves:.1f}%"
        ax.text(v + 0.01 * top, yi, f"score {f.rank_score:.2f}{saves}", va="center", fontsize=7)
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel(
        "impact = score x share of the model's FLOPs" if by_impact else "score (no FLOP shares known)"
    )
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    used = sorted(set(kinds), key=list(RULE_COLORS).index)
    names = {"steps": "across steps (prepack, memoize, delta)"}
    ax.legend(handles=[Patch(color=RULE_COLORS[r], label=names.get(r, r)) for r in used], fontsize=7,
              loc="lower right", title="rule", title_fontsize=7)  # fmt: skip
    if ax_d is not None:
        ax_d.barh(y, [d if d is not None else 0.0 for d in dens], color="#1f77b4")
        ax_d.axvline(0.5, color="black", lw=0.8, ls=":", label="sparse-GEMM threshold")
        ax_d.set_xlim(0, 1.05)
        ax_d.set_xlabel("density = nnz / numel")
        ax_d.set_title("density", fontsize=9)
        ax_d.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Findings, best first: ranked by {'impact' if by_impact else 'score'}", fontsize=10)
    caption = (
        "Each bar is one finding, in the report's order; its length is what the order follows "
        + (
            "(score x the site's share of the model's FLOPs)"
            if by_impact
            else "(the score: no FLOP shares known)"
        )
        + "; 'steps' marks a score from the across-steps rules (memoize, delta, prepack). "
    )
    if not known:
        caption += "Density is not shown: the nnz sketch was not recorded."
    elif not with_density:
        caption += (
            f"Density is not drawn: every finding shown has density >= {DENSE_ENOUGH:g} (no zeros to skip)."
        )
    else:
        caption += "Right: density, the dotted line the sparse-GEMM threshold."
    return Plot("ranking", title, caption, _png(fig))


def roof_points(records: Sequence[dict], device: Device) -> list[RoofPoint]:
    """The priced ops (flops > 0, bytes > 0, both finite) at their attainable FLOP/s on `device`."""
    pts = []
    for r in records:
        try:
            fl, nb = float(r.get("flops")), float(r.get("bytes"))
        except (TypeError, ValueError):
            continue
        if math.isfinite(fl) and math.isfinite(nb) and fl > 0 and nb > 0:
            ai = fl / nb
            pts.append(RoofPoint(str(r.get("node") or r.get("site") or ""), str(r.get("op_type") or ""), fl, nb,
                                 ai, attainable(ai, device)))  # fmt: skip
    return pts


def _labelled(pts: list[RoofPoint], sites: set[str]) -> list[tuple[RoofPoint, str]]:
    """Points to name, in intensity order: those of sites with findings, then the top ops by FLOPs, one
    label per position ('q_proj/matmul +3 more': four ops at the same point)."""
    order = sorted(pts, key=lambda p: (p.node not in sites, -p.flops))
    groups: dict[tuple, list[RoofPoint]] = {}
    for p in order:
        groups.setdefault((round(math.log10(p.intensity), 3), round(math.log10(p.attainable), 3)), []).append(
            p
        )
    out = []
    for members in list(groups.values())[:ROOF_LABELS]:
        names = ["/".join(p.node.split("/")[-2:]) for p in members]
        text = (
            ", ".join(names)
            if len(names) == 2
            else names[0] + (f" +{len(names) - 1} more" if len(names) > 2 else "")
        )
        out.append((members[0], _short(text, 40)))
    return sorted(out, key=lambda pt: pt[0].intensity)


def roofline_figure(roof: Roofline, findings: Sequence[Finding]) -> Figure | Missing:
    """The figure of `plot_roofline` (the points are its scatter collections), or a `Missing` when no op
    has known FLOPs and bytes."""
    from matplotlib.ticker import EngFormatter

    dev = roof.device
    pts = roof_points(roof.records, dev)
    if not pts:
        return Missing("roofline", ROOFLINE, f"no op priced at {roof.shapes} has known FLOPs and bytes")
    total = sum(p.flops for p in pts)
    fig = _figure(8.5, 5.5)
    ax = fig.add_subplot()
    xs = [p.intensity for p in pts]
    lo, hi = min(min(xs), dev.ridge) / 4, max(max(xs), dev.ridge) * 4
    grid = np.geomspace(lo, hi, 256)
    ax.plot(grid[grid <= dev.ridge], dev.bandwidth * grid[grid <= dev.ridge], color="#1f77b4", lw=1.6,
            label=f"memory roof: {dev.bandwidth / 1e9:.4g} GB/s x intensity")  # fmt: skip
    ax.plot([dev.ridge, hi], [dev.peak_flops] * 2, color="#d62728", lw=1.6,
            label=f"compute roof: {dev.peak_flops / 1e12:.4g} TFLOP/s ({dev.dtype})")  # fmt: skip
    ax.axvline(dev.ridge, color="black", lw=0.7, ls=":", label=f"ridge: {dev.ridge:.3g} FLOP/byte")
    for bound, color in (("memory-bound op", "#1f77b4"), ("compute-bound op", "#d62728")):
        sel = [p for p in pts if (p.intensity >= dev.ridge) == bound.startswith("compute")]
        if sel:
            ax.scatter([p.intensity for p in sel], [p.attainable for p in sel], color=color, alpha=0.6,
                       s=[16 + 300 * math.sqrt(p.flops / total) for p in sel], label=bound, zorder=3)  # fmt: skip
    sites = {f.site for f in findings if f.actionable}
    marked = [p for p in pts if p.node in sites]
    if marked:
        ax.scatter([p.intensity for p in marked], [p.attainable for p in marked], s=110, facecolors="none",
                   edgecolors="black", lw=1.2, label="site with a finding", zorder=4)  # fmt: skip
    for k, (p, text) in enumerate(_labelled(pts, sites)):  # neighbours on opposite sides of the roof
        above = k % 2 == 0
        ax.annotate(text, (p.intensity, p.attainable), xytext=(-8, 14) if above else (8, -16),
                    textcoords="offset points", ha="right" if above else "left", fontsize=7,
                    arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "#555"})  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ys = [p.attainable for p in pts]
    ax.set_ylim(min(ys) / 10, dev.peak_flops * 3)
    ax.yaxis.set_major_formatter(EngFormatter(unit="FLOP/s"))
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable performance (FLOP/s)")
    ax.set_title(f"Roofline on {dev.name} ({dev.dtype}), {len(pts)} ops at {roof.shapes}", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="major", lw=0.3, alpha=0.5)
    return fig


def plot_roofline(roof: Roofline | str, findings: Sequence[Finding]) -> Plot | Missing:
    """The priced ops on the device's roofline: x intensity (FLOP/byte), y attainable FLOP/s."""
    if isinstance(roof, str):
        return Missing("roofline", ROOFLINE, roof)
    fig = roofline_figure(roof, findings)
    if isinstance(fig, Missing):
        return fig
    dev = roof.device
    caption = (
        f"Each point is one op the analyzer priced at {roof.shapes}, drawn at the most its device can do at its "
        "intensity, min(peak, bandwidth x intensity); the area of a point is its share of the model's FLOPs. "
        f"Left of the ridge an op is memory-bound, right of it compute-bound. Device: {dev.source}."
    )
    return Plot("roofline", ROOFLINE, caption, _png(fig))


def make_plots(findings: Sequence[Finding], series: list[Series], cfg: MineConfig,
               roofline: Roofline | str | None = None, shown: Sequence[Finding] | None = None) -> list[Plot | Missing]:  # fmt: skip
    """Every plot of the report, in page order; `shown`: the findings the ranking plot draws (default:
    the actionable ones); `roofline`: what to draw it from, or the reason it cannot be drawn."""
    by_key = {_key(s): s for s in series}
    if roofline is None:
        roofline = (
            "no costs with per-op FLOPs and bytes (give --costs: `opscope analyze MODEL --format json`)"
        )
    return [
        plot_histograms(findings, by_key),
        plot_channels(findings, by_key, cfg),
        plot_ranking(shown if shown is not None else [f for f in findings if f.actionable]),
        plot_roofline(roofline, findings),
    ]


def plot_measured_roofline(prof: NodeProfile, top: int = ROOF_LABELS) -> Plot | Missing:
    """Measured nodes on the measured roofline: x intensity (FLOP/byte), y achieved FLOP/s, the memory
    and compute roofs from the probes (`analysis.bandwidth`), the `top` nodes by time labelled."""
    from matplotlib.ticker import EngFormatter

    title = "Measured roofline"
    pts = [n for n in prof.nodes if n.time_s > 0 and n.flops and n.bytes and n.flops_per_s]
    if not pts:
        return Missing("measured_roofline", title, "no node that ran has known FLOPs and bytes")
    m = prof.measured
    fig = _figure(8.5, 5.5)
    ax = fig.add_subplot()
    xs = [n.intensity for n in pts]
    lo, hi = min(min(xs), m.ridge) / 4, max(max(xs), m.ridge) * 4
    grid = np.geomspace(lo, hi, 256)
    ax.plot(grid, np.minimum(m.bandwidth * grid, m.peak_flops), color="black", lw=1.6, label="attainable")
    ax.plot(grid[grid <= m.ridge], m.bandwidth * grid[grid <= m.ridge], color="#1f77b4", lw=3, alpha=0.4,
            label=f"memory roof: {m.bandwidth / 1e9:.3g} GB/s (copy probe)")  # fmt: skip
    ax.plot([m.ridge, hi], [m.peak_flops] * 2, color="#d62728", lw=3, alpha=0.4,
            label=f"compute roof: {m.peak_flops / 1e9:.3g} GFLOP/s (MatMul probe)")  # fmt: skip
    ax.plot(grid, 0.5 * m.bandwidth * grid, color="#1f77b4", lw=0.8, ls="--", label="50% of the bandwidth")
    total = sum(n.time_s for n in pts)
    colors = {"bandwidth": "#1f77b4", "compute": "#d62728", "latency": "#7f7f7f"}
    for verdict, color in colors.items():
        sel = [n for n in pts if n.verdict == verdict]
        if sel:
            ax.scatter([n.intensity for n in sel], [n.flops_per_s for n in sel], color=color, alpha=0.6,
                       s=[12 + 400 * n.time_s / total for n in sel], label=f"{verdict}-bound node", zorder=3)  # fmt: skip
    for k, n in enumerate(sorted(pts, key=lambda n: -n.time_s)[:top]):
        above = k % 2 == 0
        ax.annotate(_short(f"{'/'.join(n.node.split('/')[-2:])} ({n.op_type})", 36), (n.intensity, n.flops_per_s),
                    xytext=(-8, 14) if above else (8, -16), textcoords="offset points",
                    ha="right" if above else "left", fontsize=7,
                    arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "#555"})  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(n.flops_per_s for n in pts) / 10, m.peak_flops * 3)
    ax.yaxis.set_major_formatter(EngFormatter(unit="FLOP/s"))
    ax.set_xlabel("arithmetic intensity (FLOP / byte, static cost at the fed shapes)")
    ax.set_ylabel("achieved performance (FLOP/s, measured)")
    where = ", ".join(p.removesuffix("ExecutionProvider") for p in prof.providers)
    ax.set_title(f"Measured roofline on {where} (opt level {prof.opt_level}): {len(pts)} nodes, "
                 f"ridge {m.ridge:.3g} FLOP/byte", fontsize=10)  # fmt: skip
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="major", lw=0.3, alpha=0.5)
    caption = (
        "Each point is one node of the model at its static intensity and the FLOP/s it achieved (its FLOPs over "
        "its measured share of the kernels' time); the area is its share of the time. The roofs are measured on "
        f"the same provider: {m.source}. The top {top} nodes by time are named."
    )
    return Plot("measured_roofline", title, caption, _png(fig))
