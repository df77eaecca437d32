"""Attention concentration: how peaked each query's distribution is, and how much mass each key receives.

On an attention probability tensor [..., queries, keys] (a Softmax output, or the shadow
softmax of a fused attention op), as it is: no NaN masking. Both keep at most `max_rows`
positions, evenly strided, position 0 always included.
"""

from __future__ import annotations

import numpy as np

from . import merge
from .base import OUTER, Sketch, Tolerance, cap_rows
from .context import TapContext
from .options import SketchOptions, TapInfo


def _build_qmax(c: TapContext) -> dict[str, str]:
    """max over keys (the last axis), then the mean over every leading axis: one value per query."""
    b = c.b
    peak = b.reduce("ReduceMax", c.x, [-1], keepdims=0)
    return {
        "attn_qmax": b.strided(
            b.reduce("ReduceMean", b.rows(peak), [0], keepdims=0), c.options.max_rows, "attn_qmax"
        )
    }


def _build_krecv(c: TapContext) -> dict[str, str]:
    """The sum over every axis but the key axis (the last): one value per key."""
    b = c.b
    return {
        "attn_krecv": b.strided(
            b.reduce("ReduceSum", b.rows(c.x), [0], keepdims=0), c.options.max_rows, "attn_krecv"
        )
    }


def _ref_qmax(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    m = np.asarray(x, np.float64).max(axis=-1)
    return cap_rows(m.reshape(-1, m.shape[-1]).mean(axis=0), o.max_rows)


def _ref_krecv(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    v = np.asarray(x, np.float64)
    return cap_rows(v.reshape(-1, v.shape[-1]).sum(axis=0), o.max_rows)


ATTN_QMAX = Sketch(
    "attn_qmax",
    "attention peak per query: max over keys (last axis), mean over batch and heads, one value per "
    "query position (at most max_rows, evenly strided)",
    build=_build_qmax,
    finalize=lambda r, o: r["attn_qmax"].copy(),
    reference=_ref_qmax,
    merge=merge.CONCAT,
    tol=Tolerance(1e-5, 1e-6),
    vector=True,
    stage=OUTER,
    kinds=("attn",),
    cost="one reduction over keys and a small mean",
)
ATTN_KRECV = Sketch(
    "attn_krecv",
    "attention mass each key receives: sum over batch, heads and queries, one value per key "
    "(at most max_rows, evenly strided, key 0 always kept)",
    build=_build_krecv,
    finalize=lambda r, o: r["attn_krecv"].copy(),
    reference=_ref_krecv,
    merge=merge.SUM,
    tol=Tolerance(1e-5, 1e-6),
    vector=True,
    stage=OUTER,
    kinds=("attn",),
    cost="one reduction keeping the key axis",
)
