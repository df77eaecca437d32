"""Cheap probes of a weight matrix, and a hint per weight of the representation that would pay.

Every probe is a pure numpy function of a float32 [rows, cols] matrix w (rows = output channels,
`weights.matrix`), with no SVD, so the probes of a 100M-parameter model take seconds
(scripts/bench_weights.py):

- `stable_rank` = ||W||_F^2 / sigma_max^2, sigma_max^2 by 30 power iterations (fixed seed) on the
  smaller Gram matrix (W^T W or W W^T): formed when its side is at most 256 (BLAS-3, cheaper than
  the 60 products it replaces), applied as two matrix-vector products otherwise;
- `quant_error`: symmetric round-to-nearest, levels = 2^(bits-1) - 1, scale = amax / levels per
  tensor, per output channel (row) or per group of `group` columns, relative L2 error
  sqrt(sum (w - q)^2 / sum w^2). No clip is needed: |w / scale| <= levels by construction;
- `nm_error`: keep the n largest |w| of each m consecutive columns of a row (2:4);
- `ternary_error` (TWN, per tensor): delta = 0.7 mean|w|, alpha = mean |w| over |w| > delta,
  w -> alpha sign(w) where |w| > delta, else 0;
- `cardinality`: distinct round(w * round_to) values, capped, and `rounding_error`, the relative L2
  error of w rounded to that grid: an absolute grid says little about small weights (a 128x32
  weight of |w| < 3e-4 rounds to one value at x1000), so the palette hint needs both;
- `outlier_channels`: input columns whose max |w| is over `ratio` x the median of the columns' max.

Columns that do not fill the last group or N:M chunk are padded with zeros: zeros quantize and
prune exactly, so padding adds no error and moves no amax. A weight with a NaN or inf raises
OpscopeError naming it (rather than probes that would all read NaN). An all-zero weight has every
error 0, stable rank 0 and hint "all zero (remove)".

The scans go over blocks of rows of ~256k elements, so each block and its temporaries stay in
cache across the several passes a probe makes: whole-matrix numpy passes on a 100 MB weight
were bound by memory bandwidth instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..errors import OpscopeError
from ..graph.io import ModelLike
from .matrix import WeightView
from .nbits import find_weights_packed

GROUPS = (32, 128)
"""Group sizes measured by `probe` (along the input axis)."""
HINT_BITS = (4, 8)
"""Always measured by `probe`, whatever `bits` asks: the hints name int4 and int8."""
BLOCK = 1 << 18
"""Elements per row block of the scans (1 MiB of float32)."""
GRAM_MAX = 256
"""Largest Gram side `stable_rank` forms; wider matrices are iterated with matrix-vector products."""
BITMAP_MAX = 1 << 24
"""Widest range of rounded values `cardinality` counts with a bitmap (16 MB); wider: sorted merges."""

HINT_ZERO = "all zero (remove)"
HINT_SPARSE = "2:4 sparse (sparse tensor cores)"
HINT_LUT = "palettize / LUT"
HINT_LOWRANK = "factored matmul (low rank)"
HINT_MIXED = "mixed int4 (AWQ/SmoothQuant-style)"
HINT_GROUPED = "grouped int4"
HINT_INT4 = "int4 per channel"
HINT_INT8 = "int8 per channel"
HINT_KEEP = "keep fp16/bf16"


# --------------------------------------------------------------------------------------------
# the probes


def stable_rank(w: np.ndarray, iters: int = 30, seed: int = 0) -> float:
    """||w||_F^2 / sigma_max^2 (0 for an all-zero w); much below min(rows, cols) means low rank."""
    fro = _sumsq(w)
    if fro == 0:
        return 0.0
    rows, cols = w.shape
    by_cols = cols <= rows  # iterate on W^T W (cols x cols) or W W^T (rows x rows), the smaller
    side = cols if by_cols else rows
    if side <= GRAM_MAX:
        gram = w.T @ w if by_cols else w @ w.T
        step: Callable[[np.ndarray], np.ndarray] = gram.__matmul__
    else:
        step = (lambda v: (w @ v) @ w) if by_cols else (lambda v: w @ (v @ w))
    v = np.random.default_rng(seed).standard_normal(side).astype(np.float32)
    v /= np.linalg.norm(v)
    for _ in range(iters):
        u = step(v)
        norm = float(np.linalg.norm(u))
        if norm == 0:
            break
        v = u / norm
    sigma2 = float(v @ step(v))  # Rayleigh quotient of the Gram matrix at the unit vector v
    return fro / sigma2 if sigma2 > 0 else 0.0


def quant_errors(
    w: np.ndarray, bits: Iterable[int] = (3, 4, 6, 8), granularity: str = "channel", group: int = 128
) -> dict[int, float]:
    """bits -> `quant_error(w, bits, granularity, group)` for several widths, sharing the amax pass."""
    widths = list(bits)
    for b in widths:
        if not 2 <= b <= 16:
            raise OpscopeError(f"cannot quantize to {b} bits: symmetric quantization needs 2 to 16")
    if granularity not in ("tensor", "channel", "group"):
        raise OpscopeError(f"unknown granularity {granularity!r}: expected tensor, channel or group")
    if granularity == "group" and group < 1:
        raise OpscopeError(f"group size {group} must be at least 1")
    total = _sumsq(w)
    if total == 0:
        return dict.fromkeys(widths, 0.0)
    tensor_amax = _amax(w) if granularity == "tensor" else None
    sums = dict.fromkeys(widths, 0.0)
    for block in _row_blocks(w):
        x = _padded(block, group).reshape(block.shape[0], -1, group) if granularity == "group" else block
        if tensor_amax is not None:
            amax = np.float32(tensor_amax)
        else:
            amax = np.abs(x).max(axis=-1, keepdims=True)
            amax[amax == 0] = 1  # an all-zero row or group quantizes exactly at any scale
        for b in widths:
            scale = amax / np.float32(2 ** (b - 1) - 1)
            d = np.rint(x / scale)
            d *= scale
            d -= x
            sums[b] += _dot(d)
    return {b: math.sqrt(sums[b] / total) for b in widths}


def quant_error(w: np.ndarray, bits: int, granularity: str = "tensor", group: int = 128) -> float:
    """Relative L2 error of symmetric `bits`-bit quantization, a scale per tensor, row or group of columns."""
    return quant_errors(w, (bits,), granularity, group)[bits]


def best_bits(w: np.ndarray, budget: float = 0.02, bits: Sequence[int] = (3, 4, 6, 8)) -> int | None:
    """The fewest of `bits` whose per-channel error is under `budget`; None when none is."""
    return _first_under(quant_errors(w, bits, "channel"), budget)


def nm_error(w: np.ndarray, n: int = 2, m: int = 4) -> float:
    """Relative L2 error of keeping the `n` largest |w| of every `m` consecutive columns of each row."""
    if not 0 <= n <= m or m < 1:
        raise OpscopeError(f"N:M sparsity needs 0 <= N <= M and M >= 1, got {n}:{m}")
    total = _sumsq(w)
    if total == 0 or n == m:
        return 0.0
    dropped = 0.0
    for block in _row_blocks(w):
        sq = np.square(_padded(block, m)).reshape(-1, m)
        dropped += float(np.partition(sq, m - n - 1, axis=1)[:, : m - n].sum(dtype=np.float64))
    return math.sqrt(dropped / total)


def ternary_error(w: np.ndarray) -> float:
    """Relative L2 error of ternary weights (TWN, one alpha per tensor)."""
    total = _sumsq(w)
    if total == 0:
        return 0.0
    delta = 0.7 * sum(float(np.abs(b).sum(dtype=np.float64)) for b in _row_blocks(w)) / w.size
    kept_sum = kept_n = 0.0
    for block in _row_blocks(w):
        a = np.abs(block)
        mask = a > delta
        kept_sum += float(np.sum(a, where=mask, dtype=np.float64))
        kept_n += int(np.count_nonzero(mask))
    # sum over kept (|w| - alpha)^2 + sum over dropped w^2 = total - kept_sum^2 / kept_n at alpha's mean
    return math.sqrt(max(total - kept_sum**2 / kept_n, 0.0) / total)


def cardinality(w: np.ndarray, round_to: float = 1000, cap: int = 100_000) -> int:
    """Distinct values of round(w * round_to), `cap` once there are that many or more."""
    lo = math.floor(float(w.min()) * round_to - 1)
    span = math.ceil(float(w.max()) * round_to + 1) - lo + 1
    if span <= BITMAP_MAX:
        seen = np.zeros(span, dtype=bool)
        for block in _row_blocks(w):
            seen[np.rint(block * np.float64(round_to)).astype(np.int64) - lo] = True
        return min(int(np.count_nonzero(seen)), cap)
    distinct = np.empty(0)
    for block in _row_blocks(w):
        distinct = np.union1d(distinct, np.rint(block * np.float64(round_to)))
        if distinct.size >= cap:
            return cap
    return int(distinct.size)


def rounding_error(w: np.ndarray, round_to: float = 1000) -> float:
    """Relative L2 error of w rounded to the grid `cardinality` counts on (round(w * round_to) / round_to)."""
    total = _sumsq(w)
    if total == 0:
        return 0.0
    err = 0.0
    for block in _row_blocks(w):
        d = np.rint(block * np.float32(round_to))
        d /= np.float32(round_to)
        d -= block
        err += _dot(d)
    return math.sqrt(err / total)


def outlier_channels(w: np.ndarray, ratio: float = 6.0) -> tuple[np.ndarray, float]:
    """(input columns whose max |w| exceeds `ratio` x the median column max, max / median).

    A zero median with a nonzero column gives max / median = inf, and every nonzero column an outlier.
    """
    colmax = np.zeros(w.shape[1], np.float32)
    for block in _row_blocks(w):
        np.maximum(colmax, np.abs(block).max(axis=0, initial=0), out=colmax)
    top = float(colmax.max(initial=0))
    median = float(np.median(colmax)) if colmax.size else 0.0
    if top == 0:
        return np.empty(0, np.int64), 0.0
    return np.flatnonzero(colmax > ratio * median), (top / median if median > 0 else math.inf)


# --------------------------------------------------------------------------------------------
# one weight, every probe, and its hint


@dataclass(frozen=True)
class Probe:
    """Every probe of one weight, beside where it lives (`WeightView`'s fields) and the hint they give.

    `quant` maps "int<bits>_<granularity>" to the relative error: granularity "tensor", "channel",
    "g32" or "g128" (per group of that many columns), for `bits` plus 4 and 8 (`HINT_BITS`).
    """

    name: str
    graph: str
    op: str
    node: str
    shape: tuple[int, ...]
    dtype: str
    out_axis: int
    rows: int
    cols: int
    stable_rank: float
    quant: dict[str, float] = field(hash=False)
    best_bits: int | None
    nm_error: float  # 2:4
    ternary_error: float
    cardinality: int  # distinct round(w * 1000), capped at 100k
    rounding_error: float  # relative L2 error of round(w * 1000) / 1000
    outliers: tuple[int, ...]  # outlier input columns (ratio 6)
    outlier_ratio: float  # max / median of the columns' max |w|
    hint: str

    @property
    def view(self) -> WeightView:
        return WeightView(self.name, self.graph, self.op, self.node, self.shape, self.dtype,
                          self.out_axis, self.rows, self.cols)  # fmt: skip

    @property
    def dense_bytes(self) -> int:
        return self.view.dense_bytes


def probe(
    view: WeightView, w: np.ndarray, *, budget: float = 0.02, bits: Sequence[int] = (3, 4, 6, 8)
) -> Probe:
    """Every probe of the [rows, cols] matrix `w` of the weight `view`, and the hint they give."""
    amax = _amax(w)
    if not math.isfinite(amax):
        raise OpscopeError(
            f"weight {view.name!r} has NaN or inf values: it cannot be probed",
            hint="fix the weight in the model (an export or training bug)",
        )
    measured = sorted(set(bits) | set(HINT_BITS))
    quant: dict[str, float] = {}
    for gran, group, key in (("tensor", 0, "tensor"), ("channel", 0, "channel"),
                             *(("group", g, f"g{g}") for g in GROUPS)):  # fmt: skip
        for b, err in quant_errors(w, measured, gran, group).items():
            quant[f"int{b}_{key}"] = err
    channel = {b: quant[f"int{b}_channel"] for b in sorted(bits)}
    outliers, ratio = outlier_channels(w)
    values = dict(
        stable_rank=stable_rank(w),
        quant=quant,
        best_bits=_first_under(channel, budget),
        nm_error=nm_error(w),
        ternary_error=ternary_error(w),
        cardinality=cardinality(w),
        rounding_error=rounding_error(w),
        outliers=tuple(int(i) for i in outliers),
        outlier_ratio=ratio,
    )
    return Probe(**vars(view), **values, hint=_hint(view, amax, budget, **values))


def _hint(view: WeightView, amax: float, budget: float, **v) -> str:
    """First match wins (issue 14), after two cases the rules mean nothing for: an all-zero weight, and
    a vector (one dim over 1: a bias, a norm's scale; nothing to prune, factor or share a scale over).

    Three guards on the issue's rules: 2:4 needs 4 columns (padding alone makes a narrower row 2:4
    sparse); a palette needs its values to be the weight's (rounding error under the budget: at
    x1000, transformer_tiny_lm's fc2 weights, all under 3e-4, have one value, 0); and low rank is
    stable rank < 0.10 x min(rows, cols), not x cols: the stable rank is at most min(rows, cols),
    so "x cols" fires on any wide matrix whatever it holds (captcha_crnn: 19 of its 29 matrices,
    64x576 convs of stable rank 15-22 among them; x min(rows, cols): 4).
    """
    q = v["quant"]
    if amax == 0:
        return HINT_ZERO
    if sum(d > 1 for d in view.shape) <= 1:
        return HINT_KEEP
    if view.cols >= 4 and v["nm_error"] < 0.10:
        return HINT_SPARSE
    if v["cardinality"] <= 32 and v["rounding_error"] < budget:
        return HINT_LUT
    if v["stable_rank"] < 0.10 * min(view.rows, view.cols):
        return HINT_LOWRANK
    if len(v["outliers"]) and v["outlier_ratio"] > 8:
        return HINT_MIXED
    if q["int4_channel"] < 0.05 <= q["int4_tensor"]:
        return HINT_GROUPED
    if q["int4_channel"] < budget:
        return HINT_INT4
    if q["int8_channel"] < budget:
        return HINT_INT8
    return HINT_KEEP


def probe_weights(
    model: ModelLike,
    *,
    budget: float = 0.02,
    bits: Sequence[int] = (3, 4, 6, 8),
    base_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Probe]:
    """`probe` of every float weight of `model` (`weights.matrix`), one tensor in memory at a time.

    `progress(done, total, name)` is called after each weight.
    """
    found = find_weights_packed(model, base_dir=base_dir)  # MatMulNBits' packed weights too, dequantized
    out = []
    for done, (view, load) in enumerate(found, 1):
        w = load()
        out.append(probe(view, w, budget=budget, bits=bits))
        del w
        if progress is not None:
            progress(done, len(found), view.name)
    return out


def probes_table(probes: Sequence[Probe]) -> pa.Table:
    """One row per weight, flat columns (Parquet that pandas, polars and DuckDB read as is).

    `shape` is "256x1024", `outliers` the outlier columns' count and `outlier_columns` them,
    space-separated; one float column per entry of `Probe.quant`.
    """
    quant_keys = list(dict.fromkeys(k for p in probes for k in p.quant))
    cols: dict[str, pa.Array] = {
        "name": pa.array([p.name for p in probes], pa.string()),
        "graph": pa.array([p.graph for p in probes], pa.string()),
        "op": pa.array([p.op for p in probes], pa.string()),
        "node": pa.array([p.node for p in probes], pa.string()),
        "shape": pa.array(["x".join(map(str, p.shape)) for p in probes], pa.string()),
        "dtype": pa.array([p.dtype for p in probes], pa.string()),
        "out_axis": pa.array([p.out_axis for p in probes], pa.int32()),
        "rows": pa.array([p.rows for p in probes], pa.int64()),
        "cols": pa.array([p.cols for p in probes], pa.int64()),
        "dense_bytes": pa.array([p.dense_bytes for p in probes], pa.int64()),
        "stable_rank": pa.array([p.stable_rank for p in probes], pa.float64()),
        **{k: pa.array([p.quant.get(k) for p in probes], pa.float64()) for k in quant_keys},
        "best_bits": pa.array([p.best_bits for p in probes], pa.int32()),
        "nm_error": pa.array([p.nm_error for p in probes], pa.float64()),
        "ternary_error": pa.array([p.ternary_error for p in probes], pa.float64()),
        "cardinality": pa.array([p.cardinality for p in probes], pa.int64()),
        "rounding_error": pa.array([p.rounding_error for p in probes], pa.float64()),
        "outliers": pa.array([len(p.outliers) for p in probes], pa.int64()),
        "outlier_columns": pa.array([" ".join(map(str, p.outliers)) for p in probes], pa.string()),
        "outlier_ratio": pa.array([p.outlier_ratio for p in probes], pa.float64()),
        "hint": pa.array([p.hint for p in probes], pa.string()),
    }
    return pa.table(cols)


# --------------------------------------------------------------------------------------------
# scans


def _row_blocks(w: np.ndarray) -> Iterator[np.ndarray]:
    step = max(1, BLOCK // max(w.shape[1], 1))
    for r in range(0, w.shape[0], step):
        yield w[r : r + step]


def _padded(block: np.ndarray, multiple: int) -> np.ndarray:
    """`block` with zero columns appended up to a multiple of `multiple` (itself when it is one)."""
    extra = -block.shape[1] % multiple
    return np.pad(block, ((0, 0), (0, extra))) if extra else block


def _dot(x: np.ndarray) -> float:
    flat = x.reshape(-1)
    return float(np.dot(flat, flat))


def _sumsq(w: np.ndarray) -> float:
    return sum(_dot(b) for b in _row_blocks(w))


def _amax(w: np.ndarray) -> float:
    """max |w|; NaN when w has a NaN or an inf."""
    top = 0.0
    for block in _row_blocks(w):
        hi, lo = float(block.max()), float(block.min())  # numpy's max and min keep a NaN
        if not (math.isfinite(hi) and math.isfinite(lo)):
            return math.nan
        top = max(top, hi, -lo)
    return top


def _first_under(errors: dict[int, float], budget: float) -> int | None:
    return next((b for b in sorted(errors) if errors[b] < budget), None)
