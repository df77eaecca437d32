"""Whole-tensor statistics: range, moments, counts. One whole-tensor reduction each, or none.

Non-finite values (NaN, +Inf, -Inf): `nan_count` and `inf_count` count them; every other
statistic here is over the finite elements only (mean and kurtosis divide by the number of
finite elements), except `nnz`, which counts x != 0, and NaN and Inf are != 0. Empty
tensors: counts and sums 0; min, max, mean and kurtosis NaN.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from . import merge
from .base import OnFinite, Sketch, Tolerance, as_f64, finite_values, n_bad, n_finite, ratio, ynorm
from .context import EPS_SCALE, TapContext
from .options import SketchOptions, TapInfo

EPS_KURT = 1e-20


def host_scale(r: dict[str, np.ndarray]) -> float:
    """max|x| + 1e-12 over the finite values, in float32 as the graph computes it (0 + 1e-12 when there
    is none): the unit of histograms and kurtosis, rebuilt on the host from the raws min and max."""
    with np.errstate(invalid="ignore"):
        a = np.maximum(np.abs(np.float32(r["min"][0])), np.abs(np.float32(r["max"][0])))
    return float((a if np.isfinite(a) else np.float32(0)) + EPS_SCALE)


def _finite_or_nan(v: np.ndarray, reduce) -> np.ndarray:
    v = v[np.isfinite(v)]
    return np.array([reduce(v) if v.size else np.nan])


MIN = Sketch(
    "min",
    "smallest finite value",
    build=lambda c: {"min": c.min},
    finalize=lambda r, o: _finite_or_nan(r["min"], np.min),
    reference=OnFinite(np.min),
    merge=merge.MIN,
    cost="one whole-tensor reduction; with max, the check and the If: the shared base, 1.24x plain",
)
MAX = Sketch(
    "max",
    "largest finite value",
    build=lambda c: {"max": c.max},
    finalize=lambda r, o: _finite_or_nan(r["max"], np.max),
    reference=OnFinite(np.max),
    merge=merge.MAX,
    cost="one whole-tensor reduction (in the shared base)",
)
MEAN = Sketch(
    "mean",
    "mean of the finite values",
    build=lambda c: {"ysum": c.ysum, "ynorm": c.ynorm},
    finalize=lambda r, o: np.array([ratio(r["ysum"][0] * ynorm(r), n_finite(r))]),
    reference=OnFinite(np.mean),
    merge=merge.MEAN,
    tol=Tolerance(1e-4, 1e-5),
    cost="one whole-tensor ReduceSum (+0.06x)",
)
L1 = Sketch(
    "l1",
    "sum of |x| over the finite values",
    build=lambda c: {"yl1": c.b.reduce("ReduceL1", c.y, hint="yl1"), "ynorm": c.ynorm},
    finalize=lambda r, o: np.array([r["yl1"][0] * ynorm(r)]),
    reference=OnFinite(lambda v: np.abs(v).sum(), 0.0),
    merge=merge.SUM,
    # onnxruntime's whole-tensor ReduceL1 accumulates in float32: 9e-4 off on captcha_crnn's
    # [400, 4096] weight; a two-stage reduction would be exact-ish but 10-25x slower
    tol=Tolerance(2e-3, 0.0),
    scalars=("yl1",),
    cost="one whole-tensor ReduceL1 (in --sketch all: +0.05x bert_like, +0.13x ppocrv4_det)",
)
SUMSQ = Sketch(
    "sumsq",
    "sum of x² over the finite values",
    build=lambda c: {"yss": c.yss, "ynorm": c.ynorm},
    finalize=lambda r, o: np.array([r["yss"][0] * ynorm(r) ** 2]),
    reference=OnFinite(lambda v: (v * v).sum(), 0.0),
    merge=merge.SUM,
    tol=Tolerance(1e-4, 0.0),
    cost="free: it is the finite check",
)


def _build_nnz(c: TapContext) -> dict[str, str]:
    b = c.b
    return {
        "nnz": b.reduce("ReduceSum", b.cast(b.cast(c.xs, TensorProto.BOOL), TensorProto.FLOAT), hint="nnz")
    }


NNZ = Sketch(
    "nnz",
    "count of x != 0 (NaN and Inf count: they are != 0)",
    build=_build_nnz,
    finalize=lambda r, o: np.array([r["nnz"][0] + n_bad(r)]),
    reference=lambda x, info, o: np.array([float(np.count_nonzero(as_f64(x)))]),
    merge=merge.SUM,
    scalars=("nnz",),
    cost="two cast passes (to bool, to float) and a ReduceSum (+0.14x bert_like, +0.23x ppocrv4_det); Sign ~10x slower",
)
NAN_COUNT = Sketch(
    "nan_count",
    "number of NaN values",
    build=lambda c: {},  # raws nan and inf come with every finite-stage tap
    finalize=lambda r, o: r["nan"][:1].copy(),
    reference=lambda x, info, o: np.array([float(np.isnan(as_f64(x)).sum())]),
    merge=merge.SUM,
    cost="free on clean tensors: counted only in the masking branch",
)
INF_COUNT = Sketch(
    "inf_count",
    "number of +Inf and -Inf values",
    build=lambda c: {},
    finalize=lambda r, o: r["inf"][:1].copy(),
    reference=lambda x, info, o: np.array([float(np.isinf(as_f64(x)).sum())]),
    merge=merge.SUM,
    cost="free on clean tensors",
)


def _build_kurtosis(c: TapContext) -> dict[str, str]:
    """Moments of d = (x - mean) / scale: |d| <= 2, so d^4 cannot overflow."""
    b = c.b
    mean = b.op("Div", [c.ysum, c.n_finite])
    if c.slow:
        d = b.where(c.bad, b.const(0.0), b.op("Sub", [c.y, mean]))
    else:
        # (x - mean) / sqrt(scale²) as BatchNormalization on x viewed as [1, 1, n]: onnxruntime runs it
        # as one pass x·a + b, 25-30% faster than Sub then Div (197 vs 278 us on [512, 768]). Its
        # rounding is unbiased, so the kurtosis is as close as Sub then Div's (1e-4 at |mean| = 1e4·std).
        one = b.i64([1])
        d = b.op(
            "BatchNormalization",
            [
                b.op("Reshape", [c.x, b.i64([1, 1, -1])]),
                b.const([1.0]),
                b.const([0.0]),
                b.op("Reshape", [mean, one]),
                b.op("Reshape", [b.op("Mul", [c.scale, c.scale]), one]),
            ],
            epsilon=0.0,
        )
    d2 = b.op("Mul", [d, d])
    m2, m4 = b.reduce("ReduceSum", d2, hint="m2"), b.reduce("ReduceSumSquare", d2, hint="m4")
    return {"min": c.min, "max": c.max, "m2": m2, "m4": m4}


def _finalize_kurtosis(r: dict[str, np.ndarray], o: SketchOptions) -> np.ndarray:
    nf, s = n_finite(r), host_scale(r)  # m2, m4 are moments of (x - mean) / scale
    if nf <= 0:
        return np.array([np.nan])
    m2 = r["m2"][0] / nf * s**2
    m4 = r["m4"][0] / nf * s**4
    return np.array([m4 / (m2 * m2 + EPS_KURT)])


def _ref_kurtosis(x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    v = finite_values(x)
    if not v.size:
        return np.array([np.nan])
    d = v - v.mean()
    d2 = d * d  # not d**4: numpy's pow is ~10x slower than two multiplies on a 16M-element weight
    m2, m4 = np.mean(d2), np.mean(d2 * d2)
    return np.array([m4 / (m2 * m2 + EPS_KURT)])


KURTOSIS = Sketch(
    "kurtosis",
    "E[(x-mu)^4] / (E[(x-mu)^2]^2 + 1e-20) over the finite values",
    build=_build_kurtosis,
    finalize=_finalize_kurtosis,
    reference=_ref_kurtosis,
    merge=merge.MEAN,
    tol=Tolerance(2e-3, 0.0),
    scalars=("m2", "m4"),
    cost="an affine pass (BatchNormalization), a square and two reductions (+0.30x bert_like, +0.55x ppocrv4_det)",
)
