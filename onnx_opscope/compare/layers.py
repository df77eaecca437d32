"""Layer by layer: how far the statistics of the same sites drift between two runs.

Both sides get the *same* taps, so only small statistics are compared, never the tensors:
memory stays constant however deep the model. Each (site, role, stat) gets a divergence,
max|Δ| over a scale:

- min / max: over the tensor's max|x| on A (so a min near 0 does not inflate it);
- nan_count / inf_count: infinite as soon as the counts differ;
- every other statistic (sumsq, attn_qmax, route_load, ...): over max|value| on A.
"""

from __future__ import annotations

import numpy as np

from ..instrument import Rows

LAYER_SKETCHES = ("min", "max", "sumsq", "nan_count", "inf_count")

Key = tuple[str, str, str]  # site, role, stat


def by_key(rows: Rows) -> dict[Key, np.ndarray]:
    out: dict[Key, list[float]] = {}
    for site, role, stat, v in zip(rows.site, rows.role, rows.stat, rows.value):
        out.setdefault((site, role, stat), []).append(v)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def divergence(stat: str, va: np.ndarray, vb: np.ndarray, absmax: float | None) -> float:
    if va.shape != vb.shape:
        return float("inf")
    if stat in ("nan_count", "inf_count"):
        return 0.0 if np.array_equal(va, vb) else float("inf")
    fa, fb = np.isfinite(va), np.isfinite(vb)
    if np.any(fa != fb):
        return float("inf")
    if not fa.any():
        return 0.0
    d = float(np.max(np.abs(va[fa] - vb[fa])))
    scale = absmax if stat in ("min", "max") and absmax else float(np.max(np.abs(va[fa])))
    return d / scale if scale > 0 else (0.0 if d == 0 else float("inf"))


def layer_divergences(rows_a: Rows, rows_b: Rows) -> dict[Key, float]:
    """(site, role, stat) -> divergence of B from A, for every statistic both runs have."""
    ka, kb = by_key(rows_a), by_key(rows_b)
    out = {}
    for key, va in ka.items():
        if key not in kb:
            continue
        site, role, stat = key
        lo, hi = ka.get((site, role, "min")), ka.get((site, role, "max"))
        absmax = None
        if lo is not None and hi is not None and np.isfinite(lo).all() and np.isfinite(hi).all():
            absmax = float(max(np.abs(lo).max(), np.abs(hi).max()))
        out[key] = divergence(stat, va, kb[key], absmax)
    return out
