"""Static analysis: where the work of a model goes, without running it (and, asked, measured time).

- `costs`: `analyze` (per-node FLOPs, bytes, intensity, roofline class, roll-ups; `Report`);
- `opcosts`: the FLOP formula of every op kind;
- `roofline`: device presets and the roofline classification;
- `profile`: measured seconds per op kind (onnxruntime's profiler);
- `table`: the report as terminal tables;
- `survey`: many models, one task each (locally or on Ray), one row each (`opscope zoo`;
  imported on its own, as it brings onnxruntime and pyarrow, which the analysis does not need).
"""

from .costs import OpCost, Report, analyze, site_flops
from .roofline import DEVICES, Device, get_device

__all__ = [
    "DEVICES",
    "Device",
    "OpCost",
    "Report",
    "SurveyResult",
    "analyze",
    "get_device",
    "site_flops",
    "survey",
]
