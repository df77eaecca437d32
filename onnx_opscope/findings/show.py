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


def print_findings(findings: Sequence[Finding], top: int | None = None, file: IO[str] | None = None) -> None:
    """A ranked rich table in the terminal (or `file`)."""
    from rich.console import Console
    from rich.table import Table

    shown = list(findings)[:top] if top else list(findings)
    multi = len({(f.run_id, f.provider, f.dist) for f in findings}) > 1
    table = Table(title=f"findings: {len(shown)} of {len(findings)}, best first", title_justify="left")
    cols = ["#", "site", "role"] + (["dist"] if multi else [])
    cols += ["exploit", "score", "guard", "stability", "est", "meas", "across steps", "saves"]
    for name in cols:
        right = name in ("#", "score", "est", "meas", "saves")
        table.add_column(name, justify="right" if right else "left", overflow="fold")
    for i, f in enumerate(shown, 1):
        t = f.temporal
        saves = f.savings if f.savings is not None else (t.savings if t else None)
        stab = f.stability + (f" σ={f.stability_sigma:.2g}" if f.stability_sigma is not None else "")
        row = [str(i), f.site, f.role] + ([f.dist] if multi else [])
        row += [f.exploit, f"{f.score:.2f}", f.guard or "-", stab, _x(f.est_speedup), _x(f.measured_speedup),
                temporal_text(t), _pct(saves)]  # fmt: skip
        table.add_row(*row)
    console = Console(file=file)
    if not console.is_terminal:
        console.width = 180
    console.print(table)
    if any(f.rule == "dense" for f in shown):
        console.print(f"dense: {DENSE_NOTE}.")
    actions = [(i, f) for i, f in enumerate(shown, 1) if f.action]
    for i, f in actions:
        checked = ""
        if f.validation is not None:
            v = f.validation
            top1 = "" if v.get("top1") is None else f", top-1 {v['top1']:.1%}"
            checked = f"  ({'validated' if v['passed'] else 'NOT validated'}: cosine {v.get('cosine', float('nan')):.6f}{top1})"
        console.print(f"#{i} {f.site}: {f.action}{checked}", soft_wrap=True, highlight=False)
