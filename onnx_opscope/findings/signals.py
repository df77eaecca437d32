"""Scale-free signals of one batch of one (site, role), and what a series of steps says.

Histogram shares are count / sum of counts, so the sampled histogram (~4096 elements) and the
exact one read the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .config import MineConfig

SIGNALS = (
    "density", "outlier", "histtop", "hist_peak", "hist_gaps", "levels", "pos_cv", "adj", "kurtosis", "nonfinite",
)  # fmt: skip
# How much evidence a rule's signal stands on: the rules' minimum sizes (`rules.Rule.support`) read these.
SUPPORT = ("numel", "hist_per_bin", "channels", "rows")


def _finite(v: np.ndarray | None) -> np.ndarray:
    if v is None:
        return np.zeros(0)
    v = np.asarray(v, dtype=np.float64)
    return v[np.isfinite(v)]


def scalar(stats: Mapping[str, np.ndarray], name: str) -> float:
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


def hist_peak(hist: np.ndarray) -> float:
    """The largest bin over the fuller of the bins beside it: >= 3 where values pile on one value (a
    saturation level, a padding value), ~1 in the middle of a continuous density however peaked (a
    Gaussian, a Laplace, rows of different scales), 1.7 at the edge of an exponential. Empty
    neighbours count as a millionth of the histogram, so the ratio stays finite."""
    h = _finite(hist)
    if not h.size or h.sum() <= 0:
        return math.nan
    i = int(np.argmax(h))
    beside = max((h[j] for j in (i - 1, i + 1) if 0 <= j < h.size), default=0.0)
    return float(h[i] / max(beside, 1e-6 * h.sum()))


def step_signals(stats: Mapping[str, np.ndarray], numel: int | None, cfg: MineConfig | None = None) -> dict:
    """The signals of one batch of one (site, role); NaN where the sketches needed are absent."""
    cfg = cfg or MineConfig()
    n = float(numel) if numel else math.nan
    s: dict[str, float] = dict.fromkeys(SIGNALS + SUPPORT, math.nan)
    s["numel"] = n
    with np.errstate(all="ignore"):
        s["density"] = scalar(stats, "nnz") / n
        bad = [scalar(stats, k) for k in ("nan_count", "inf_count")]
        if any(math.isfinite(b) for b in bad):
            s["nonfinite"] = sum(b for b in bad if math.isfinite(b)) / n
        cm = _finite(stats.get("chan_maxabs"))
        s["channels"] = float(cm.size) if cm.size else math.nan
        s["outlier"] = (
            float(cm.max() / cm.mean()) if cm.size and cm.mean() > 0 else scalar(stats, "chan_outlier")
        )
        h = _finite(stats.get("hist"))
        if h.size and h.sum() > 0:
            s["histtop"] = float(h.max() / h.sum())
            s["hist_peak"] = hist_peak(h)
            s["hist_gaps"] = hist_gaps(h, cfg.gaps_mass)
            s["levels"] = float(np.count_nonzero(h))
            s["hist_per_bin"] = float(h.sum() / h.size)
        p = _finite(stats.get("pos_sumsq"))
        # rows: the positions the channels are measured over (pos_sumsq keeps at most max_rows of them)
        s["rows"] = float(p.size) if p.size else (n / cm.size if cm.size else math.nan)
        if p.size > 1 and p.mean() != 0:
            s["pos_cv"] = float(p.std() / abs(p.mean()))
        a = _finite(stats.get("adj_sumsq"))
        if a.size and p.size and p.mean() > 0:
            s["adj"] = float(a.mean() / p.mean())
        s["kurtosis"] = scalar(stats, "kurtosis")
    return {k: (float(v) if math.isfinite(v) else math.nan) for k, v in s.items()}


def persistent_outlier(chan_maxabs: Sequence[np.ndarray]) -> float:
    """max/mean of each channel's smallest max|x| over the steps (NaN: fewer than two steps that agree
    on the channel count). Outlier channels are large at every step, as real ones are; a heavy tail
    puts its largest value in another channel each batch, so its smallest maxima are unremarkable."""
    steps = [_finite(c) for c in chan_maxabs]
    steps = [c for c in steps if c.size]
    if len(steps) < 2 or len({c.size for c in steps}) != 1:
        return math.nan
    m = np.min(np.stack(steps), axis=0)
    return float(m.max() / m.mean()) if m.mean() > 0 else math.nan


def chance_cv(stat: str, stats: Mapping[str, np.ndarray], numel: int | None) -> float:
    """The coefficient of variation over steps that `stat` (l1 or sumsq) of `numel` fresh values drawn
    like these would have by chance: sqrt(Var|x| / n) / E|x| for l1, sqrt((kurtosis - 1) / n) for
    sumsq (kurtosis 3 when it was not recorded). NaN when unknown. The norm of a million fresh Gaussian
    values moves by 8e-4 from batch to batch, of a hundred million by 8e-5: below `stationary_cv`."""
    if not numel:
        return math.nan
    m1, m2 = scalar(stats, "l1") / numel, scalar(stats, "sumsq") / numel
    if stat == "l1":
        return math.sqrt(max(m2 - m1 * m1, 0.0) / numel) / m1 if m1 > 0 and math.isfinite(m2) else math.nan
    kurtosis = scalar(stats, "kurtosis")
    return math.sqrt(max((kurtosis if math.isfinite(kurtosis) else 3.0) - 1.0, 0.0) / numel)


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
        # an all-zero fingerprint (16 positions that all fell on zeros of a sparse tensor) says nothing:
        # it neither repeats nor stands still
        seen = [bool(np.any(np.nan_to_num(e.astype(np.float64)) != 0)) for e in sigs]
        repeats = sum(
            seen[t] and any(rel_dist(sigs[t], sigs[u]) < cfg.repeat_dist for u in range(t))
            for t in range(1, len(sigs))
        )
        repeat = repeats / len(sigs)
        steps = np.array(
            [rel_dist(sigs[t], sigs[t - 1]) for t in range(1, len(sigs)) if seen[t] or seen[t - 1]]
        )
        if steps.size:
            drift, drift_sigma = float(np.mean(steps)), float(np.std(steps))
    return {"l1_cv": l1_cv, "repeat_share": repeat, "drift": drift, "drift_sigma": drift_sigma}


def nanmean(vals: Sequence[float]) -> float:
    v = np.asarray(vals, np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


def nanstd(vals: Sequence[float]) -> float:
    v = np.asarray(vals, np.float64)
    v = v[np.isfinite(v)]
    return float(v.std()) if v.size > 1 else math.nan


def finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)
