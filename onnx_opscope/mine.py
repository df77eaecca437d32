"""Mine a sketch table: signals per (site, role), a rule cascade, temporal rules -> findings.

The table is tidy (one row per sketch element, see record.py). For every run (run_id,
provider, dist) and every tapped (site, role), each batch ("step") gives a handful of
scale-free *signals*; they are averaged over the steps and a cascade of rules, first match
wins, names the exploit. When the run has several steps, the steps are compared too: a
tensor whose l1 never moves is stationary (precompute / prepack), one whose fingerprint
(elemsig) repeats can be memoized, one that moves little from step to step suits
delta-compute. `plan.py` adds the estimated and measured benefit of each finding.

Every threshold lives in `MineConfig`, never in the code; the README section "Rules (first
match wins)" gives the evidence behind the defaults that differ from the reference harness
(hist_gaps, kurtosis, pos_cv).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import OpscopeError, did_you_mean, listing

FORMAT = "onnx-opscope/findings"
VERSION = 1
REQUIRED_COLUMNS = ("site", "role", "stat", "idx", "value")
SIGNALS = ("density", "outlier", "histtop", "hist_gaps", "levels", "pos_cv", "adj", "kurtosis", "nonfinite")
DENSE = "dense: no sketch-visible exploit"
DENSE_NOTE = "low rank and other structure across channels are not visible in sketches"

TableLike = Any  # a path (Parquet / CSV / .parts folder), a pyarrow.Table or a pandas DataFrame


@dataclass(frozen=True)
class MineConfig:
    """Thresholds and knobs of the miner. Defaults follow the reference harness except
    `pos_cv_min` (0.75 -> 1.0) and the two added rules (`gaps_min`, `kurtosis_min`); see
    the README section "Rules (first match wins)" for the measurements behind each."""

    nonfinite_max: float = 0.0  # share of NaN/Inf above this: fix the numerics before anything else
    density_max: float = 0.5  # nnz/numel below: sparse GEMM
    outlier_min: float = 6.0  # max/mean of per-channel max|x| above: per-channel int quant
    gaps_min: float = 0.3  # empty-bin share inside the histogram's bulk above: few discrete levels (LUT)
    gaps_mass: float = 0.01  # the bulk = bins between the gaps_mass and 1 - gaps_mass quantiles
    kurtosis_min: float = 10.0  # above: heavy tails, per-tensor int quant loses resolution
    histtop_min: float = 0.25  # largest bin share above: concentrated values, quantize / LUT
    adj_max: float = 0.5  # mean(adj_sumsq)/mean(pos_sumsq) below: adjacent rows close, delta-compute
    pos_cv_min: float = 1.0  # std/|mean| of per-row energy above: sequence / positional structure
    stationary_cv: float = 1e-4  # l1 over steps with a smaller coefficient of variation: stationary
    repeat_dist: float = 1e-3  # a step whose elemsig is this close (relative L2) to an earlier one repeats
    repeat_share_min: float = 0.2  # repeat share above: memoize
    drift_max: float = 0.3  # mean step-to-step elemsig distance below: delta-compute across steps
    min_steps: int = 3  # temporal rules need at least this many steps
    stable_sigma: float = 0.02  # sigma over steps of the fired rule's score below: stable guard
    stationary_score: float = 0.25  # rank of precompute / prepack (runtimes often prepack weights already)
    delta_tau: float = 0.1  # delta-compute skips delta entries below tau x RMS of the tensor
    measure_cap: int = 1024  # measured speed-ups cap M, K and N at this
    measure_repeats: int = 3  # timed repeats (best of) per measurement


def config_with(
    base: MineConfig | None = None, overrides: Mapping[str, str] | Sequence[str] = ()
) -> MineConfig:
    """`base` with fields set from 'NAME=VALUE' strings (or a mapping); unknown names are an OpscopeError."""
    base = base or MineConfig()
    items = overrides.items() if isinstance(overrides, Mapping) else (_split_setting(s) for s in overrides)
    types = {f.name: f.type for f in fields(MineConfig)}
    changes: dict[str, Any] = {}
    for name, text in items:
        if name not in types:
            raise OpscopeError(
                f"--set {name}: no such threshold{did_you_mean(name, types)}; known: {listing(types, 30)}"
            )
        try:
            changes[name] = int(text) if types[name] == "int" else float(text)
        except ValueError:
            raise OpscopeError(f"--set {name}={text}: expected a number") from None
    return replace(base, **changes)


def _split_setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise OpscopeError(f"--set {text!r}: expected NAME=VALUE, e.g. density_max=0.4")
    return name.strip(), value.strip()


# --------------------------------------------------------------------------------------------
# rules


@dataclass(frozen=True)
class Rule:
    """One step of the cascade: `signal <op> config.<threshold>` fires `exploit`."""

    name: str
    signal: str
    op: str  # "<" or ">"
    threshold: str  # a MineConfig field
    exploit: str
    guard: str  # runtime predicate over the sketches; {t} is the threshold
    score: Callable[[float], float]

    def limit(self, cfg: MineConfig) -> float:
        return float(getattr(cfg, self.threshold))

    def holds(self, value: float | None, cfg: MineConfig) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value < self.limit(cfg) if self.op == "<" else value > self.limit(cfg)

    def condition(self, cfg: MineConfig) -> str:
        return f"{self.signal} {self.op} {_fmt_num(self.limit(cfg))}"


RULES: tuple[Rule, ...] = (
    Rule("nonfinite", "nonfinite", ">", "nonfinite_max", "fix numerics first (NaN/Inf)",
         "(nan_count + inf_count)/numel > {t}", lambda v: 1.0),
    Rule("sparse", "density", "<", "density_max", "sparse GEMM", "nnz/numel < {t}", lambda v: 1.0 - v),
    Rule("outlier", "outlier", ">", "outlier_min", "per-channel int quant",
         "max(chan_maxabs)/mean(chan_maxabs) > {t}", lambda v: min(v / 30.0, 1.0)),
    Rule("levels", "hist_gaps", ">", "gaps_min", "quantize / LUT (few levels)",
         "hist_gaps(hist) > {t}", lambda v: v),
    Rule("heavy_tail", "kurtosis", ">", "kurtosis_min",
         "outlier-aware quant (heavy tails)", "kurtosis > {t}", lambda v: min(v / 50.0, 1.0)),
    Rule("concentrated", "histtop", ">", "histtop_min", "quantize / LUT (concentrated values)",
         "max(hist)/sum(hist) > {t}", lambda v: v),
    Rule("coherent", "adj", "<", "adj_max", "delta-compute (adjacent rows)",
         "mean(adj_sumsq)/mean(pos_sumsq) < {t}", lambda v: 1.0 - v),
    Rule("positional", "pos_cv", ">", "pos_cv_min", "sequence / positional structure",
         "std(pos_sumsq)/|mean(pos_sumsq)| > {t}", lambda v: min(v / 3.0, 1.0)),
)  # fmt: skip
RULE_NAMES = tuple(r.name for r in RULES) + ("dense",)
# The sketches each rule reads; the opt-in ones (nnz, chan_maxabs, kurtosis, adj_sumsq) may be absent.
RULE_SKETCHES = {
    "nonfinite": ("nan_count", "inf_count"),
    "sparse": ("nnz",),
    "outlier": ("chan_maxabs",),
    "levels": ("hist",),
    "heavy_tail": ("kurtosis",),
    "concentrated": ("hist",),
    "coherent": ("adj_sumsq", "pos_sumsq"),
    "positional": ("pos_sumsq",),
}


def unchecked_rules(table: TableLike) -> dict[str, list[str]]:
    """Rules the table cannot fire because a sketch they read was not recorded: rule -> missing sketches."""
    t, _ = read_sketch_table(table)
    have = set(pc.unique(t.column("stat")).to_pylist())
    missing = {rule: [s for s in need if s not in have] for rule, need in RULE_SKETCHES.items()}
    return {rule: m for rule, m in missing.items() if m}


TEMPORAL_RULES = {
    "stationary": ("precompute / prepack", "cv(l1, or sumsq, over steps) < {t}", "stationary_cv"),
    "memoize": ("memoize", "reldist(elemsig, a cached elemsig) < {t}", "repeat_dist"),
    "delta": ("delta-compute (across steps)", "reldist(elemsig_t, elemsig_t-1) < {t}", "drift_max"),
    "drifting": ("none: drifting", "", ""),
}


# --------------------------------------------------------------------------------------------
# findings


@dataclass
class Temporal:
    """What the steps of a run say about one (site, role)."""

    steps: int
    l1_cv: float | None
    stationary: bool
    repeat_share: float | None
    drift: float | None  # mean relative L2 distance of elemsig between consecutive steps
    drift_sigma: float | None
    rule: str  # stationary | memoize | delta | drifting
    condition: str
    exploit: str
    score: float
    guard: str
    reuse: float | None = None  # share of the site's work that reuse skips
    savings: float | None = None  # flop_share x reuse
    est_speedup: float | None = None
    measured_speedup: float | None = None
    measure_note: str = ""


@dataclass
class Finding:
    """One (site, role) of one run: the signals used, the rule that fired and what it is worth."""

    site: str
    op_type: str
    role: str
    run_id: str
    provider: str
    dist: str
    M: int | None
    K: int | None
    N: int | None
    numel: int | None
    steps: int
    signals: dict[str, float | None]  # means over steps
    sigma: dict[str, float | None]  # standard deviation over steps (None with one step)
    rule: str
    condition: str
    exploit: str
    score: float
    guard: str
    guard_held: float | None  # share of steps on which the guard held
    stability: str  # stable | watch drift | single step | n/a
    stability_sigma: float | None  # sigma over steps of the rule's score
    est_speedup: float | None = None
    measured_speedup: float | None = None
    measure_note: str = ""
    flop_share: float | None = None
    savings: float | None = None  # share of the known FLOPs the exploit saves
    temporal: Temporal | None = None
    note: str = ""

    @property
    def rank_score(self) -> float:
        """What `mine` ranks by: the better of the per-batch and the across-steps score."""
        return max(self.score, self.temporal.score if self.temporal else 0.0)


# --------------------------------------------------------------------------------------------
# reading the table


@dataclass
class Series:
    """All steps of one (run, site, role): stat -> values (ordered by idx) per step."""

    run_id: str
    provider: str
    dist: str
    site: str
    op_type: str
    role: str
    dims: tuple[int | None, int | None, int | None]
    steps: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    numel: dict[int, int | None] = field(default_factory=dict)

    def stat(self, step: int, name: str) -> np.ndarray:
        return self.steps[step].get(name, np.zeros(0))

    def label(self, with_run: bool = False) -> str:
        base = f"{self.site}/{self.role}"
        return f"{base} [{self.dist}]" if with_run else base


def read_sketch_table(table: TableLike) -> tuple[pa.Table, Path | None]:
    """The table as pyarrow (and its path, if it came from a file); wrong input is an OpscopeError."""
    path = None
    if isinstance(table, pa.Table):
        t = table
    elif isinstance(table, str | os.PathLike):
        from .record import read_table

        path = Path(table)
        t = read_table(path)
    elif hasattr(table, "columns") and hasattr(table, "dtypes"):  # a pandas DataFrame
        t = pa.Table.from_pandas(table, preserve_index=False)
    else:
        raise TypeError(f"expected a table path, a pyarrow.Table or a DataFrame, got {type(table).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in t.column_names]
    if missing:
        where = str(path) if path else "table"
        raise OpscopeError(
            f"{where}: not a sketch table (missing column(s) {', '.join(missing)}; "
            f"has {', '.join(t.column_names) or 'none'})",
            hint="record one with `opscope record MODEL -o TABLE`",
        )
    return t, path


def _strings(t: pa.Table, name: str, default: str = "") -> np.ndarray:
    if name not in t.column_names:
        return np.full(t.num_rows, default, dtype=object)
    col = pc.fill_null(t.column(name).cast(pa.string()), default)
    return col.to_numpy(zero_copy_only=False)


def _numbers(t: pa.Table, name: str, default: float = np.nan) -> np.ndarray:
    if name not in t.column_names:
        return np.full(t.num_rows, default)
    return t.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)


def collect(table: TableLike) -> list[Series]:
    """Split the tidy table into one Series per (run_id, provider, dist, site, role), sorted.

    Vectorised: one lexsort and one pass over the segments, so a table of millions of rows
    costs one Python iteration per (run, site, role, step, stat), not per row.
    """
    t, _ = read_sketch_table(table)
    if t.num_rows == 0:
        return []
    text = {c: _strings(t, c) for c in ("run_id", "provider", "dist", "site", "op_type", "role", "stat")}
    codes, uniq = {}, {}
    for c, arr in text.items():
        uniq[c], codes[c] = np.unique(arr.astype(str), return_inverse=True)
    step = _numbers(t, "step", 0.0)
    step = np.where(np.isfinite(step), step, 0).astype(np.int64)
    idx = _numbers(t, "idx", 0.0)
    value = _numbers(t, "value")
    numel = _numbers(t, "numel")
    dims = [_numbers(t, d) for d in ("M", "K", "N")]
    keys = [
        codes["run_id"],
        codes["provider"],
        codes["dist"],
        codes["site"],
        codes["role"],
        step,
        codes["stat"],
    ]
    order = np.lexsort([idx, *reversed(keys)])
    keys = [k[order] for k in keys]
    value, numel, idx = value[order], numel[order], idx[order]
    dims = [d[order] for d in dims]
    op_codes = codes["op_type"][order]
    change = np.zeros(len(order), dtype=bool)
    change[0] = True
    for k in keys:
        change[1:] |= k[1:] != k[:-1]
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], len(order))
    out: dict[tuple, Series] = {}
    for s, e in zip(starts, ends):
        run, prov, dist, site, role, st, stat = (int(k[s]) for k in keys)
        key = (run, prov, dist, site, role)
        series = out.get(key)
        if series is None:
            series = out[key] = Series(
                str(uniq["run_id"][run]), str(uniq["provider"][prov]), str(uniq["dist"][dist]),
                str(uniq["site"][site]), str(uniq["op_type"][op_codes[s]]), str(uniq["role"][role]),
                tuple(_int_or_none(d[s:e]) for d in dims),
            )  # fmt: skip
        series.steps.setdefault(st, {})[str(uniq["stat"][stat])] = value[s:e]
        if series.numel.get(st) is None:
            series.numel[st] = _int_or_none(numel[s:e])
        if None in series.dims:
            series.dims = tuple(
                a if a is not None else _int_or_none(d[s:e]) for a, d in zip(series.dims, dims)
            )
    return list(out.values())


def _int_or_none(v: np.ndarray) -> int | None:
    ok = v[np.isfinite(v)]
    return int(ok[0]) if ok.size else None


# --------------------------------------------------------------------------------------------
# signals


def _finite(v: np.ndarray | None) -> np.ndarray:
    if v is None:
        return np.zeros(0)
    v = np.asarray(v, dtype=np.float64)
    return v[np.isfinite(v)]


def _scalar(stats: Mapping[str, np.ndarray], name: str) -> float:
    v = stats.get(name)
    return float(v[0]) if v is not None and len(v) else math.nan


def hist_gaps(hist: np.ndarray, mass: float = 0.01) -> float:
    """Share of empty bins between the `mass` and `1 - mass` quantiles of the histogram.

    Continuous data fills every bin of its bulk (gaps ~ 0); data with a few discrete levels
    coarser than a bin leaves every other bin empty (gaps ~ 0.5). The tails are left out
    because a sampled histogram of continuous data has empty bins there too.
    """
    h = _finite(hist)
    total = h.sum() if h.size else 0.0
    if total <= 0:
        return math.nan
    c = np.cumsum(h) / total
    lo = int(np.searchsorted(c, mass, side="right"))
    hi = int(np.searchsorted(c, 1.0 - mass, side="left"))
    lo, hi = min(lo, len(h) - 1), min(max(hi, lo), len(h) - 1)
    bulk = h[lo : hi + 1]
    return float(np.count_nonzero(bulk == 0) / bulk.size)


def step_signals(stats: Mapping[str, np.ndarray], numel: int | None, cfg: MineConfig | None = None) -> dict:
    """The signals of one batch of one (site, role); NaN where the sketches needed are absent."""
    cfg = cfg or MineConfig()
    n = float(numel) if numel else math.nan
    s: dict[str, float] = dict.fromkeys(SIGNALS, math.nan)
    with np.errstate(all="ignore"):
        s["density"] = _scalar(stats, "nnz") / n
        bad = [_scalar(stats, k) for k in ("nan_count", "inf_count")]
        if any(math.isfinite(b) for b in bad):
            s["nonfinite"] = sum(b for b in bad if math.isfinite(b)) / n
        cm = _finite(stats.get("chan_maxabs"))
        s["outlier"] = (
            float(cm.max() / cm.mean()) if cm.size and cm.mean() > 0 else _scalar(stats, "chan_outlier")
        )
        h = _finite(stats.get("hist"))
        if h.size and h.sum() > 0:
            s["histtop"] = float(h.max() / h.sum())
            s["hist_gaps"] = hist_gaps(h, cfg.gaps_mass)
            s["levels"] = float(np.count_nonzero(h))
        p = _finite(stats.get("pos_sumsq"))
        if p.size > 1 and p.mean() != 0:
            s["pos_cv"] = float(p.std() / abs(p.mean()))
        a = _finite(stats.get("adj_sumsq"))
        if a.size and p.size and p.mean() > 0:
            s["adj"] = float(a.mean() / p.mean())
        s["kurtosis"] = _scalar(stats, "kurtosis")
    return {k: (float(v) if math.isfinite(v) else math.nan) for k, v in s.items()}


def rel_dist(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / max(||a||, ||b||), 0 for two zero vectors; non-finite entries count as 0."""
    a = np.nan_to_num(np.asarray(a, np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    b = np.nan_to_num(np.asarray(b, np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if a.shape != b.shape:
        return math.inf
    scale = max(np.linalg.norm(a), np.linalg.norm(b))
    return float(np.linalg.norm(a - b) / scale) if scale > 0 else 0.0


def temporal_signals(l1: Sequence[float], elemsig: Sequence[np.ndarray], cfg: MineConfig) -> dict:
    """l1 coefficient of variation, repeat share and drift of a series of steps."""
    v = _finite(np.asarray(l1, np.float64))
    l1_cv = math.nan
    if v.size >= 2:
        m, sd = abs(v.mean()), v.std()
        l1_cv = float(sd / m) if m > 0 else (0.0 if sd == 0 else math.inf)
    repeat = drift = drift_sigma = math.nan
    sigs = [np.asarray(e) for e in elemsig]
    if len(sigs) >= 2 and all(e.size for e in sigs):
        repeats = sum(
            any(rel_dist(sigs[t], sigs[u]) < cfg.repeat_dist for u in range(t)) for t in range(1, len(sigs))
        )
        repeat = repeats / len(sigs)
        steps = np.array([rel_dist(sigs[t], sigs[t - 1]) for t in range(1, len(sigs))])
        drift, drift_sigma = float(np.mean(steps)), float(np.std(steps))
    return {"l1_cv": l1_cv, "repeat_share": repeat, "drift": drift, "drift_sigma": drift_sigma}


# --------------------------------------------------------------------------------------------
# the miner


def _nanmean(vals: list[float]) -> float:
    v = np.asarray(vals, np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


def _nanstd(vals: list[float]) -> float:
    v = np.asarray(vals, np.float64)
    v = v[np.isfinite(v)]
    return float(v.std()) if v.size > 1 else math.nan


def _none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _fmt_num(x: float) -> str:
    return f"{x:g}"


def fire(signals: Mapping[str, float | None], cfg: MineConfig) -> Rule | None:
    """The first rule of the cascade whose condition holds (None: dense)."""
    return next((r for r in RULES if r.holds(signals.get(r.signal), cfg)), None)


def _temporal(series: Series, steps: list[int], cfg: MineConfig) -> Temporal | None:
    if len(steps) < max(cfg.min_steps, 2):
        return None
    # l1 is opt-in; sumsq (always recorded) stands still exactly when l1 does
    stat = "l1" if all("l1" in series.steps[s] for s in steps) else "sumsq"
    l1 = [_scalar(series.steps[s], stat) for s in steps]
    sigs = [series.stat(s, "elemsig") for s in steps]
    ts = temporal_signals(l1, sigs, cfg)
    stationary = math.isfinite(ts["l1_cv"]) and ts["l1_cv"] < cfg.stationary_cv
    rep, drift = ts["repeat_share"], ts["drift"]
    if stationary:
        rule, score = "stationary", cfg.stationary_score
    elif math.isfinite(rep) and rep > cfg.repeat_share_min:
        rule, score = "memoize", rep
    elif math.isfinite(drift) and drift < cfg.drift_max:
        rule, score = "delta", 1.0 - drift
    else:
        rule, score = "drifting", 0.0
    exploit, guard, thr = TEMPORAL_RULES[rule]
    cond = {
        "stationary": f"l1_cv < {_fmt_num(cfg.stationary_cv)}",
        "memoize": f"repeat_share > {_fmt_num(cfg.repeat_share_min)}",
        "delta": f"drift < {_fmt_num(cfg.drift_max)}",
        "drifting": "none of stationary, memoize, delta",
    }[rule]
    return Temporal(
        steps=len(steps), l1_cv=_none(ts["l1_cv"]), stationary=bool(stationary), repeat_share=_none(rep),
        drift=_none(drift), drift_sigma=_none(ts["drift_sigma"]), rule=rule, condition=cond, exploit=exploit,
        score=float(min(max(score, 0.0), 1.0)), guard=guard.format(t=_fmt_num(getattr(cfg, thr))) if thr else "",
    )  # fmt: skip


def finding_for(series: Series, cfg: MineConfig | None = None) -> Finding:
    """The finding of one (site, role): per-step signals, averaged; the cascade; the steps."""
    cfg = cfg or MineConfig()
    steps = sorted(series.steps)
    per_step = [step_signals(series.steps[s], series.numel.get(s), cfg) for s in steps]
    signals = {k: _nanmean([p[k] for p in per_step]) for k in SIGNALS}
    sigma = {k: _nanstd([p[k] for p in per_step]) for k in SIGNALS}
    rule = fire(signals, cfg)
    if rule is None:
        name, cond, exploit, score, guard = "dense", "no rule fired", DENSE, 0.0, ""
        held, stab_sigma, stability = None, None, "n/a"
    else:
        name, cond, exploit, guard = rule.name, rule.condition(cfg), rule.exploit, rule.guard
        guard = guard.format(t=_fmt_num(rule.limit(cfg)))
        score = float(min(max(rule.score(signals[rule.signal]), 0.0), 1.0))
        vals = [p[rule.signal] for p in per_step]
        held = sum(rule.holds(v, cfg) for v in vals) / len(vals)
        scores = [min(max(rule.score(v), 0.0), 1.0) for v in vals if math.isfinite(v)]
        stab_sigma = float(np.std(scores)) if len(scores) > 1 else None
        if stab_sigma is None:
            stability = "single step"
        else:
            stability = "stable" if stab_sigma < cfg.stable_sigma else "watch drift"
    numels = [n for n in series.numel.values() if n is not None]
    return Finding(
        site=series.site, op_type=series.op_type, role=series.role, run_id=series.run_id,
        provider=series.provider, dist=series.dist, M=series.dims[0], K=series.dims[1], N=series.dims[2],
        numel=max(numels) if numels else None, steps=len(steps),
        signals={k: _none(v) for k, v in signals.items()}, sigma={k: _none(v) for k, v in sigma.items()},
        rule=name, condition=cond, exploit=exploit, score=score, guard=guard,
        guard_held=None if held is None else float(held), stability=stability,
        stability_sigma=_none(stab_sigma), temporal=_temporal(series, steps, cfg),
        note=DENSE_NOTE if rule is None else "",
    )  # fmt: skip


def mine(
    table: TableLike,
    costs: Any = None,
    config: MineConfig | None = None,
    *,
    measure: bool = False,
) -> list[Finding]:
    """Findings for every (run, site, role) of a sketch table, best first.

    `costs` (optional) gives each site's FLOPs, for the FLOP share and the savings: a dict
    site -> flops, a path to a `.sites.csv` sidecar or an `opscope analyze` output, or an
    analyzer Report. When `table` is a path its sidecar is read by default. `measure` times
    a real implementation of each exploit against dense at the site's shape (slow: seconds).
    """
    from .plan import load_costs

    t, path = read_sketch_table(table)
    return mine_series(collect(t), load_costs(costs, path), config, measure=measure)


def mine_series(series: Sequence[Series], costs: Any, config: MineConfig | None = None, *,
                measure: bool = False) -> list[Finding]:  # fmt: skip
    """`mine` on series already collected, with costs already loaded (a plan.Costs)."""
    from .plan import annotate

    cfg = config or MineConfig()
    findings = [finding_for(s, cfg) for s in series]
    for f in findings:
        annotate(f, costs, cfg, measure=measure)
    return rank(findings)


def rank(findings: list[Finding]) -> list[Finding]:
    """Best first: rank score, then savings, then site and role for a stable order."""
    return sorted(findings, key=lambda f: (-f.rank_score, -(f.savings or 0.0), f.site, f.role, f.dist))


# --------------------------------------------------------------------------------------------
# saving, loading, printing


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        return _clean(x.item())
    return x


def findings_to_dict(findings: Sequence[Finding], config: MineConfig | None = None) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "config": asdict(config or MineConfig()),
        "findings": [_clean(asdict(f)) for f in findings],
    }


def save_findings(
    findings: Sequence[Finding], path: str | os.PathLike, config: MineConfig | None = None
) -> Path:
    """Write the findings as JSON (non-finite numbers become null)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(findings_to_dict(findings, config), indent=1, allow_nan=False))
    return p


def load_findings(path: str | os.PathLike) -> list[Finding]:
    """Read findings saved by `save_findings`; a wrong file is an OpscopeError."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise OpscopeError(f"{p}: no such findings file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpscopeError(f"{p}: not a findings file ({type(exc).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise OpscopeError(
            f"{p}: not an onnx-opscope findings file", hint="write one with `opscope mine --json`"
        )
    if d.get("version") != VERSION:
        raise OpscopeError(f"{p}: findings version {d.get('version')} is not {VERSION}")
    names = {f.name for f in fields(Finding)}
    tnames = {f.name for f in fields(Temporal)}
    out = []
    try:
        for item in d["findings"]:
            item = {k: v for k, v in item.items() if k in names}
            t = item.get("temporal")
            item["temporal"] = Temporal(**{k: v for k, v in t.items() if k in tnames}) if t else None
            out.append(Finding(**item))
    except (KeyError, TypeError) as exc:
        raise OpscopeError(f"{p}: malformed findings ({exc})") from None
    return out


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
