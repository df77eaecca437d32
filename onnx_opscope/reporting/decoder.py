"""The report's Decoder section: a `generate` table's decoder findings, a table per kind, and one plot.

In the ranked findings a 30-layer decoder's ~150 decoder findings sit among ~400 gemm ones, ranked by
score, so "which layers carry a massive channel" or "which caches need per-channel scales" takes a
scan of the whole list. Here each kind (`findings.decoder`'s rules) is one table in layer order, with
the findings' own figures per phase, and the plot puts the residual stream's max|x| and the KV caches'
absmax per layer side by side, prefill against decode, on a log axis: a massive activation is a spike
of 2-3 decades in one layer, a prefill-only one a gap between the two lines.

The section is built from the findings (`Finding.kind == "decoder"`) and, for the stream curve, from the
series of the same table: max(|min|, |max|) of every stream tensor the rules read (the block outputs a
residual Add adds on a plain export, the norms' `in` / `skip` on a fused one), max over the layer's
tensors and the phase's steps. The KV cache table shows the per-head figures of `kv_range` (absmax per
head, their spread, the dominant heads, the RMS in int8 steps per tensor / head / (head, channel)), the
same on plain and fused exports (`sketch.heads`); a table recorded before the head sketches has none ('-').
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..findings import Finding, Series
from ..findings.decoder import KIND, NORM_OPS, NORM_ROLES, PHASES, STREAM_ROLES, TOP_CHANNELS, layer_of
from .plots import Missing, Plot, _figure, _png

PLOT = "decoder_layers"
PLOT_TITLE = "Decoder: max|x| per layer, prefill vs decode"
PHASE_STYLE = {"prefill": ("#1f77b4", "o", "-"), "decode": ("#ff7f0e", "s", "--")}
NUMERIC = ("layer", "ratio prefill", "ratio decode", "max|x| prefill", "max|x| decode", "sink share (decode)",
           "sink excess (prefill)", "window share", "keys", "min", "max", "absmax", "RMS", "crest",
           "absmax prefill", "absmax decode", "head spread", "outlier ratio", "prefill", "decode", "decode/prefill")  # fmt: skip


@dataclass
class DecoderPart:
    """One kind's table: a level-3 heading, what its columns mean, and the rows in layer order."""

    title: str
    anchor: str
    note: str
    head: list[str]
    rows: list[list[str]]


@dataclass
class DecoderSection:
    summary: str
    parts: list[DecoderPart]
    plot: Plot | Missing


def g(v: float | None) -> str:
    """A figure as the section prints it: 3 significant digits, '-' when absent or not finite."""
    return "-" if v is None or not math.isfinite(v) else f"{v:.3g}"


def _layer(f: Finding) -> str:
    layer = f.signals.get("layer")
    return "-" if layer is None else str(layer)


def _order(findings: Sequence[Finding]) -> list[Finding]:
    def key(f: Finding) -> tuple:
        layer = f.signals.get("layer")
        return layer is None, layer or 0, f.site, f.role, f.run_id

    return sorted(findings, key=key)


def _channels(channels: Sequence[int] | None) -> str:
    if not channels:
        return "-"
    more = " ..." if len(channels) > TOP_CHANNELS else ""
    return ", ".join(map(str, channels[:TOP_CHANNELS])) + more


def massive_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    head = ["layer", "site", "role", "basis", "ratio prefill", "ratio decode", "max|x| prefill", "max|x| decode",
            "fired in", "channels", "exploit"]  # fmt: skip
    rows = []
    for f in _order(findings):
        s, ph = f.signals, f.signals.get("phases") or {}
        get = [g((ph.get(p) or {}).get(k)) for k in ("ratio", "max") for p in PHASES]
        named = _channels(s.get("channels")) if s.get("basis") == "chan_maxabs" else "not recorded"
        rows.append([_layer(f), f.site, f.role, s.get("basis", "-"), *get, " and ".join(s.get("fired") or []),
                     named, f.exploit])  # fmt: skip
    return head, rows


def attention_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    head = ["layer", "site", "verdict", "sink share (decode)", "sink excess (prefill)", "window share", "keys",
            "exploit"]  # fmt: skip
    rows = []
    for f in _order(findings):
        s = f.signals
        share = s.get("share") if f.rule == "attention_sink" else s.get("sink_share")
        keys = s.get("keys") or []
        rows.append([_layer(f), f.site, f.rule, g((share or {}).get("decode")), g((s.get("excess") or {}).get("prefill")),
                     g(s.get("kept_share")), "..".join(map(str, keys)) or "-", f.exploit])  # fmt: skip
    return head, rows


def _heads(values: Sequence[float] | None) -> str:
    """Per-head figures as 'a / b / c' (3 significant digits each)."""
    return " / ".join(g(v) for v in values) if values else "-"


def kv_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    """One row per cache tensor: its kv_range (over every step, and per phase), its per-head figures
    (absmax per head, max / median over heads, the dominant heads, the RMS in int8 steps per tensor /
    head / (head, channel)) and its outlier channels ('h{head}.{channel}' where per-head figures exist)."""
    head = ["layer", "cache", "site", "min", "max", "absmax", "RMS", "crest", "absmax prefill", "absmax decode",
            "int8", "head absmax", "head spread", "dominant heads", "int8 steps tensor / head / channel",
            "outlier ratio", "channels"]  # fmt: skip
    outliers = {(f.run_id, f.site, f.role): f for f in findings if f.rule == "kv_outlier_channels"}
    rows = []
    for f in _order([f for f in findings if f.rule == "kv_range"]):
        ph = f.signals.get("phases") or {}
        r = ph.get("all") or {}
        o = outliers.get((f.run_id, f.site, f.role))
        ratio = max(p["ratio"] for p in o.signals["phases"].values()) if o else None
        verdict = f.signals.get("verdict") or (
            "per-tensor" if f.exploit.startswith("per-tensor") else "per-channel / per-head"
        )
        steps = r.get("int8_steps") or {}
        named = (o.signals.get("named") or [str(c) for c in o.signals.get("channels") or []]) if o else []
        channels = (
            ", ".join(named[:TOP_CHANNELS]) + (" ..." if len(named) > TOP_CHANNELS else "") if named else "-"
        )
        dominant = r.get("dominant_heads")
        rows.append([_layer(f), f.role, f.site, *(g(r.get(k)) for k in ("min", "max", "absmax", "rms", "crest")),
                     *(g((ph.get(p) or {}).get("absmax")) for p in PHASES), verdict, _heads(r.get("head_absmax")),
                     g(r.get("head_spread")), ("-" if dominant is None else ", ".join(map(str, dominant)) or "none"),
                     " / ".join(g(steps.get(k)) for k in ("tensor", "head", "channel")) if steps else "-",
                     g(ratio), channels])  # fmt: skip
    return head, rows


def drift_rows(findings: Sequence[Finding]) -> tuple[list[str], list[list[str]]]:
    """One row per figure that moved beyond phase_drift_min between the phases."""
    head = ["layer", "site", "role", "figure", "prefill", "decode", "decode/prefill"]
    rows = []
    for f in _order(findings):
        drift = f.signals.get("drift") or {}
        for name in f.signals.get("moved") or []:
            d = drift[name]
            rows.append(
                [_layer(f), f.site, f.role, name, g(d.get("prefill")), g(d.get("decode")), g(d.get("ratio"))]
            )
    return head, rows


PARTS = (
    (("massive_activation",), "Massive activations", "decoder-massive", massive_rows,
     "Residual-stream tensors whose peak channel is far above the median channel (basis chan_maxabs: max / median "
     "of per-channel max|x|; basis max/rms: max|x| over the RMS of the other values, channels not named)."),
    (("attention_sink", "windowed_attention"), "Attention sinks and windows", "decoder-attention", attention_rows,
     "Sink share: the decode-step attention mass the first sink_keys keys receive; the prefill is judged by its "
     "excess over causal uniform attention. Window share: sink keys plus the last attn_window keys."),
    (("kv_range", "kv_outlier_channels"), "KV cache", "decoder-kv", kv_rows,
     "What each step writes into the cache: range over every step, crest = absmax / RMS (per-tensor int8 keeps "
     "127 / crest steps for the RMS); per KV head: absmax per head, max / median over the heads, the heads at 2x "
     "the median or more, and the RMS in int8 steps with one scale per tensor / per head / per (head, channel); "
     "the (head, channel)s far above the median (h{head}.{channel}: per-channel scales)."),
    (("phase_drift",), "Prefill to decode drift", "decoder-drift", drift_rows,
     "Figures that differ between the prefill and the decode steps beyond phase_drift_min: calibrate, and pick "
     "kernels, per phase."),
)  # fmt: skip


def decoder_section(findings: Sequence[Finding], series: Sequence[Series],
                    phases: Mapping[tuple[str, int], tuple[str, int]]) -> DecoderSection | None:  # fmt: skip
    """The section for a `generate` table (`phases` from `findings.step_phases`), None for any other table."""
    if not phases:
        return None
    mine = [f for f in findings if f.kind == KIND]
    parts, missing = [], []
    for rules, title, anchor, rows, note in PARTS:
        got = [f for f in mine if f.rule in rules]
        head, body = rows(got)
        if body:
            parts.append(DecoderPart(title, anchor, note, head, body))
        else:
            missing.append(title.lower())
    counts = {r: sum(f.rule == r for f in mine) for r in dict.fromkeys(f.rule for f in mine)}
    layers = {f.signals.get("layer") for f in mine} - {None}
    summary = (f"{len(mine)} decoder finding(s) over {len(layers)} layer(s): "
               + (", ".join(f"{n} {r}" for r, n in counts.items()) or "none") + ".")  # fmt: skip
    if missing:
        summary += f" Nothing fired for: {', '.join(missing)}."
    return DecoderSection(summary, parts, plot_decoder(mine, series, phases))


def stream_peaks(series: Sequence[Series], phases: Mapping[tuple[str, int], tuple[str, int]]) -> dict:
    """{phase: {layer: max|x|}} of the residual-stream tensors the decoder rules read, max over a layer's
    tensors and the phase's steps (max(|min|, |max|), else the max of chan_maxabs)."""
    out: dict[str, dict[int, float]] = {}
    for s in series:
        stream = s.role in STREAM_ROLES or (s.role in NORM_ROLES and s.op_type in NORM_OPS)
        layer = layer_of(s.site)
        if not stream or layer is None:
            continue
        for step in s.steps:
            phase = phases.get((s.run_id, step), (None,))[0]
            got = [s.stat(step, k) for k in ("min", "max")]
            vals = np.abs(np.concatenate(got)) if all(v.size for v in got) else s.stat(step, "chan_maxabs")
            vals = vals[np.isfinite(vals)] if vals.size else vals
            if phase is None or not vals.size:
                continue
            peak = float(vals.max())
            out.setdefault(phase, {})[layer] = max(out.get(phase, {}).get(layer, 0.0), peak)
    return out


def _kv_peaks(findings: Sequence[Finding]) -> dict[tuple[str, str], dict[int, float]]:
    """{(cache role, phase): {layer: absmax}} from the kv_range findings, max over a layer's caches."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for f in findings:
        layer = f.signals.get("layer")
        if f.rule != "kv_range" or layer is None:
            continue
        for phase in PHASES:
            v = ((f.signals.get("phases") or {}).get(phase) or {}).get("absmax")
            if v is not None:
                at = out.setdefault((f.role, phase), {})
                at[layer] = max(at.get(layer, 0.0), v)
    return out


def _curve(ax, points: Mapping[int, float], phase: str, label: str, colour: str | None = None) -> None:
    c, marker, ls = PHASE_STYLE[phase]
    xs = sorted(k for k, v in points.items() if v > 0)
    ax.plot(xs, [points[x] for x in xs], color=colour or c, marker=marker, ls=ls, lw=1.2, ms=4, label=label)


def plot_decoder(findings: Sequence[Finding], series: Sequence[Series],
                 phases: Mapping[tuple[str, int], tuple[str, int]]) -> Plot | Missing:  # fmt: skip
    """Left: the residual stream's max|x| per layer, prefill and decode, massive-activation findings labelled
    with their channels; right: each KV cache's absmax per layer and phase. Log y: the spikes span decades."""
    stream, kv = stream_peaks(series, phases), _kv_peaks(findings)
    if not any(stream.values()) and not kv:
        return Missing(
            PLOT, PLOT_TITLE, "the table has no residual-stream or KV-cache tensor with a layer in its name"
        )
    fig = _figure(11, 4.2)
    left, right = fig.subplots(1, 2)
    for phase in PHASES:
        if stream.get(phase):
            _curve(left, stream[phase], phase, phase)
    for f in findings:
        layer, ph = f.signals.get("layer"), f.signals.get("phases") or {}
        if f.rule != "massive_activation" or layer is None:
            continue
        peak = max((p.get("max") or 0.0) for p in ph.values()) if ph else 0.0
        chans = f.signals.get("channels") or []
        text = f"ch {_channels(chans[:3])}" if chans else f"{max(p['ratio'] for p in ph.values()):.0f}x rest"
        left.scatter([layer], [peak], s=80, facecolors="none", edgecolors="#d62728", zorder=3)
        left.annotate(
            text, (layer, peak), textcoords="offset points", xytext=(7, -12), fontsize=8, color="#d62728"
        )
    left.set_title("residual stream max|x| (red: massive activation)", fontsize=9)
    right.set_title("KV cache absmax (what each phase writes)", fontsize=9)
    cache_colour = {"key": "#2ca02c", "value": "#9467bd", "kv": "#8c564b"}
    for (role, phase), points in sorted(kv.items()):
        _curve(right, points, phase, f"{role}, {phase}", cache_colour.get(role))
    for ax in (left, right):
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("max |x| (tensor units, log)")
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(PLOT_TITLE, fontsize=10)
    caption = ("Max |x| per layer over each phase's steps: the residual-stream tensors the decoder rules read "
               "(left; circled: massive-activation findings, with their channels when chan_maxabs was recorded) "
               "and the KV-cache entries each phase writes (right). A gap between prefill and decode is "
               "prefill-only (or decode-only) range: calibrate per phase.")  # fmt: skip
    return Plot(PLOT, PLOT_TITLE, caption, _png(fig))
