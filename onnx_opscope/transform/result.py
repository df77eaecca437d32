"""What every rewrite returns and promises: a typed result, and the invariants checked around it.

Rewrites copy their input (which is left untouched), never load external weights, and return
the new model with a record of what changed. Each checks the same post-conditions (a
failure is a bug in the rewrite, not a user error): the original outputs keep their names
and order, and a model that passed `onnx.checker` before still passes after.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import onnx
from onnx import ModelProto

from ..graph.io import ModelLike, load_model

_PROTO_LIMIT = 2**31 - 1


@dataclass
class Pruned:
    """What dead-code removal took out (counted from dims: no weight is read)."""

    nodes_removed: int = 0
    ops_removed: dict[str, int] = field(default_factory=dict)
    initializers_removed: int = 0
    params_removed: int = 0
    bytes_removed: int = 0


@dataclass
class SkippedBlock:
    site: str
    node: str
    kept: str  # the residual input the Identity now forwards
    dropped: str  # the block's output, now dead


@dataclass
class QuantizedOperand:
    graph: str
    node: str
    input: str
    operand: str  # A or B
    kind: str  # activation or weight
    amax: str  # how amax is taken, e.g. "reduce axis -1"


@dataclass
class Rewritten:
    """A rewrite's result: the new model (a copy) and what changed in it."""

    model: ModelProto
    transform: str
    skipped: list[SkippedBlock] = field(default_factory=list)  # skip_blocks
    pruned: Pruned = field(default_factory=Pruned)
    quantized: list[QuantizedOperand] = field(default_factory=list)  # fake_quant
    left_alone: list[dict] = field(default_factory=list)  # operands a rewrite could not treat, with why
    options: dict = field(default_factory=dict)  # the rewrite's own settings (mode, weights, ...)

    def to_dict(self) -> dict:
        """Everything but the model, JSON-ready."""
        d = asdict(self)
        d.pop("model")
        return d


def copy_of(model: ModelLike) -> tuple[ModelProto, ModelProto]:
    """(the source as loaded, a copy to rewrite)."""
    source = load_model(model)
    m = ModelProto()
    m.CopyFrom(source)
    return source, m


def _checks_ok(model: ModelProto) -> bool:
    if model.ByteSize() > _PROTO_LIMIT:
        return False
    try:
        onnx.checker.check_model(model)
    except Exception:  # noqa: BLE001 - any checker failure means "not valid"
        return False
    return True


def check_rewrite(before: ModelProto, after: ModelProto, transform: str) -> None:
    """The post-conditions of every rewrite."""
    names = [o.name for o in before.graph.output]
    if [o.name for o in after.graph.output] != names:
        raise AssertionError(f"{transform}: the rewrite changed the model's outputs")
    if _checks_ok(before) and not _checks_ok(after):
        onnx.checker.check_model(after)  # raises with onnx's own message
        raise AssertionError(f"{transform}: the rewritten model fails onnx.checker")
