"""The report: ranked findings, the commands that act on them, signals and plots, as Markdown or HTML.

The HTML embeds the plots (`plots`) as base64 data URIs and carries its CSS inline, so the
file opens offline and fetches nothing; the Markdown links them from a `<stem>_files/`
folder beside it.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import OpscopeError
from ..files import write_bytes, write_text
from ..findings import (
    RULES,
    Finding,
    MineConfig,
    check_costs,
    check_findings,
    collect,
    load_costs,
    mine_series,
    read_findings,
    temporal_text,
)
from ..findings.miner import run_record
from ..findings.rules import DENSE_NOTE
from ..findings.series import TableLike, read_sketch_table
from .plots import Plot, make_plots, multi_run
from .weights import WeightsSection, weights_section

HTML_SUFFIXES = (".html", ".htm")
MD_SUFFIXES = (".md", ".markdown")


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
    multi = multi_run(findings)
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
    multi = multi_run(findings)
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
    rows.append(["attn", "concentrated_attention", f"mean attn_qmax > {cfg.attn_peak_min:g}",
                 f"windowed / sink sparse attention (sink: a key with >= {cfg.sink_share_min:g} of the mass)"])  # fmt: skip
    rows.append(["route", "cold_experts", f"load share < {cfg.cold_share_max:g}", "drop / merge the experts"])
    rows.append(
        ["route", "hot_expert", f"busiest share > {cfg.hot_imbalance_min:g}x uniform", "prefetch / pin it"]
    )
    rows.append(["residual", "weak_residual_branch", f"gap < {cfg.residual_gap_max:g}",
                 "skip the block (`opscope rewrite skip`), validated end to end"])  # fmt: skip
    return ["order", "rule", "fires when", "exploit"], rows


def action_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    """The findings opscope can act on, with the command and, when it was run, its validation."""
    rows = []
    for i, f in enumerate(findings, 1):
        if not f.action:
            continue
        v = f.validation
        checked = "-"
        if v is not None:
            top1 = "" if v.get("top1") is None else f", top-1 {v['top1']:.1%}"
            checked = (
                f"{'passed' if v['passed'] else 'failed'}: cosine {v.get('cosine', float('nan')):.6f}{top1}"
            )
        rows.append([str(i), f.site, f.exploit, f.action, checked])
    return ["#", "site", "exploit", "command", "validation"], rows


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


def _md_weights(section: WeightsSection | None, plot_dir: str) -> list[str]:
    if section is None:
        return []
    parts = [
        "## Weights: plans per byte budget",
        "",
        section.summary,
        "",
        _md_table(section.head, section.rows),
        "",
    ]
    for p in section.plots:
        parts += [f"### {p.title}", "", f"![{p.title}]({plot_dir}/{p.name}.png)", "", p.caption, ""]
    return parts


def render_markdown(findings: Sequence[Finding], plots: Sequence[Plot], plot_dir: str, source: str,
                    cfg: MineConfig, weights: WeightsSection | None = None) -> str:  # fmt: skip
    parts = ["# onnx-opscope report", "", *(f"- {line}" for line in _summary(findings, source)), ""]
    parts += ["## Findings (best first)", "", _md_table(*findings_rows(findings)), ""]
    actions = action_rows(findings)
    if actions[1]:
        parts += ["## What to do about it", "", _md_table(*actions), ""]
    for p in plots:
        parts += [f"## {p.title}", "", f"![{p.title}]({plot_dir}/{p.name}.png)", "", p.caption, ""]
    parts += _md_weights(weights, plot_dir)
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


def _html_figure(p: Plot, level: str = "h2") -> list[str]:
    data = base64.b64encode(p.png).decode("ascii")
    return [
        f'<{level} id="{p.name}">{html.escape(p.title)}</{level}>',
        f'<figure><img alt="{html.escape(p.title)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(p.caption)}</figcaption></figure>",
    ]


def _html_weights(section: WeightsSection | None) -> list[str]:
    if section is None:
        return []
    numeric = (
        "budget",
        "greedy Σerr",
        "DADO Σerr",
        "plan MiB",
        "stored MiB",
        "cosine",
        "top-1",
        "top-5",
        "KL",
    )
    body = ['<h2 id="weights">Weights: plans per byte budget</h2>', f"<p>{html.escape(section.summary)}</p>"]
    body.append(_html_table(section.head, section.rows, numeric=numeric))
    for p in section.plots:
        body += _html_figure(p, "h3")
    return body


def _html_page(title: str, body: list[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def write_weights_report(plan: Any, out_path: str | os.PathLike) -> Path:
    """A page of the weights section alone (`opscope weights --report`): .html self-contained, .md with
    its PNGs beside it. `plan`: the plan JSON of `opscope weights --plan`, a path or its dict."""
    section = weights_section(plan)
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix in HTML_SUFFIXES:
        return write_text(
            out,
            _html_page("onnx-opscope weights", ["<h1>onnx-opscope weights</h1>", *_html_weights(section)]),
        )
    if suffix not in MD_SUFFIXES:
        raise OpscopeError(f"{out}: the report is .html or .md, not {suffix or 'no suffix'!r}")
    plot_dir = out.with_name(out.stem + "_files")
    for p in section.plots:
        write_bytes(plot_dir / f"{p.name}.png", p.png)
    return write_text(out, "\n".join(["# onnx-opscope weights", "", *_md_weights(section, plot_dir.name)]))


def render_html(findings: Sequence[Finding], plots: Sequence[Plot], source: str, cfg: MineConfig,
                weights: WeightsSection | None = None) -> str:  # fmt: skip
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
    actions = action_rows(findings)
    if actions[1]:
        body += ["<h2>What to do about it</h2>", _html_table(*actions, numeric=("#",))]
    for p in plots:
        body += _html_figure(p)
    body += _html_weights(weights)
    body += ["<h2>Signals (means over steps)</h2>", _html_table(*signal_rows(findings), numeric=numeric)]
    body += ["<h2>Rules (first match wins)</h2>", _html_table(*rule_rows(cfg))]
    return _html_page(f"onnx-opscope report: {source}", body)


def _inline_code(line: str) -> str:
    """`x` -> <code>x</code>, the rest escaped."""
    parts = line.split("`")
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


# --------------------------------------------------------------------------------------------
# entry point


def report(
    table: TableLike,
    out_path: str | os.PathLike = "report.html",
    *,
    findings: Sequence[Finding] | str | os.PathLike | None = None,
    costs: Any = None,
    config: MineConfig | None = None,
    weights: Any = None,
) -> Path:
    """Write the report for `table` to `out_path` (.html: self-contained; .md: PNGs in `<stem>_files/`).

    `findings`: a list from `mine`, a path to saved findings, or None to mine the table now.
    `costs`: as for `mine`; analyzer records (flops, bytes, intensity) add the roofline plot.
    `weights`: the plan JSON of `opscope weights --plan` (a path or its dict) adds the weights section.
    Findings of another table (run ids, model sha256) or costs of another model are an
    OpscopeError (see `findings.identity`); files that carry no identity give a SourceWarning.
    """
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix not in HTML_SUFFIXES + MD_SUFFIXES:
        raise OpscopeError(f"-o {out}: the report is .html or .md, not {suffix or 'no suffix'!r}")
    cfg = config or MineConfig()
    t, path = read_sketch_table(table)
    cost_info = load_costs(costs, path)
    check_costs(cost_info, path)  # another model's costs: one error line, before anything is written
    weights_part = weights_section(weights) if weights is not None else None
    series = collect(t)
    if findings is None:
        findings = mine_series(series, cost_info, cfg, model=run_record(path).get("model") or "MODEL")
    else:
        origin, source = None, None
        if isinstance(findings, str | os.PathLike):
            origin = findings
            findings, source = read_findings(findings)
        check_findings(findings, source, {s.run_id for s in series}, path, origin)
    plots = make_plots(findings, series, cost_info, cfg)
    source = path.name if path is not None else "<in-memory table>"
    if suffix in HTML_SUFFIXES:
        return write_text(out, render_html(findings, plots, source, cfg, weights_part))
    plot_dir = out.with_name(out.stem + "_files")
    for p in [*plots, *(weights_part.plots if weights_part else [])]:  # each PNG whole, then the page
        write_bytes(plot_dir / f"{p.name}.png", p.png)
    return write_text(out, render_markdown(findings, plots, plot_dir.name, source, cfg, weights_part))
