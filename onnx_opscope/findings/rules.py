"""The rule cascade over a gemm operand's signals (first match wins), and the rules across steps.

Each rule is `signal <op> config.<threshold>`; nothing is a literal in the rule code. The
README section "Rules (first match wins)" gives the evidence behind every default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

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
    # minimum sizes: (support signal, MineConfig field), each signal >= the field (`signals.SUPPORT`)
    support: tuple[tuple[str, str], ...] = (("numel", "numel_min"),)

    def limit(self, cfg: MineConfig) -> float:
        return float(getattr(cfg, self.threshold))

    def holds(self, value: float | None, cfg: MineConfig) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value < self.limit(cfg) if self.op == "<" else value > self.limit(cfg)

    def guard_text(self, cfg: MineConfig) -> str:
        """The guard with its thresholds filled in: {t} is the rule's own, {name} any MineConfig field."""
        return self.guard.format(
            t=fmt_num(self.limit(cfg)), **{f.name: fmt_num(getattr(cfg, f.name)) for f in fields(cfg)}
        )

    def condition(self, cfg: MineConfig) -> str:
        return f"{self.signal} {self.op} {fmt_num(self.limit(cfg))}"

    def too_little(self, signals: Mapping[str, float | None], cfg: MineConfig) -> str | None:
        """The first minimum size the evidence misses, as 'channels 3 < 8' (None: enough). An unknown
        size (an older table without numel, chan_outlier recorded without chan_maxabs) does not block."""
        for name, field_name in self.support:
            v, least = signals.get(name), float(getattr(cfg, field_name))
            if v is not None and math.isfinite(v) and v < least:
                return f"{name} {fmt_num(v)} < {fmt_num(least)}"
        return None


_SIZE = (("numel", "numel_min"),)
_HIST = (("hist_per_bin", "hist_per_bin_min"),)
_CHANNELS = (("channels", "channels_min"),)
_ROWS = (("rows", "rows_min"),)
_PEAK = (("hist_peak", "peak_min"),)
RULES: tuple[Rule, ...] = (
    Rule("nonfinite", "nonfinite", ">", "nonfinite_max", "fix numerics first (NaN/Inf)",
         "(nan_count + inf_count)/numel > {t}", lambda v: 1.0, support=()),
    Rule("sparse", "density", "<", "density_max", "sparse GEMM", "nnz/numel < {t}", lambda v: 1.0 - v),
    Rule("outlier", "outlier", ">", "outlier_min", "per-channel int quant",
         "max(chan_maxabs)/mean(chan_maxabs) > {t}", lambda v: min(v / 30.0, 1.0), _SIZE + _CHANNELS + _ROWS),
    Rule("levels", "hist_gaps", ">", "gaps_min", "quantize / LUT (few levels)",
         "hist_gaps(hist) > {t}", lambda v: v, _SIZE + _HIST),
    Rule("heavy_tail", "kurtosis", ">", "kurtosis_min",
         "outlier-aware quant (heavy tails)", "kurtosis > {t}", lambda v: min(v / 50.0, 1.0)),
    Rule("concentrated", "histtop", ">", "histtop_min", "quantize / LUT (concentrated values)",
         "max(hist)/sum(hist) > {t} and max(hist) >= {peak_min} x the fuller bin beside it", lambda v: v,
         _SIZE + _HIST + _PEAK),
    Rule("coherent", "adj", "<", "adj_max", "delta-compute (adjacent rows)",
         "mean(adj_sumsq)/mean(pos_sumsq) < {t}", lambda v: 1.0 - v, _SIZE + _ROWS),
    Rule("positional", "pos_cv", ">", "pos_cv_min", "sequence / positional structure",
         "std(pos_sumsq)/|mean(pos_sumsq)| > {t}", lambda v: min(v / 3.0, 1.0), _SIZE + _ROWS + _CHANNELS),
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


def fire(signals: Mapping[str, float | None], cfg: MineConfig) -> tuple[Rule | None, list[str]]:
    """The first rule of the cascade whose condition holds on enough evidence (None: dense), and the
    rules whose condition held on too little, as 'levels (numel 8 < 256)'."""
    unsure = []
    for r in RULES:
        if r.holds(signals.get(r.signal), cfg):
            short = r.too_little(signals, cfg)
            if short is None:
                return r, unsure
            unsure.append(f"{r.name} ({short})")
    return None, unsure
