"""The tap context: the pieces that several sketches of one tensor share, each built once, on first use.

One tapped tensor gets one small subgraph whose raw outputs serve every sketch asked for.
Its layout, for a tensor x cast to float32:

    shape, samples                       outer: a cheap gather, no full pass
    s2 = ReduceSumSquare(x)              one pass: the sumsq sketch, and the NaN/Inf check
    If isnan(s2 - s2):  slow branch      mask non-finite values, count them
    else:               fast branch      the same statistics with no masking at all

A main-graph tap builds its fast branch in the graph itself, beside an If whose one output is the
slow branch's raws in one vector (`tap.build_tap`, `packed`).

Sketch builders never build these pieces themselves: they ask the context (`c.min`,
`c.scale`, `c.y`, `c.outer.samples`, ...), and a piece two sketches ask for is built once.
An OUTER context is the graph around the If; a branch context (`slow` True or False) is
one branch, and reaches the outer pieces through `c.outer`.

Why the check is Σx²: a finite sum of squares means no NaN, no Inf and no square that
overflows, so the fast branch sums x itself (`ynorm` = 1) with no masking and no scaling
pass. The slow branch takes its sums on y = x / (max|x| + 1e-12) with non-finite values
zeroed (`ynorm` = that scale), so |y| <= 1 and nothing overflows in float32, not even BERT's
-3.4e38 mask values; the host multiplies `ynorm` back in float64. When a sketch reads the
per-row Σx² (`Sketch.uses_rows`), the check is taken per row first and the fast branch reuses the
rows (`row_squares`: over the innermost axis as Mul + ReduceSum, over another as ReduceSumSquare).

Measured on CPU (onnxruntime, a [512, 256] float tensor): a whole-tensor reduction costs
about 10 us, one that keeps the channel axis about 50 us and Sign about 90 us, so min/max
are whole-tensor reductions, only chan_maxabs keeps the channel axis, and nnz counts
through a bool cast instead of Sign.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from onnx import TensorProto

from ..graph.build import INT64_MAX, Builder
from ..graph.opset import reshape_allows_zero
from .options import SketchOptions, TapInfo

F = TensorProto.FLOAT
EPS_SCALE = np.float32(1e-12)  # y = x / (max|x| + 1e-12), as the histogram definition asks
SAMPLE_BLOCK = 16  # the sampled histogram reads blocks of 16 contiguous elements (one cache line)
GOLDEN = (np.sqrt(5.0) - 1) / 2  # block j of the sample is at frac(j * GOLDEN) of the tensor


ROW_PERIOD = 720  # 2^4 * 3^2 * 5: the row counts of real tensors (B*S, H*W) mostly share its factors
MAX_BLOCK = 16


def row_block(rows: int) -> int:
    """Rows reduced per block in a channel-last per-channel reduction (`TapContext.per_channel`): the
    largest divisor of gcd(rows, 720) up to 16 (1 for a prime count)."""
    g = math.gcd(rows, ROW_PERIOD)
    return max(d for d in range(1, MAX_BLOCK + 1) if g % d == 0)


@functools.cache
def row_blocks_table() -> np.ndarray:
    """`row_block(r)` for r in [0, 720), the lookup table the graph indexes with rows mod 720: made on
    the first channel-last tap, not at import (~1 ms)."""
    return np.array([row_block(r) for r in range(ROW_PERIOD)], np.int64)


class SampleIndex(NamedTuple):
    """Where the sample of a tensor lies: the block view's shape ([-1, g]) and the block indices.

    Both depend on the element count alone, so taps on tensors of one shape share one
    (`instrument.samples`): made once, or constants when the shape is static, instead of the
    ~20 scalar nodes of `sample_index` in every tap (~1 µs each on CPU, however small the tensor).
    """

    view: str
    idx: str


class TapContext:
    """Shared pieces of one tensor's tap at one level (outer, or one If branch). State is real: the memo."""

    def __init__(
        self,
        b: Builder,
        x: str,
        info: TapInfo,
        options: SketchOptions,
        outer: TapContext | None = None,
        slow: bool | None = None,
        sample: SampleIndex | None = None,
    ):
        self.b, self.x, self.info, self.options = b, x, info, options
        self._outer, self.slow, self.sample = outer, slow, sample
        self._memo: dict[str, str] = {}

    @classmethod
    def for_tensor(
        cls, b: Builder, tensor: str, info: TapInfo, options: SketchOptions, sample: SampleIndex | None = None
    ) -> TapContext:
        """The outer context of `tensor`, whose `x` is the tensor as float32; `sample`: its shared sample index."""
        return cls(b, _as_float(b, tensor, info.elem_type), info, options, sample=sample)

    def memo(self, key: str, make: Callable[[], str]) -> str:
        """`make()` the first time `key` is asked for at this level, the same tensor afterwards."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    @property
    def outer(self) -> TapContext:
        return self._outer if self._outer is not None else self

    @property
    def in_branch(self) -> bool:
        return self.slow is not None

    def axes(self) -> tuple[int, int | None] | None:
        return self.info.axes()

    # --- outer pieces: the tensor as it is, before the finite split ----------------------------

    @property
    def shape(self) -> str:
        """[1, *shape] as int64: a leading 1 keeps a scalar's shape non-empty (empty means "did not run")."""
        o = self.outer
        return o.memo(
            "shape", lambda: o.b.op("Concat", [o.b.i64([1]), o.b.op("Shape", [o.x])], "shape", axis=0)
        )

    @property
    def flat(self) -> str:
        o = self.outer
        return o.memo("flat", lambda: o.b.flat(o.x))

    @property
    def size(self) -> str:
        o = self.outer
        return o.memo("size", lambda: o.b.op("Size", [o.x], "numel"))

    @property
    def samples(self) -> str:
        """The elements at `sample_positions`: blocks of the flat tensor, gathered (contiguous)."""
        o = self.outer

        def make() -> str:
            at = o.sample or sample_index(o.b, o.size, o.options)
            return o.b.flat(o.b.op("Gather", [o.b.op("Reshape", [o.x, at.view]), at.idx], axis=0), "samples")

        return o.memo("samples", make)

    @property
    def tensor(self) -> str:
        """The whole tensor, flat (the host histogram mode copies it out)."""
        o = self.outer
        return o.memo("tensor", lambda: o.b.op("Identity", [o.flat], "tensor"))

    # --- the finite split (outer level) --------------------------------------------------------

    def split(self, uses_rows: bool, uses_channels: bool = False) -> Split:
        """The If's condition and what both branches share: the row view, Σx² and, with `uses_rows`, Σx² per row.
        `uses_channels`: a sketch reads the per-channel extremes, from which the fast branch then takes
        min and max too."""
        b, x, info = self.b, self.x, self.info
        if info.as_rows:
            x = b.rows(x, "rows")
            info = TapInfo(2, F, 1, 0)
        axes = info.axes()
        rows = None
        if uses_rows and axes is not None:
            rows = b.flat(row_squares(b, x, axes[0], info.rank))
            check = b.reduce("ReduceSum", rows, hint="sumsq")
        else:
            check = b.reduce("ReduceSumSquare", x, hint="sumsq")
        bad = b.nonfinite(check, "has_nonfinite")
        return Split(self, x, info, check, rows, bad, uses_channels and axes is not None)

    # --- finite pieces (inside a branch) -------------------------------------------------------

    def _branch(self, what: str) -> None:
        if not self.in_branch:
            raise RuntimeError(
                f"{what} is built inside the finite/non-finite split: give the sketch stage FINITE"
            )

    @property
    def bad(self) -> str | None:
        """Mask of the non-finite elements (slow branch); None where there are none (fast branch)."""
        self._branch("bad")
        if not self.slow:
            return None
        return self.memo("bad", lambda: self.b.nonfinite(self.x, "nonfinite"))

    @property
    def xs(self) -> str:
        """x with non-finite elements zeroed."""
        self._branch("xs")
        if not self.slow:
            return self.x
        return self.memo("xs", lambda: self.b.where(self.bad, self.b.const(0.0), self.x))

    @property
    def nan(self) -> str:
        self._branch("nan")
        if not self.slow:
            return self.memo("nan", lambda: self.b.const(0.0))
        return self.memo("nan", lambda: self.b.reduce("ReduceSum", self.b.cast(self.b.isnan(self.x), F)))

    @property
    def inf(self) -> str:
        self._branch("inf")
        if not self.slow:  # its own tensor: one name cannot be two outputs of a branch
            return self.memo("inf", lambda: self.b.op("Identity", [self.nan]))
        return self.memo("inf", lambda: self.b.reduce("ReduceSum", self.b.cast(self.b.isinf(self.x), F)))

    @property
    def min(self) -> str:
        self._branch("min")
        b = self.b
        if not self.slow and self._split.channels:  # from the per-channel minima: no pass of its own
            return self.memo("min", lambda: b.reduce("ReduceMin", self.chan_min, hint="min"))
        lo = (lambda: b.where(self.bad, b.const(np.inf), self.x)) if self.slow else (lambda: self.x)
        return self.memo("min", lambda: b.reduce("ReduceMin", lo(), hint="min"))

    @property
    def max(self) -> str:
        self._branch("max")
        b = self.b
        if not self.slow and self._split.channels:
            return self.memo("max", lambda: b.reduce("ReduceMax", self.chan_max, hint="max"))
        hi = (lambda: b.where(self.bad, b.const(-np.inf), self.x)) if self.slow else (lambda: self.x)
        return self.memo("max", lambda: b.reduce("ReduceMax", hi(), hint="max"))

    @property
    def chan_max(self) -> str:
        """max of x per channel, [C] (fast branch: nothing to mask)."""
        self._branch("chan_max")
        return self.memo("chan_max", lambda: self.per_channel("ReduceMax", self.x))

    @property
    def chan_min(self) -> str:
        self._branch("chan_min")
        return self.memo("chan_min", lambda: self.per_channel("ReduceMin", self.x))

    def per_channel(self, op: str, x: str) -> str:
        """`op` (ReduceMax, ReduceMin) of x, a tensor of this level's shape, over every axis but the
        channel axis: [C] (x itself at rank 1).

        onnxruntime reduces every axis but the last 4-6x slower than a blocked view [rows/k, k, C]
        reduced over k and then over the rows left (512 vs 86 us on [512, 768], k = 16), so a
        channel-last tensor is reduced that way, k = `row_block(rows)` looked up from its shape once
        per tap outside the If (`row_blocks`). That needs Reshape's allowzero (opset 14) to keep an
        empty tensor's zero dims; before, the channels are transposed to the front (once per tensor)
        and the contiguous rest reduced, ~2x faster than reducing around them.
        """
        b, (ch, _), rank = self.b, self.axes(), self.info.rank
        keep = [a for a in range(rank) if a != ch]
        if not keep:
            return x
        if ch == rank - 1 and reshape_allows_zero(b.opset):
            blocks = self.memo(f"blocks:{x}", lambda: b.op("Reshape", [x, self.row_blocks], allowzero=1))
            return b.reduce(op, b.reduce(op, blocks, [1]), [0])
        if ch == rank - 1:
            x = self.memo(f"channels_first:{x}", lambda: b.op("Transpose", [x], perm=[ch, *keep]))
            keep = list(range(1, rank))
        return b.flat(b.reduce(op, x, keep))

    @property
    def row_blocks(self) -> str:
        """The shape [rows / k, k, C] of this level's channel-last x, k = `row_block(rows)`: made once per
        tap, outside the If, from the shape alone (Shape, two Slices, ReduceProd, Mod, a table lookup)."""
        o, x = self.outer, self.x

        def make() -> str:
            b = o.b
            shape = b.op("Shape", [x])
            rows = b.reduce("ReduceProd", b.slice(shape, 0, -1, 0), [0], keepdims=1)
            chans = b.slice(shape, -1, INT64_MAX, 0)
            k = b.op("Gather", [b.i64(row_blocks_table()), b.op("Mod", [rows, b.i64([ROW_PERIOD])])], axis=0)
            return b.op("Concat", [b.op("Div", [rows, k]), k, chans], "row_blocks", axis=0)

        return o.memo("row_blocks", make)

    @property
    def scale(self) -> str:
        """max(|min|, |max|) + 1e-12 over the finite values (0 + 1e-12 when there is none), as the host rebuilds it."""

        def make() -> str:
            b = self.b
            absmax = b.op("Max", [b.op("Abs", [self.min]), b.op("Abs", [self.max])])
            absmax = b.where(b.isinf(absmax), b.const(0.0), absmax)
            return b.op("Add", [absmax, b.const(EPS_SCALE)], "scale")

        self._branch("scale")
        return self.memo("scale", make)

    @property
    def y(self) -> str:
        """The values sums are taken on: x in the fast branch, x / scale (non-finite zeroed) in the slow one."""
        self._branch("y")
        if not self.slow:
            return self.x
        return self.memo("y", lambda: self.b.op("Div", [self.xs, self.scale], "y"))

    @property
    def y_unit(self) -> str:
        """x / scale in both branches: values in [-1, 1] (the histogram's unit)."""
        self._branch("y_unit")
        if self.slow:
            return self.y
        return self.memo("y_unit", lambda: self.b.op("Div", [self.x, self.scale], "y"))

    @property
    def ynorm(self) -> str:
        """What the sums were divided by (raw "ynorm"): the scale in the slow branch, 1 in the fast one."""
        self._branch("ynorm")
        return self.scale if self.slow else self.memo("one", lambda: self.b.const(1.0))

    @property
    def ysum(self) -> str:
        self._branch("ysum")
        return self.memo("ysum", lambda: self.b.reduce("ReduceSum", self.y, hint="ysum"))

    @property
    def n_finite(self) -> str:
        """The number of finite elements, float32."""

        def make() -> str:
            b = self.b
            n = b.cast(b.op("Size", [self.x]), F)
            return b.op("Sub", [n, b.op("Add", [self.nan, self.inf])]) if self.slow else n

        self._branch("n_finite")
        return self.memo("n_finite", make)

    @property
    def row_energy(self) -> str | None:
        """Σy² per row (over the channel axis), flat; None when the rank is unknown."""
        self._branch("row_energy")
        axes = self.axes()
        if axes is None:
            return None
        if not self.slow and self._split.rows is not None:
            return self._split.rows
        return self.memo(
            "row_energy", lambda: self.b.flat(self.b.reduce("ReduceSumSquare", self.y, [axes[0]]))
        )

    @property
    def yss(self) -> str:
        """Σy² over the whole tensor: the check itself in the fast branch."""
        self._branch("yss")
        if not self.slow:
            return self._split.check

        def make() -> str:
            if self._split.rows is not None and self.row_energy is not None:
                return self.b.reduce("ReduceSum", self.row_energy)
            return self.b.reduce("ReduceSumSquare", self.y)

        return self.memo("yss", make)

    _split: Split  # set on branch contexts by Split.branch


class Split:
    """The finite/non-finite split of one tap: what the two branches share, and how to make each."""

    def __init__(
        self, outer: TapContext, x: str, info: TapInfo, check: str, rows: str | None, bad: str, channels: bool
    ):
        self.outer, self.x, self.info, self.check, self.rows, self.bad = outer, x, info, check, rows, bad
        self.channels = channels

    def branch(self, b: Builder, slow: bool) -> TapContext:
        ctx = TapContext(b, self.x, self.info, self.outer.options, outer=self.outer, slow=slow)
        ctx._split = self
        return ctx


def row_squares(b: Builder, x: str, channel: int, rank: int) -> str:
    """Σx² over the channel axis, whichever op onnxruntime's CPU kernels run faster there. Over the
    innermost axis (a transformer's [B, S, C]) Mul + ReduceSum: ReduceSumSquare is 2x slower ([128, 768]
    34 vs 71 µs). Over another (a conv's [N, C, H, W]) ReduceSumSquare: the square is not written out
    ([1, 16, 112, 112] 207 vs 132 µs, [1, 128, 28, 28] 75 vs 59). Both round the same."""
    if channel == rank - 1:
        return b.reduce("ReduceSum", b.op("Mul", [x, x]), [channel])
    return b.reduce("ReduceSumSquare", x, [channel])


def _as_float(b: Builder, x: str, elem_type: int) -> str:
    if elem_type == TensorProto.FLOAT:
        return x
    if elem_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        # onnxruntime's CPU EP runs fp16 ops in float32 between Casts it inserts, and drops a
        # Cast(float->fp16) -> Cast(fp16->float) pair even with optimizations off: a direct Cast
        # would read the unrounded float32 values (finite where the tensor holds inf). A Reshape
        # to its own shape in between keeps the tensor's own fp16 values, at every opset.
        return b.cast(b.op("Reshape", [x, b.op("Shape", [x])]), F)
    return b.cast(x, F)


def sample_index(b: Builder, n: str, o: SketchOptions) -> SampleIndex:
    """The block view and block indices of `sample_positions` (sketch.histogram) for n elements
    (an int64 scalar): x viewed as [n/g, g], rows idx gathered.

    Integer arithmetic only, no Mod or integer Less, so it reads the same at every opset:
    16 divides n when (n / 16) * 16 == n, and k < rows (k <= rows always) when k != rows.
    """
    i64 = TensorProto.INT64
    blk = SAMPLE_BLOCK
    divides = b.op("Equal", [b.op("Mul", [b.op("Div", [n, b.i64(blk)]), b.i64(blk)]), n])
    g = b.where(divides, b.i64(blk), b.i64(1), i64)
    rows = b.op("Div", [n, g])
    k = b.minimum(rows, b.op("Div", [b.op("Add", [b.i64(o.sample_size - 1), g]), g]))
    j = b.arange(k, bound=o.sample_size)
    u = b.op("Mul", [b.cast(j, TensorProto.DOUBLE), b.const(GOLDEN, np.float64)])
    frac = b.op("Sub", [u, b.op("Floor", [u])])
    at = b.op("Floor", [b.op("Mul", [frac, b.cast(rows, TensorProto.DOUBLE)])])
    idx = b.where(b.op("Not", [b.op("Equal", [k, rows])]), b.cast(at, i64), j, i64)
    view = b.op("Concat", [b.i64([-1]), b.op("Reshape", [g, b.i64([1])])], "sample_view", axis=0)
    return SampleIndex(view, idx)
