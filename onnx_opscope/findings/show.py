"""Findings in the terminal: a ranked rich table, and the commands that act on them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO

from .finding import Finding, Temporal
from .rules import DENSE_NOTE


def _x(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}x" if v >= 100 else f"{v:.2g}x" if v < 10 else f"{v:.1f}x")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def temporal_text(t: Temporal | None) -> str:
    """One short cell for a finding's across-steps verdict."""
    if t is None:
        return "-"
    if t.rule == "memoize":
        return f"memoize (repeat {_pct(t.repeat_share)})"
    if t.rule == "delta":
        return f"delta-compute (drift {t.drift:.3g})"
    if t.rule == "stationary":
        return "precompute / prepack (stationary)"
    return "drifting"


def shown_findings(
    findings: Sequence[Finding], top: int | None = None, show_all: bool = False
) -> tuple[list[Finding], int]:
    """(the findings to list, in rank order, how many non-actionable ones were left out): dense, too
    small and 'none: ...' rows are hidden unless `show_all`; `top` cuts what is left."""
    kept = [f for f in findings if show_all or f.actionable]
    return (kept[:top] if top else kept), len(findings) - len(kept)


def measure_notes(findings: Sequence[Finding]) -> list[str]:
    """The distinct reasons measurements are missing ('not measured: scipy is not installed ...')."""
    notes = [
        f.measure_note
        for f in findings
        if f.measured_speedup is None and f.measure_note.startswith("not measured")
    ]
    return list(dict.fromkeys(notes))


def print_findings(
    findings: Sequence[Finding], top: int | None = None, file: IO[str] | None = None, show_all: bool = False
) -> None:
    """A ranked rich table in the terminal (or `file`): the actionable findings by impact (`miner.rank`),
    a one-line count of the hidden ones, and the commands that act on them."""
    from rich.console import Console
    from rich.table import Table

    shown, hidden = shown_findings(findings, top, show_all)
    multi = len({(f.run_id, f.provider, f.dist) for f in findings}) > 1
    ranked_by = "impact (score x FLOP share)" if any(f.impact is not None for f in shown) else "score"
    title = f"findings: {len(shown)} of {len(findings)}, ranked by {ranked_by}"
    table = Table(title=title, title_justify="left")
    cols = ["#", "site", "role"] + (["dist"] if multi else [])
    cols += ["exploit", "impact", "score", "guard", "stability", "est", "meas", "across steps", "saves"]
    for name in cols:
        right = name in ("#", "impact", "score", "est", "meas", "saves")
        table.add_column(name, justify="right" if right else "left", overflow="fold")
    for i, f in enumerate(shown, 1):
        t = f.temporal
        stab = f.stability + (f" σ={f.stability_sigma:.2g}" if f.stability_sigma is not None else "")
        impact = "-" if f.impact is None else f"{f.impact:.3f}"
        row = [str(i), f.site, f.role] + ([f.dist] if multi else [])
        row += [f.exploit, impact, f"{f.rank_score:.2f}", f.guard or "-", stab, _x(f.est_speedup),
                _x(f.measured_speedup), temporal_text(t), _pct(f.saves)]  # fmt: skip
        table.add_row(*row)
    console = Console(file=file)
    if not console.is_terminal:
        console.width = 180
    console.print(table)
    if hidden:
        console.print(
            f"{hidden} finding(s) hidden: dense, too small to judge or nothing to do (--all shows them)"
        )
    if any(f.rule == "dense" for f in shown):
        console.print(f"dense: {DENSE_NOTE}.")
    for note in measure_notes(shown):
        console.print(f"meas: {note}", highlight=False, markup=False)  # "[measure]" is not a style
    actions = [(i, f) for i, f in enumerate(shown, 1) if f.action]
    for i, f in actions:
        checked = ""
        if f.validation is not None:
            v = f.validation
            top1 = "" if v.get("top1") is None else f", top-1 {v['top1']:.1%}"
            checked = f"  ({'validated' if v['passed'] else 'NOT validated'}: cosine {v.get('cosine', float('nan')):.6f}{top1})"
        console.print(f"#{i} {f.site}: {f.action}{checked}", soft_wrap=True, highlight=False, markup=False)
