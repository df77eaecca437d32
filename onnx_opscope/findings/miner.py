"""The miner: one finding per (run, site, role) of a sketch table, ranked.

For every run (run_id, provider, dist) and every tapped (site, role), each batch ("step")
gives a handful of scale-free signals (`signals`); they are averaged over the steps and the
rules of the site's kind decide: the gemm cascade (`rules`, first match wins), or the
attention, routing and residual rules (`inference`). When the run has several steps, the
steps are compared too (stationary / memoize / delta-compute). `plan` adds what each
finding is worth: estimated and measured speed-ups, FLOP share and savings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OpscopeError
from ..run.feeds import FeedSpec
from ..run.parity import validate_skips
from ..run.table import sidecar_paths
from .config import MineConfig
from .decoder import KV_ROLES, decoder_findings, step_phases
from .finding import Finding, Temporal
from .identity import check_costs
from .inference import KIND_OF_ROLE, attention_finding, residual_finding, routing_finding
from .plan import RHS_ROLES, Costs, annotate, load_costs
from .rules import DENSE, DENSE_NOTE, TEMPORAL_RULES, fire, fmt_num
from .series import Series, TableLike, collect, read_sketch_table
from .signals import (
    SIGNALS,
    SUPPORT,
    chance_cv,
    finite_or_none,
    nanmean,
    nanstd,
    persistent_outlier,
    scalar,
    step_signals,
    temporal_signals,
)


def fixed_norm(value: float, numel: int | None, dims: Sequence[int | None], tol: float) -> int | None:
    """The d for which `value` (a tensor's l1 or sumsq) equals numel / d within `tol`, None if none:
    rows summing to 1 (softmax, d = the row length), unit-norm or unit-RMS rows, ±1 values (d = 1).
    Such a norm stands still by construction, whatever the input: it is no stationarity signal."""
    if not numel or not math.isfinite(value) or value <= 0:
        return None
    return next((d for d in (1, *dims) if d and abs(value * d / numel - 1.0) < tol), None)


def _temporal(series: Series, steps: list[int], cfg: MineConfig) -> tuple[Temporal | None, str]:
    """The across-steps verdict, and a note when the norm stands still for another reason than the values
    (rows normalised by construction, the law of large numbers)."""
    if len(steps) < max(cfg.min_steps, 2):
        return None, ""
    # l1 is opt-in; sumsq (always recorded) stands still exactly when l1 does
    stat = "l1" if all("l1" in series.steps[s] for s in steps) else "sumsq"
    l1 = [scalar(series.steps[s], stat) for s in steps]
    sigs = [series.stat(s, "elemsig") for s in steps]
    ts = temporal_signals(l1, sigs, cfg)
    stationary = math.isfinite(ts["l1_cv"]) and ts["l1_cv"] < cfg.stationary_cv
    note = ""
    if stationary:
        numel = max((n for n in series.numel.values() if n), default=None)
        d = fixed_norm(nanmean(l1), numel, series.dims, cfg.fixed_norm_tol)
        chance = chance_cv(stat, series.steps[steps[0]], numel)
        if d is not None:
            stationary = False
            note = f"{stat} = numel/{d}: fixed by construction (normalised rows), no stationarity verdict"
        elif math.isfinite(chance) and ts["l1_cv"] >= cfg.stationary_chance * chance:
            stationary = False
            note = (f"{stat} moves by {ts['l1_cv']:.2g}, as much as {numel} fresh values do by chance "
                    f"({chance:.2g}): no stationarity verdict")  # fmt: skip
    rep, drift = ts["repeat_share"], ts["drift"]
    repeats = math.isfinite(rep) and rep > cfg.repeat_share_min
    if stationary and repeats and series.role not in RHS_ROLES:
        # values that repeat in an activation's place are a repeated input: memoize. Precompute /
        # prepack is for the operand a kernel prepacks (a weight, or a repeated rhs).
        stationary = False
    if stationary:
        rule, score = "stationary", cfg.stationary_score
    elif repeats:
        rule, score = "memoize", rep
    elif math.isfinite(drift) and drift < cfg.drift_max:
        rule, score = "delta", 1.0 - drift
    else:
        rule, score = "drifting", 0.0
    exploit, guard, thr = TEMPORAL_RULES[rule]
    cond = {
        "stationary": f"l1_cv < {fmt_num(cfg.stationary_cv)}",
        "memoize": f"repeat_share > {fmt_num(cfg.repeat_share_min)}",
        "delta": f"drift < {fmt_num(cfg.drift_max)}",
        "drifting": "none of stationary, memoize, delta",
    }[rule]
    return Temporal(
        steps=len(steps), l1_cv=finite_or_none(ts["l1_cv"]), stationary=bool(stationary), repeat_share=finite_or_none(rep),
        drift=finite_or_none(drift), drift_sigma=finite_or_none(ts["drift_sigma"]), rule=rule, condition=cond, exploit=exploit,
        score=float(min(max(score, 0.0), 1.0)), guard=guard.format(t=fmt_num(getattr(cfg, thr))) if thr else "",
    ), note  # fmt: skip


def finding_for(series: Series, cfg: MineConfig | None = None) -> Finding:
    """The finding of one (site, role): per-step signals, averaged; the cascade; the steps."""
    cfg = cfg or MineConfig()
    steps = sorted(series.steps)
    per_step = [step_signals(series.steps[s], series.numel.get(s), cfg) for s in steps]
    signals = {k: nanmean([p[k] for p in per_step]) for k in SIGNALS + SUPPORT}
    lasting = persistent_outlier([series.stat(s, "chan_maxabs") for s in steps])
    if math.isfinite(lasting):  # several steps: a channel counts by its smallest max over them
        signals["outlier"] = lasting
    sigma = {k: nanstd([p[k] for p in per_step]) for k in SIGNALS}
    numels = [n for n in series.numel.values() if n is not None]
    numel = max(numels) if numels else None
    small = numel is not None and numel < cfg.numel_min
    rule, unsure = fire(signals, cfg)
    small = small and (rule is None or rule.name != "nonfinite")  # NaN/Inf matter at any size
    notes = [] if small else [DENSE_NOTE] if rule is None else []
    if unsure and not small:
        notes.append("held on too little evidence: " + ", ".join(unsure))
    if rule is None or small:
        name, cond, exploit, score, guard = "dense", "no rule fired", DENSE, 0.0, ""
        if small:
            name, cond = "small", f"numel {numel} < {cfg.numel_min}"
            exploit = "none: too few elements to judge (or to be worth it)"
        held, stab_sigma, stability = None, None, "n/a"
    else:
        name, cond, exploit, guard = rule.name, rule.condition(cfg), rule.exploit, rule.guard_text(cfg)
        score = float(min(max(rule.score(signals[rule.signal]), 0.0), 1.0))
        vals = [p[rule.signal] for p in per_step]
        held = sum(rule.holds(v, cfg) for v in vals) / len(vals)
        scores = [min(max(rule.score(v), 0.0), 1.0) for v in vals if math.isfinite(v)]
        stab_sigma = float(np.std(scores)) if len(scores) > 1 else None
        if stab_sigma is None:
            stability = "single step"
        else:
            stability = "stable" if stab_sigma < cfg.stable_sigma else "watch drift"
    temporal, temporal_note = (None, "") if small else _temporal(series, steps, cfg)
    return Finding(
        site=series.site, op_type=series.op_type, role=series.role, run_id=series.run_id,
        provider=series.provider, dist=series.dist, M=series.dims[0], K=series.dims[1], N=series.dims[2],
        numel=numel, steps=len(steps),
        signals={k: finite_or_none(v) for k, v in signals.items()}, sigma={k: finite_or_none(v) for k, v in sigma.items()},
        rule=name, condition=cond, exploit=exploit, score=score, guard=guard,
        guard_held=None if held is None else float(held), stability=stability,
        stability_sigma=finite_or_none(stab_sigma), temporal=temporal,
        note="; ".join(n for n in [*notes, temporal_note] if n),
    )  # fmt: skip


def mine(
    table: TableLike,
    costs: Any = None,
    config: MineConfig | None = None,
    *,
    measure: bool = False,
    skip_quality: Mapping[str, Mapping] | None = None,
    validate: bool = False,
    model: str | None = None,
) -> list[Finding]:
    """Findings for every (run, site, role) of a sketch table, best first.

    `costs` (optional) gives each site's FLOPs, for the FLOP share and the savings: a dict
    site -> flops, a path to a `.sites.csv` sidecar or an `opscope analyze` output, or an
    analyzer Report. When `table` is a path its sidecars are read by default: `.sites.csv`
    for the costs, `.run.json` for the model and feeds it was recorded from. `measure` times
    a real implementation of each exploit against dense at the site's shape (slow: seconds).
    `skip_quality` (site -> `run.validate_skips` result) validates skip candidates; `validate`
    computes it, replaying the recorded feeds on the recorded model (a skip per candidate).
    `model` is the model path the findings' commands name (default: the recorded one).
    """
    t, path = read_sketch_table(table)
    run = run_record(path)
    model = model or run.get("model") or "MODEL"
    series = collect(t)
    cfg = config or MineConfig()
    cost_info = load_costs(costs, path)
    check_costs(cost_info, path)  # FLOP shares of another model would be wrong everywhere
    if validate and skip_quality is None:
        skip_quality = validated_skips(series, cfg, model, run)
    return mine_series(series, cost_info, cfg, measure=measure, skip_quality=skip_quality, model=model,
                       phases=step_phases(t))  # fmt: skip


def mine_series(
    series: Sequence[Series],
    costs: Costs,
    config: MineConfig | None = None,
    *,
    measure: bool = False,
    skip_quality: Mapping[str, Mapping] | None = None,
    model: str = "MODEL",
    phases: Mapping[tuple[str, int], tuple[str, int]] | None = None,
) -> list[Finding]:
    """`mine` on series already collected, with costs already loaded (a plan.Costs). `phases` ((run_id,
    step) -> (phase, position), `decoder.step_phases` of a `generate` table) adds the decoder findings,
    which then judge the KV-cache taps instead of the gemm cascade."""
    cfg = config or MineConfig()
    findings = decoder_findings(series, phases, cfg) if phases else []
    residual: dict[tuple, dict[str, Series]] = {}
    for s in series:
        if phases and s.role in KV_ROLES:
            continue
        kind = KIND_OF_ROLE.get(s.role, "gemm")
        if kind == "attn":
            findings.append(attention_finding(s, cfg))
        elif kind == "route":
            findings.append(routing_finding(s, cfg))
        elif kind == "residual":
            residual.setdefault((s.run_id, s.provider, s.dist, s.site), {})[s.role] = s
        else:
            findings.append(finding_for(s, cfg))
    for pair in residual.values():
        if {"residual_a", "residual_b"} <= set(pair):
            findings.append(
                residual_finding(pair["residual_a"], pair["residual_b"], cfg, model, skip_quality)
            )
    for f in findings:
        annotate(f, costs, cfg, measure=measure)
    return rank(findings)


def rank(findings: list[Finding]) -> list[Finding]:
    """Best first, by impact: the finding's score x its site's share of the model's FLOPs, so a sure
    pattern on a small op ranks below a likely one on the op that does most of the work. NaN/Inf
    come first whatever their site; findings whose site has no known FLOPs come after those with an
    impact, by score. Ties: the saving, then site and role for a stable order."""
    for f in findings:
        f.impact = None if f.flop_share is None else f.rank_score * f.flop_share

    def key(f: Finding) -> tuple:
        first = f.rule == "nonfinite"
        return (not first, f.impact is None, -(f.impact if f.impact is not None else f.rank_score),
                -(f.saves or 0.0), f.site, f.role, f.dist)  # fmt: skip

    return sorted(findings, key=key)


def run_record(table_path: Path | None) -> dict:
    """The table's `<stem>.run.json` (what `record` ran), {} when there is none."""
    if table_path is None:
        return {}
    run_path = sidecar_paths(table_path)[1]
    try:
        return json.loads(run_path.read_text())
    except (OSError, ValueError):
        return {}


def validated_skips(series: Sequence[Series], cfg: MineConfig, model: str, run: dict) -> dict[str, dict]:
    """Skip every candidate block of the table on its own and score the result on the recorded feeds."""
    if not run or not Path(model).is_file():
        raise OpscopeError(
            f"cannot validate skip candidates: the recorded model {model!r} is not at hand",
            hint="validate on the table `opscope record` wrote (its .run.json names the model), or pass the model",
        )
    candidates = {f.site for f in mine_series(series, Costs(), cfg) if f.rule == "weak_residual_branch"}
    if not candidates:
        return {}
    spec = {k: v for k, v in (run.get("feeds") or {}).items() if k in FeedSpec.__dataclass_fields__}
    spec["ranges"] = {k: tuple(v) for k, v in spec.get("ranges", {}).items()}
    return validate_skips(model, sorted(candidates), FeedSpec(**spec))
