"""The terminal view of a `NodeProfile`: the measured roofline, time against cost per op kind and
region, the top nodes with their verdicts, and the region times of the skip rewrite."""

from __future__ import annotations

from collections import Counter
from typing import IO

from rich.console import Console

from .profile import BANDWIDTH_BOUND, NodeProfile
from .table import _pct, _short, _table, si


def print_profile(
    prof: NodeProfile, top: int = 15, file: IO[str] | None = None, width: int | None = None
) -> None:
    """Print the measured profile as rich tables to `file` (stdout by default)."""
    con = Console(file=file, highlight=False)
    if width or not con.is_terminal:
        con.width = width or 150
    m = prof.measured
    threads = "default" if prof.threads is None else prof.threads
    con.print(
        f"[bold]measured[/bold] on {', '.join(prof.providers)} (opt level {prof.opt_level}, threads {threads}), "
        f"feeds {', '.join(f'{k}{v}' for k, v in prof.feeds.items())}: {si(prof.wall_s, 's')} per run, "
        f"{si(prof.kernel_s, 's')} in kernels"
    )
    con.print(
        f"measured roofline: {si(m.bandwidth, 'B/s')}, {si(m.peak_flops, 'FLOP/s')}, ridge "
        f"{m.ridge:.3g} FLOP/B ({m.source})"
    )
    fused = sum(1 for k in prof.kernels if k.how == "fused")
    inserted = sum(1 for k in prof.kernels if k.inserted)
    con.print(
        f"{len(prof.kernels)} kernels: {fused} fused (stand for several nodes), {inserted} inserted by "
        f"onnxruntime (charged to the node they serve), {sum(1 for k in prof.kernels if not k.nodes)} unmapped"
    )
    cols = ["", "nodes", "time", "time %", "FLOP %", "byte %"]
    for title, rows in (
        ("measured time by op kind", prof.by_op()),
        ("measured time by region", prof.by_region()),
    ):
        tab = _table(title, cols, set(cols) - {""})
        for r in rows[:top]:
            if r["time_s"] or r["flops"]:
                tab.add_row(
                    r["name"],
                    str(r["nodes"]),
                    si(r["time_s"], "s"),
                    _pct(r["time_share"]),
                    _pct(r["flops_share"]),
                    _pct(r["bytes_share"]),
                )
        con.print(tab)
    cols = ["node", "op", "time", "FLOP/s", "B/s", "AI", "verdict", "kernels"]
    tab = _table(f"top {top} nodes by measured time", cols, {"time", "FLOP/s", "B/s", "AI"})
    for n in sorted(prof.nodes, key=lambda n: -n.time_s)[:top]:
        tab.add_row(
            _short(n.node),
            n.op_type,
            si(n.time_s, "s"),
            si(n.flops_per_s),
            si(n.bytes_per_s),
            "?" if n.intensity is None else f"{n.intensity:.3g}",
            n.verdict,
            _kernels(n.kernels),
        )
    con.print(tab)
    verdicts = Counter(n.verdict for n in prof.nodes if n.time_s)
    con.print(
        "verdicts of the nodes that ran: "
        + ", ".join(f"{v} {c}" for v, c in verdicts.most_common())
        + f" (bandwidth-bound: >= {BANDWIDTH_BOUND:.0%} of the measured bandwidth; compute-bound: intensity > ridge)"
    )
    if prof.regions:
        r = prof.regions
        con.print(
            f"regions by the skip rewrite (best of {r.repeats}; {r.attention_blocks} attention, {r.mlp_blocks} "
            f"MLP blocks): model {si(r.full_s, 's')}, attention {si(r.attention_s, 's')} "
            f"{_pct(r.attention_s / r.full_s)}, MLP {si(r.mlp_s, 's')} {_pct(r.mlp_s / r.full_s)}, other "
            f"{si(r.other_s, 's')} {_pct(r.other_s / r.full_s)}, slack {si(r.slack_s, 's')} "
            f"{_pct(r.slack_s / r.full_s)}"
        )
    for note in prof.notes:
        con.print(f"note: {note}")


def _kernels(names: tuple[str, ...]) -> str:
    """The kernels a node's time comes from: the first, and how many more (layout reorders, ...)."""
    if not names:
        return ""
    return _short(names[0], 30) + (f" +{len(names) - 1}" if len(names) > 1 else "")
