"""The decomposition menu of one weight: every cheaper representation, with its error, bytes and MACs.

A weight is a float32 matrix w [rows, cols] (rows = output channels, see `matrix.as_matrix`).
Each `Option`'s error is the relative L2 error ‖w − ŵ‖_F / ‖w‖_F of its actual reconstruction
ŵ (`reconstruct`), never a bound; bytes count what would be stored; MACs are per input row
(per output position for a convolution), so the dense cost is rows·cols.

- int8 / int4, per channel or per group of 32 / 128 columns: symmetric round to nearest,
  levels = 2^(bits−1) − 1, scale = amax / levels (the formula of `probes.quant_error`); a
  grouped row is padded with zeros to a multiple of the group. Bytes ceil(rows·cols·bits/8) +
  4 per float32 scale.
- ternary, TWN (Li, Zhang & Liu 2016, "Ternary Weight Networks", arXiv:1605.04711): Δ = 0.7·mean|w|,
  α = mean|w| over |w| > Δ, ŵ = α·sign(w) where |w| > Δ else 0. 2 bits a value + one scale.
- 2:4 (NVIDIA's sparse tensor cores; Mishra et al. 2021, arXiv:2104.08378): per row, in chunks of 4
  columns (zero-padded), keep the 2 largest |w|. Kept values at `itemsize` + 2-bit indices; MACs
  halve.
- low rank r: truncated SVD (Eckart–Young), r = the smallest rank whose cumulative σ² reaches each
  of `energies` of ‖w‖_F², offered only when (rows+cols)·r < rows·cols. When min(rows, cols) >
  `svd_cap`, a randomized SVD instead (Halko, Martinsson & Tropp 2011, "Finding structure with
  randomness", SIAM Review 53(2): Gaussian test matrix, oversampling 10, 2 power iterations with a
  QR after each product (their Algorithms 4.4 and 5.1)) of target rank min(svd_cap, the largest
  useful rank): no rank above `svd_cap` is ever computed, so an energy it cannot reach is not
  offered. The exact SVD of a 4096×4096 float32 matrix takes about 35 s on 2 free cores, the
  randomized one at `svd_cap` 1024 about 8 s: `svd_cap` is the knob that bounds a layer's time.
- Monarch (Dao et al. 2022, "Monarch: Expressive Structured Matrices for Efficient and Accurate
  Training", ICML, arXiv:2204.00595), for square n = m², m ≥ 3: M = P L Pᵀ R with L, R
  block-diagonal (m blocks of m×m) and P (= Pᵀ) the permutation that transposes an m×m grid of
  indices.
  Entrywise M[a·m+i, c·m+d] = L_i[a, c]·R_c[i, d], so for each (i, c) the m×m slice over (a, d) is
  the rank-1 outer product L_i[:, c] ⊗ R_c[i, :], and the slices share no parameters: the
  Frobenius projection is the top singular pair of each of the m² slices (the paper's projection
  algorithm), one batched numpy SVD. 2m³ values, 2m³ MACs.
- Tucker-2 (HOSVD, De Lathauwer et al. 2000; the Conv compression of Kim et al. 2016, ICLR), when
  `shape` (the tensor with its output-channel axis moved first) is [rows, C, spatial...] with
  spatial size S > 1: factors U1 [rows, r1] and U2 [C, r2] from
  the SVDs of the mode-0 and mode-1 unfoldings, each rank the smallest keeping 0.99 of that
  unfolding's energy, core G = T ×0 U1ᵀ ×1 U2ᵀ. MACs per output position: C·r2 + r2·r1·S + r1·rows
  (1×1 conv, spatial conv, 1×1 conv).
- tensor train (TT-SVD, Oseledets 2011, SIAM J. Sci. Comput. 33(5), Algorithm 1) of the matrix
  tensorised as in Novikov et al. 2015 ("Tensorizing Neural Networks", NeurIPS): rows = r1·…·rd
  and cols = c1·…·cd (d = 3 when both have 3 prime factors, else 2; factors balanced, largest
  first), w reshaped to [r1..rd, c1..cd] and permuted to modes (r1·c1, …, rd·cd); each SVD truncated
  so its dropped σ² ≤ (1 − 0.99)·‖w‖²/(d − 1), so the relative error is ≤ 0.1.

Factored options (lowrank, Monarch, Tucker, TT) are offered only when they store fewer values and
take fewer MACs than dense (TT gives up as soon as the cores found so far cost that much), and
none of their SVDs is above `svd_cap` in its smaller dimension. Every option's
params carry `seconds` (its fit and scoring time; the low-rank options share one SVD, timed as
`svd_seconds`) and the dense option, always first, carries `menu_seconds`, the whole menu's time
(`menu_seconds(menu)`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import OpscopeError, did_you_mean, listing

KINDS = (
    "dense",
    "int8_channel",
    "int4_channel",
    "int8_group",
    "int4_group",
    "ternary",
    "sparse_2_4",
    "lowrank",
    "monarch",
    "tucker",
    "tt",
)
GROUPS = (32, 128)
FACTORED_ENERGY = 0.99  # Tucker ranks and the TT truncation
OVERSAMPLE = 10  # randomized SVD (Halko et al. 2011, section 4.2)
POWER_ITERS = 2
SVD_SEED = 0


@dataclass(frozen=True)
class Option:
    """One representation of a weight: what it costs and how far it is from the weight."""

    kind: str
    label: str
    error: float  # relative L2 error of `reconstruct` vs the weight
    bytes: int
    macs: int  # multiply-accumulates per input row
    params: dict = field(default_factory=dict)  # JSON-serialisable: what `reconstruct` needs, and timings

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "label": self.label,
            "error": self.error,
            "bytes": self.bytes,
            "macs": self.macs,
            "params": dict(self.params),
        }


def option_from_dict(d: dict) -> Option:
    """The `Option` that `Option.to_dict` wrote (e.g. read back from a plan's JSON). Only `kind` (and
    the params it needs) is required, so a plan can be written by hand: a missing label is the kind,
    missing error / bytes / macs are unknown (NaN error, 0 bytes and MACs)."""
    if not isinstance(d, dict) or "kind" not in d:
        raise OpscopeError(f"weight option {d!r} lacks its kind")
    if d["kind"] not in KINDS:
        raise OpscopeError(
            f"unknown weight option kind {d['kind']!r}{did_you_mean(str(d['kind']), KINDS)}; "
            f"kinds: {listing(KINDS)}"
        )
    return Option(
        kind=str(d["kind"]),
        label=str(d.get("label", d["kind"])),
        error=float(d.get("error", float("nan"))),
        bytes=int(d.get("bytes", 0)),
        macs=int(d.get("macs", 0)),
        params=dict(d.get("params") or {}),
    )


def menu_seconds(menu: Sequence[Option]) -> float:
    """The time `layer_menu` took for this menu (kept on its dense option)."""
    return float(next((o.params["menu_seconds"] for o in menu if "menu_seconds" in o.params), 0.0))


def layer_menu(
    w: np.ndarray,
    *,
    itemsize: int = 4,
    shape: tuple[int, ...] | None = None,
    energies: Sequence[float] = (0.9, 0.99, 0.999),
    svd_cap: int | None = 4096,
) -> list[Option]:
    """Every option for the weight matrix `w` [rows, cols], dense first.

    `itemsize`: bytes of one stored value of the weight's dtype (dense, factors, 2:4 values).
    `shape`: the weight as a tensor with its output-channel axis first ([M, C, kh, kw] for a Conv;
    its product is rows·cols); Tucker is offered only with it. `svd_cap`: the largest smaller
    dimension decomposed exactly (None: no cap); above it the low rank comes from a randomized SVD.
    """
    start = time.perf_counter()
    w = _matrix(w, shape)
    if not all(0 < e <= 1 for e in energies):
        raise OpscopeError(f"energies are fractions of ‖w‖² in (0, 1], got {tuple(energies)}")
    rows, cols = w.shape
    norm2 = _sumsq(w)
    options = [Option("dense", "dense", 0.0, rows * cols * itemsize, rows * cols, {})]
    options += _quant_options(w, norm2)
    options.append(_scored(w, norm2, "ternary", "ternary", math.ceil(w.size * 2 / 8) + 4, w.size, {}))
    stored = rows * 2 * _chunks(cols, 4)
    options.append(
        _scored(
            w,
            norm2,
            "sparse_2_4",
            "2:4",
            stored * itemsize + math.ceil(stored * 2 / 8),
            stored,
            {"n": 2, "m": 4},
        )
    )
    if norm2 > 0:  # an all-zero weight is exactly dense already: nothing to factor
        options += _lowrank_options(w, norm2, itemsize, energies, svd_cap)
        options += _monarch_options(w, norm2, itemsize)
        options += _tucker_options(w, norm2, itemsize, shape, svd_cap)
        options += _tt_options(w, norm2, itemsize, svd_cap)
    options[0] = replace(
        options[0], params={"seconds": 0.0, "menu_seconds": round(time.perf_counter() - start, 6)}
    )
    return options


def reconstruct(w: np.ndarray, option: Option) -> np.ndarray:
    """The float32 [rows, cols] approximation of `w` that `option` stands for."""
    w = _matrix(w, None)
    build = _RECONSTRUCT.get(option.kind)
    if build is None:
        raise OpscopeError(f"unknown weight option kind {option.kind!r}{did_you_mean(option.kind, KINDS)}")
    return build(w, option.params)


def quantize(w: np.ndarray, bits: int, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric `bits`-bit codes q (int8 [rows, ngroups·group]) and float32 scales [rows, ngroups].

    One scale per row (`group` None) or per `group` columns, the row zero-padded to a multiple of
    `group`; ŵ = q·scale (`dequantize`). An all-zero row or group gets scale 0 and codes 0.
    """
    if not 2 <= bits <= 8 or (group is not None and group < 1):
        raise OpscopeError(f"quantize: bits must be 2..8 and group ≥ 1, got bits={bits}, group={group}")
    levels = 2 ** (bits - 1) - 1
    rows, cols = w.shape
    g = cols if group is None else group
    n = _chunks(cols, g)
    blocks = _padded(w, n * g).reshape(rows, n, g)
    scale = np.abs(blocks).max(axis=2) / np.float32(levels)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(blocks / safe[..., None]), -levels, levels).astype(np.int8)
    return q.reshape(rows, n * g), scale.astype(np.float32)


def dequantize(q: np.ndarray, scale: np.ndarray, cols: int) -> np.ndarray:
    """ŵ [rows, cols] from `quantize`'s codes and scales."""
    rows, n = scale.shape
    blocks = q.reshape(rows, n, -1).astype(np.float32) * scale[..., None]
    return blocks.reshape(rows, -1)[:, :cols]


def lowrank_factors(w: np.ndarray, option: Option) -> tuple[np.ndarray, np.ndarray]:
    """a [rows, r], b [r, cols] with a @ b the low-rank reconstruction, σ split evenly (√σ each side)."""
    if option.kind != "lowrank":
        raise OpscopeError(f"lowrank_factors needs a lowrank option, got {option.kind!r}")
    u, s, vt = _svd(_matrix(w, None), option.params)
    r = int(option.params["rank"])
    root = np.sqrt(s[:r])
    return u[:, :r] * root, root[:, None] * vt[:r]


# --- options -----------------------------------------------------------------------------------


def _scored(
    w: np.ndarray,
    norm2: float,
    kind: str,
    label: str,
    nbytes: int,
    macs: int,
    params: dict,
    approx: np.ndarray | None = None,
    extra_seconds: float = 0.0,
) -> Option:
    """An option whose error is measured on its reconstruction (built here unless given)."""
    start = time.perf_counter()
    if approx is None:
        approx = _RECONSTRUCT[kind](w, params)
    error = _rel_error(w, approx, norm2)
    seconds = round(time.perf_counter() - start + extra_seconds, 6)
    return Option(kind, label, error, int(nbytes), int(macs), {**params, "seconds": seconds})


def _quant_options(w: np.ndarray, norm2: float) -> list[Option]:
    rows, cols = w.shape
    options = []
    for bits in (8, 4):
        packed = math.ceil(rows * cols * bits / 8)
        options.append(
            _scored(
                w,
                norm2,
                f"int{bits}_channel",
                f"int{bits} per-channel",
                packed + 4 * rows,
                w.size,
                {"bits": bits},
            )
        )
        for g in GROUPS:
            n = _chunks(cols, g)
            if n > 1:  # one group per row is the per-channel option again
                params = {"bits": bits, "group": g}
                options.append(
                    _scored(
                        w, norm2, f"int{bits}_group", f"int{bits} g{g}", packed + 4 * rows * n, w.size, params
                    )
                )
    return options


def _lowrank_options(
    w: np.ndarray, norm2: float, itemsize: int, energies: Sequence[float], svd_cap: int | None
) -> list[Option]:
    rows, cols = w.shape
    useful = (rows * cols - 1) // (rows + cols)  # largest r with (rows+cols)·r < rows·cols
    if useful < 1:
        return []
    if svd_cap is None or min(rows, cols) <= svd_cap:
        params: dict = {"svd": "exact"}
    else:
        params = {"svd": "randomized", "target_rank": min(svd_cap, useful), "oversample": OVERSAMPLE}
        params |= {"power_iters": POWER_ITERS, "seed": SVD_SEED}
    start = time.perf_counter()
    u, s, vt = _svd(w, params)
    svd_seconds = time.perf_counter() - start
    reached = np.cumsum(s.astype(np.float64) ** 2) / norm2
    best: dict[int, float] = {}  # rank -> the highest energy target it meets
    for e in sorted(energies):
        r = int(np.searchsorted(reached, e)) + 1
        if r <= min(useful, len(s)):
            best[r] = e
    options = []
    for r, e in sorted(best.items()):
        approx = (u[:, :r] * s[:r]) @ vt[:r]
        p = {"rank": r, "energy": e, **params, "svd_seconds": round(svd_seconds, 6)}
        label = f"lowrank r={r} ({e * 100:g}%)"
        options.append(
            _scored(w, norm2, "lowrank", label, (rows + cols) * r * itemsize, (rows + cols) * r, p, approx)
        )
    return options


def _monarch_options(w: np.ndarray, norm2: float, itemsize: int) -> list[Option]:
    rows, cols = w.shape
    m = math.isqrt(rows)
    if rows != cols or m * m != rows or m < 3:  # m < 3: 2m³ ≥ m⁴, no saving
        return []
    n = 2 * m**3
    return [_scored(w, norm2, "monarch", f"monarch m={m}", n * itemsize, n, {"blocks": m})]


def _tucker_options(
    w: np.ndarray, norm2: float, itemsize: int, shape: tuple[int, ...] | None, svd_cap: int | None
) -> list[Option]:
    if shape is None or len(shape) < 3 or math.prod(shape[2:]) < 2:
        return []
    rows, c = shape[0], shape[1]
    spatial = math.prod(shape[2:])
    if svd_cap is not None and max(min(rows, c * spatial), min(c, rows * spatial)) > svd_cap:
        return []
    start = time.perf_counter()
    t = w.reshape(rows, c, spatial)
    (u1, s1), (u2, s2) = _mode_svd(t, 0), _mode_svd(t, 1)
    r1, r2 = _energy_rank(s1, FACTORED_ENERGY), _energy_rank(s2, FACTORED_ENERGY)
    values = rows * r1 + c * r2 + r1 * r2 * spatial
    if values >= w.size:
        return []
    approx = _tucker_from_factors(t, u1[:, :r1], u2[:, :r2]).reshape(w.shape)
    params = {"ranks": [r1, r2], "energy": FACTORED_ENERGY, "shape": [int(d) for d in shape]}
    macs = c * r2 + r2 * r1 * spatial + r1 * rows
    fit = time.perf_counter() - start
    return [
        _scored(w, norm2, "tucker", f"tucker r=({r1}, {r2})", values * itemsize, macs, params, approx, fit)
    ]


def _tt_options(w: np.ndarray, norm2: float, itemsize: int, svd_cap: int | None) -> list[Option]:
    layout = _tt_layout(*w.shape)
    if layout is None:
        return []
    row_f, col_f = layout
    dims = [r * c for r, c in zip(row_f, col_f)]
    start = time.perf_counter()

    def too_big(ranks: list[int]) -> bool:  # not cheaper than dense even with the unknown ranks at 1
        ranks = ranks + [1] * (len(dims) + 1 - len(ranks))
        return max(_tt_values(dims, ranks), _tt_macs(row_f, col_f, ranks)) >= w.size

    tail2 = (1 - FACTORED_ENERGY) * norm2 / (len(row_f) - 1)
    cores = _tt_svd(_tensorise(w, row_f, col_f), dims, tail2=tail2, svd_cap=svd_cap, give_up=too_big)
    if cores is None:
        return []
    ranks = [1] + [int(g.shape[2]) for g in cores]
    if too_big(ranks):
        return []
    approx = _detensorise(_tt_full(cores), row_f, col_f)
    params = {"row_factors": row_f, "col_factors": col_f, "ranks": ranks, "energy": FACTORED_ENERGY}
    fit = time.perf_counter() - start
    label = f"tt r=({', '.join(map(str, ranks))})"
    nbytes, macs = _tt_values(dims, ranks) * itemsize, _tt_macs(row_f, col_f, ranks)
    return [_scored(w, norm2, "tt", label, nbytes, macs, params, approx, fit)]


# --- reconstructions (one per kind; `layer_menu` scores the same functions) ----------------------


def _dense(w: np.ndarray, params: dict) -> np.ndarray:
    return w.copy()


def _quantized(w: np.ndarray, params: dict) -> np.ndarray:
    group = params.get("group")
    q, scale = quantize(w, int(params["bits"]), None if group is None else int(group))
    return dequantize(q, scale, w.shape[1])


def _ternary(w: np.ndarray, params: dict) -> np.ndarray:
    a = np.abs(w)
    keep = a > np.float32(0.7 * a.mean(dtype=np.float64))
    alpha = np.float32(a[keep].mean(dtype=np.float64)) if keep.any() else np.float32(0)
    return np.where(keep, alpha * np.sign(w), np.float32(0)).astype(np.float32)


def _sparse_2_4(w: np.ndarray, params: dict) -> np.ndarray:
    rows, cols = w.shape
    n = _chunks(cols, 4)
    blocks = _padded(w, 4 * n).reshape(rows, n, 4)
    smallest = np.argsort(np.abs(blocks), axis=2, kind="stable")[..., :2]
    out = blocks.copy()
    np.put_along_axis(out, smallest, np.float32(0), axis=2)
    return out.reshape(rows, 4 * n)[:, :cols]


def _lowrank(w: np.ndarray, params: dict) -> np.ndarray:
    u, s, vt = _svd(w, params)
    r = int(params["rank"])
    return (u[:, :r] * s[:r]) @ vt[:r]


def _monarch(w: np.ndarray, params: dict) -> np.ndarray:
    m = int(params["blocks"])
    if w.shape != (m * m, m * m):
        raise OpscopeError(f"monarch option with {m} blocks needs a {m * m}×{m * m} weight, got {w.shape}")
    # w[a·m+i, c·m+d] -> slices[i, c] = the (a, d) matrix, each rank 1 in a Monarch matrix
    slices = w.reshape(m, m, m, m).transpose(1, 2, 0, 3)
    u, s, vt = np.linalg.svd(slices, full_matrices=False)
    top = s[..., 0, None, None] * u[..., :, :1] * vt[..., :1, :]
    return np.ascontiguousarray(top.transpose(2, 0, 1, 3)).reshape(w.shape).astype(np.float32)


def _tucker(w: np.ndarray, params: dict) -> np.ndarray:
    shape = [int(d) for d in params["shape"]]
    if math.prod(shape) != w.size or shape[0] != w.shape[0]:
        raise OpscopeError(f"tucker option for shape {shape} does not fit a {w.shape} weight")
    t = w.reshape(shape[0], shape[1], -1)
    r1, r2 = (int(r) for r in params["ranks"])
    u1, u2 = _mode_svd(t, 0)[0], _mode_svd(t, 1)[0]
    return _tucker_from_factors(t, u1[:, :r1], u2[:, :r2]).reshape(w.shape)


def _tt(w: np.ndarray, params: dict) -> np.ndarray:
    row_f, col_f = [int(f) for f in params["row_factors"]], [int(f) for f in params["col_factors"]]
    if (math.prod(row_f), math.prod(col_f)) != w.shape:
        raise OpscopeError(f"tt option for {row_f} × {col_f} does not fit a {w.shape} weight")
    dims = [r * c for r, c in zip(row_f, col_f)]
    cores = _tt_svd(_tensorise(w, row_f, col_f), dims, ranks=[int(r) for r in params["ranks"]])
    return _detensorise(_tt_full(cores), row_f, col_f)


_RECONSTRUCT: dict[str, Callable[[np.ndarray, dict], np.ndarray]] = {
    "dense": _dense,
    "int8_channel": _quantized,
    "int4_channel": _quantized,
    "int8_group": _quantized,
    "int4_group": _quantized,
    "ternary": _ternary,
    "sparse_2_4": _sparse_2_4,
    "lowrank": _lowrank,
    "monarch": _monarch,
    "tucker": _tucker,
    "tt": _tt,
}


# --- linear algebra ------------------------------------------------------------------------------


def _svd(w: np.ndarray, params: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """u, s, vt: the thin SVD, or the randomized one `params` describes (same seed, same result)."""
    if params.get("svd", "exact") == "exact":
        return np.linalg.svd(w, full_matrices=False)
    rows, cols = w.shape
    k = int(params["target_rank"])
    width = min(k + int(params["oversample"]), rows, cols)
    omega = np.random.default_rng(int(params["seed"])).standard_normal((cols, width)).astype(np.float32)
    q = np.linalg.qr(w @ omega)[0]
    for _ in range(int(params["power_iters"])):  # subspace iteration, re-orthonormalised (Alg. 4.4)
        q = np.linalg.qr(w.T @ q)[0]
        q = np.linalg.qr(w @ q)[0]
    ub, s, vt = np.linalg.svd(q.T @ w, full_matrices=False)
    return (q @ ub)[:, :k], s[:k], vt[:k]


def _energy_rank(s: np.ndarray, energy: float) -> int:
    """The smallest r whose top-r σ² hold `energy` of the total."""
    cum = np.cumsum(s.astype(np.float64) ** 2)
    return min(int(np.searchsorted(cum, energy * cum[-1])) + 1, len(s))


def _mode_svd(t: np.ndarray, mode: int) -> tuple[np.ndarray, np.ndarray]:
    """Left singular vectors and values of the mode-`mode` unfolding of t [M, C, S]."""
    unfold = np.moveaxis(t, mode, 0).reshape(t.shape[mode], -1)
    u, s, _ = np.linalg.svd(unfold, full_matrices=False)
    return u, s


def _tucker_from_factors(t: np.ndarray, u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    core = np.einsum("mcs,mr,cq->rqs", t, u1, u2, optimize=True)
    return np.einsum("rqs,mr,cq->mcs", core, u1, u2, optimize=True).astype(np.float32)


def _tt_layout(rows: int, cols: int) -> tuple[list[int], list[int]] | None:
    """Row and column factors for the TT-matrix: d = 3 where both allow it, else 2, else None."""
    for d in (3, 2):
        row_f, col_f = _balanced_factors(rows, d), _balanced_factors(cols, d)
        if row_f and col_f:
            return row_f, col_f
    return None


def _balanced_factors(n: int, d: int) -> list[int] | None:
    """n as d factors ≥ 2 of near-equal size, largest first (primes placed largest first)."""
    primes, p, rest = [], 2, n
    while p * p <= rest:
        while rest % p == 0:
            primes.append(p)
            rest //= p
        p += 1
    if rest > 1:
        primes.append(rest)
    if len(primes) < d:
        return None
    bins = [1] * d
    for prime in sorted(primes, reverse=True):
        bins[bins.index(min(bins))] *= prime
    return sorted(bins, reverse=True)


def _tensorise(w: np.ndarray, row_f: list[int], col_f: list[int]) -> np.ndarray:
    """w [rows, cols] -> modes (r1·c1, ..., rd·cd)."""
    d = len(row_f)
    t = w.reshape(*row_f, *col_f).transpose([x for k in range(d) for x in (k, d + k)])
    return t.reshape([r * c for r, c in zip(row_f, col_f)])


def _detensorise(t: np.ndarray, row_f: list[int], col_f: list[int]) -> np.ndarray:
    d = len(row_f)
    t = t.reshape([x for r, c in zip(row_f, col_f) for x in (r, c)])
    t = t.transpose([2 * k for k in range(d)] + [2 * k + 1 for k in range(d)])
    return t.reshape(math.prod(row_f), math.prod(col_f)).astype(np.float32)


def _tt_svd(
    t: np.ndarray,
    dims: list[int],
    *,
    ranks: list[int] | None = None,
    tail2: float | None = None,
    svd_cap: int | None = None,
    give_up: Callable[[list[int]], bool] | None = None,
) -> list[np.ndarray] | None:
    """TT cores [R_{k−1}, n_k, R_k]: fixed `ranks`, or each dropping at most `tail2` of σ².

    None when an unfolding's smaller dimension is above `svd_cap`, or as soon as `give_up` says so
    of the ranks found so far [1, R_1, ..., R_k]; it is asked first with the rank the unfolding's
    Gram eigenvalues give (σ² at a fraction of an SVD's cost), so a hopeless TT costs no SVD.
    """
    cores, found, rest = [], [1], t
    for k, n in enumerate(dims[:-1]):
        rest = rest.reshape(found[-1] * n, -1)
        if svd_cap is not None and min(rest.shape) > svd_cap:
            return None
        if ranks is None and give_up is not None:
            small = rest if rest.shape[0] <= rest.shape[1] else rest.T
            if give_up([*found, _tail_rank(np.linalg.eigvalsh(small @ small.T), tail2)]):
                return None
        u, s, vt = np.linalg.svd(rest, full_matrices=False)
        r = _tail_rank(s.astype(np.float64) ** 2, tail2) if ranks is None else ranks[k + 1]
        if not 1 <= r <= len(s):
            raise OpscopeError(f"tt rank {r} at core {k} does not fit an unfolding of rank ≤ {len(s)}")
        cores.append(u[:, :r].reshape(found[-1], n, r))
        found.append(r)
        if give_up is not None and give_up(found):
            return None
        rest = s[:r, None] * vt[:r]
    cores.append(rest.reshape(found[-1], dims[-1], 1))
    return cores


def _tail_rank(sigma2: np.ndarray, tail2: float) -> int:
    """The smallest r ≥ 1 whose dropped σ² (all but the r largest of `sigma2`) is ≤ `tail2`."""
    dropped = np.cumsum(np.sort(np.maximum(sigma2, 0)))  # dropped[j]: the j + 1 smallest together
    return max(1, len(sigma2) - int(np.sum(dropped <= tail2)))


def _tt_full(cores: list[np.ndarray]) -> np.ndarray:
    full = cores[0].reshape(-1, cores[0].shape[2])
    for g in cores[1:]:
        full = (full @ g.reshape(g.shape[0], -1)).reshape(-1, g.shape[2])
    return full.reshape([g.shape[1] for g in cores])


def _tt_values(dims: list[int], ranks: list[int]) -> int:
    """Σ_k R_{k−1}·n_k·R_k: the values the cores store (`ranks` [1, R_1, ..., 1])."""
    return sum(ranks[k] * dims[k] * ranks[k + 1] for k in range(len(dims)))


def _tt_macs(row_f: list[int], col_f: list[int], ranks: list[int]) -> int:
    """MACs of y = W x, the cores contracted last to first: Σ_k (Π_{j≤k} c_j)(Π_{j≥k} r_j) R_{k−1} R_k."""
    return sum(
        math.prod(col_f[: k + 1]) * math.prod(row_f[k:]) * ranks[k] * ranks[k + 1] for k in range(len(row_f))
    )


# --- small helpers -------------------------------------------------------------------------------


def _matrix(w: np.ndarray, shape: tuple[int, ...] | None) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2 or w.size == 0:
        raise OpscopeError(f"a weight menu needs a non-empty [rows, cols] matrix, got shape {w.shape}")
    if shape is not None and (math.prod(shape) != w.size or shape[0] != w.shape[0]):
        raise OpscopeError(f"shape {tuple(shape)} is not the {w.shape} matrix with its output channels first")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if not np.isfinite(w).all():
        raise OpscopeError("weight has NaN or Inf values: no representation of it has a finite error")
    return w


def _chunks(n: int, size: int) -> int:
    return -(-n // size)


def _padded(w: np.ndarray, cols: int) -> np.ndarray:
    if w.shape[1] == cols:
        return w
    out = np.zeros((w.shape[0], cols), dtype=np.float32)
    out[:, : w.shape[1]] = w
    return out


def _sumsq(x: np.ndarray) -> float:
    return float(np.square(x, dtype=np.float32).sum(dtype=np.float64))


def _rel_error(w: np.ndarray, approx: np.ndarray, norm2: float) -> float:
    diff = _sumsq(w - approx)
    return math.sqrt(diff / norm2) if norm2 > 0 else (0.0 if diff == 0 else math.inf)
