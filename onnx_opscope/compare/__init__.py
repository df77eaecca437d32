"""Comparing runs: the one output comparator, layer-wise divergence of sketch rows, the parity report.

Pure functions over arrays and decoded rows: running the models is `run`'s job (the record
parity gate and `run.parity` both compare through here), so this package sits below `run`.
"""

from .layers import LAYER_SKETCHES, layer_divergences
from .outputs import (
    DropIn,
    check_drop_in,
    compare_outputs,
    looks_like_logits,
    output_metrics,
    within,
    worst_of,
)
from .report import DEFAULT_TOL, ParityReport

__all__ = [
    "DEFAULT_TOL",
    "LAYER_SKETCHES",
    "DropIn",
    "ParityReport",
    "check_drop_in",
    "compare_outputs",
    "layer_divergences",
    "looks_like_logits",
    "output_metrics",
    "within",
    "worst_of",
]
