"""The sketch registry: what we measure on a tapped tensor, how, and how to check it.

Each `Sketch` is a name, the raw in-graph outputs it needs, a host-side `finalize` that
turns those raw values into the sketch's values (float64), a numpy `reference` computed
straight from the tensor, how it `merge`s across batches or loop iterations, and the
tolerance the tests hold the two to.

The in-graph part is shared between sketches: one tapped tensor gets one small subgraph
(`build_tap`) whose raw outputs serve every sketch asked for, so no pass over the tensor is
made twice. Layout of that subgraph, for a tensor x cast to float32:

    shape, samples                       outside any branch: a cheap gather, no full pass
    s2 = ReduceSumSquare(x)              one pass: the sumsq sketch, and the NaN/Inf check
    If isnan(s2 - s2):  slow branch      mask non-finite values, count them
    else:               fast branch      the same statistics with no masking at all

Both branches produce the same raw outputs; the fast one is what runs on clean tensors. A
finite sum of squares means no NaN, no Inf and no square that overflows, so the fast branch
sums x itself (`ynorm` = 1). The slow branch takes its sums on y = x / (max|x| + 1e-12)
(`ynorm` = that scale), so |y| <= 1 and nothing overflows in float32 even on BERT's -3.4e38
mask values; the host multiplies `ynorm` back in float64. The scale of histograms and
kurtosis is rebuilt on the host from min and max, in float32 as the graph computes it.

Weights (constant taps) have no subgraph: `weights.host_values` runs the references below on
them once per recording.

Non-finite values (NaN, +Inf, -Inf), exactly:
- `nan_count`, `inf_count` count them; every other statistic ignores them: min, max, mean,
  l1, sumsq, kurtosis, hist, chan_maxabs, pos_sumsq and adj_sumsq are over the finite
  elements only (non-finite ones count as 0 in pos/adj sums), mean and kurtosis divide by
  the number of finite elements;
- `nnz` counts x != 0, and NaN and Inf are != 0, so they count;
- `elemsig` returns the gathered values as they are (NaN stays NaN).

Empty tensors: counts and sums are 0; min, max, mean and kurtosis are NaN; hist is all zeros;
elemsig is empty; chan_maxabs is NaN for every channel (no finite value, as for a masked one);
pos_sumsq and adj_sumsq have one 0 per (row, pair) left, none when there are none.

Site-kind sketches (`kinds` set: attn_qmax, attn_krecv, route_load, see inference_taps)
bring their own in-graph `build`, run outside the finite/non-finite split on the tensor as
it is (not NaN-masked), and give one raw output named after the sketch. They are not in
the default set: `for_site` gives each site kind its sketches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from onnx import TensorProto, helper

from . import inference_taps as it
from .ops import Builder, scatter_add_available

EPS_SCALE = np.float32(1e-12)  # y = x / (max|x| + 1e-12), as the histogram definition asks
EPS_KURT = 1e-20

HIST_MODES = ("sampled", "exact", "host")


@dataclass(frozen=True)
class SketchOptions:
    """Knobs of the sketches; saved in the manifest so decoding uses the same ones."""

    hist_bins: int = 32
    hist_range: tuple[float, float] | None = None  # None: x/(max|x|+1e-12) over [-1, 1]
    hist_mode: str = "sampled"  # sampled | exact (every element) | host (copy out, bin in numpy)
    # exact: counted in the graph (ScatterElements / Unique), or bin indices computed in the graph
    # and counted on the host (np.bincount) -- what `for_providers` picks on CPU, where the
    # outputs are not copied and the in-graph scatter costs ~35 passes over the tensor.
    exact_counts: str = "graph"
    sample_size: int = 4096
    elemsig_k: int = 16
    max_rows: int = 512  # pos_sumsq / adj_sumsq keep at most this many rows (evenly strided)
    adj_pairs: int = 32  # adj_sumsq: adjacent pairs per sequence, evenly spaced along the row axis

    def __post_init__(self):
        if self.hist_mode not in HIST_MODES:
            raise ValueError(f"hist_mode must be one of {HIST_MODES}, not {self.hist_mode!r}")
        if self.exact_counts not in ("graph", "host"):
            raise ValueError(f"exact_counts must be 'graph' or 'host', not {self.exact_counts!r}")
        if self.hist_range is not None and not self.hist_range[0] < self.hist_range[1]:
            raise ValueError(f"hist_range needs lo < hi, got {self.hist_range}")


def for_providers(o: SketchOptions, providers: list[str]) -> SketchOptions:
    """`o` as it should run on `providers`: exact histograms are counted on the host when the
    CPU provider runs everything (bert_like: 14.8x plain in the graph, see BENCHMARKS.md)."""
    cpu_only = all(p == "CPUExecutionProvider" for p in providers)
    if o.hist_mode == "exact" and cpu_only and o.exact_counts == "graph":
        return replace(o, exact_counts="host")
    return o


@dataclass(frozen=True)
class TapInfo:
    """What the builder needs to know about a tapped tensor.

    `channel_axis` is the feature axis (chan_maxabs keeps it; pos_sumsq sums over it);
    `seq_axis` is the axis along which rows are adjacent (adj_sumsq). `rank` None means
    unknown: then only the rank-free sketches are built.
    """

    rank: int | None
    elem_type: int = TensorProto.FLOAT
    channel_axis: int = -1
    seq_axis: int = -2
    bins: int | None = None  # route_load: the number of experts (None: max id + 1, in the graph)

    @property
    def as_rows(self) -> bool:
        """Rank unknown but channel-last with rows along -2 (every MatMul operand): the tensor is then
        viewed as [rows, channels] = reshape(x, [-1, C]), rows running over all leading axes."""
        return self.rank is None and self.channel_axis == -1 and self.seq_axis == -2

    def axes(self) -> tuple[int, int] | None:
        """(channel, seq) as non-negative axes, seq None when rank < 2; None when rank unknown/0."""
        if self.as_rows:
            return 1, 0
        if not self.rank:
            return None
        ch = self.channel_axis % self.rank
        seq = self.seq_axis % self.rank if self.rank >= 2 else None
        return ch, (seq if seq != ch else None)


Raw = dict[str, np.ndarray]


@dataclass(frozen=True)
class Sketch:
    name: str
    raws: tuple[str, ...]
    finalize: Callable[[Raw, SketchOptions], np.ndarray]
    reference: Callable[[np.ndarray, TapInfo, SketchOptions], np.ndarray]
    merge: str  # min | max | sum | mean | concat | first | maxelem | derived
    vector: bool
    tol: tuple[float, float] = (0.0, 0.0)  # (rtol, atol as a fraction of the reference's scale)
    needs_rank: bool = False
    doc: str = ""
    extra: dict = field(default_factory=dict)
    # Site-kind sketches: build(b, x_float, info, options) -> the one raw output (named like the
    # sketch), appended outside the finite/non-finite If; `kinds` are the site kinds it serves.
    build: Callable[[Builder, str, TapInfo, SketchOptions], str] | None = None
    kinds: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# host side: raw outputs -> sketch values


def _numel(r: Raw) -> int:
    return int(np.prod(r["shape"][1:])) if len(r["shape"]) > 1 else 1


def _n_bad(r: Raw) -> float:
    return float(r["nan"][0] + r["inf"][0])


def _n_finite(r: Raw) -> float:
    return _numel(r) - _n_bad(r)


def _scale(r: Raw) -> float:
    """max|x| + 1e-12 over the finite values, in float32 as the graph computes it (0 + 1e-12 when
    there is none): the histogram's and kurtosis' unit, rebuilt from min and max."""
    with np.errstate(invalid="ignore"):
        a = np.maximum(np.abs(np.float32(r["min"][0])), np.abs(np.float32(r["max"][0])))
    return float((a if np.isfinite(a) else np.float32(0)) + EPS_SCALE)


def _ynorm(r: Raw) -> float:
    """What the branch divided the sums by: 1 on a finite tensor, the scale in the masking branch."""
    return float(r["ynorm"][0])


def _finite_or_nan(v: np.ndarray, reduce) -> np.ndarray:
    v = v[np.isfinite(v)]
    return np.array([reduce(v) if v.size else np.nan])


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def _chan_maxabs(r: Raw) -> np.ndarray:
    """Per-channel max|x|; the graph marks channels with no finite value by -1 (or -inf)."""
    out = r["chan_abs"].copy()
    out[out < 0] = np.nan
    return out


def _chan_outlier(v: np.ndarray) -> np.ndarray:
    v = v[np.isfinite(v)]
    return np.array([_ratio(v.max(), v.mean()) if v.size else np.nan])


def _hist_counts(values: np.ndarray, scale: float, o: SketchOptions) -> np.ndarray:
    """Bin like the graph does (float32 arithmetic), so exact and host modes agree bit for bit."""
    v = np.asarray(values, np.float32).ravel()
    v = v[np.isfinite(v)]
    bins = o.hist_bins
    if o.hist_range is None:
        t = np.floor((v / np.float32(scale) + np.float32(1)) * np.float32(bins / 2))
    else:
        lo, hi = np.float32(o.hist_range[0]), np.float32(o.hist_range[1])
        v = v[(v >= lo) & (v <= hi)]
        t = np.floor((v - lo) / np.float32((hi - lo) / bins))
    idx = np.clip(t, 0, bins - 1).astype(np.int64)
    return np.bincount(idx, minlength=bins).astype(np.float64)


def _fin_hist(r: Raw, o: SketchOptions) -> np.ndarray:
    if o.hist_mode == "exact" and o.exact_counts == "host":
        idx = np.asarray(r["hidx"]).ravel().astype(np.intp, copy=False)
        return np.bincount(idx, minlength=o.hist_bins + 1)[: o.hist_bins].astype(np.float64)
    if o.hist_mode == "exact":
        return r["hist"]
    if o.hist_mode == "host":
        return _hist_counts(r["tensor"], _scale(r), o)
    return _hist_counts(r["samples"], _scale(r), o)


SAMPLE_BLOCK = 16  # the sampled histogram reads blocks of 16 contiguous elements (one cache line)
GOLDEN = (np.sqrt(5.0) - 1) / 2  # block j of the sample is at frac(j * GOLDEN) of the tensor


def sample_positions(n: int, sample_size: int) -> np.ndarray:
    """Flat positions of the sampled histogram: every element when n <= sample_size, else
    k = ceil(sample_size / g) blocks of g contiguous elements (g = 16 when 16 divides n, else
    1), block j at floor(frac(j * golden ratio) * n/g) (every block, in order, when there are
    at most k): a low-discrepancy sequence, so the
    blocks cover the tensor evenly without lining up with any row or channel period (evenly
    spaced blocks did: every block of a [512, 256] tensor fell on channels 0-15; a fixed
    prime stride clusters when it is close to a multiple of n/g).

    Blocks, not scattered single elements: 4096 positions j * 1000003 mod n cost 3x more on
    the BERT-like encoder (a cache miss each, and index arithmetic on 4096 int64s), and whole
    rows (the cheapest) follow the tensor's structure: total-variation distance to the exact
    histogram up to 0.21 on the real models, where spread blocks stay within ~0.1.
    """
    g = SAMPLE_BLOCK if n % SAMPLE_BLOCK == 0 else 1
    rows = n // g
    k = min(rows, -(-sample_size // g))
    j = np.arange(k, dtype=np.int64)
    if k < rows:  # else every block, in order
        u = j * GOLDEN
        j = np.floor((u - np.floor(u)) * np.float64(rows)).astype(np.int64)
    return (j[:, None] * g + np.arange(g, dtype=np.int64)[None, :]).ravel()


def _fin_kurtosis(r: Raw, o: SketchOptions) -> np.ndarray:
    nf, s = _n_finite(r), _scale(r)  # m2, m4 are moments of (x - mean) / scale
    if nf <= 0:
        return np.array([np.nan])
    m2 = r["m2"][0] / nf * s**2
    m4 = r["m4"][0] / nf * s**4
    return np.array([m4 / (m2 * m2 + EPS_KURT)])


# --------------------------------------------------------------------------------------------
# numpy references: straight from the definitions, float64, on the finite elements


def _f64(x: np.ndarray) -> np.ndarray:
    """x as the graph sees it (cast to float32: ints past 2**24 round, float64 past 3.4e38 is inf), in float64."""
    return np.asarray(x).astype(np.float32).astype(np.float64)


def _finite(x: np.ndarray) -> np.ndarray:
    v = _f64(x).ravel()
    return v[np.isfinite(v)]


def _scale_of(x: np.ndarray) -> np.float32:
    v = np.asarray(x).astype(np.float32).ravel()
    v = v[np.isfinite(v)]
    return np.float32(np.abs(v).max() if v.size else np.inf) + EPS_SCALE


@dataclass(frozen=True)
class _OnFinite:
    """A scalar reference over the finite values: fn(finite float64 values), `empty` when none."""

    fn: Callable[[np.ndarray], float]
    empty: float = np.nan

    def of(self, finite: np.ndarray) -> np.ndarray:
        return np.array([self.fn(finite) if finite.size else self.empty])

    def __call__(self, x, info, o) -> np.ndarray:
        return self.of(_finite(x))


def _ref_scalar(fn, empty=np.nan) -> _OnFinite:
    return _OnFinite(fn, empty)


def _ref_kurtosis(x, info, o):
    v = _finite(x)
    if not v.size:
        return np.array([np.nan])
    d = v - v.mean()
    d2 = d * d  # not d**4: numpy's pow is ~10x slower than two multiplies on a 16M-element weight
    m2, m4 = np.mean(d2), np.mean(d2 * d2)
    return np.array([m4 / (m2 * m2 + EPS_KURT)])


def _ref_hist(x, info, o):
    if o.hist_mode != "sampled":
        return _hist_counts(x, _scale_of(x), o)
    flat = np.asarray(x).astype(np.float32).ravel()
    return _hist_counts(flat[sample_positions(flat.size, o.sample_size)], _scale_of(x), o)


def _elemsig_of(samples: np.ndarray, o: SketchOptions) -> np.ndarray:
    """k = min(16, m) of the m sampled values, at sample positions j*m/k: spread over the tensor
    like the sample itself, and no node of its own in the graph."""
    m = samples.size
    k = min(m, o.elemsig_k)
    return np.asarray(samples, np.float64)[(np.arange(k, dtype=np.int64) * m) // max(k, 1)]


def _ref_elemsig(x, info, o):
    flat = np.asarray(x).astype(np.float32).ravel()
    return _elemsig_of(_f64(flat[sample_positions(flat.size, o.sample_size)]), o)


def _clean(x: np.ndarray) -> np.ndarray:
    v = _f64(x)
    return np.where(np.isfinite(v), v, 0.0)


def _view(x, info: TapInfo) -> np.ndarray:
    v = _f64(x)
    return v.reshape(-1, v.shape[-1]) if info.as_rows and v.ndim >= 1 else v


def _ref_chan(x, info, o):
    ch, _ = info.axes()
    v = _view(x, info)
    other = tuple(a for a in range(v.ndim) if a != ch)
    fin = np.isfinite(v)
    absv = np.where(fin, np.abs(v), -np.inf)
    out = absv.max(axis=other) if v.size else np.full(v.shape[ch], -np.inf)  # no element: no finite value
    return np.where(np.isfinite(out), out, np.nan).ravel()


def _row_cap(v: np.ndarray, o: SketchOptions) -> np.ndarray:
    v = v.ravel()
    k = min(v.size, o.max_rows)
    return v[(np.arange(k, dtype=np.int64) * v.size) // max(k, 1)]


def _ref_pos(x, info, o):
    ch, _ = info.axes()
    return _row_cap((_clean(_view(x, info)) ** 2).sum(axis=ch), o)


def _ref_adj(x, info, o):
    ch, seq = info.axes()
    if seq is None:
        return np.zeros(0)
    c = _clean(_view(x, info))
    n = c.shape[seq] - 1
    if n <= 0:
        return np.zeros(0)
    k = min(n, o.adj_pairs)
    t = (np.arange(k, dtype=np.int64) * n) // k
    d = np.take(c, t + 1, axis=seq) - np.take(c, t, axis=seq)
    return _row_cap((d**2).sum(axis=ch), o)


# --------------------------------------------------------------------------------------------
# the registry

_BASE = ("shape", "nan", "inf")

REGISTRY: dict[str, Sketch] = {
    s.name: s
    for s in [
        Sketch(
            "min",
            _BASE + ("min",),
            lambda r, o: _finite_or_nan(r["min"], np.min),
            _ref_scalar(np.min),
            "min",
            False,
            doc="smallest finite value",
        ),
        Sketch(
            "max",
            _BASE + ("max",),
            lambda r, o: _finite_or_nan(r["max"], np.max),
            _ref_scalar(np.max),
            "max",
            False,
            doc="largest finite value",
        ),
        Sketch(
            "mean",
            _BASE + ("ynorm", "ysum"),
            lambda r, o: np.array([_ratio(r["ysum"][0] * _ynorm(r), _n_finite(r))]),
            _ref_scalar(np.mean),
            "mean",
            False,
            tol=(1e-4, 1e-5),
            doc="mean of finite values",
        ),
        Sketch(
            "l1",
            _BASE + ("ynorm", "yl1"),
            lambda r, o: np.array([r["yl1"][0] * _ynorm(r)]),
            _ref_scalar(lambda v: np.abs(v).sum(), 0.0),
            "sum",
            False,
            # onnxruntime's whole-tensor ReduceL1 accumulates in float32: 9e-4 off on captcha_crnn's
            # [400, 4096] weight; a two-stage reduction would be exact-ish but 10-25x slower
            tol=(2e-3, 0.0),
            doc="sum of |x| over finite values",
        ),
        Sketch(
            "sumsq",
            _BASE + ("ynorm", "yss"),
            lambda r, o: np.array([r["yss"][0] * _ynorm(r) ** 2]),
            _ref_scalar(lambda v: (v * v).sum(), 0.0),
            "sum",
            False,
            tol=(1e-4, 0.0),
            doc="sum of x^2 over finite values",
        ),
        Sketch(
            "nnz",
            _BASE + ("nnz",),
            lambda r, o: np.array([r["nnz"][0] + _n_bad(r)]),
            lambda x, info, o: np.array([float(np.count_nonzero(_f64(x)))]),
            "sum",
            False,
            doc="count of x != 0 (NaN and Inf count)",
        ),
        Sketch(
            "nan_count",
            _BASE,
            lambda r, o: r["nan"][:1].copy(),
            lambda x, info, o: np.array([float(np.isnan(_f64(x)).sum())]),
            "sum",
            False,
        ),
        Sketch(
            "inf_count",
            _BASE,
            lambda r, o: r["inf"][:1].copy(),
            lambda x, info, o: np.array([float(np.isinf(_f64(x)).sum())]),
            "sum",
            False,
        ),
        Sketch(
            "kurtosis",
            _BASE + ("min", "max", "m2", "m4"),
            _fin_kurtosis,
            _ref_kurtosis,
            "mean",
            False,
            tol=(2e-3, 0.0),
            doc="E[(x-mu)^4] / (E[(x-mu)^2]^2 + 1e-20) over finite values",
        ),
        Sketch(
            "hist",
            _BASE + ("min", "max"),
            _fin_hist,
            _ref_hist,
            "sum",
            True,
            tol=(0.0, 1e-3),
            doc="counts in hist_bins bins of x/(max|x|+1e-12) over [-1, 1], or of x over hist_range",
        ),
        Sketch(
            "elemsig",
            ("shape", "samples"),
            lambda r, o: _elemsig_of(r["samples"], o),
            _ref_elemsig,
            "first",
            True,
            doc="k = min(16, m) of the m values the sampled histogram reads, at sample positions j*m/k",
        ),
        Sketch(
            "chan_maxabs",
            _BASE + ("chan_abs",),
            lambda r, o: _chan_maxabs(r),
            _ref_chan,
            "maxelem",
            True,
            needs_rank=True,
            doc="max|x| over all axes but the channel axis",
        ),
        Sketch(
            "chan_outlier",
            _BASE + ("chan_abs",),
            lambda r, o: _chan_outlier(_chan_maxabs(r)),
            lambda x, info, o: _chan_outlier(_ref_chan(x, info, o)),
            "derived",
            False,
            needs_rank=True,
            doc="max / mean of chan_maxabs",
        ),
        Sketch(
            "pos_sumsq",
            _BASE + ("ynorm", "pos"),
            lambda r, o: r["pos"] * _ynorm(r) ** 2,
            _ref_pos,
            "concat",
            True,
            tol=(1e-4, 1e-6),
            needs_rank=True,
            doc="sum of x^2 over the channel axis, one value per row (at most max_rows rows)",
        ),
        Sketch(
            "adj_sumsq",
            _BASE + ("ynorm", "adj"),
            lambda r, o: r["adj"] * _ynorm(r) ** 2,
            _ref_adj,
            "concat",
            True,
            tol=(1e-4, 1e-6),
            needs_rank=True,
            doc="sum of (row_{t+1} - row_t)^2 over the channel axis, for adj_pairs evenly spaced pairs per sequence",
        ),
        Sketch(
            "attn_qmax",
            ("shape", "attn_qmax"),
            lambda r, o: r["attn_qmax"].copy(),
            it.ref_attn_qmax,
            "concat",
            True,
            tol=(1e-5, 1e-6),
            doc="attention peak per query: max over keys (last axis), mean over batch and heads, "
            "one value per query position (at most max_rows, evenly strided)",
            build=it.build_attn_qmax,
            kinds=("attn",),
        ),
        Sketch(
            "attn_krecv",
            ("shape", "attn_krecv"),
            lambda r, o: r["attn_krecv"].copy(),
            it.ref_attn_krecv,
            "sum",
            True,
            tol=(1e-5, 1e-6),
            doc="attention mass each key receives: sum over batch, heads and queries, one value per "
            "key (at most max_rows, evenly strided, key 0 always kept)",
            build=it.build_attn_krecv,
            kinds=("attn",),
        ),
        Sketch(
            "route_load",
            ("shape", "route_load"),
            lambda r, o: r["route_load"].copy(),
            it.ref_route_load,
            "sum",
            True,
            doc="how many times each expert id was selected, over E bins (E = the gate's last dim, "
            "else max id + 1)",
            build=it.build_route_load,
            kinds=("route",),
        ),
    ]
}

ALL_SKETCHES: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if not s.kinds)
# Always on: whole-tensor reductions and small gathers only, what fits the <= 1.5x-plain goal on
# CPU (bert_like, every MatMul, 1 thread; BENCHMARKS.md). The rest are opt-in by name or with
# "all": l1 is one more pass (+0.05x plain there), the others need a full elementwise pass
# first (x*x per row, |x|, a bool cast, (x-mean)^2) and cost +0.15 to +0.5x each.
DEFAULT_SKETCHES: tuple[str, ...] = (
    "min",
    "max",
    "mean",
    "sumsq",
    "nan_count",
    "inf_count",
    "hist",
    "elemsig",
)
SKETCH_SETS = {"default": DEFAULT_SKETCHES, "all": ALL_SKETCHES}


def resolve(names: list[str] | tuple[str, ...] | None) -> list[str]:
    """Validate sketch names (None: the default set; "default" and "all" name sets), keeping
    registry order."""
    from .errors import OpscopeError, did_you_mean, listing

    if not names:
        return list(DEFAULT_SKETCHES)
    known = {**REGISTRY, **SKETCH_SETS}
    for n in names:
        if n not in known:
            raise OpscopeError(f"unknown sketch {n!r}{did_you_mean(n, known)}; known: {listing(known)}")
    chosen = {m for n in names for m in SKETCH_SETS.get(n, (n,))}
    return [n for n in REGISTRY if n in chosen]


def for_site(kind: str, names: list[str]) -> list[str]:
    """The sketches a site of `kind` gets from the chosen `names`.

    GEMM sites get the general sketches among `names`; other kinds get the kind's own sketches
    among `names`, or its default set (inference_taps.KIND_SKETCHES) when `names` has none.
    """
    if kind == "gemm":
        return [n for n in names if not REGISTRY[n].kinds]
    own = [n for n in names if kind in REGISTRY[n].kinds]
    return own or [n for n in REGISTRY if n in it.KIND_SKETCHES.get(kind, ())]


def raws_for(names: list[str], info: TapInfo, o: SketchOptions) -> list[str]:
    """The raw outputs the chosen sketches need on a tensor described by `info`."""
    need: dict[str, None] = {}
    for n in names:
        sk = REGISTRY[n]
        if sk.needs_rank and info.axes() is None:
            continue
        for r in sk.raws:
            need[r] = None
        if n == "hist":
            exact = "hidx" if o.exact_counts == "host" else "hist"
            need[{"sampled": "samples", "exact": exact, "host": "tensor"}[o.hist_mode]] = None
    return list(need)


def sketches_for(names: list[str], info: TapInfo) -> list[str]:
    return [n for n in names if not (REGISTRY[n].needs_rank and info.axes() is None)]


def finalize(name: str, raw: Raw, o: SketchOptions) -> np.ndarray:
    return np.asarray(REGISTRY[name].finalize(raw, o), dtype=np.float64).ravel()


def reference(name: str, x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
    return np.asarray(REGISTRY[name].reference(x, info, o), dtype=np.float64).ravel()


def references(names: list[str], x: np.ndarray, info: TapInfo, o: SketchOptions) -> dict[str, np.ndarray]:
    """`reference` of each of `names` on x, the scalar ones sharing one float64 view of the
    finite values: each alone converts and masks the whole tensor twice, which made the
    default set ~1 s on one 4096 x 4096 weight."""
    finite = None
    out = {}
    for name in names:
        ref = REGISTRY[name].reference
        if isinstance(ref, _OnFinite):
            finite = _finite(x) if finite is None else finite
            out[name] = ref.of(finite)
        else:
            out[name] = reference(name, x, info, o)
    return out


# --------------------------------------------------------------------------------------------
# graph side: one tap subgraph per tensor

OUTSIDE = ("shape", "samples", "tensor")  # built before the finite/non-finite split
SCALAR_RAWS = frozenset({"min", "max", "ynorm", "ysum", "yl1", "yss", "nnz", "m2", "m4", "nan", "inf"})


def raw_dtype(raw: str, o: SketchOptions) -> int:
    """The element type of a raw output: float32 but for the shape and the histogram's bin indices."""
    if raw == "shape":
        return TensorProto.INT64
    if raw == "hidx":
        return TensorProto.UINT8 if o.hist_bins < 255 else TensorProto.INT32
    return TensorProto.FLOAT


def raw_rank(raw: str) -> int:
    """Scalars come back as rank-0 tensors (no Reshape per statistic), everything else as 1-D."""
    return 0 if raw in SCALAR_RAWS else 1


def build_tap(b: Builder, x: str, info: TapInfo, raws: list[str], o: SketchOptions) -> dict[str, str]:
    """Append the nodes computing `raws` of tensor `x` to `b`; returns raw name -> output name."""
    out: dict[str, str] = {}
    if info.elem_type == TensorProto.FLOAT:
        xf = x
    elif info.elem_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        # onnxruntime's CPU EP runs fp16 ops in float32 between Casts it inserts, and drops a
        # Cast(float->fp16) -> Cast(fp16->float) pair even with optimizations off: a direct Cast
        # would read the unrounded float32 values (finite where the tensor holds inf). A Reshape
        # to its own shape in between keeps the tensor's own fp16 values, at every opset.
        xf = b.cast(b.op("Reshape", [x, b.op("Shape", [x])]), TensorProto.FLOAT)
    else:
        xf = b.cast(x, TensorProto.FLOAT)
    flat = b.flat(xf)
    n = b.op("Size", [xf], "numel")
    out["shape"] = b.op("Concat", [b.i64([1]), b.op("Shape", [xf])], "shape", axis=0)
    if "samples" in raws:
        out["samples"] = _block_samples(b, flat, n, o)
    if "tensor" in raws:
        out["tensor"] = b.op("Identity", [flat], "tensor")
    for r in raws:
        own = REGISTRY.get(r)
        if own is not None and own.build is not None:
            out[r] = own.build(b, xf, info, o)
    inner = [r for r in raws if r not in OUTSIDE and r not in out]
    if not inner:
        return out
    if info.as_rows:
        last = b.op("Slice", [b.op("Shape", [xf]), b.i64([-1]), b.i64([np.iinfo(np.int64).max])])
        xf = b.op("Reshape", [xf, b.op("Concat", [b.i64([-1]), last], axis=0)], "rows")
        info = TapInfo(2, TensorProto.FLOAT, 1, 0)
    # The check is Σx², per row first when pos_sumsq wants the rows: finite means no NaN, no
    # Inf and no square that overflows, so the fast branch sums x itself, with no masking and no
    # scaling pass. The rows are Mul + ReduceSum: ReduceSumSquare over an axis is 5x slower.
    axes = info.axes()
    rows = None
    if "pos" in inner and axes is not None:
        rows = b.flat(b.reduce("ReduceSum", b.op("Mul", [xf, xf]), [axes[0]]))
        s2 = b.reduce("ReduceSum", rows, hint="sumsq")
    else:
        s2 = b.reduce("ReduceSumSquare", xf, hint="sumsq")
    bad = b.op("IsNaN", [b.op("Sub", [s2, s2])], "has_nonfinite")
    branches = []
    for slow in (True, False):
        sub = b.child()
        names = _build_inner(sub, xf, info, inner, o, slow, sumsq=s2, rows=rows)
        made = {name for n in sub.nodes for name in n.output}
        # A branch output must be made inside the branch: shared constants live outside.
        names = {r: n if n in made else sub.op("Identity", [n], r) for r, n in names.items()}
        outputs = [
            helper.make_tensor_value_info(names[r], raw_dtype(r, o), [None] * raw_rank(r)) for r in inner
        ]
        branches.append(helper.make_graph(sub.nodes, b.fresh("slow" if slow else "fast"), [], outputs))
    outs = [b.fresh(r) for r in inner]
    b.nodes.append(
        helper.make_node(
            "If", [bad], outs, name=b.fresh("n_If_finite"), then_branch=branches[0], else_branch=branches[1]
        )
    )
    out.update(zip(inner, outs))
    return out


def _block_samples(b: Builder, flat: str, n: str, o: SketchOptions) -> str:
    """The elements at `sample_positions`: rows of x viewed as [n/g, g], gathered (contiguous)."""
    blk = SAMPLE_BLOCK
    g = b.op("Where", [b.op("Equal", [b.op("Mod", [n, b.i64(blk)]), b.i64(0)]), b.i64(blk), b.i64(1)])
    rows = b.op("Div", [n, g])
    k = b.minimum(rows, b.op("Div", [b.op("Add", [b.i64(o.sample_size - 1), g]), g]))
    j = b.op("Range", [b.i64(0), k, b.i64(1)])
    u = b.op("Mul", [b.cast(j, TensorProto.DOUBLE), b.const(GOLDEN, np.float64)])
    frac = b.op("Sub", [u, b.op("Floor", [u])])
    at = b.op("Floor", [b.op("Mul", [frac, b.cast(rows, TensorProto.DOUBLE)])])
    idx = b.op("Where", [b.op("Less", [k, rows]), b.cast(at, TensorProto.INT64), j])
    view = b.op("Reshape", [flat, b.op("Concat", [b.i64([-1]), b.op("Reshape", [g, b.i64([1])])], axis=0)])
    return b.flat(b.op("Gather", [view, idx], axis=0), "samples")


def _scale_of_minmax(b: Builder, lo: str, hi: str) -> str:
    """max(|min|, |max|) + 1e-12 (0 + 1e-12 when min/max are +-inf: no finite value); `_scale` on the host."""
    absmax = b.op("Max", [b.op("Abs", [lo]), b.op("Abs", [hi])])
    absmax = b.op("Where", [b.op("IsInf", [absmax]), b.const(0.0), absmax])
    return b.op("Add", [absmax, b.const(EPS_SCALE)], "scale")


def _build_inner(
    b: Builder,
    x: str,
    info: TapInfo,
    raws: list[str],
    o: SketchOptions,
    slow: bool,
    sumsq: str | None = None,
    rows: str | None = None,
) -> dict[str, str]:
    """Raw statistics of x; `slow` masks NaN/Inf first (the fast branch knows there are none).

    The fast branch takes its sums on x itself (`ynorm` = 1) and reuses Σx² (`sumsq`) and the
    per-row Σx² (`rows`) the check computed. The slow branch takes them on y = x / scale with
    non-finite values zeroed (`ynorm` = scale), so BERT's -3.4e38 mask values cannot overflow.

    Measured on CPU (onnxruntime, a [512, 256] float tensor): a whole-tensor reduction costs
    about 10 us, one that keeps the channel axis about 50 us and Sign about 90 us, so min/max
    are whole-tensor reductions, only chan_maxabs keeps the channel axis, and nnz counts
    through a bool cast instead of Sign.
    """
    F = TensorProto.FLOAT
    out: dict[str, str] = {}
    axes = info.axes()
    wants = set(raws)
    if slow:
        bad = b.op("IsNaN", [b.op("Sub", [x, x])], "nonfinite")
        xs = b.op("Where", [bad, b.const(0.0), x], "finite_x")
        lo_in = b.op("Where", [bad, b.const(np.inf), x])
        hi_in = b.op("Where", [bad, b.const(-np.inf), x])
        out["nan"] = b.reduce("ReduceSum", b.cast(b.op("IsNaN", [x]), F))
        out["inf"] = b.reduce("ReduceSum", b.cast(b.op("IsInf", [x]), F))
    else:
        bad, xs, lo_in, hi_in = None, x, x, x
        out["nan"] = b.const(0.0)
        out["inf"] = b.op("Identity", [out["nan"]])
    out["min"] = b.reduce("ReduceMin", lo_in, hint="min")
    out["max"] = b.reduce("ReduceMax", hi_in, hint="max")
    if "chan_abs" in wants and axes is not None:
        absx = b.op("Abs", [xs])
        if slow:
            absx = b.op("Where", [bad, b.const(-1.0), absx])
        keep = [a for a in range(info.rank) if a != axes[0]]
        if keep and axes[0] == info.rank - 1:
            # Reducing every axis but the last is ~2x slower in onnxruntime than transposing the
            # channels to the front and reducing the contiguous rest (measured: 117 vs 58 us on
            # [4, 128, 256]).
            absx = b.op("Transpose", [absx], perm=[axes[0], *keep])
            keep = list(range(1, info.rank))
        out["chan_abs"] = b.flat(b.reduce("ReduceMax", absx, keep)) if keep else absx
    scale = None
    if slow or wants & {"m2", "m4", "hist", "hidx"}:
        scale = _scale_of_minmax(b, out["min"], out["max"])
    y_needed = slow and bool(wants & {"ysum", "yl1", "yss", "pos", "adj", "m2", "m4", "hist", "hidx"})
    y = b.op("Div", [xs, scale], "y") if y_needed else x  # the values the sums are taken on
    if "ynorm" in wants:
        out["ynorm"] = scale if slow else b.const(1.0)
    if wants & {"ysum", "m2", "m4"}:
        out["ysum"] = b.reduce("ReduceSum", y, hint="ysum")
    if "yl1" in wants:
        out["yl1"] = b.reduce("ReduceL1", y, hint="yl1")
    if "nnz" in wants:
        out["nnz"] = b.reduce("ReduceSum", b.cast(b.cast(xs, TensorProto.BOOL), F), hint="nnz")
    if "m2" in wants or "m4" in wants:
        # moments of d = (x - mean) / scale: |d| <= 2, so d^4 cannot overflow
        n_fin = b.cast(b.op("Size", [x]), F)
        if slow:
            n_fin = b.op("Sub", [n_fin, b.op("Add", [out["nan"], out["inf"]])])
            d = b.op("Where", [bad, b.const(0.0), b.op("Sub", [y, b.op("Div", [out["ysum"], n_fin])])])
        else:
            d = b.op("Div", [b.op("Sub", [x, b.op("Div", [out["ysum"], n_fin])]), scale])
        d2 = b.op("Mul", [d, d])
        out["m2"] = b.reduce("ReduceSum", d2, hint="m2")
        out["m4"] = b.reduce("ReduceSumSquare", d2, hint="m4")
    pos_full = rows if not slow else None
    if slow and axes is not None and wants & {"pos", "yss"}:
        pos_full = b.flat(b.reduce("ReduceSumSquare", y, [axes[0]]))
    if "pos" in wants and pos_full is not None:
        idx = b.strided_indices(b.op("Size", [pos_full]), o.max_rows)
        out["pos"] = b.op("Gather", [pos_full, idx], axis=0)
    if "yss" in wants:
        if not slow:
            out["yss"] = sumsq
        else:
            out["yss"] = b.reduce("ReduceSum", pos_full) if pos_full else b.reduce("ReduceSumSquare", y)
    if "adj" in wants and axes is not None:
        ch, seq = axes
        if seq is None:
            out["adj"] = b.const(np.zeros(0, np.float32))
        else:
            # Only `adj_pairs` evenly spaced pairs per sequence: the miner needs the mean ratio to
            # pos_sumsq, and diffing every pair cost 4 passes over the tensor (two Slice copies).
            n_rows = b.op("Gather", [b.op("Shape", [y]), b.i64(seq)], axis=0)
            t = b.strided_indices(b.op("Sub", [n_rows, b.i64(1)]), o.adj_pairs)
            after = b.op("Gather", [y, b.op("Add", [t, b.i64(1)])], axis=seq)
            diff = b.op("Sub", [after, b.op("Gather", [y, t], axis=seq)])
            adj = b.flat(b.reduce("ReduceSum", b.op("Mul", [diff, diff]), [ch]))
            out["adj"] = b.op("Gather", [adj, b.strided_indices(b.op("Size", [adj]), o.max_rows)], axis=0)
    if wants & {"hist", "hidx"}:
        yh = y if slow or o.hist_range is not None else b.op("Div", [x, scale], "y")
        t, valid = _hist_bins(b, xs, yh, bad, o)
        if "hidx" in wants:
            if valid is not None:  # masked or out-of-range values go to an extra bin, dropped on the host
                t = b.op("Where", [valid, t, b.const(float(o.hist_bins))])
            out["hidx"] = b.flat(b.cast(t, raw_dtype("hidx", o)))
        else:
            out["hist"] = _count_bins(b, t, valid, o)
    return {r: out[r] for r in raws}


def _hist_bins(b: Builder, xs: str, y: str, bad: str | None, o: SketchOptions) -> tuple[str, str | None]:
    """(bin index as float, clipped to [0, bins-1]; the mask of values that count or None for all),
    with the float32 arithmetic `_hist_counts` repeats on the host."""
    bins = o.hist_bins
    if o.hist_range is None:
        t = b.op("Floor", [b.op("Mul", [b.op("Add", [y, b.const(1.0)]), b.const(bins / 2)])])
        valid = None
    else:
        lo, hi = (np.float32(v) for v in o.hist_range)
        t = b.op(
            "Floor", [b.op("Div", [b.op("Sub", [xs, b.const(lo)]), b.const(np.float32((hi - lo) / bins))])]
        )
        valid = b.op(
            "And",
            [
                b.op("Not", [b.op("Less", [xs, b.const(lo)])]),
                b.op("Not", [b.op("Greater", [xs, b.const(hi)])]),
            ],
        )
    if bad is not None:
        ok = b.op("Not", [bad])
        valid = ok if valid is None else b.op("And", [valid, ok])
    return b.op("Clip", [t, b.const(0.0), b.const(float(bins - 1))]), valid


def _count_bins(b: Builder, t: str, valid: str | None, o: SketchOptions) -> str:
    """Exact in-graph counts: ScatterElements(add) from opset 16; before, Unique's counts.

    Unique (opset 11) sorts, so it costs ~8x a scatter-add on CPU, but a bins-wide one-hot
    compare was ~70x plain inference on a BERT-like model. Masked elements go to an extra
    overflow bin that is sliced off.
    """
    F = TensorProto.FLOAT
    bins = o.hist_bins
    idx = b.flat(b.cast(t, TensorProto.INT64))
    if not scatter_add_available(b.opset):
        if valid is not None:
            idx = b.op("Where", [b.flat(valid), idx, b.i64(bins)])
        values, _, _, counts = b.ops("Unique", [idx], 4, "unique", sorted=1)
        hist = b.op(
            "ScatterElements", [b.const(np.zeros(bins + 1, np.float32)), values, b.cast(counts, F)], axis=0
        )
        return b.slice(hist, 0, bins, 0)
    if valid is None:
        updates = b.op("Expand", [b.const([1.0]), b.op("Shape", [idx])])
    else:
        updates = b.flat(b.cast(valid, F))
    return b.scatter_add(b.const(np.zeros(bins, np.float32)), idx, updates)
