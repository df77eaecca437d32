"""Findings of the inference site kinds: attention concentration, expert load, residual-block influence.

Each reads the series of its own role (first match wins within a kind) and returns a
`Finding` like the gemm cascade does, with thresholds in `MineConfig`:

- attention (role `attn`): mean attn_qmax > attn_peak_min -> windowed / top-k sparse
  attention; a key receiving at least sink_share_min of attn_krecv (and 4x the uniform share)
  is a sink -> sink + sliding-window attention.
- routing (role `route`): experts under cold_share_max of the routed load -> drop / merge
  them; else the busiest expert over hot_imbalance_min x uniform -> prefetch / pin it; else
  balanced. The busiest expert is named in every routing finding.
- residual (roles `residual_a`, `residual_b` of one Add, one finding with role `residual`):
  gap = sqrt(min(Σa², Σb²) / max(Σa², Σb²)) < residual_gap_max -> skip the block, with the
  `opscope rewrite skip` command that does it; `skip_quality` (from `run.validate_skips`)
  marks a candidate validated when the skipped model keeps cosine >= skip_min_cosine and
  top-1 >= skip_min_top1.

Per-step values give the guard's hold share and the stability, as for the gemm rules.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping

import numpy as np

from .config import MineConfig
from .finding import Finding
from .rules import fmt_num
from .series import Series
from .signals import finite_or_none, nanmean

KIND_OF_ROLE = {"attn": "attn", "route": "route", "residual_a": "residual", "residual_b": "residual"}


def _values(series: Series, stat: str) -> list[np.ndarray]:
    """The stat's vector on each step (steps in order; empty where it was not recorded)."""
    return [np.asarray(series.stat(s, stat), np.float64) for s in sorted(series.steps)]


def _summed(per_step: list[np.ndarray]) -> np.ndarray:
    """Element-wise sum over steps (NaN as 0), the longest vector's length."""
    n = max((v.size for v in per_step), default=0)
    out = np.zeros(n)
    for v in per_step:
        out[: v.size] += np.nan_to_num(v)
    return out


def _base(series: Series, role: str, kind: str) -> dict:
    numels = [n for n in series.numel.values() if n is not None]
    return dict(
        site=series.site, op_type=series.op_type, role=role, run_id=series.run_id, provider=series.provider,
        dist=series.dist, M=series.dims[0], K=series.dims[1], N=series.dims[2],
        numel=max(numels) if numels else None, steps=len(series.steps), kind=kind,
    )  # fmt: skip


def _stability(scores: list[float], cfg: MineConfig) -> tuple[str, float | None]:
    ok = [s for s in scores if math.isfinite(s)]
    if len(ok) < 2:
        return "single step", None
    sigma = float(np.std(ok))
    return ("stable" if sigma < cfg.stable_sigma else "watch drift"), sigma


def attention_finding(series: Series, cfg: MineConfig) -> Finding:
    peaks = [float(np.nanmean(v)) if v.size else math.nan for v in _values(series, "attn_qmax")]
    peak = nanmean(peaks)
    mass = _summed(_values(series, "attn_krecv"))
    total = float(mass.sum())
    sink = int(np.argmax(mass)) if total > 0 else None
    share = float(mass[sink] / total) if sink is not None else None
    is_sink = share is not None and share >= max(cfg.sink_share_min, 4.0 / mass.size)
    fired = math.isfinite(peak) and peak > cfg.attn_peak_min
    stability, sigma = _stability(peaks, cfg)
    if not fired:
        rule, exploit = "spread_attention", "none: queries spread their mass over many keys"
    elif is_sink:
        rule, exploit = (
            "concentrated_attention",
            f"sink + sliding-window sparse attention (keep key {sink} plus a recent window)",
        )
    else:
        rule, exploit = (
            "concentrated_attention",
            "windowed / top-k sparse attention (each query puts most of its mass on few keys)",
        )
    return Finding(
        **_base(series, "attn", "attn"),
        signals={"mean_peak": finite_or_none(peak), "sink_key": sink, "sink_share": share, "keys": int(mass.size)},
        sigma={}, rule=rule, condition=f"mean attn_qmax {peak:.3f} > {fmt_num(cfg.attn_peak_min)}",
        exploit=exploit, score=float(peak) if fired else 0.0,
        guard=f"mean attn_qmax stays > {fmt_num(cfg.attn_peak_min)} on deployment data",
        guard_held=sum(p > cfg.attn_peak_min for p in peaks if math.isfinite(p)) / max(len(peaks), 1),
        stability=stability, stability_sigma=sigma,
    )  # fmt: skip


def routing_finding(series: Series, cfg: MineConfig) -> Finding:
    load = _summed(_values(series, "route_load"))
    total = float(load.sum())
    share = load / total if total > 0 else np.zeros_like(load)
    e = int(share.size)
    hot = int(np.argmax(share)) if e else None
    imbalance = float(share[hot] * e) if hot is not None else 0.0
    cold = [int(i) for i in np.flatnonzero(share < cfg.cold_share_max)] if total > 0 else []
    signals = {"load_share": share.tolist(), "experts": e, "cold": cold, "hot": hot, "imbalance": imbalance}
    hot_text = (
        f"expert {hot} takes {share[hot]:.1%} of the routed tokens ({imbalance:.1f}x uniform)"
        if hot is not None
        else ""
    )
    if cold:
        rule, score = "cold_experts", len(cold) / e
        exploit = f"drop or merge expert(s) {', '.join(map(str, cold))}: together {share[cold].sum():.1%} of the routed tokens"
        condition = f"load share < {fmt_num(cfg.cold_share_max)} for {len(cold)} of {e} experts"
        note = f"{hot_text}: prefetch / pin its weights"
    elif imbalance > cfg.hot_imbalance_min:
        rule, score, note = "hot_expert", float(share[hot]), ""
        exploit = f"prefetch / pin expert {hot}'s weights: {share[hot]:.1%} of the routed tokens"
        condition = f"{hot_text} > {fmt_num(cfg.hot_imbalance_min)}x"
    else:
        rule, score, note = "balanced_experts", 0.0, hot_text
        exploit = "none: the routed load is balanced"
        condition = f"no expert under {fmt_num(cfg.cold_share_max)}, none over {fmt_num(cfg.hot_imbalance_min)}x uniform"
    return Finding(
        **_base(series, "route", "route"), signals=signals, sigma={}, rule=rule, condition=condition,
        exploit=exploit, score=score, guard="the load shares stay on the same side of the thresholds on deployment data",
        guard_held=None, stability="single step" if len(series.steps) < 2 else "n/a", stability_sigma=None, note=note,
    )  # fmt: skip


def residual_finding(
    a: Series, b: Series, cfg: MineConfig, model: str, skip_quality: Mapping[str, Mapping] | None = None
) -> Finding:
    """One finding for the residual Add whose input series are `a` (residual_a) and `b` (residual_b)."""
    per_a = [float(np.nansum(v)) for v in _values(a, "sumsq")]
    per_b = [float(np.nansum(v)) for v in _values(b, "sumsq")]
    sa, sb = sum(per_a), sum(per_b)
    hi = max(sa, sb)
    gap = math.sqrt(min(sa, sb) / hi) if hi > 0 else math.nan
    gaps = [math.sqrt(min(x, y) / max(x, y)) if max(x, y) > 0 else math.nan for x, y in zip(per_a, per_b)]
    fired = gap < cfg.residual_gap_max
    stability, sigma = _stability(gaps, cfg)
    finding = Finding(
        **_base(a, "residual", "residual"),
        signals={"sumsq_a": sa, "sumsq_b": sb, "gap": finite_or_none(gap)}, sigma={},
        rule="weak_residual_branch" if fired else "strong_residual_branch",
        condition=f"gap {gap:.4f} < {fmt_num(cfg.residual_gap_max)}",
        exploit="skip the block" if fired else f"none: the block moves its input (gap {gap:.3g})",
        score=1.0 - gap if fired else 0.0,
        guard="output quality of the skipped model on real feeds (see validation)",
        guard_held=sum(g < cfg.residual_gap_max for g in gaps if math.isfinite(g)) / max(len(gaps), 1),
        stability=stability, stability_sigma=sigma,
        action=f"opscope rewrite skip {shlex.quote(model)} --blocks {shlex.quote(a.site)} -o skipped.onnx" if fired else "",
    )  # fmt: skip
    quality = (skip_quality or {}).get(a.site) if fired else None
    if quality is not None:
        top1 = quality.get("top1")
        ok = quality.get("cosine", 0.0) >= cfg.skip_min_cosine and (top1 is None or top1 >= cfg.skip_min_top1)
        finding.validation = {**dict(quality), "passed": bool(ok)}
    return finding
