"""What a sketch is: the `Sketch` unit, its options, and what it knows about the tensor it reads.

A `Sketch` holds everything about one statistic in one place: its in-graph builder (which
reads the shared pieces it needs from a `TapContext` and returns its raw outputs), the host
`finalize` that turns raw outputs into its values (float64), the numpy `reference` computed
straight from the definition, its `merge` rule, the tolerance the tests hold the two to, and
a cost note. Raw outputs are named, and a name means the same quantity in every sketch that
reads it ("min" is the smallest finite value; "ynorm" what the branch divided sums by), so a
tap computes each raw once however many sketches read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .context import TapContext
from .merge import Derived, Merge
from .options import SketchOptions, TapInfo

FINITE = "finite"  # built in both branches of the finite / non-finite If, on the finite values
OUTER = "outer"  # built once, outside the If, on the tensor as it is (no NaN masking)

Raw = dict[str, np.ndarray]


class Tolerance(NamedTuple):
    """How close finalize(graph) must be to the reference: |got - ref| <= rtol·|ref| + atol·scale."""

    rtol: float = 0.0
    atol: float = 0.0  # a fraction of the statistic's scale (tests/test_sketches.py `scale_of`)


@dataclass(frozen=True)
class Sketch:
    """One statistic of a tapped tensor: graph builder, host finalize, numpy reference, merge, tolerance."""

    name: str
    doc: str
    build: Callable[[TapContext], dict[str, str]]  # raw name -> tensor, built through the tap context
    finalize: Callable[[Raw, SketchOptions], np.ndarray]
    reference: Callable[[np.ndarray, TapInfo, SketchOptions], np.ndarray]
    merge: Merge | Derived
    tol: Tolerance = Tolerance()
    vector: bool = False
    stage: str = FINITE
    needs_rank: bool = False  # per-channel / per-row: skipped on tensors of unknown or zero rank
    uses_rows: bool = False  # reads the per-row Σx²: the finite check is then taken per row, and shared
    uses_channels: bool = False  # reads per-channel extremes, which give the fast branch's min and max
    kinds: tuple[str, ...] = ()  # site kinds this sketch is made for (attn, route); () for every tensor
    scalars: tuple[str, ...] = ()  # its own raw outputs that are scalars (rank 0); the others are 1-D
    cost: str = ""  # what it costs on CPU, measured (BENCHMARKS.md, --sketches-alone)


# --------------------------------------------------------------------------------------------
# host-side helpers every finalize may use: raws "shape", "nan", "inf" come with every tap


def numel(r: Raw) -> int:
    return int(np.prod(r["shape"][1:])) if len(r["shape"]) > 1 else 1


def n_bad(r: Raw) -> float:
    return float(r["nan"][0] + r["inf"][0])


def n_finite(r: Raw) -> float:
    return numel(r) - n_bad(r)


def ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def ynorm(r: Raw) -> float:
    """What the branch divided the sums by: 1 on a finite tensor, the scale in the masking branch."""
    return float(r["ynorm"][0])


# --------------------------------------------------------------------------------------------
# reference helpers: straight from the definitions, float64, on the finite elements


def as_f64(x: np.ndarray) -> np.ndarray:
    """x as the graph sees it (cast to float32: ints past 2**24 round, float64 past 3.4e38 is inf), in float64."""
    return np.asarray(x).astype(np.float32).astype(np.float64)


def finite_values(x: np.ndarray) -> np.ndarray:
    v = as_f64(x).ravel()
    return v[np.isfinite(v)]


def zero_nonfinite(x: np.ndarray) -> np.ndarray:
    v = as_f64(x)
    return np.where(np.isfinite(v), v, 0.0)


def row_view(x: np.ndarray, info: TapInfo) -> np.ndarray:
    """x in float64, viewed as [rows, channels] when the rank was unknown to the graph (TapInfo.as_rows)."""
    v = as_f64(x)
    return v.reshape(-1, v.shape[-1]) if info.as_rows and v.ndim >= 1 else v


def cap_rows(v: np.ndarray, k_max: int) -> np.ndarray:
    """At most k_max evenly strided entries of v (entry 0 always kept), as the graph's strided gather."""
    v = v.ravel()
    k = min(v.size, k_max)
    return v[(np.arange(k, dtype=np.int64) * v.size) // max(k, 1)]


@dataclass(frozen=True)
class OnFinite:
    """A scalar reference over the finite values: fn(finite float64 values), `empty` when there are none.

    `references` hands several of these one shared finite view of a weight instead of each
    converting and masking the whole tensor again.
    """

    fn: Callable[[np.ndarray], float]
    empty: float = np.nan

    def of(self, finite: np.ndarray) -> np.ndarray:
        return np.array([self.fn(finite) if finite.size else self.empty])

    def __call__(self, x: np.ndarray, info: TapInfo, o: SketchOptions) -> np.ndarray:
        return self.of(finite_values(x))
