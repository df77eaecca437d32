"""The graph layer: everything else reads and edits models through it.

- `io`: load and save `.onnx` files, checked, external weights kept on disk (lazy, never copied);
- `index`: one walk over a model, subgraphs included: graph paths, stable node ids,
  producers, consumers, constants and a name allocator (`ModelIndex`, `Names`);
- `proto`: attribute and tensor readers shared by every stage;
- `opset` and `build`: opset-aware node builders (`Builder`), the one place that knows how
  the ops we emit changed across opsets;
- `wire`: inserting nodes at the protobuf wire level (the only hand-written encoding);
- `expose`: carrying a tensor of an If branch or a Loop/Scan body up to the model's outputs.

The base is protobuf itself (`onnx.ModelProto`) with this thin layer on top, chosen by
measurement over onnx-ir and onnx-graphsurgeon (BENCHMARKS.md, "Graph base"): instrumenting
never deserialises a model into a second object graph, and external weights are never read.
This package imports nothing from the rest of onnx_opscope but `errors`.
"""

from .build import Builder, Constants
from .index import ModelIndex, Names, iter_graphs, iter_tensors, node_ids, walk_graphs
from .io import ModelLike, load_model, model_sha256, opset_version, save_model

__all__ = [
    "Builder",
    "Constants",
    "ModelIndex",
    "ModelLike",
    "Names",
    "iter_graphs",
    "iter_tensors",
    "load_model",
    "model_sha256",
    "node_ids",
    "opset_version",
    "save_model",
    "walk_graphs",
]
