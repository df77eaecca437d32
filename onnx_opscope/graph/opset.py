"""The one place that knows how the ONNX ops we build changed across opsets.

Builders (`graph.build.Builder` and the zoo's model builder on top of it) ask these
predicates; no call site tests an opset number itself.
"""

from __future__ import annotations

MIN_TAP_OPSET = 11  # below: tap subgraphs would need Unique / Range forms that do not exist yet

_AXES_AS_INPUT_SINCE = {"ReduceSum": 13, "Unsqueeze": 13, "Squeeze": 13}
_REDUCE_AXES_AS_INPUT_SINCE = 18


def axes_as_input(op_type: str, opset: int) -> bool:
    """Whether `op_type` takes its axes as a second input (else as an attribute) at `opset`.

    Reduce* moved them at opset 18, ReduceSum (and Unsqueeze / Squeeze) at 13.
    """
    return opset >= _AXES_AS_INPUT_SINCE.get(op_type, _REDUCE_AXES_AS_INPUT_SINCE)


def scatter_add_available(opset: int) -> bool:
    """ScatterElements(reduction="add") exists from opset 16."""
    return opset >= 16


def shape_takes_range(opset: int) -> bool:
    """Shape's `start` / `end` attributes exist from opset 15."""
    return opset >= 15


def min_max_take_int64(opset: int) -> bool:
    """Min / Max accept every numeric type (int64 included) from opset 12."""
    return opset >= 12
