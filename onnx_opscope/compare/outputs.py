"""The one output comparator: how far model B's outputs are from model A's, and whether that is within a tolerance.

Used by the record parity gate (is the instrumented model a drop-in?) and by `parity`
(does a rewrite or another provider keep the outputs?). Per output:

- max_abs = max|a - b| over the elements finite on both sides;
- scale = max|a| over those elements; max_rel = max_abs / scale;
- cosine of the two (finite elements); when the output looks like logits (classes on the last
  axis): top-1 agreement, top-5 (B's top class among A's five best) and the mean over rows of
  KL(P_a || P_b), P the row's softmax (the row itself when it is already a distribution);
- nonfinite_mismatch: elements NaN/Inf on one side only, or different non-finite values.

A mismatch in shape or in non-finite values makes max_abs and max_rel infinite.
`within(m, rtol, atol)`: max_abs <= atol + rtol * scale for float outputs; other dtypes must
be equal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

_MEANS = ("top1", "top5", "kl")  # averaged over rows across batches (the rest take the worst)
_LOGIT_NAMES = re.compile(r"logit|prob|score|softmax|class|cls|pred", re.IGNORECASE)


def looks_like_logits(name: str, x: np.ndarray) -> bool:
    """Float, rank >= 2, classes on the last axis, and a telling name or rows that are distributions."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating) or x.ndim < 2 or x.shape[-1] < 2 or x.size == 0:
        return False
    if _LOGIT_NAMES.search(name):
        return True
    v = x.astype(np.float64)
    return bool(np.all((v >= 0) & (v <= 1)) and np.allclose(v.sum(-1), 1.0, atol=1e-3))


def _distribution(x: np.ndarray) -> np.ndarray:
    """Rows as probabilities: themselves when they already are, else their softmax (float64)."""
    v = x.astype(np.float64)
    if np.all((v >= 0) & (v <= 1)) and np.allclose(v.sum(-1), 1.0, atol=1e-3):
        return v
    e = np.exp(v - v.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def class_metrics(a: np.ndarray, b: np.ndarray) -> dict:
    """top1, top5 and kl of two logits-like outputs of one shape (classes on the last axis)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    if not (np.isfinite(a2).all() and np.isfinite(b2).all()):
        return {"top1": float(np.mean(np.argmax(a2, -1) == np.argmax(b2, -1))), "top5": None, "kl": None}
    best_b = np.argmax(b2, -1)
    k = min(5, a2.shape[-1])
    top5 = np.argpartition(-a2, k - 1, axis=-1)[:, :k]
    p, q = _distribution(a2), _distribution(b2)
    kl = np.sum(p * (np.log(np.maximum(p, 1e-12)) - np.log(np.maximum(q, 1e-12))), axis=-1)
    return {
        "top1": float(np.mean(np.argmax(a2, -1) == best_b)),
        "top5": float(np.mean((top5 == best_b[:, None]).any(-1))),
        "kl": float(np.mean(kl)),
    }


def output_metrics(name: str, a: np.ndarray, b: np.ndarray) -> dict:
    """max_abs, max_rel, scale, cosine, top1 / top5 / kl (None unless logits-like), nonfinite_mismatch,
    exact (a non-float dtype)."""
    a, b = np.asarray(a), np.asarray(b)
    exact = a.dtype.kind not in "fc"
    if a.shape != b.shape:
        return {"shape_a": list(a.shape), "shape_b": list(b.shape), "max_abs": float("inf"), "max_rel": float("inf"),
                "scale": 0.0, "cosine": float("nan"), "top1": None, "top5": None, "kl": None,
                "nonfinite_mismatch": 0, "exact": exact}  # fmt: skip
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    fx, fy = np.isfinite(x), np.isfinite(y)
    same_bad = ~fx & ~fy & ((np.isnan(x) & np.isnan(y)) | (x == y))
    mismatch = int(np.count_nonzero((fx != fy) | (~fx & ~fy & ~same_bad)))
    both = fx & fy
    d = np.abs(x[both] - y[both])
    max_abs = float(d.max()) if d.size else 0.0
    scale = float(np.abs(x[both]).max()) if d.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    nx, ny = np.linalg.norm(x[both]), np.linalg.norm(y[both])
    cosine = float(x[both] @ y[both] / (nx * ny)) if nx > 0 and ny > 0 else (1.0 if nx == ny else 0.0)
    classes = class_metrics(a, b) if looks_like_logits(name, a) else {"top1": None, "top5": None, "kl": None}
    if mismatch:
        max_abs = max_rel = float("inf")
    return {"max_abs": max_abs, "max_rel": max_rel, "scale": scale, "cosine": cosine, **classes,
            "nonfinite_mismatch": mismatch, "exact": exact}  # fmt: skip


def within(m: dict, rtol: float, atol: float) -> bool:
    """Whether metrics `m` are within tolerance: exact for non-float outputs, atol + rtol * scale otherwise."""
    if m["nonfinite_mismatch"] or "shape_a" in m:
        return False
    if m["exact"]:
        return m["max_abs"] == 0
    return m["max_abs"] <= atol + rtol * m["scale"]


def compare_outputs(
    a: Mapping[str, np.ndarray] | Sequence, b: Mapping[str, np.ndarray] | Sequence
) -> dict[str, dict]:
    """name -> `output_metrics`. Dicts are matched by name (names in only one side are left out; with no
    name in common and as many outputs, by position); sequences by position, named `output_<i>`."""
    if not isinstance(a, Mapping):
        a = {f"output_{i}": v for i, v in enumerate(a)}
    if not isinstance(b, Mapping):
        b = {f"output_{i}": v for i, v in enumerate(b)}
    common = [n for n in a if n in b]
    if not common and len(a) == len(b):
        return {f"{na}|{nb}": output_metrics(na, a[na], b[nb]) for na, nb in zip(a, b)}
    return {n: output_metrics(n, a[n], b[n]) for n in common}


def worst_of(acc: dict | None, new: dict, rows: int) -> dict:
    """Metrics over batches: max of max_abs / max_rel, min cosine; top-1, top-5 and KL weighted by rows."""
    if acc is None:
        return {**new, "_rows": rows, **{f"_{k}_sum": (new.get(k) or 0.0) * rows for k in _MEANS}}
    out = dict(acc)
    out["max_abs"] = max(acc["max_abs"], new["max_abs"])
    out["max_rel"] = max(acc["max_rel"], new["max_rel"])
    out["scale"] = max(acc["scale"], new["scale"])
    out["cosine"] = min(acc["cosine"], new["cosine"])
    out["nonfinite_mismatch"] = acc["nonfinite_mismatch"] + new["nonfinite_mismatch"]
    out["_rows"] = acc["_rows"] + rows
    for k in _MEANS:
        if new.get(k) is not None and acc.get(k) is not None:
            out[f"_{k}_sum"] = acc[f"_{k}_sum"] + new[k] * rows
            out[k] = out[f"_{k}_sum"] / out["_rows"]
    for k in ("shape_a", "shape_b"):
        if k in new:
            out[k] = new[k]
    return out


@dataclass
class DropIn:
    """The record parity gate's verdict: do the instrumented model's own outputs match the plain model's?"""

    ok: bool
    worst_output: str | None
    max_abs: float
    max_rel: float
    rtol: float
    atol: float


def check_drop_in(names: Sequence[str], plain: Sequence[np.ndarray], tapped: Sequence[np.ndarray],
                  rtol: float, atol: float) -> DropIn:  # fmt: skip
    """Every output `within` (rtol, atol) of the plain model's; names the worst one (largest max_rel)."""
    worst, worst_m, ok = None, None, True
    for name, a, b in zip(names, plain, tapped):
        m = output_metrics(name, a, b)
        bad = not within(m, rtol, atol)
        ok = ok and not bad
        if (
            worst_m is None
            or m["max_rel"] > worst_m["max_rel"]
            or (bad and m["max_rel"] >= worst_m["max_rel"])
        ):
            worst, worst_m = name, m
    if worst_m is None:
        return DropIn(True, None, 0.0, 0.0, rtol, atol)
    return DropIn(ok, worst, worst_m["max_abs"], worst_m["max_rel"], rtol, atol)
