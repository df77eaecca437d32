"""The weights section: every layer's options as error against bytes, and the allocators' frontier.

Read from the JSON `opscope weights --plan` writes (`run.weights.WeightPlans.to_dict`): its
`menus` (each layer's options), `frontier` (per budget: both allocators, the plan kept, what it
stores and its end-to-end check) and `layers` (the chosen plan).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OpscopeError
from .plots import Plot, _figure, _png

KIND_COLOURS = {
    "dense": "#7f7f7f", "int8_channel": "#1f77b4", "int8_group": "#aec7e8", "int4_channel": "#ff7f0e",
    "int4_group": "#ffbb78", "ternary": "#d62728", "sparse_2_4": "#2ca02c", "lowrank": "#9467bd",
    "monarch": "#8c564b", "tucker": "#e377c2", "tt": "#17becf",
}  # fmt: skip


@dataclass
class WeightsSection:
    head: list[str]
    rows: list[list[str]]
    plots: list[Plot]
    summary: str


def load_plan_doc(plan: Any) -> dict:
    """A plan document: a dict, or the path of the JSON `opscope weights --plan` wrote."""
    if isinstance(plan, dict):
        doc = plan
    else:
        try:
            doc = json.loads(Path(plan).read_text())
        except OSError as exc:
            raise OpscopeError(f"{plan}: cannot read the weight plan: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise OpscopeError(f"{plan}: not a JSON weight plan ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("frontier"), list) or "menus" not in doc:
        raise OpscopeError(f"{plan}: not a plan written by `opscope weights --plan` (no frontier / menus)")
    return doc


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def frontier_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    head = ["budget", "greedy Σerr", "DADO Σerr", "kept", "plan MiB", "stored MiB", "cosine", "top-1", "top-5",
            "KL", "gate"]  # fmt: skip
    rows = []
    for b in doc["frontier"]:
        q = b.get("quality") or {}
        stored = None if b.get("stored_bytes") is None else b["stored_bytes"] / 2**20
        gate = "-" if not q else ("pass" if b.get("passes") else "fail")
        rows.append(
            [f"{b['budget']:g}", _fmt(b["greedy"]["error"], ".4f"), _fmt(b["dado"]["error"], ".4f"), b["method"],
             _fmt(b["plan_bytes"] / 2**20, ".2f"), _fmt(stored, ".2f"), _fmt(q.get("cosine"), ".5f"),
             _fmt(q.get("top1"), ".1%"), _fmt(q.get("top5"), ".1%"), _fmt(q.get("kl"), ".2e"), gate]
        )  # fmt: skip
    return head, rows


def plot_menus(doc: dict) -> Plot | None:
    """Every option of every layer: relative error against bytes as a share of the layer's dense bytes."""
    menus = doc.get("menus") or []
    if not menus:
        return None
    chosen = {(layer["weight"], layer["option"]["label"]) for layer in doc.get("layers", [])}
    fig = _figure(9, 5)
    ax = fig.subplots()
    seen: set[str] = set()
    for m in menus:
        for o in m["options"]:
            if o["kind"] == "dense" or not m["dense_bytes"]:
                continue
            x, y = o["bytes"] / m["dense_bytes"], max(o["error"], 1e-6)
            first = o["kind"] not in seen
            seen.add(o["kind"])
            picked = (m["weight"], o["label"]) in chosen
            ax.scatter(x, y, s=40 if picked else 14, color=KIND_COLOURS.get(o["kind"], "#333"),
                       edgecolors="black" if picked else "none", linewidths=1.0,
                       label=o["kind"] if first else None, zorder=3 if picked else 2)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes, as a share of the layer's dense bytes (log)")
    ax.set_ylabel("relative L2 error of the reconstruction (log)")
    budget = doc.get("budget")
    ax.set_title(f"Each layer's options ({len(menus)} weights); outlined: the plan at budget {budget}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="lower left")
    caption = (
        "One point per option and layer. Lower-left is better: less error for fewer bytes. Outlined points are "
        "the options the written plan chose (the allocator trades them across layers under the byte budget)."
    )
    return Plot("weights_menus", "Weights: error against bytes per layer", caption, _png(fig))


def plot_frontier(doc: dict) -> Plot | None:
    """Σ error of both allocators per budget, and the checked plans' output cosine beside it."""
    rows = doc.get("frontier") or []
    if not rows:
        return None
    fig = _figure(7, 4)
    ax = fig.subplots()
    budgets = [b["budget"] for b in rows]
    ax.plot(budgets, [b["greedy"]["error"] for b in rows], "o-", label="greedy Σ error")
    ax.plot(budgets, [b["dado"]["error"] for b in rows], "s--", label="DADO Σ error")
    ax.set_xlabel("byte budget (share of the dense weights)")
    ax.set_ylabel("Σ relative error over layers")
    ax.set_title("Allocators' frontier, and what the plans do to the outputs")
    ax.grid(True, alpha=0.3)
    cos = [(b["budget"], b["quality"]["cosine"]) for b in rows if b.get("quality")]
    handles, labels = ax.get_legend_handles_labels()
    if cos:
        ax2 = ax.twinx()
        (line,) = ax2.plot([c[0] for c in cos], [c[1] for c in cos], "^:", color="#2ca02c")
        ax2.set_ylabel("worst output cosine vs the model")
        handles.append(line)
        labels.append("output cosine (checked)")
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    caption = (
        "Left axis: the per-layer error the allocators minimise. Right axis: each budget's plan applied and run "
        "against the original model on the same feeds; the plan is recommended only where that holds."
    )
    return Plot("weights_frontier", "Weights: the allocators' frontier", caption, _png(fig))


def weights_section(plan: Any) -> WeightsSection:
    doc = load_plan_doc(plan)
    rec = doc.get("recommended_budget")
    summary = (
        f"{len(doc['menus'])} weights planned; recommended budget: {rec}" if rec is not None
        else f"{len(doc['menus'])} weights planned; no budget passed the quality gate (cosine >= "
        f"{doc.get('min_cosine')}, top-1 >= {doc.get('min_top1')})"
    )  # fmt: skip
    plots = [p for p in (plot_menus(doc), plot_frontier(doc)) if p is not None]
    return WeightsSection(*frontier_rows(doc), plots, summary)
