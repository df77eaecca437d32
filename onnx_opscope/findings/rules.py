"""The rule cascade over a gemm operand's signals (first match wins), and the rules across steps.

Each rule is `signal <op> config.<threshold>`; nothing is a literal in the rule code. The
README section "Rules (first match wins)" gives the evidence behind every default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pyarrow.compute as pc

from .config import MineConfig
from .series import TableLike, read_sketch_table

DENSE = "dense: no sketch-visible exploit"
DENSE_NOTE = "low rank and other structure across channels are not visible in sketches"


def fmt_num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Rule:
    """One step of the cascade: `signal <op> config.<threshold>` fires `exploit`."""

    name: str
    signal: str
    op: str  # "<" or ">"
    threshold: str  # a MineConfig field
    exploit: str
    guard: str  # runtime predicate over the sketches; {t} is the threshold
    score: Callable[[float], float]

    def limit(self, cfg: MineConfig) -> float:
        return float(getattr(cfg, self.threshold))

    def holds(self, value: float | None, cfg: MineConfig) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value < self.limit(cfg) if self.op == "<" else value > self.limit(cfg)

    def condition(self, cfg: MineConfig) -> str:
        return f"{self.signal} {self.op} {fmt_num(self.limit(cfg))}"


RULES: tuple[Rule, ...] = (
    Rule("nonfinite", "nonfinite", ">", "nonfinite_max", "fix numerics first (NaN/Inf)",
         "(nan_count + inf_count)/numel > {t}", lambda v: 1.0),
    Rule("sparse", "density", "<", "density_max", "sparse GEMM", "nnz/numel < {t}", lambda v: 1.0 - v),
    Rule("outlier", "outlier", ">", "outlier_min", "per-channel int quant",
         "max(chan_maxabs)/mean(chan_maxabs) > {t}", lambda v: min(v / 30.0, 1.0)),
    Rule("levels", "hist_gaps", ">", "gaps_min", "quantize / LUT (few levels)",
         "hist_gaps(hist) > {t}", lambda v: v),
    Rule("heavy_tail", "kurtosis", ">", "kurtosis_min",
         "outlier-aware quant (heavy tails)", "kurtosis > {t}", lambda v: min(v / 50.0, 1.0)),
    Rule("concentrated", "histtop", ">", "histtop_min", "quantize / LUT (concentrated values)",
         "max(hist)/sum(hist) > {t}", lambda v: v),
    Rule("coherent", "adj", "<", "adj_max", "delta-compute (adjacent rows)",
         "mean(adj_sumsq)/mean(pos_sumsq) < {t}", lambda v: 1.0 - v),
    Rule("positional", "pos_cv", ">", "pos_cv_min", "sequence / positional structure",
         "std(pos_sumsq)/|mean(pos_sumsq)| > {t}", lambda v: min(v / 3.0, 1.0)),
)  # fmt: skip
# The sketches each rule reads; the opt-in ones (nnz, chan_maxabs, kurtosis, adj_sumsq) may be absent.
RULE_SKETCHES = {
    "nonfinite": ("nan_count", "inf_count"),
    "sparse": ("nnz",),
    "outlier": ("chan_maxabs",),
    "levels": ("hist",),
    "heavy_tail": ("kurtosis",),
    "concentrated": ("hist",),
    "coherent": ("adj_sumsq", "pos_sumsq"),
    "positional": ("pos_sumsq",),
}


def unchecked_rules(table: TableLike) -> dict[str, list[str]]:
    """Rules the table cannot fire because a sketch they read was not recorded: rule -> missing sketches."""
    t, _ = read_sketch_table(table, columns=["stat"])
    have = set(pc.unique(t.column("stat")).to_pylist())
    missing = {rule: [s for s in need if s not in have] for rule, need in RULE_SKETCHES.items()}
    return {rule: m for rule, m in missing.items() if m}


TEMPORAL_RULES = {
    "stationary": ("precompute / prepack", "cv(l1, or sumsq, over steps) < {t}", "stationary_cv"),
    "memoize": ("memoize", "reldist(elemsig, a cached elemsig) < {t}", "repeat_dist"),
    "delta": ("delta-compute (across steps)", "reldist(elemsig_t, elemsig_t-1) < {t}", "drift_max"),
    "drifting": ("none: drifting", "", ""),
}


def fire(signals: Mapping[str, float | None], cfg: MineConfig) -> Rule | None:
    """The first rule of the cascade whose condition holds (None: dense)."""
    return next((r for r in RULES if r.holds(signals.get(r.signal), cfg)), None)
