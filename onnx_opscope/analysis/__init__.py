"""Static analysis: where the work of a model goes, without running it (and, asked, measured time).

- `costs`: `analyze` (per-node FLOPs, bytes, intensity, roofline class, roll-ups; `Report`);
- `opcosts`: the FLOP formula of every op kind;
- `roofline`: device presets and the roofline classification;
- `profile`: measured seconds per op kind (onnxruntime's profiler);
- `table`: the report as terminal tables;
- `motifs`: repeated chains and cones with hints and the share they cover (`find_motifs`);
- `survey`: many models, one task each (locally or on Ray), one row each (`opscope zoo`;
  imported on its own, as it brings onnxruntime and pyarrow, which the analysis does not need).
"""

from .costs import OpCost, Report, analyze, site_flops
from .motifs import Motifs, Pattern, find_motifs
from .roofline import DEVICES, Device, get_device

__all__ = [
    "DEVICES",
    "Device",
    "Motifs",
    "OpCost",
    "Pattern",
    "Report",
    "SurveyResult",
    "analyze",
    "find_motifs",
    "get_device",
    "site_flops",
    "survey",
]
