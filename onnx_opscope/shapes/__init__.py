"""Shapes and types: the one source every stage reads them from.

`infer_shapes(model, shapes=, dims=)` returns a `ShapeTable` (shapes, element types, the
input symbols and where each answer came from), combining onnx's inference, per-node rules
that keep symbols through shape arithmetic (`rules`) and onnxruntime's symbolic inference
where those leave gaps. Dims that stay symbolic are polynomials (`symbolic.Poly`), so costs
built from them are too. Instrumentation, the site finders, rewrites and the analyzer all
take their types and shapes from one such table per model.
"""

from .infer import infer_shapes, input_symbols, prepare_inputs
from .symbolic import Poly, parse_dim, safe_symbol
from .table import Dim, Shape, ShapeTable, TensorType, dtype_size

__all__ = [
    "Dim",
    "Poly",
    "Shape",
    "ShapeTable",
    "TensorType",
    "dtype_size",
    "infer_shapes",
    "input_symbols",
    "parse_dim",
    "prepare_inputs",
    "safe_symbol",
]
