"""The one place that knows how the ONNX ops we build changed across opsets.

Builders (`graph.build.Builder` and the zoo's model builder on top of it) ask these
predicates; no call site tests an opset number itself.

Taps are built at the model's own opset, from 7 up (onnxruntime's oldest), with no version
conversion. What the taps need that changed below opset 11, from the operator changelog
(`onnx.defs.get_schema(op, opset).since_version`):

- ops that do not exist yet: Where and IsNaN (9), IsInf and Mod (10), Range, Unique and
  ScatterElements (11), Compress (9), Expand (8);
- forms that changed: Constant holds only floats before 9; Slice takes starts / ends as
  attributes before 10, Clip its min / max before 11; If's branches must agree on the known
  shapes of their outputs before 11; Less / Greater compare only floats before 9, Equal only
  bools and ints before 11; Min / Max take int64 from 12; Reduce* / Unsqueeze / Squeeze axes
  moved to inputs at 13 and 18.

`Builder` spells each missing op with older ones (its docstrings say how), so a sketch reads
the same at every opset; `MIN_TAP_OPSET` is the only number a caller compares with.
"""

from __future__ import annotations

MIN_TAP_OPSET = 7  # below: Add / Mul take a `broadcast` attribute, and onnxruntime runs no such model

_AXES_AS_INPUT_SINCE = {"ReduceSum": 13, "Unsqueeze": 13, "Squeeze": 13}
_REDUCE_AXES_AS_INPUT_SINCE = 18

# The first opset of each op the builders emit that is newer than MIN_TAP_OPSET.
_OP_SINCE = {
    "Expand": 8,
    "Where": 9,
    "IsNaN": 9,
    "Compress": 9,
    "IsInf": 10,
    "Mod": 10,
    "Range": 11,
    "Unique": 11,
    "ScatterElements": 11,
}


def has_op(op_type: str, opset: int) -> bool:
    """Whether the default-domain op `op_type` exists at `opset` (for the ops the builders emit)."""
    return opset >= _OP_SINCE.get(op_type, 0)


def axes_as_input(op_type: str, opset: int) -> bool:
    """Whether `op_type` takes its axes as a second input (else as an attribute) at `opset`.

    Reduce* moved them at opset 18, ReduceSum (and Unsqueeze / Squeeze) at 13.
    """
    return opset >= _AXES_AS_INPUT_SINCE.get(op_type, _REDUCE_AXES_AS_INPUT_SINCE)


def slice_bounds_as_input(opset: int) -> bool:
    """Slice takes starts / ends / axes as inputs from opset 10 (attributes before)."""
    return opset >= 10


def clip_bounds_as_input(opset: int) -> bool:
    """Clip takes min / max as inputs from opset 11 (float attributes before)."""
    return opset >= 11


def compare_takes_ints(opset: int) -> bool:
    """Less / Greater accept integer tensors from opset 9 (floats only before)."""
    return opset >= 9


def constant_takes_any_type(opset: int) -> bool:
    """A Constant node may hold any tensor type from opset 9 (float types only before)."""
    return opset >= 9


def if_merges_branch_shapes(opset: int) -> bool:
    """If lets its branches' outputs have different known shapes from opset 11 (they must agree before)."""
    return opset >= 11


def scatter_add_available(opset: int) -> bool:
    """ScatterElements(reduction="add") exists from opset 16."""
    return opset >= 16


def reshape_allows_zero(opset: int) -> bool:
    """Reshape can keep a 0 in its target as a zero dim (`allowzero`) from opset 14; before, 0 copies the input's dim."""
    return opset >= 14


def shape_takes_range(opset: int) -> bool:
    """Shape's `start` / `end` attributes exist from opset 15."""
    return opset >= 15


def min_max_take_int64(opset: int) -> bool:
    """Min / Max accept every numeric type (int64 included) from opset 12."""
    return opset >= 12
