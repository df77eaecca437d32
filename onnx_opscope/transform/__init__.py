"""Rewrites whose effect on the outputs is then measured (`run.parity`): skip blocks, int8 fake-quant,
a weight plan (`weight_plan`).

One module per rewrite, each a plain function that copies its input, never loads external
weights, checks the same post-conditions (`result.check_rewrite`) and returns a typed
`Rewritten` (the model and what changed). `prune` is the dead-code removal they share.
"""

from .fake_quant import QUANT_MODES, fake_quant, fake_quant_reference
from .prune import prune
from .result import Pruned, QuantizedOperand, Rewritten, SkippedBlock
from .skip import residual_sites, resolve_blocks, skip_blocks
from .weight_plan import AppliedLayer, WeightPlanApplied, apply_weight_plan, storage, stored_menus

__all__ = [
    "QUANT_MODES",
    "AppliedLayer",
    "WeightPlanApplied",
    "apply_weight_plan",
    "storage",
    "stored_menus",
    "Pruned",
    "QuantizedOperand",
    "Rewritten",
    "SkippedBlock",
    "fake_quant",
    "fake_quant_reference",
    "prune",
    "residual_sites",
    "resolve_blocks",
    "skip_blocks",
]
