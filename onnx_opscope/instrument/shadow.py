"""The shadow softmax of a fused attention op: softmax(Q·Kᵀ·scale + masks), rebuilt next to the op.

Fused attention ops (com.microsoft Attention, MultiHeadAttention, GroupQueryAttention, ONNX
opset-23 Attention) keep their probabilities inside the kernel. The site finder
(`sites.attention`) taps `<op's first output>` + SHADOW_SUFFIX; `build_shadow` computes that
tensor from the op's own inputs (the QKV MatMul and bias for the contrib Attention; raw 2-D /
3-D masks, key lengths, causal, attention bias, grouped kv heads, softcap, the past key of
opset-23 Attention, MultiHeadAttention and GroupQueryAttention) right after the op. The fused
op and its outputs are untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import NodeProto, TensorProto

from ..errors import OpscopeError
from ..graph.build import Builder
from ..graph.index import GraphEntry
from ..graph.proto import attr as _attr
from ..graph.proto import input_at as _input
from ..sites.attention import SHADOW_SUFFIX


def build_shadow(
    b: Builder, entry: GraphEntry, shadow: str, type_of: Callable[[str], tuple[int, int | None]]
) -> int:
    """Append to `b` the nodes computing `shadow` (softmax probabilities [B, heads, S, T]).

    `shadow` is `<fused op's first output>` + SHADOW_SUFFIX; returns the fused node's
    position in its graph, after which the nodes go. `type_of(name)` -> (elem type, rank or None).
    """
    target = shadow[: -len(SHADOW_SUFFIX)]
    at = entry.producer_index(target)
    if at is None:
        raise OpscopeError(f"no fused attention node produces {target!r}: cannot build its shadow softmax")
    node = entry.graph.node[at]
    op = node.op_type
    if node.domain == "com.microsoft" and op == "Attention":
        scores, guard = _contrib_attention(b, node, type_of), False
    elif op == "MultiHeadAttention":
        scores, guard = _multi_head_attention(b, node, type_of), False
    elif op == "GroupQueryAttention":
        scores, guard = _group_query_attention(b, node), True
    else:
        scores, guard = _onnx_attention(b, node, type_of), True
    if guard:  # -inf masks: a fully masked row gives NaN, which the op itself turns into 0
        p = b.op("Softmax", [scores], "probs", axis=-1)
        b.op("Where", [b.op("IsNaN", [p]), b.const(0.0), p], out=shadow)
    else:
        b.op("Softmax", [scores], out=shadow, axis=-1)
    return at


def _heads(b: Builder, t: str, heads: int) -> str:
    """[B, S, heads·d] -> [B, heads, S, d]."""
    r = b.op("Reshape", [t, b.i64([0, 0, heads, -1])])
    return b.op("Transpose", [r], perm=[0, 2, 1, 3])


def _qk(b: Builder, qh: str, kh: str) -> str:
    """Q·Kᵀ for q [B, Hq, S, d], k [B, Hk, T, d] with Hq a multiple of Hk (query head h uses kv head h // G)."""
    shape_q, shape_k = b.op("Shape", [qh]), b.op("Shape", [kh])
    grouped = b.op(
        "Reshape",
        [qh, b.op("Concat", [b.slice(shape_k, 0, 2, 0), b.i64([-1]), b.slice(shape_q, 2, 4, 0)], axis=0)],
    )  # [B, Hk, G, S, d]
    kt = b.op("Reshape", [b.op("Transpose", [kh], perm=[0, 1, 3, 2]), b.op("Concat", [
        b.slice(shape_k, 0, 2, 0), b.i64([1]), b.slice(shape_k, 3, 4, 0), b.slice(shape_k, 2, 3, 0)], axis=0)])  # fmt: skip
    s = b.op("MatMul", [grouped, kt])  # [B, Hk, G, S, T]
    return b.op(
        "Reshape", [s, b.op("Concat", [b.slice(shape_q, 0, 3, 0), b.slice(shape_k, 2, 3, 0)], axis=0)]
    )


def _scaled(b: Builder, scores: str, qh: str, scale: float | None) -> str:
    if scale:
        return b.op("Mul", [scores, b.const(np.float32(scale))])
    d = b.cast(b.dim(qh, 3), TensorProto.FLOAT)
    return b.op("Div", [scores, b.op("Sqrt", [d])])


def _causal(b: Builder, scores: str, fill: float, window: int = 0) -> str:
    """Mask key j for query i when j > i + (T - S) (bottom-right aligned), or j <= i + (T - S) - window."""
    s, t = b.dim(scores, -2), b.dim(scores, -1)
    i = b.op("Reshape", [b.arange(s), b.i64([-1, 1])])
    j = b.op("Reshape", [b.arange(t), b.i64([1, -1])])
    frontier = b.op("Add", [i, b.op("Sub", [t, s])])
    masked = b.op("Greater", [j, frontier])
    if window > 0:
        masked = b.op(
            "Or", [masked, b.op("Not", [b.op("Greater", [j, b.op("Sub", [frontier, b.i64(window)])])])]
        )
    return b.op("Add", [scores, b.op("Where", [masked, b.const(np.float32(fill)), b.const(0.0)])])


def _keep_mask(b: Builder, scores: str, keep: str, fill: float) -> str:
    return b.op("Add", [scores, b.op("Where", [keep, b.const(0.0), b.const(np.float32(fill))])])


def _mask_2d(b: Builder, mask: str) -> str:
    """[B, T] (1 keep, 0 mask) -> bool [B, 1, 1, T]."""
    keep = b.op("Greater", [b.cast(mask, TensorProto.FLOAT), b.const(0.0)])
    return b.op("Reshape", [keep, b.i64([0, 1, 1, -1])])


def _contrib_attention(b: Builder, node: NodeProto, type_of) -> str:
    """com.microsoft Attention: input [B, S, Hin] @ weights [Hin, 3H] + bias, heads, mask_index."""
    x, w = node.input[0], node.input[1]
    heads = _attr(node, "num_heads")
    qkv = b.op("MatMul", [x, w])
    if _input(node, 2):
        qkv = b.op("Add", [qkv, node.input[2]])
    sizes = _attr(node, "qkv_hidden_sizes")
    if sizes:
        q, k = b.slice(qkv, 0, sizes[0], -1), b.slice(qkv, sizes[0], sizes[0] + sizes[1], -1)
    else:
        third = b.op("Div", [b.slice(b.op("Shape", [w]), 1, 2, 0), b.i64([3])])
        q = b.op("Slice", [qkv, b.i64([0]), third, b.i64([-1])])
        k = b.op("Slice", [qkv, third, b.op("Mul", [third, b.i64([2])]), b.i64([-1])])
    qh, kh = _heads(b, q, heads), _heads(b, k, heads)
    scores = _scaled(
        b, b.op("MatMul", [qh, b.op("Transpose", [kh], perm=[0, 1, 3, 2])]), qh, _attr(node, "scale")
    )
    fill = float(_attr(node, "mask_filter_value", -10000.0))
    mask = _input(node, 3)
    if mask:
        rank = type_of(mask)[1]
        if rank == 1:  # end position of each sequence (right padding)
            t = b.dim(scores, -1)
            pos = b.op("Reshape", [b.arange(t), b.i64([1, -1])])
            lens = b.op("Reshape", [b.cast(mask, TensorProto.INT64), b.i64([-1, 1])])
            keep = b.op("Reshape", [b.op("Less", [pos, lens]), b.i64([0, 1, 1, -1])])
        elif rank == 3:  # [B, S, T]
            m = b.op("Greater", [b.cast(mask, TensorProto.FLOAT), b.const(0.0)])
            keep = b.op(
                "Reshape",
                [m, b.op("Concat", [b.i64([0, 1, -1]), b.slice(b.op("Shape", [m]), 2, 3, 0)], axis=0)],
            )
        else:  # raw 2-D [B, T]
            keep = _mask_2d(b, mask)
        scores = _keep_mask(b, scores, keep, fill)
    if _attr(node, "unidirectional", 0):
        scores = _causal(b, scores, fill)
    if _input(node, 5):
        scores = b.op("Add", [scores, node.input[5]])
    return scores


def _multi_head_attention(b: Builder, node: NodeProto, type_of) -> str:
    """com.microsoft MultiHeadAttention: query [B, S, D], key [B, T, D] or [B, heads, T, d], bias [3D]."""
    heads = _attr(node, "num_heads")
    q, k = node.input[0], node.input[1]
    key_4d = type_of(k)[1] == 4
    bias = _input(node, 3)
    if bias:
        d = b.slice(b.op("Shape", [q]), 2, 3, 0)
        q = b.op("Add", [q, b.op("Slice", [bias, b.i64([0]), d, b.i64([0])])])
        if not key_4d:
            k = b.op("Add", [k, b.op("Slice", [bias, d, b.op("Mul", [d, b.i64([2])]), b.i64([0])])])
    qh = _heads(b, q, heads)
    kh = k if key_4d else _heads(b, k, heads)
    if _input(node, 6):  # past key [B, heads, P, d]: one step's scores over past + S keys
        kh = b.op("Concat", [node.input[6], kh], axis=2)
    scores = _scaled(
        b, b.op("MatMul", [qh, b.op("Transpose", [kh], perm=[0, 1, 3, 2])]), qh, _attr(node, "scale")
    )
    fill = float(_attr(node, "mask_filter_value", -10000.0))
    if _input(node, 4):
        scores = _keep_mask(b, scores, _mask_2d(b, node.input[4]), fill)
    if _input(node, 5):
        scores = b.op("Add", [scores, node.input[5]])
    if _attr(node, "unidirectional", 0):
        scores = _causal(b, scores, fill)
    return scores


def _softcap(b: Builder, scores: str, cap: float | None) -> str:
    if not cap or cap <= 0:
        return scores
    c = b.const(np.float32(cap))
    return b.op("Mul", [b.op("Tanh", [b.op("Div", [scores, c])]), c])


def _group_query_attention(b: Builder, node: NodeProto) -> str:
    """com.microsoft GroupQueryAttention (no rotary): past key, causal, optional local window, seqlens_k."""
    qh = _heads(b, node.input[0], _attr(node, "num_heads"))
    kh = _heads(b, node.input[1], _attr(node, "kv_num_heads"))
    if _input(node, 3):  # past key [B, kv_heads, P, d]: one step's scores over past + S keys
        kh = b.op("Concat", [node.input[3], kh], axis=2)
    scores = _softcap(b, _scaled(b, _qk(b, qh, kh), qh, _attr(node, "scale")), _attr(node, "softcap"))
    scores = _causal(b, scores, -np.inf, max(0, int(_attr(node, "local_window_size", -1))))
    if _input(node, 5):  # seqlens_k[b] = valid length - 1: later keys are padding
        t = b.dim(scores, -1)
        pos = b.op("Reshape", [b.arange(t), b.i64([1, -1])])
        last = b.op("Reshape", [b.cast(node.input[5], TensorProto.INT64), b.i64([-1, 1])])
        keep = b.op("Reshape", [b.op("Not", [b.op("Greater", [pos, last])]), b.i64([0, 1, 1, -1])])
        scores = _keep_mask(b, scores, keep, -np.inf)
    return scores


def _onnx_attention(b: Builder, node: NodeProto, type_of) -> str:
    """ONNX Attention (opset 23): Q, K 3-D (with q/kv_num_heads) or 4-D, past_key, attn_mask, is_causal."""
    q, k = node.input[0], node.input[1]
    three_d = type_of(q)[1] == 3 or (type_of(q)[1] is None and _attr(node, "q_num_heads") is not None)
    qh = _heads(b, q, _attr(node, "q_num_heads")) if three_d else q
    kh = _heads(b, k, _attr(node, "kv_num_heads")) if three_d else k
    if _input(node, 4):
        kh = b.op("Concat", [node.input[4], kh], axis=2)
    if type_of(q)[0] not in (TensorProto.FLOAT, TensorProto.UNDEFINED):  # fp16 / bf16: the shadow is float32
        qh, kh = b.cast(qh, TensorProto.FLOAT), b.cast(kh, TensorProto.FLOAT)
    scores = _softcap(b, _scaled(b, _qk(b, qh, kh), qh, _attr(node, "scale")), _attr(node, "softcap"))
    mask = _input(node, 3)
    if mask:
        if type_of(mask)[0] == TensorProto.BOOL:
            scores = _keep_mask(b, scores, mask, -np.inf)
        else:
            scores = b.op("Add", [scores, b.cast(mask, TensorProto.FLOAT)])
    if _attr(node, "is_causal", 0):
        scores = _causal(b, scores, -np.inf)
    return scores
