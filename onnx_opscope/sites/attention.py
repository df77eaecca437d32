"""Attention sites: every Softmax over the last axis, and fused attention ops through a shadow softmax.

A Softmax of rank >= 2 normalising its last axis is tapped as role `attn` when its output
weights values through a MatMul (attention), else as `probs` (a classifier head, a router),
which the attention rules leave alone. Fused attention ops (com.microsoft Attention,
MultiHeadAttention, GroupQueryAttention, ONNX opset-23 Attention) have no probabilities to
tap: the site taps `<first output>` + SHADOW_SUFFIX, a softmax(Q·Kᵀ·scale + masks) that
`instrument.shadow` rebuilds next to the op from its own inputs, past key included
(MultiHeadAttention and GroupQueryAttention with a KV cache: one step's [B, heads, S, past + S]
scores, never more). What the shadow cannot rebuild (rotary inside the op, packed QKV, 4-D
masks, windows, a past buffer shared with present, a quantized cache) gets no site.
"""

from __future__ import annotations

from onnx import NodeProto

from ..graph.proto import attr, input_at
from .site import Tap
from .view import GraphView

FUSED_ATTENTION = {
    ("com.microsoft", "Attention"),
    ("com.microsoft", "MultiHeadAttention"),
    ("com.microsoft", "GroupQueryAttention"),
    ("", "Attention"),
    ("ai.onnx", "Attention"),
}
SHADOW_SUFFIX = "/opscope_shadow_probs"
_PASS_THROUGH = frozenset({"Cast", "Dropout", "Identity", "Where", "Reshape", "Mul", "Div"})


def softmax_taps(node: NodeProto, view: GraphView) -> tuple[list[Tap], dict] | None:
    rank = view.rank(node.output[0])
    if rank is None:
        rank = view.rank(node.input[0])
    if rank is None or rank < 2:
        return None
    axis = attr(node, "axis", -1 if view.opset >= 13 else 1)
    if axis % rank != rank - 1:  # attention normalises over keys, the last axis
        return None
    role = "attn" if _weights_values(view, node.output[0]) else "probs"
    return [Tap(role, node.output[0])], {}


def _weights_values(view: GraphView, probs: str, depth: int = 4) -> bool:
    """Whether softmax output `probs` weights values (probs @ V): attention, not a classifier or router."""
    for c in view.consumers(probs):
        if c.op_type in ("MatMul", "Einsum") or (
            depth
            and c.op_type in _PASS_THROUGH
            and c.output
            and _weights_values(view, c.output[0], depth - 1)
        ):
            return True
    return False


def fused_attention_taps(node: NodeProto, view: GraphView) -> tuple[list[Tap], dict] | None:
    if fused_unsupported(node, view) is not None or not node.output or not node.output[0]:
        return None
    return [Tap("attn", node.output[0] + SHADOW_SUFFIX)], {"shadow_of": node.op_type}


def fused_unsupported(node: NodeProto, view: GraphView) -> str | None:
    """Why the shadow cannot be built for this fused attention node (None: it can)."""
    op = node.op_type
    if node.domain == "com.microsoft" and op == "Attention":
        if input_at(node, 4) or attr(node, "do_rotary", 0) or attr(node, "past_present_share_buffer", 0):
            return "past state or rotary embedding"
        if not input_at(node, 1):
            return "no weights input"
        if input_at(node, 3) and view.rank(node.input[3]) == 4:
            return "4-D Megatron mask"
        return None
    if op == "MultiHeadAttention":
        if not input_at(node, 1) or view.rank(node.input[0]) not in (None, 3):
            return "packed QKV"
        if input_at(node, 6) and (view.rank(node.input[1]) == 4 or input_at(node, 8) or input_at(node, 9)):
            return "past state with a 4-D key, a shared buffer or beam search"
        if input_at(node, 4) and view.rank(node.input[4]) not in (None, 2):
            return "key padding mask other than 2-D"
        return None
    if op == "GroupQueryAttention":
        if not input_at(node, 1) or attr(node, "do_rotary", 0) or attr(node, "smooth_softmax", 0):
            return "packed QKV, rotary or smooth softmax"
        if any(input_at(node, i) for i in range(10, len(node.input))) or not attr(node, "causal", 1):
            return "attention bias, head sink, quantized cache, QK norm or not causal"
        if input_at(node, 3) and isinstance((view.dims(node.input[3]) or [None] * 3)[2], int):
            return "a static past: a buffer shared with present"
        return None
    # opset-23 Attention
    if (
        input_at(node, 6)
        or attr(node, "left_window_size", -1) >= 0
        or attr(node, "right_window_size", -1) >= 0
    ):
        return "non-pad lengths or sliding window"
    return None
