"""How a sketch's values from several parts combine: Loop / Scan iterations, batches, workers.

A merge rule is a typed value, not a string: `Merge` combines the parts' values (with each
part's element count, for means weighted by size); `Derived` is recomputed from another
sketch's merged values (chan_outlier from the merged chan_maxabs), so decoding merges the
plain rules first and the derived ones from their results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Parts = Sequence[np.ndarray]


@dataclass(frozen=True)
class Merge:
    name: str
    combine: Callable[[Parts, Sequence[int]], np.ndarray]

    def __call__(self, parts: Parts, numels: Sequence[int]) -> np.ndarray:
        with np.errstate(all="ignore"):
            return self.combine(parts, numels)


@dataclass(frozen=True)
class Derived:
    """Recomputed from the merged values of sketch `source`."""

    source: str
    of: Callable[[np.ndarray], np.ndarray]

    @property
    def name(self) -> str:
        return f"derived from {self.source}"


def _weighted_mean(parts: Parts, numels: Sequence[int]) -> np.ndarray:
    w = np.asarray(numels, np.float64)
    v = np.concatenate(parts)
    ok = np.isfinite(v)
    return np.array([np.sum(v[ok] * w[ok]) / np.sum(w[ok]) if ok.any() else np.nan])


MIN = Merge("min", lambda p, n: np.array([np.nanmin(np.concatenate(p))]) if len(p) else np.array([np.nan]))
MAX = Merge("max", lambda p, n: np.array([np.nanmax(np.concatenate(p))]) if len(p) else np.array([np.nan]))
SUM = Merge("sum", lambda p, n: np.sum(p, axis=0))
MEAN = Merge("mean weighted by size", _weighted_mean)
CONCAT = Merge("concat", lambda p, n: np.concatenate(p))
ELEMENT_MAX = Merge("elementwise max", lambda p, n: np.nanmax(np.stack(p), axis=0))
FIRST = Merge("first", lambda p, n: p[0])
