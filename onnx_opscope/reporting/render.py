"""The report: what to do next, the ranked findings, the commands that act on them, signals and plots.

The page is written for someone deciding what to do next: a summary at the top (the three
actions with the largest estimated saving, each with the command that checks or applies it,
`findings.actions`), the findings in `miner.rank` order with the non-actionable ones counted
in one line (`show_all` lists them), sections for attention, experts and residual blocks when
the table has such sites (and a Decoder section for a `generate` table, `decoder`), then the plots
and the details. One list of blocks is laid out as
Markdown or HTML, so both say the same. The HTML embeds the plots (`plots`) as base64 data
URIs and carries its CSS inline, so the file opens offline and fetches nothing; the Markdown
links them from a `<stem>_files/` folder beside it.

The roofline needs per-op FLOPs and bytes. When the costs given are symbolic (an `analyze`
without `--dim`) or absent, they are evaluated at the shapes the recording used: the model and
feeds of the table's `.run.json`, analyzed again at batch 0's shapes, else the GEMM shapes of
its `.sites.csv`. When none of these is at hand the report says why in one line.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..analysis.roofline import Device, get_device
from ..errors import OpscopeError
from ..files import write_bytes, write_text
from ..findings import (
    RULES,
    Costs,
    Finding,
    MineConfig,
    check_costs,
    check_findings,
    collect,
    feed_flags,
    findings_line,
    fix_first,
    load_costs,
    measure_notes,
    mine_series,
    next_steps,
    rank,
    read_findings,
    shown_findings,
    step_phases,
    temporal_text,
    top_actions,
    unchecked_rules,
)
from ..findings.actions import acts_per_batch
from ..findings.miner import run_record
from ..findings.rules import DENSE_NOTE
from ..findings.series import TableLike, read_sketch_table
from ..run.feeds import FeedSpec
from ..run.table import sidecar_paths
from .decoder import NUMERIC as DECODER_NUMERIC
from .decoder import DecoderSection, decoder_section
from .plots import Missing, Plot, Roofline, make_plots, multi_run
from .weights import WeightsSection, weights_section

HTML_SUFFIXES = (".html", ".htm")
MD_SUFFIXES = (".md", ".markdown")
TOP_ACTIONS = 3
FP32 = 4  # bytes per element when only GEMM dims are known (the table has no dtype)


# --------------------------------------------------------------------------------------------
# the page as blocks, laid out by `_markdown` and `_html`


@dataclass
class Heading:
    text: str
    anchor: str
    level: int = 2


@dataclass
class Para:
    text: str  # `code` spans are code in both layouts
    note: bool = False  # a one-line remark (a plot not drawn, a count), set smaller


@dataclass
class Table:
    head: list[str]
    rows: list[list[str]]
    numeric: Sequence[str] = ()


@dataclass
class Action:
    title: str
    detail: str
    steps: list[tuple[str, str]] = field(default_factory=list)  # (what, command)


@dataclass
class Actions:
    items: list[Action]


@dataclass
class Figure:
    plot: Plot


Block = Heading | Para | Table | Actions | Figure


# --------------------------------------------------------------------------------------------
# text


def _num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


NUMERIC = ("#", "impact", "score", "saves", "FLOP share", "est", "measured", "M", "K", "N", "steps", "density",
           "outlier", "histtop", "hist_gaps", "pos_cv", "adj", "kurtosis", "nonfinite", "l1 cv", "repeat", "drift",
           "mean peak", "sink share", "keys", "experts", "busiest share", "x uniform", "gap")  # fmt: skip


def findings_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the ranked findings table: the order follows `impact` (`miner.rank`)."""
    multi = multi_run(findings)
    head = ["#", "site", "op", "role"] + (["dist"] if multi else [])
    head += ["exploit", "impact", "score", "saves", "FLOP share", "est", "measured", "across steps", "condition",
             "guard", "stability"]  # fmt: skip
    rows = []
    for i, f in enumerate(findings, 1):
        t = f.temporal
        est = f.est_speedup if f.est_speedup is not None else (t.est_speedup if t else None)
        meas = f.measured_speedup if f.measured_speedup is not None else (t.measured_speedup if t else None)
        stab = f.stability + (f" (σ {f.stability_sigma:.2g})" if f.stability_sigma is not None else "")
        row = [str(i), f.site, f.op_type, f.role] + ([f.dist] if multi else [])
        row += [_exploit(f), _num(f.impact), f"{f.rank_score:.2f}", _pct(f.saves), _pct(f.flop_share), _x(est),
                _x(meas), temporal_text(t), f.condition, f.guard or "-", stab]  # fmt: skip
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
    rows.append(
        [
            "size",
            "small",
            f"numel < {cfg.numel_min:g}",
            "none: too few elements to judge (NaN/Inf still fire)",
        ]
    )
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


def _validation(v: dict | None) -> str:
    if v is None:
        return "-"
    top1 = "" if v.get("top1") is None else f", top-1 {v['top1']:.1%}"
    return f"{'passed' if v['passed'] else 'failed'}: cosine {v.get('cosine', float('nan')):.6f}{top1}"


@dataclass
class Context:
    """What the commands of the report name: the recorded model, the table, the recorded feeds."""

    model: str = "MODEL"
    table: str = "TABLE"
    feeds: list[str] = field(default_factory=list)
    multi: bool = False  # several runs in the table: findings name their dist

    def steps(self, f: Finding) -> list[tuple[str, str]]:
        return [(s.what, s.command) for s in next_steps(f, self.model, self.table, self.feeds)]


def action_rows(findings: Sequence[Finding], ctx: Context) -> tuple[list[str], list[list[str]]]:
    """Every command that acts on a listed finding, once, with the findings (by rank) it checks or applies."""
    by_cmd: dict[str, tuple[str, list[str]]] = {}
    for i, f in enumerate(findings, 1):
        checked = "" if f.validation is None else f" ({_validation(f.validation)})"
        for what, cmd in ctx.steps(f):
            by_cmd.setdefault(cmd, (what, []))[1].append(f"#{i} {f.site} ({f.role}, {f.rule}){checked}")
    rows = [[what, cmd, "; ".join(who)] for cmd, (what, who) in by_cmd.items()]
    return ["step", "command", "for the findings"], rows


def _worth(f: Finding) -> str:
    """What a finding is worth, in words: the saving, else why there is none, and the impact behind its rank."""
    if f.saves is not None:
        worth = f"saves ~{_pct(f.saves)} of the model's FLOPs"
    elif f.rule in ("outlier", "heavy_tail", "levels", "concentrated"):
        worth = "no FLOP saving: int8 / LUT saves bytes and cycles per FLOP"
    elif f.flop_share is None:
        worth = "saving unknown: no FLOPs known for this site"
    else:
        worth = "saving not estimable from sketches"
    est = f.est_speedup if f.est_speedup is not None else (f.temporal.est_speedup if f.temporal else None)
    if est is not None:
        worth += f"; est {_x(est)} at the site"
    if f.impact is not None:
        worth += f"; impact {f.impact:.3g} = score {f.rank_score:.2f} x {_pct(f.flop_share)} of FLOPs"
    else:
        worth += f"; score {f.rank_score:.2f}"
    return worth


def _exploit(f: Finding) -> str:
    """The exploit that makes the finding actionable: the per-batch one, else the across-steps one."""
    if acts_per_batch(f) or f.temporal is None:
        return f.exploit
    return f"{f.temporal.exploit} (across steps)"


def _action(f: Finding, ctx: Context) -> Action:
    steps = ctx.steps(f)
    detail = _worth(f)
    if not steps:
        detail += "; no opscope command for it: apply it in the runtime or kernel"
    if f.validation is not None:
        detail += f"; validation {_validation(f.validation)}"
    where = f"{f.role}, dist {f.dist}" if ctx.multi else f.role
    return Action(f"`{f.site}` ({where}): {_exploit(f)}", detail, steps)


def summary_blocks(findings: Sequence[Finding], ctx: Context, unchecked: dict[str, list[str]]) -> list[Block]:
    """The top of the page: NaN/Inf first, the three largest estimated savings with their commands, or
    why there is nothing to do; then the counts per rule."""
    out: list[Block] = [Heading("Summary: what to do next", "summary")]
    nonfinite = fix_first(findings)
    if nonfinite:
        out.append(
            Para(f"Fix first: {len(nonfinite)} tensor(s) hold NaN or Inf; every other number is suspect.")
        )
        out.append(Actions([_action(f, ctx) for f in nonfinite]))
    top = top_actions(findings, TOP_ACTIONS)
    if top:
        out.append(Para(f"The {len(top)} action(s) with the largest estimated saving (then impact):"))
        out.append(Actions([_action(f, ctx) for f in top]))
    elif not nonfinite:
        out.append(Para(f"Nothing to act on: none of the {len(findings)} tapped tensors shows an exploitable "
                        f"pattern (dense, too small to judge, or drifting across steps); {DENSE_NOTE}."))  # fmt: skip
    line = findings_line(findings)
    out.append(Para(line[:1].upper() + line[1:] + "."))
    if unchecked:
        need = sorted({s for m in unchecked.values() for s in m})
        out.append(Para(f"Not checked: {', '.join(unchecked)} (not recorded: {', '.join(need)}); record with "
                        "`--sketch all` to check them.", note=True))  # fmt: skip
    return out


def attention_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for f in findings:
        s = f.signals
        rows.append([f.site, f.rule, _num(s.get("mean_peak")), "-" if s.get("sink_key") is None else str(s["sink_key"]),
                     _pct(s.get("sink_share")), _num(s.get("keys")), f.exploit, f.stability])  # fmt: skip
    return ["site", "verdict", "mean peak", "busiest key", "sink share", "keys", "exploit", "stability"], rows


def routing_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for f in findings:
        s = f.signals
        shares, hot = s.get("load_share") or [], s.get("hot")
        busiest = _pct(shares[hot]) if hot is not None and hot < len(shares) else "-"
        cold = ", ".join(map(str, s.get("cold") or [])) or "-"
        rows.append([f.site, f.rule, _num(s.get("experts")), "-" if hot is None else str(hot), busiest,
                     _num(s.get("imbalance")), cold, f.exploit])  # fmt: skip
    return [
        "site",
        "verdict",
        "experts",
        "busiest",
        "busiest share",
        "x uniform",
        "cold experts",
        "exploit",
    ], rows


def residual_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for f in findings:
        s = f.signals
        rows.append([f.site, f.rule, _num(s.get("gap")), _num(s.get("sumsq_a")), _num(s.get("sumsq_b")),
                     _validation(f.validation), f.action or "-"])  # fmt: skip
    return ["site", "verdict", "gap", "Σa² (kept)", "Σb²", "validation", "command"], rows


KIND_SECTIONS = (
    ("attn", "Attention", "attention", attention_rows,
     "Mean attn_qmax is the mass a query puts on its top key, averaged over queries; a key receiving a large "
     "share of all the mass (attn_krecv) is a sink."),
    ("route", "Experts (routing)", "experts", routing_rows,
     "The routed load per expert over every step; cold experts are drop / merge candidates, a hot one is worth "
     "pinning."),
    ("residual", "Residual blocks", "residual", residual_rows,
     "gap = sqrt(min(Σa², Σb²) / max(Σa², Σb²)) of the residual Add's inputs: a small gap means the block "
     "barely moves its input; `opscope mine TABLE --validate` scores the skip end to end."),
)  # fmt: skip


def kind_blocks(findings: Sequence[Finding]) -> list[Block]:
    """A section per inference site kind the table has (every site of the kind, actionable or not)."""
    out: list[Block] = []
    for kind, title, anchor, rows, note in KIND_SECTIONS:
        mine = [f for f in findings if f.kind == kind]
        if mine:
            out += [Heading(title, anchor), Para(note), Table(*rows(mine), numeric=NUMERIC)]
    return out


def decoder_blocks(section: DecoderSection | None) -> list[Block]:
    """The Decoder section of a `generate` table (`reporting.decoder`): a table per kind, then its plot."""
    if section is None:
        return []
    out: list[Block] = [Heading("Decoder", "decoder"), Para(section.summary)]
    for part in section.parts:
        out += [Heading(part.title, part.anchor, 3), Para(part.note)]
        out.append(Table(part.head, part.rows, DECODER_NUMERIC))
    p = section.plot
    if isinstance(p, Plot):
        return [*out, Heading(p.title, p.name, 3), Figure(p)]
    return [*out, Para(f"{p.title}: not drawn, {p.reason}.", note=True)]


def page_blocks(findings: Sequence[Finding], shown: Sequence[Finding], hidden: int, ctx: Context,
                plots: Sequence[Plot | Missing], source: str, unchecked: dict[str, list[str]],
                decoder: DecoderSection | None = None) -> list[Block]:  # fmt: skip
    """Everything but the weights section, in page order."""
    runs = sorted({(f.run_id, f.provider, f.dist, f.steps) for f in findings})
    meta = [f"Table `{source}`: {len(findings)} tapped tensors (site, role)."]
    meta += [f"Run `{r}` on `{p}`, data `{d}`, {n} step(s)." for r, p, d, n in runs[:12]]
    out: list[Block] = [Para(" ".join(meta), note=True), *summary_blocks(findings, ctx, unchecked)]
    by = (
        "impact = score x the site's share of the model's FLOPs"
        if any(f.impact is not None for f in shown)
        else "score"
    )
    out += [Heading("Findings (best first)", "findings"),
            Para(f"Ranked by {by}; NaN/Inf first, sites of unknown FLOPs after, by score. 'saves' is the estimated "
                 "saving as a share of the model's FLOPs.")]  # fmt: skip
    out.append(Table(*findings_rows(shown), numeric=NUMERIC) if shown else Para("No actionable finding."))
    if hidden:
        out.append(Para(f"{hidden} finding(s) hidden: dense, too small to judge or nothing to do "
                        "(`opscope report --all` lists them).", note=True))  # fmt: skip
    out += [Para(f"measured: {n}", note=True) for n in measure_notes(shown)]
    out += kind_blocks(findings)
    out += decoder_blocks(decoder)
    actions = action_rows(shown, ctx)
    if actions[1]:
        out += [Heading("What to do about it", "actions"),
                Para("Every command that checks or applies a listed finding, on the recorded feeds. The fake-quant "
                     "and calibrate commands act on every MatMul / Gemm input of the model at once."),
                Table(*actions)]  # fmt: skip
    for p in plots:
        if isinstance(p, Plot):
            out += [Heading(p.title, p.name), Figure(p)]
        else:
            out.append(Para(f"{p.title}: not drawn, {p.reason}.", note=True))
    gemm = [f for f in shown if f.kind == "gemm"]
    if gemm:
        out += [Heading("Signals (means over steps)", "signals"), Table(*signal_rows(gemm), numeric=NUMERIC)]
    return out


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


def _md_block(b: Block, plot_dir: str) -> list[str]:
    if isinstance(b, Heading):
        return ["#" * b.level + " " + b.text, ""]
    if isinstance(b, Para):
        return [f"*{b.text}*" if b.note else b.text, ""]
    if isinstance(b, Table):
        return [_md_table(b.head, b.rows), ""]
    if isinstance(b, Actions):
        out = []
        for i, a in enumerate(b.items, 1):
            out.append(f"{i}. **{a.title}**  \n   {a.detail}")
            out += [f"   - {what}: `{cmd}`" for what, cmd in a.steps]
        return [*out, ""]
    p = b.plot
    return [f"![{p.title}]({plot_dir}/{p.name}.png)", "", p.caption, ""]


def render_markdown(blocks: Sequence[Block], plot_dir: str, cfg: MineConfig,
                    weights: WeightsSection | None = None) -> str:  # fmt: skip
    parts = ["# onnx-opscope report", ""]
    for b in blocks:
        parts += _md_block(b, plot_dir)
    parts += _md_weights(weights, plot_dir)
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
figcaption{font-size:13px;color:#555;max-width:900px}
code{background:#f4f4f4;padding:0 3px}
p.note{font-size:13px;color:#555}
nav{font-size:13px}nav a{margin-right:1em}
ol.actions{background:#f7faff;border:1px solid #cfe0f5;padding:0.8em 0.8em 0.8em 2.4em;max-width:1100px}
ol.actions li{margin:0.4em 0}ol.actions .detail{color:#444;font-size:14px}
ol.actions pre{margin:0.2em 0;background:#eef3f9;padding:3px 6px;white-space:pre-wrap;word-break:break-all}
ol.actions .what{display:inline-block;min-width:4em;color:#555;font-size:12px}
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


def _inline_code(line: str) -> str:
    """`x` -> <code>x</code>, the rest escaped."""
    parts = line.split("`")
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


def _html_block(b: Block) -> list[str]:
    if isinstance(b, Heading):
        return [f'<h{b.level} id="{b.anchor}">{html.escape(b.text)}</h{b.level}>']
    if isinstance(b, Para):
        tag = '<p class="note">' if b.note else "<p>"
        return [f"{tag}{_inline_code(b.text)}</p>"]
    if isinstance(b, Table):
        return [_html_table(b.head, b.rows, numeric=b.numeric)]
    if isinstance(b, Actions):
        out = ['<ol class="actions">']
        for a in b.items:
            steps = "".join(
                f'<pre><span class="what">{html.escape(w)}</span>{html.escape(c)}</pre>' for w, c in a.steps
            )
            out.append(f'<li><b>{_inline_code(a.title)}</b><br><span class="detail">{_inline_code(a.detail)}</span>'
                       f"{steps}</li>")  # fmt: skip
        return [*out, "</ol>"]
    return _html_figure(b.plot)[1:]


def render_html(
    blocks: Sequence[Block], source: str, cfg: MineConfig, weights: WeightsSection | None = None
) -> str:
    """One self-contained page: inline CSS, PNGs as data URIs, no script, no external reference."""
    heads = [b for b in blocks if isinstance(b, Heading) and b.level == 2]
    heads += [Heading("Weights", "weights")] if weights is not None else []
    heads.append(Heading("Rules", "rules"))
    nav = "<nav>" + "".join(f'<a href="#{h.anchor}">{html.escape(h.text)}</a>' for h in heads) + "</nav>"
    body = ["<h1>onnx-opscope report</h1>", nav]
    for b in blocks:
        body += _html_block(b)
    body += _html_weights(weights)
    body += ['<h2 id="rules">Rules (first match wins)</h2>', _html_table(*rule_rows(cfg))]
    return _html_page(f"onnx-opscope report: {source}", body)


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


# --------------------------------------------------------------------------------------------
# the roofline's costs


def _numeric(records: Sequence[dict]) -> bool:
    """Whether the records price ops in numbers: some op has FLOPs and bytes, and none is still symbolic."""
    symbolic = any(r.get("flops") is None and str(r.get("flops_expr") or "").strip() for r in records)
    return not symbolic and any(_pos(r.get("flops")) and _pos(r.get("bytes")) for r in records)


def _pos(v: Any) -> bool:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return False
    return math.isfinite(x) and x > 0


def cost_device(costs: Any, cost_info: Costs, name: str | None = None) -> Device:
    """The device of the roofline: `name` when given, else the one the costs were analyzed for (an
    analyzer Report, or the `device` block of its JSON), else the CPU preset."""
    if name is not None:
        return get_device(name)
    if hasattr(costs, "device") and isinstance(costs.device, Device):
        return costs.device
    if isinstance(costs, str | os.PathLike) and str(costs).lower().endswith(".json"):
        try:
            d = json.loads(Path(costs).read_text()).get("device") or {}
            return Device(d["name"], float(d["peak_flops"]), float(d["bandwidth"]), d.get("dtype", ""),
                          d.get("source", ""))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    return get_device("cpu", cost_info.ridge)


def _recorded_shapes(model: str, feeds: dict) -> dict[str, list[int]]:
    """The input shapes of batch 0 of the recording (`.run.json` feeds), as `record` made or read them."""
    from ..run.feeds import iter_feeds

    spec = {k: v for k, v in feeds.items() if k in {f.name for f in fields(FeedSpec)}}
    spec["ranges"] = {k: tuple(v) for k, v in (spec.get("ranges") or {}).items()}
    batch = next(iter(iter_feeds(model, FeedSpec(**spec), batches=1)))
    return {k: list(v.shape) for k, v in batch.items()}


def _sidecar_records(table_path: Path | None) -> list[dict]:
    """GEMM sites of the table's `.sites.csv` (M, K, N, FLOPs at run time) as roofline records, fp32
    operands read once and the result written once."""
    import pyarrow.csv as pacsv

    if table_path is None or not sidecar_paths(table_path)[0].is_file():
        return []
    try:
        rows = pacsv.read_csv(sidecar_paths(table_path)[0]).to_pylist()
    except (OSError, ValueError):
        return []
    out = []
    for r in rows:
        m, k, n = r.get("M"), r.get("K"), r.get("N")
        if _pos(r.get("flops")) and all(_pos(v) for v in (m, k, n)):
            nbytes = FP32 * (m * k + k * n + m * n)
            out.append({"node": r["site"], "op_type": r.get("op_type"), "flops": r["flops"], "bytes": nbytes})
    return out


def roofline_costs(costs: Any, cost_info: Costs, table_path: Path | None, run: dict,
                   device: str | None = None) -> Roofline | str:  # fmt: skip
    """What the roofline is drawn from (see the module docstring), or the one-line reason it cannot be."""
    from ..analysis import analyze
    from ..graph.io import file_sha256

    dev = cost_device(costs, cost_info, device)
    if _numeric(cost_info.ops):
        return Roofline(dev, cost_info.ops, "the analyzed shapes")
    why = "the costs given are symbolic" if cost_info.ops else "no per-op costs were given"
    model, feeds = run.get("model"), run.get("feeds")
    tried = ""
    if model and feeds is not None and Path(model).is_file():
        if run.get("model_sha256") and file_sha256(model) != run["model_sha256"]:
            tried = f"; {Path(model).name} changed since it was recorded"
        else:
            try:
                shapes = _recorded_shapes(model, feeds)
                records = analyze(model, shapes=shapes).to_records()
            except (OpscopeError, OSError, ValueError) as exc:  # the report still comes out, saying why
                records, tried = [], f"; analyzing {Path(model).name} at the recorded shapes failed: {exc}"
            if _numeric(records):
                shown = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in list(shapes.items())[:4])
                return Roofline(
                    dev, [r for r in records if r.get("counted", True)], f"the recorded shapes ({shown})"
                )
            tried = tried or f"; {Path(model).name} at the recorded shapes still has symbolic costs"
    records = _sidecar_records(table_path)
    if records:
        return Roofline(dev, records, "the recorded GEMM shapes of the .sites.csv (fp32 operands)")
    return (f"{why}, and there is neither the recorded model to analyze at the recorded shapes nor a "
            f"GEMM site in the table's .sites.csv{tried}")  # fmt: skip


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
    show_all: bool = False,
    device: str | None = None,
) -> Path:
    """Write the report for `table` to `out_path` (.html: self-contained; .md: PNGs in `<stem>_files/`).

    `findings`: a list from `mine`, a path to saved findings, or None to mine the table now.
    `costs`: as for `mine`; analyzer records (flops, bytes) give the roofline, evaluated at the
    recorded shapes when they are symbolic or absent. `weights`: the plan JSON of `opscope weights
    --plan` (a path or its dict) adds the weights section. `show_all` lists the non-actionable
    findings too; `device` names the roofline's device preset (default: the costs', else cpu).
    Findings of another table (run ids, model sha256) or costs of another model are an
    OpscopeError (see `findings.identity`); files that carry no identity give a SourceWarning.
    """
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix not in HTML_SUFFIXES + MD_SUFFIXES:
        raise OpscopeError(f"-o {out}: the report is .html or .md, not {suffix or 'no suffix'!r}")
    cfg = config or MineConfig()
    if device is not None:
        get_device(device)  # an unknown device is one error line before any work
    t, path = read_sketch_table(table)
    cost_info = load_costs(costs, path)
    check_costs(cost_info, path)  # another model's costs: one error line, before anything is written
    weights_part = weights_section(weights) if weights is not None else None
    series = collect(t)
    run = run_record(path)
    ctx = Context(
        run.get("model") or "MODEL", str(path) if path is not None else "TABLE", feed_flags(run.get("feeds"))
    )
    phases = step_phases(t)  # a `generate` table: the decoder findings, and the Decoder section
    if findings is None:
        findings = mine_series(series, cost_info, cfg, model=ctx.model, phases=phases)
    else:
        origin, source = None, None
        if isinstance(findings, str | os.PathLike):
            origin = findings
            findings, source = read_findings(findings)
        check_findings(findings, source, {s.run_id for s in series}, path, origin)
    findings = rank(list(findings))  # saved findings too: the page follows the miner's order
    ctx.multi = multi_run(findings)
    shown, hidden = shown_findings(findings, None, show_all)
    roof = roofline_costs(costs, cost_info, path, run, device)
    plots = make_plots(findings, series, cfg, roof, shown)
    source = path.name if path is not None else "<in-memory table>"
    decoder = decoder_section(findings, series, phases)
    blocks = page_blocks(findings, shown, hidden, ctx, plots, source, unchecked_rules(t), decoder)
    if suffix in HTML_SUFFIXES:
        return write_text(out, render_html(blocks, source, cfg, weights_part))
    plot_dir = out.with_name(out.stem + "_files")
    drawn = [p for p in [*plots, decoder and decoder.plot] if isinstance(p, Plot)]
    for p in [*drawn, *(weights_part.plots if weights_part else [])]:  # each PNG whole, then the page
        write_bytes(plot_dir / f"{p.name}.png", p.png)
    return write_text(out, render_markdown(blocks, plot_dir.name, cfg, weights_part))
