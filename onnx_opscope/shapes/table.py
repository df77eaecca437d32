"""What shape inference knows about every value of a model: shapes, element types, where they came from.

A dim is an int, a `symbolic.Poly` (an expression in the input symbols, `batch`, `seq`) or
None (unknown); a shape is a tuple of dims, or None when even the rank is unknown. The
table is keyed by tensor name over all graphs (ONNX names are unique in a model, subgraphs
included, except that sibling If branches may reuse one: they share an entry).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from onnx import TensorProto

from .symbolic import Dimlike, Poly

Dim = Dimlike | None
Shape = tuple[Dim, ...]


class TensorType(NamedTuple):
    """What a tap needs to know of a tensor: element type (0: unknown), rank and static size (None: unknown)."""

    elem_type: int
    rank: int | None
    numel: int | None


@dataclass
class ShapeTable:
    """Shapes and element types of all values (all graphs), plus where they came from."""

    shapes: dict[str, Shape | None] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)
    weights: set[str] = field(default_factory=set)  # initializers and Constant outputs, any graph
    symbols: dict[str, str] = field(default_factory=dict)  # input symbol -> where it first appears
    sources: dict[str, str] = field(default_factory=dict)  # inference stage -> what it did
    values: dict[str, tuple[Dim, ...] | None] = field(default_factory=dict)  # tracked small int tensors
    value_of: Callable[[str], tuple[Dim, ...] | None] | None = field(default=None, repr=False)
    const_of: Callable[[str], np.ndarray | None] | None = field(default=None, repr=False)

    def shape(self, name: str) -> Shape | None:
        return self.shapes.get(name)

    def type_of(self, name: str) -> TensorType | None:
        """Element type, rank and static element count of `name` (None when nothing is known of it)."""
        shape = self.shapes.get(name)
        elem = self.dtypes.get(name, 0)
        if shape is None and not elem:
            return None
        if shape is None:
            return TensorType(elem, None, None)
        static = all(type(d) is int for d in shape)
        return TensorType(elem, len(shape), math.prod(shape) if static else None)


def dim_rank(d: Dim, strong: set[str]) -> int:
    if d is None:
        return 0
    if isinstance(d, Poly):
        return 2 if d.symbols() <= strong else 1
    return 3


def best_shape(old: Shape | None, new: Shape | None, strong: set[str]) -> Shape | None:
    if old is None:
        return new
    if new is None or len(new) != len(old):
        return old
    out = []
    for a, b in zip(old, new, strict=True):
        out.append(b if dim_rank(b, strong) > dim_rank(a, strong) else a)
    return tuple(out)


def complete(shape: Shape | None, strong: set[str]) -> bool:
    if shape is None:
        return False
    for d in shape:
        if type(d) is int:
            continue
        if d is None or not isinstance(d, Poly) or not d.symbols() <= strong:
            return False
    return True


def dtype_size(elem_type: int) -> float | None:
    """Bytes per element of an ONNX elem_type (0.5 for 4-bit types); None for strings/unknown."""
    return _DTYPE_SIZES.get(elem_type)


_DTYPE_SIZES: dict[int, float] = {}
for _name, _size in (
    ("FLOAT", 4),
    ("UINT8", 1),
    ("INT8", 1),
    ("UINT16", 2),
    ("INT16", 2),
    ("INT32", 4),
    ("INT64", 8),
    ("BOOL", 1),
    ("FLOAT16", 2),
    ("DOUBLE", 8),
    ("UINT32", 4),
    ("UINT64", 8),
    ("COMPLEX64", 8),
    ("COMPLEX128", 16),
    ("BFLOAT16", 2),
    ("FLOAT8E4M3FN", 1),
    ("FLOAT8E4M3FNUZ", 1),
    ("FLOAT8E5M2", 1),
    ("FLOAT8E5M2FNUZ", 1),
    ("UINT4", 0.5),
    ("INT4", 0.5),
    ("FLOAT4E2M1", 0.5),
    ("FLOAT8E8M0", 1),
    ("UINT2", 0.25),
    ("INT2", 0.25),
):
    if hasattr(TensorProto, _name):
        _DTYPE_SIZES[getattr(TensorProto, _name)] = _size
