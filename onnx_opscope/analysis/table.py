"""The terminal view of a cost `Report`: totals, top ops, and every roll-up, with rich.

Numbers are shown with SI prefixes; a cost that still depends on a symbol is shown as its
expression, an unknown one as `?`.
"""

from __future__ import annotations

from typing import IO

from rich.console import Console
from rich.table import Table

from ..shapes.symbolic import to_number, to_text
from .costs import Report, rank_value


def si(x: float | None, unit: str = "") -> str:
    """1234567 -> '1.23 M' (unit appended), 2.5e-7 -> '250 n'; None -> '?'."""
    if x is None:
        return "?"
    scales = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""))
    if unit == "s":
        scales += ((1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))
    for div, prefix in scales:
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}".rstrip()
    return f"{x:.3g} {unit}".rstrip()


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _val(value: float | None, expr: str, unit: str = "", width: int = 28) -> str:
    if value is not None:
        return si(value, unit)
    text = expr or "?"
    return text if len(text) <= width else text[: width - 1] + "…"


def _count(c) -> str:
    return f"{c:g}" if isinstance(c, float) else str(c)


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _ai(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


def _table(title: str, cols: list[str], right: set[str]) -> Table:
    tab = Table(title=title, title_justify="left")
    for col in cols:
        tab.add_column(col, justify="right" if col in right else "left", overflow="fold")
    return tab


def _header(con: Console, report: Report) -> None:
    t, dev = report.totals, report.device
    con.print(
        f"[bold]{report.model}[/bold]: {t['nodes']} nodes ({t['nodes_counted']} counted), "
        f"{si(t['params'])} params, {si(t['weights_unique_bytes'], 'B')} of weights"
    )
    con.print(f"device {dev.name} ({dev.dtype}): ridge {dev.ridge:.1f} FLOP/B — {dev.source}")
    flops = _val(t["flops"], t["flops_expr"], "FLOP", 80)
    nbytes = _val(t["bytes"], t["bytes_expr"], "B", 80)
    extra = f" (+{t['flops_unknown_nodes']} nodes unknown)" if t["flops_unknown_nodes"] else ""
    con.print(f"total {flops}{extra}, {nbytes} moved, intensity {_ai(t['intensity'])} FLOP/B")
    if t.get("symbols"):
        con.print(
            f"[yellow]costs depend on {', '.join(t['symbols'])}[/yellow]: give --dim NAME=VALUE or "
            "--shape NAME:D0,D1,... for numbers"
        )


def _top_ops(report: Report, top: int) -> Table:
    recs = sorted((r for r in report.records if r.counted and r.modelled), key=lambda r: -rank_value(r.flops))
    cols = ["node", "op", "FLOPs", "bytes", "weights", "AI", "class", "est time", "note"]
    tab = _table(
        f"top {min(top, len(recs))} ops by FLOPs", cols, {"FLOPs", "bytes", "weights", "AI", "est time"}
    )
    for r in recs[:top]:
        total = r.bytes_total
        tab.add_row(
            _short(r.node),
            r.op_type,
            _val(to_number(r.flops), to_text(r.flops)),
            _val(to_number(total), to_text(total), "B"),
            _val(to_number(r.bytes_weights), to_text(r.bytes_weights), "B"),
            _ai(r.intensity),
            r.roofline,
            si(r.est_time_s, "s"),
            r.note,
        )
    return tab


def _by_op(report: Report) -> Table:
    cols = ["op", "count", "FLOPs", "FLOP %", "bytes", "byte %", "AI", "class"]
    timed = report.profile is not None
    tab = _table("by op kind", cols + (["time %"] if timed else []), set(cols + ["time %"]) - {"op", "class"})
    for row in report.by_op:
        cells = [
            row["op_type"], str(row["count"]), _val(row["flops"], row["flops_expr"]), _pct(row["flops_share"]),
            _val(row["bytes"], row["bytes_expr"], "B"), _pct(row["bytes_share"]), _ai(row["intensity"]), row["roofline"],
        ]  # fmt: skip
        tab.add_row(*cells, *([_pct(row.get("time_share"))] if timed else []))
    return tab


def _gemms(report: Report, top: int) -> Table:
    cols = ["batch", "M", "K", "N", "count", "FLOPs", "ops"]
    tab = _table("GEMM shapes (batch x M x K x N; convs as implicit GEMM)", cols, set(cols) - {"ops"})
    for e in report.gemm_shapes[:top]:
        tab.add_row(e["batch"], e["M"], e["K"], e["N"], _count(e["count"]), _val(e["flops"], e["flops_expr"]),
                    ",".join(e["op_types"]))  # fmt: skip
    return tab


def _traffic(report: Report) -> Table:
    tr = report.traffic
    cols = ["weights", "graph I/O", "intermediates (fusible)", "unique weights"]
    tab = _table("memory traffic", cols, set(cols))
    tab.add_row(
        f"{_val(tr['weights'], tr['weights_expr'], 'B')} {_pct(tr['weights_share'])}",
        f"{_val(tr['io'], tr['io_expr'], 'B')} {_pct(tr['io_share'])}",
        f"{_val(tr['intermediate'], tr['intermediate_expr'], 'B')} {_pct(tr['intermediate_share'])}",
        si(tr["weights_unique_bytes"], "B"),
    )
    return tab


def _fusion(report: Report) -> Table:
    cols = ["op", "count", "saved", "AI fused", "AI unfused"]
    tab = _table("fused contrib ops: traffic the fusion keeps on chip", cols, set(cols) - {"op"})
    for f in report.fusion:
        tab.add_row(f["op_type"], str(f["count"]), _val(f["saved_bytes"], f["saved_bytes_expr"], "B"),
                    _ai(f["intensity_fused"]), _ai(f["intensity_unfused"]))  # fmt: skip
    return tab


def print_report(
    report: Report, top: int = 15, file: IO[str] | None = None, width: int | None = None
) -> None:
    """Print the report as rich tables to `file` (stdout by default)."""
    con = Console(file=file, highlight=False)
    if width or not con.is_terminal:
        con.width = width or 150  # a pipe or file: wide enough for every column
    _header(con, report)
    con.print(_top_ops(report, top))
    con.print(_by_op(report))
    if report.gemm_shapes:
        con.print(_gemms(report, top))
    con.print(_traffic(report))
    if report.boundedness:
        parts = [
            f"{c} {_pct(v['share']) or _val(v['flops'], v['flops_expr'])}"
            for c, v in report.boundedness.items()
        ]
        con.print("FLOP share by boundedness: " + ", ".join(parts))
    if report.fusion:
        con.print(_fusion(report))
    if report.unmodelled:
        con.print(
            "unmodelled (FLOPs not counted): " + ", ".join(f"{k} x{v}" for k, v in report.unmodelled.items())
        )
    for note in report.notes[:top]:
        con.print(f"note: {note}")
    if len(report.notes) > top:
        con.print(f"note: ...and {len(report.notes) - top} more (all in --format json)")
    con.print("shapes: " + "; ".join(f"{k} {v}" for k, v in report.shape_sources.items()))
