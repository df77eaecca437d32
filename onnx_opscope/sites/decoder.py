"""Decoder ops as sites: the normalizations and rotary embedding onnxruntime's transformer fusions make.

An optimized decoder has no residual Add and no RMSNorm subgraph left to tap: they live inside
SkipLayerNormalization / SkipSimplifiedLayerNormalization (com.microsoft: residual add, then
normalise) and SimplifiedLayerNormalization (RMSNorm, registered by onnxruntime in the default
domain), and its q / k rotation inside com.microsoft RotaryEmbedding. Their tensors are the ones
decoder findings need: a norm's input is the residual stream (where LLMs' massive-activation
channels are), a rotary output is the q / k the KV cache stores. Roles follow the op's inputs:
`in` (input 0), `skip` (input 1 of the Skip* ops), `out` (output 0; the Skip* ops' residual sum,
output 3, is the next norm's `in`). Channels are the last axis (hidden, or heads·head_dim for a
3-D rotary input, head_dim for a 4-D one), rows the sequence axis before it. These sites get the
user's sketches, as gemm sites do (`KIND_SKETCHES` names none for them).
"""

from __future__ import annotations

from onnx import NodeProto

from ..graph.proto import input_at
from .site import Tap
from .view import GraphView

NORM_OPS = {
    ("com.microsoft", "SkipLayerNormalization"),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"),
    ("", "SimplifiedLayerNormalization"),
    ("ai.onnx", "SimplifiedLayerNormalization"),
    ("com.microsoft", "SimplifiedLayerNormalization"),
}
ROTARY_OPS = {("com.microsoft", "RotaryEmbedding")}
DECODER_OPS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
               "RotaryEmbedding")  # fmt: skip


def decoder_site(node: NodeProto, view: GraphView) -> tuple[str, list[Tap], dict] | None:
    """(kind, taps, attrs) of a fused norm (kind `norm`) or rotary embedding (kind `rotary`); None otherwise."""
    key = (node.domain, node.op_type)
    if key not in NORM_OPS and key not in ROTARY_OPS:
        return None
    if not node.input or not node.input[0] or not node.output or not node.output[0]:
        return None
    taps = [Tap("in", node.input[0])]
    if node.op_type.startswith("Skip") and input_at(node, 1):
        taps.append(Tap("skip", node.input[1]))
    taps.append(Tap("out", node.output[0]))
    return ("norm" if key in NORM_OPS else "rotary"), taps, {}
