"""What the site finders see of one graph: the model index's entry, enclosing constants and shapes."""

from __future__ import annotations

from dataclasses import dataclass

from onnx import NodeProto

from ..graph.index import GraphEntry, ModelIndex
from ..shapes import ShapeTable
from ..shapes.table import Dim

Dims = list[Dim]


@dataclass(frozen=True)
class GraphView:
    index: ModelIndex
    entry: GraphEntry
    opset: int
    table: ShapeTable

    @property
    def path(self) -> str:
        return self.entry.path

    def producer(self, name: str) -> NodeProto | None:
        return self.entry.producer(name)

    def consumers(self, name: str) -> list[NodeProto]:
        return self.entry.consumers(name)

    def used(self, name: str) -> bool:
        return bool(self.entry.consumer_indices(name)) or name in self.entry.outputs

    def is_constant(self, name: str) -> bool:
        return self.index.is_constant(self.path, name)

    def constant_dims(self, name: str) -> list[int] | None:
        return self.index.constant_dims(self.path, name)

    def dims(self, name: str) -> Dims | None:
        """Dims of `name` (ints, symbolic expressions, None where unknown; a dim <= 0 reads as unknown)."""
        shape = self.table.shapes.get(name)
        if shape is None:
            return None
        return [d if not isinstance(d, int) or d > 0 else None for d in shape]

    def rank(self, name: str) -> int | None:
        shape = self.table.shapes.get(name)
        return None if shape is None else len(shape)
