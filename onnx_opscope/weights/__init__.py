"""Weights: what each weight of a model costs and what cheaper representation it would take.

- `matrix`: every float weight (initializers and Constants, subgraphs included, external data
  read one tensor at a time) viewed as a [rows, cols] matrix along its consumer's output channels;
- `probes`: cheap per-weight probes (stable rank, quantization error at several widths and
  granularities, 2:4 and ternary error, cardinality, outlier columns) and a hint per weight;
- `menu`: the decomposition options of one weight, each with its error, bytes and MACs;
- `allocate`: a per-layer choice of options under a byte budget, and the plan it gives.

Imports only `errors`, `files`, `graph`, `shapes` and `sites` (tests/test_layout.py).
"""

from .allocate import Allocation, allocate, allocate_budgets, plan_dict
from .matrix import WeightView, iter_weights
from .menu import Option, layer_menu, option_from_dict, reconstruct
from .probes import Probe, probe_weights, probes_table

__all__ = [
    "Allocation",
    "Option",
    "Probe",
    "WeightView",
    "allocate",
    "allocate_budgets",
    "iter_weights",
    "layer_menu",
    "option_from_dict",
    "plan_dict",
    "probe_weights",
    "probes_table",
    "reconstruct",
]
