"""The report: ranked findings, their signals and plots, as Markdown or one self-contained HTML file.

Plots are drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display),
as PNG. The HTML embeds them as base64 data URIs and carries its CSS inline, so the file
opens offline and fetches nothing; the Markdown links them from a `<stem>_files/` folder
beside it. Plots: the histogram of every (site, role) as a heatmap, per-channel max|x| of
the sites with the strongest channel outliers, density and score per site, and the
analyzer's roofline scatter when per-op costs (flops, bytes, intensity) are given.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import OpscopeError
from .mine import (
    DENSE_NOTE,
    RULES,
    Finding,
    MineConfig,
    Series,
    TableLike,
    collect,
    load_findings,
    mine_series,
    read_sketch_table,
    temporal_text,
)
from .plan import Costs, load_costs

HTML_SUFFIXES = (".html", ".htm")
MD_SUFFIXES = (".md", ".markdown")
MAX_ROWS = 40  # rows in the heatmap and the bar charts
TOP_CHANNEL_SITES = 4

RULE_COLORS = {
    "nonfinite": "#7f7f7f", "sparse": "#1f77b4", "outlier": "#d62728", "levels": "#9467bd",
    "heavy_tail": "#e377c2", "concentrated": "#8c564b", "coherent": "#2ca02c", "positional": "#ff7f0e",
    "dense": "#c7c7c7", "steps": "#17becf",
}  # fmt: skip


@dataclass
class Plot:
    name: str
    title: str
    caption: str
    png: bytes


# --------------------------------------------------------------------------------------------
# plots


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


def _label(f: Finding, multi: bool) -> str:
    return f"{f.site}/{f.role}" + (f" [{f.dist}]" if multi else "")


def _multi(findings: Sequence[Finding]) -> bool:
    return len({(f.run_id, f.provider, f.dist) for f in findings}) > 1


def plot_histograms(findings: Sequence[Finding], series: dict[tuple, Series]) -> Plot | None:
    """Mean histogram shares over steps, one row per (site, role), in rank order."""
    from matplotlib.colors import PowerNorm

    rows, labels = [], []
    multi = _multi(findings)
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
            labels.append(_label(f, multi))
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
    multi = _multi(findings)
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
        ax.set_title(f"{_label(f, multi)}: max/mean = {f.signals['outlier']:.3g}", fontsize=9)
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
    multi = _multi(findings)
    labels = [_label(f, multi) for f in shown]
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
    colors = [RULE_COLORS.get(k, "#c7c7c7") for k in kinds]
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


# --------------------------------------------------------------------------------------------
# text


def _num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def findings_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the ranked findings table (shared by Markdown and HTML)."""
    multi = _multi(findings)
    head = ["#", "site", "op", "role"] + (["dist"] if multi else [])
    head += ["exploit", "score", "rule", "guard", "stability", "est", "measured", "across steps", "FLOP share",
             "saves"]  # fmt: skip
    rows = []
    for i, f in enumerate(findings, 1):
        t = f.temporal
        saves = f.savings if f.savings is not None else (t.savings if t else None)
        stab = f.stability + (f" (σ {f.stability_sigma:.2g})" if f.stability_sigma is not None else "")
        meas = f.measured_speedup if f.measured_speedup is not None else (t.measured_speedup if t else None)
        row = [str(i), f.site, f.op_type, f.role] + ([f.dist] if multi else [])
        row += [f.exploit, f"{f.score:.2f}", f.condition, f.guard or "-", stab, _x(f.est_speedup), _x(meas),
                temporal_text(t), _pct(f.flop_share), _pct(saves)]  # fmt: skip
        rows.append(row)
    return head, rows


def signal_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    multi = _multi(findings)
    names = ["density", "outlier", "histtop", "hist_gaps", "pos_cv", "adj", "kurtosis", "nonfinite"]
    head = ["site", "role"] + (["dist"] if multi else []) + ["M", "K", "N", "steps"] + names
    head += ["l1 cv", "repeat", "drift"]
    rows = []
    for f in findings:
        t = f.temporal
        row = [f.site, f.role] + ([f.dist] if multi else [])
        row += [_num(f.M, 9), _num(f.K, 9), _num(f.N, 9), str(f.steps)]
        row += [_num(f.signals.get(n)) for n in names]
        row += [_num(t.l1_cv) if t else "-", _pct(t.repeat_share) if t else "-", _num(t.drift) if t else "-"]
        rows.append(row)
    return head, rows


def rule_rows(cfg: MineConfig) -> tuple[list[str], list[list[str]]]:
    rows = [[str(i), r.name, r.condition(cfg), r.exploit] for i, r in enumerate(RULES, 1)]
    rows.append([str(len(RULES) + 1), "dense", "otherwise", f"none ({DENSE_NOTE})"])
    rows.append(["steps", "stationary", f"l1_cv < {cfg.stationary_cv:g}", "precompute / prepack"])
    rows.append(["steps", "memoize", f"repeat_share > {cfg.repeat_share_min:g} (repeat: reldist < "
                 f"{cfg.repeat_dist:g})", "memoize"])  # fmt: skip
    rows.append(["steps", "delta", f"drift < {cfg.drift_max:g}", "delta-compute (across steps)"])
    return ["order", "rule", "fires when", "exploit"], rows


def _summary(findings: Sequence[Finding], source: str) -> list[str]:
    runs = sorted({(f.run_id, f.provider, f.dist, f.steps) for f in findings})
    lines = [f"Table: `{source}`; {len(findings)} tapped tensors (site, role)."]
    for run_id, prov, dist, steps in runs[:12]:
        lines.append(f"Run `{run_id}` on `{prov}`, data `{dist}`, {steps} step(s).")
    fired: dict[str, int] = {}
    for f in findings:
        fired[f.exploit] = fired.get(f.exploit, 0) + 1
    lines.append(
        "Exploits: " + "; ".join(f"{k}: {v}" for k, v in sorted(fired.items(), key=lambda kv: -kv[1]))
    )
    return lines


# --------------------------------------------------------------------------------------------
# Markdown


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(map(_md_cell, head)) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(findings: Sequence[Finding], plots: Sequence[Plot], plot_dir: str, source: str,
                    cfg: MineConfig) -> str:  # fmt: skip
    parts = ["# onnx-opscope report", "", *(f"- {line}" for line in _summary(findings, source)), ""]
    parts += ["## Findings (best first)", "", _md_table(*findings_rows(findings)), ""]
    for p in plots:
        parts += [f"## {p.title}", "", f"![{p.title}]({plot_dir}/{p.name}.png)", "", p.caption, ""]
    parts += ["## Signals (means over steps)", "", _md_table(*signal_rows(findings)), ""]
    parts += ["## Rules (first match wins)", "", _md_table(*rule_rows(cfg)), ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# HTML

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1400px;padding:0 1em;
color:#222}
h1{font-size:1.6em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:0.5em 0}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:13px;color:#555}
code{background:#f4f4f4;padding:0 3px}
"""


def _html_table(head: list[str], rows: list[list[str]], numeric: Sequence[str] = ()) -> str:
    cols = [h in numeric for h in head]
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for r in rows:
        cells = "".join(
            f'<td class="n">{html.escape(c)}</td>' if num else f"<td>{html.escape(c)}</td>"
            for c, num in zip(r, cols)
        )
        out.append(f"<tr>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def render_html(findings: Sequence[Finding], plots: Sequence[Plot], source: str, cfg: MineConfig) -> str:
    """One self-contained page: inline CSS, PNGs as data URIs, no script, no external reference."""
    numeric = ("#", "score", "est", "measured", "FLOP share", "saves", "M", "K", "N", "steps", "density", "outlier",
               "histtop", "hist_gaps", "pos_cv", "adj", "kurtosis", "nonfinite", "l1 cv", "repeat", "drift")  # fmt: skip
    body = ["<h1>onnx-opscope report</h1>", "<ul>"]
    body += [f"<li>{_inline_code(line)}</li>" for line in _summary(findings, source)]
    body += [
        "</ul>",
        "<h2>Findings (best first)</h2>",
        _html_table(*findings_rows(findings), numeric=numeric),
    ]
    for p in plots:
        data = base64.b64encode(p.png).decode("ascii")
        body += [
            f'<h2 id="{p.name}">{html.escape(p.title)}</h2>',
            f'<figure><img alt="{html.escape(p.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(p.caption)}</figcaption></figure>",
        ]
    body += ["<h2>Signals (means over steps)</h2>", _html_table(*signal_rows(findings), numeric=numeric)]
    body += ["<h2>Rules (first match wins)</h2>", _html_table(*rule_rows(cfg))]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>onnx-opscope report: {html.escape(source)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _inline_code(line: str) -> str:
    """`x` -> <code>x</code>, the rest escaped."""
    parts = line.split("`")
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


# --------------------------------------------------------------------------------------------
# entry point


def write_report(
    table: TableLike,
    findings: Sequence[Finding] | str | os.PathLike | None = None,
    out_path: str | os.PathLike = "report.html",
    costs: Any = None,
    config: MineConfig | None = None,
) -> Path:
    """Write the report for `table` to `out_path` (.html: self-contained; .md: PNGs in `<stem>_files/`).

    `findings`: a list from `mine`, a path to saved findings, or None to mine the table now.
    `costs`: as for `mine`; analyzer records (flops, bytes, intensity) add the roofline plot.
    """
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix not in HTML_SUFFIXES + MD_SUFFIXES:
        raise OpscopeError(f"-o {out}: the report is .html or .md, not {suffix or 'no suffix'!r}")
    cfg = config or MineConfig()
    t, path = read_sketch_table(table)
    cost_info = load_costs(costs, path)
    series = collect(t)
    if findings is None:
        findings = mine_series(series, cost_info, cfg)
    elif isinstance(findings, str | os.PathLike):
        findings = load_findings(findings)
    plots = make_plots(findings, series, cost_info, cfg)
    source = path.name if path is not None else "<in-memory table>"
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix in HTML_SUFFIXES:
        out.write_text(render_html(findings, plots, source, cfg), encoding="utf-8")
        return out
    plot_dir = out.with_name(out.stem + "_files")
    plot_dir.mkdir(exist_ok=True)
    for p in plots:
        (plot_dir / f"{p.name}.png").write_bytes(p.png)
    out.write_text(render_markdown(findings, plots, plot_dir.name, source, cfg), encoding="utf-8")
    return out
