"""Per-op FLOP formulas: one documented rule per op family, symbols kept as polynomials.

Conventions (a FLOP is one add, multiply, compare or transcendental, whatever the dtype;
integer MACs of quantized ops count the same, 2 per MAC):

* MatMul `[..., M, K] x [..., K, N]`: 2*M*K*N per matrix, times the broadcast batch size.
  1-D operands are promoted as in numpy. MatMulInteger adds M*K (+ K*N) for zero points;
  QLinearMatMul adds 3*M*N to requantize; FusedMatMul adds M*N when alpha != 1;
  MatMulNBits adds 2*K*N to dequantize the weight.
* Gemm: 2*M*K*N after transA/transB, + M*N for the C bias, + M*N when alpha != 1.
* Conv (and ConvInteger, QLinearConv, FusedConv): 2 * numel(Y) * (C_in/group) * prod(kernel)
  + numel(Y) for a bias. Dilations widen the window, not the work; groups divide C_in.
* ConvTranspose: 2 * numel(X) * (C_out/group) * prod(kernel) + numel(Y) for a bias (every
  input pixel is scattered through the kernel).
* Einsum (any equation, ellipsis included): with T the product of the extents of all
  distinct indices (ellipsis dims broadcast across operands) and n operands,
  (n-1)*T multiplies + T adds when anything is summed out. For two operands this is 2*T,
  i.e. MatMul's 2*M*K*N. Naive evaluation: engines contracting 3+ operands pairwise may
  do less.
* LSTM per step and direction: 2*B*4H*(I+H) for the two GEMMs + 4H*B to add them + 8H*B
  for both biases (when given) + 9*B*H for gates and cell update + 6*B*H for peepholes;
  times seq_len * num_directions. GRU: 2*B*3H*(I+H) + 3H*B + 6H*B (biases) + 8*B*H.
  RNN: 2*B*H*(I+H) + 2*B*H + 2*B*H (biases) + B*H. DynamicQuantizeLSTM is an LSTM plus
  5*B*(I+H) per step to quantize its inputs.
* Elementwise ops: a per-output-element count (`ELEMENTWISE`): 1 for arithmetic,
  comparisons and single transcendentals; composites count their parts (Gelu 5,
  tanh-Gelu/FastGelu 8, HardSwish 4, ...). Variadic Sum/Max/Min: (n-1) per element.
* Softmax/LogSoftmax 5 per element (max, sub, exp, sum, div). LayerNormalization 7
  (mean, sub, square, sum, scale, gamma, beta), RMS/SimplifiedLayerNormalization 4,
  BatchNormalization 2 (inference: folded to one scale and shift), Instance/Group 7.
* Reductions: 1 per input element (L2, SumSquare 2; LogSumExp 3). Pools: prod(kernel) per
  output element; global pools 1 per input element. Resize: 0 for nearest, 3 per output
  element per resized axis for linear, 8 for cubic.
* Quantize 3 per element, Dequantize 2, DynamicQuantizeLinear 5; QLinearAdd/Mul 8
  (dequantize both, op, requantize), QLinearSigmoid/LeakyRelu 6.
* com.microsoft fused ops count the unfused maths; see `_attention`,
  `_multi_head_attention`, `_skip_layer_norm` and friends. Their "fusion saves" figure is
  the elements the unfused chain would write to and read back from memory.
* Data movement (Transpose, Concat, Gather, Slice, Pad, Cast, ...) is 0 FLOPs; its cost is
  in bytes. Views (Reshape, Squeeze, Identity, Shape, ...) cost nothing.

Ops not listed are "unmodelled": counted by the caller and listed, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from onnx import NodeProto

from ..graph.proto import attr as get_attr
from ..graph.proto import op_set
from ..shapes.symbolic import add as _plus
from ..shapes.symbolic import prod
from ..shapes.table import Dim, Shape

Gemm = tuple[Dim, Dim, Dim, Dim]  # (batch, M, K, N)


class OpCount(NamedTuple):
    """What one node costs in compute: FLOPs (None = unknown), GEMM shapes, fusion savings."""

    flops: Dim
    gemms: tuple[Gemm, ...] = ()
    saved_elems: Dim = 0  # elements an unfused chain would write and read back (fused ops only)


Formula = Callable[[NodeProto, Sequence[Shape | None], Sequence[Shape | None]], OpCount]

# Ops whose outputs alias or describe their inputs: no FLOPs and no memory traffic.
VIEWS = op_set(
    "Reshape Flatten Squeeze Unsqueeze Identity Shape Size Constant Dropout Optional OptionalGetElement"
)
# Ops that read only as much of their data input as they write (plus their index inputs).
PARTIAL_READS = op_set("Gather GatherElements GatherND Slice Compress")
# Pure data movement: bytes, no FLOPs.
MOVEMENT = op_set(
    "Transpose Concat Split Slice Gather GatherElements GatherND ScatterND ScatterElements Scatter Pad "
    "Tile Expand Cast CastLike ConstantOfShape Range DepthToSpace SpaceToDepth NonZero Compress OneHot "
    "EyeLike Trilu ReverseSequence SplitToSequence SequenceAt SequenceConstruct SequenceInsert "
    "ConcatFromSequence QLinearConcat Col2Im Unique"
)
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})

ELEMENTWISE: dict[str, float] = {
    **dict.fromkeys(
        op_set(
            "Add Sub Mul Div Pow Mod Neg Abs Ceil Floor Round Sign Reciprocal Sqrt Exp Log Sin Cos Tan Asin "
            "Acos Atan Sinh Cosh Asinh Acosh Atanh Erf Tanh Sigmoid Relu Not And Or Xor Equal Less Greater "
            "LessOrEqual GreaterOrEqual IsNaN IsInf BitShift BitwiseAnd BitwiseOr BitwiseXor BitwiseNot Where "
            "ThresholdedRelu CumSum"
        ),
        1,
    ),
    **dict.fromkeys(("Clip", "LeakyRelu", "PRelu", "Shrink", "Swish", "Hardmax"), 2),
    **dict.fromkeys(("Elu", "Celu", "HardSigmoid", "Softplus", "Softsign", "QuickGelu"), 3),
    **dict.fromkeys(("Selu", "HardSwish"), 4),
    "Mish": 5,
    "Gelu": 5,
    "FastGelu": 8,
    "BiasGelu": 6,
    "QuantizeLinear": 3,
    "DequantizeLinear": 2,
    "DynamicQuantizeLinear": 5,
    "QLinearAdd": 8,
    "QLinearMul": 8,
    "QLinearSigmoid": 6,
    "QLinearLeakyRelu": 6,
    "Softmax": 5,
    "LogSoftmax": 5,
    "BatchNormalization": 2,
    "LayerNormalization": 7,
    "InstanceNormalization": 7,
    "GroupNormalization": 7,
    "MeanVarianceNormalization": 7,
    "LpNormalization": 3,
    "SimplifiedLayerNormalization": 4,
    "RMSNormalization": 4,
    "RotaryEmbedding": 3,
}
REDUCTIONS: dict[str, float] = {
    **dict.fromkeys(
        op_set("ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceLogSum ArgMax ArgMin"),
        1,
    ),
    "ReduceL2": 2,
    "ReduceSumSquare": 2,
    "ReduceLogSumExp": 3,
}
# Fused com.microsoft elementwise ops: extra elements (x numel) the unfused chain would
# write and read back, per output element.
_FUSED_ELEMENTWISE_SAVES = {"BiasGelu": 2, "SkipLayerNormalization": 2, "SkipSimplifiedLayerNormalization": 2}


def numel(shape: Shape | None) -> Dim:
    return None if shape is None else prod(shape)


def _shape(xs: Sequence[Shape | None], i: int) -> Shape | None:
    return xs[i] if i < len(xs) else None


def _dim(shape: Shape | None, i: int) -> Dim:
    if shape is None or not -len(shape) <= i < len(shape):
        return None
    return shape[i]


def _has(node: NodeProto, i: int) -> bool:
    return i < len(node.input) and bool(node.input[i])


def _times(*xs: Dim) -> Dim:
    return prod(xs)


def _div(a: Dim, b: Dim) -> Dim:
    if a is None or b is None or b == 0:
        return None
    if isinstance(a, int) and isinstance(b, int):
        return a // b if a % b == 0 else a / b
    try:
        return a / b
    except (ValueError, ZeroDivisionError):
        return None


# -- GEMM family ----------------------------------------------------------------------------


def _matmul_dims(a: Shape | None, b: Shape | None) -> tuple[Dim, Dim, Dim, Dim, bool]:
    """(batch, M, K, N, rhs_is_shared): batch is the broadcast batch size."""
    if a is None or b is None:
        return None, None, None, None, False
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    m, k, n = a2[-2], a2[-1], b2[-1]
    if k is None:
        k = b2[-2]
    ba, bb = a2[:-2], b2[:-2]
    rank = max(len(ba), len(bb))
    batch: Dim = 1
    for i in range(rank):
        da = ba[i - rank + len(ba)] if i - rank + len(ba) >= 0 else 1
        db = bb[i - rank + len(bb)] if i - rank + len(bb) >= 0 else 1
        if da == 1:
            d = db
        elif db == 1 or da == db:
            d = da
        elif da is None or db is None:
            d = None
        else:
            d = da if isinstance(da, int) else db
        batch = None if batch is None or d is None else batch * d
    return batch, m, k, n, len(bb) == 0 or all(d == 1 for d in bb)


def _gemm_key(batch: Dim, m: Dim, k: Dim, n: Dim, shared_rhs: bool) -> Gemm:
    # A weight-like right side (no batch dims) runs as one GEMM with the batch folded into M.
    if shared_rhs:
        return (1, _times(batch, m), k, n)
    return (batch, m, k, n)


def _mm(a: Shape | None, b: Shape | None, extra_per_mn: float = 0) -> OpCount:
    batch, m, k, n, shared = _matmul_dims(a, b)
    flops = _times(2, batch, m, k, n)
    if extra_per_mn and flops is not None:
        flops = _plus(flops, _times(extra_per_mn, batch, m, n))
    return OpCount(flops, (_gemm_key(batch, m, k, n, shared),))


def _matmul(node, ins, outs) -> OpCount:
    return _mm(_shape(ins, 0), _shape(ins, 1))


def _matmul_integer(node, ins, outs) -> OpCount:
    c = _mm(_shape(ins, 0), _shape(ins, 1))
    batch, m, k, n, _ = _matmul_dims(_shape(ins, 0), _shape(ins, 1))
    extra: Dim = 0
    if _has(node, 2):
        extra = _plus(extra, _times(batch, m, k))
    if _has(node, 3):
        extra = _plus(extra, _times(k, n))
    return c._replace(flops=_plus(c.flops, extra))


def _qlinear_matmul(node, ins, outs) -> OpCount:
    return _mm(_shape(ins, 0), _shape(ins, 3), extra_per_mn=3)


def _matmul_integer_to_float(node, ins, outs) -> OpCount:
    return _mm(_shape(ins, 0), _shape(ins, 1), extra_per_mn=1 + (1 if _has(node, 6) else 0))


def _dynamic_quantize_matmul(node, ins, outs) -> OpCount:
    c = _mm(_shape(ins, 0), _shape(ins, 1), extra_per_mn=1 + (1 if _has(node, 4) else 0))
    return c._replace(flops=_plus(c.flops, _times(5, numel(_shape(ins, 0)))))


def _matmul_nbits(node, ins, outs) -> OpCount:
    a = _shape(ins, 0)
    k, n = get_attr(node, "K"), get_attr(node, "N")
    m = None if a is None else prod(a[:-1])
    flops = _plus(_times(2, m, k, n), _times(2, k, n))
    return OpCount(flops, ((1, m, k, n),))


def _fused_matmul(node, ins, outs) -> OpCount:
    a, b = _shape(ins, 0), _shape(ins, 1)
    saved: Dim = 0
    if a is not None and get_attr(node, "transA", 0) and len(a) >= 2:
        a, saved = (*a[:-2], a[-1], a[-2]), _plus(saved, _times(2, numel(a)))
    if b is not None and get_attr(node, "transB", 0) and len(b) >= 2:
        b, saved = (*b[:-2], b[-1], b[-2]), _plus(saved, _times(2, numel(b)))
    alpha = get_attr(node, "alpha", 1.0)
    c = _mm(a, b, extra_per_mn=0 if alpha == 1.0 else 1)
    if alpha != 1.0:
        saved = _plus(saved, _times(2, numel(_shape(outs, 0))))
    return c._replace(saved_elems=saved)


def _gemm(node, ins, outs) -> OpCount:
    a, b = _shape(ins, 0), _shape(ins, 1)
    ta, tb = get_attr(node, "transA", 0), get_attr(node, "transB", 0)
    m, k = (_dim(a, 1), _dim(a, 0)) if ta else (_dim(a, 0), _dim(a, 1))
    n = _dim(b, 0) if tb else _dim(b, 1)
    if k is None:
        k = _dim(b, 1) if tb else _dim(b, 0)
    mn = _times(m, n)
    flops = _times(2, m, k, n)
    if _has(node, 2) and get_attr(node, "beta", 1.0) != 0:
        flops = _plus(flops, mn)
    if get_attr(node, "alpha", 1.0) != 1.0:
        flops = _plus(flops, mn)
    if node.op_type == "QGemm":
        flops = _plus(flops, _times(3, mn))
    saved: Dim = 0
    if node.op_type == "FusedGemm":
        flops = _plus(flops, mn)
        saved = _times(2, mn)
    return OpCount(flops, ((1, m, k, n),), saved)


# -- convolutions -----------------------------------------------------------------------------


def _conv(node, ins, outs) -> OpCount:
    op = node.op_type
    wi, bias_i = (3, 8) if op == "QLinearConv" else (1, 2)
    w, y = _shape(ins, wi), _shape(outs, 0)
    if w is None or y is None or len(w) < 3:
        return OpCount(None)
    group = get_attr(node, "group", 1)
    cin_per_group, kernel = w[1], prod(w[2:])
    flops = _times(2, numel(y), cin_per_group, kernel)
    if op in ("Conv", "QLinearConv", "FusedConv") and _has(node, bias_i):
        flops = _plus(flops, numel(y))
    saved: Dim = 0
    if op == "QLinearConv":
        flops = _plus(flops, _times(3, numel(y)))
    if op == "FusedConv":
        flops = _plus(flops, numel(y), numel(y) if _has(node, 3) else 0)
        saved = _times(2, numel(y))
    batch_spatial = _times(y[0], prod(y[2:]))
    cout_per_group = _div(w[0], group)
    return OpCount(flops, ((group, batch_spatial, _times(cin_per_group, kernel), cout_per_group),), saved)


def _conv_transpose(node, ins, outs) -> OpCount:
    x, w, y = _shape(ins, 0), _shape(ins, 1), _shape(outs, 0)
    if x is None or w is None or len(w) < 3:
        return OpCount(None)
    group = get_attr(node, "group", 1)
    cout_per_group, kernel = w[1], prod(w[2:])
    flops = _times(2, numel(x), cout_per_group, kernel)
    if _has(node, 2):
        flops = _plus(flops, numel(y))
    cin_per_group = _div(x[1], group)
    return OpCount(
        flops, ((group, _times(x[0], prod(x[2:])), cin_per_group, _times(cout_per_group, kernel)),)
    )


# -- Einsum --------------------------------------------------------------------------------


def _einsum(node, ins, outs) -> OpCount:
    eq = (get_attr(node, "equation", "") or "").replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ins) or any(s is None for s in ins):
        return OpCount(None)
    letters: dict[str, Dim] = {}
    ell_shapes: list[Shape] = []
    operand_letters: list[set[str]] = []
    for term, shape in zip(terms, ins, strict=True):
        has_ell = "..." in term
        plain = term.replace("...", "")
        n_ell = len(shape) - len(plain) if has_ell else 0
        if n_ell < 0:
            return OpCount(None)
        pos = term.find("...") if has_ell else len(term)
        dims_by_letter = list(zip(plain[:pos], shape[:pos], strict=True))
        dims_by_letter += list(zip(plain[pos:], shape[pos + n_ell :], strict=True))
        if has_ell:
            ell_shapes.append(tuple(shape[pos : pos + n_ell]))
        for c, d in dims_by_letter:
            letters[c] = _pick_extent(letters.get(c, 1), d) if c in letters else d
        operand_letters.append(set(plain))
    ell = _broadcast_extents(ell_shapes)
    if not arrow:  # implicit output: letters seen once, alphabetical, after the ellipsis
        counts = [c for t in terms for c in t.replace("...", "")]
        rhs = ("..." if ell_shapes else "") + "".join(sorted(c for c in set(counts) if counts.count(c) == 1))
    out_letters = set(rhs.replace("...", ""))
    total = _times(prod(letters.values()), ell)
    summed = bool(set(letters) - out_letters) or (bool(ell_shapes) and "..." not in rhs and ell != 1)
    n = len(terms)
    flops = _plus(_times(n - 1, total), total if summed else 0)
    gemms: tuple[Gemm, ...] = ()
    if n == 2:
        a, b = operand_letters
        if not ((a | b) - out_letters - (a & b)):  # nothing summed from one side only
            batch = _times(prod(letters[c] for c in a & b & out_letters), ell if "..." in rhs else 1)
            m = prod(letters[c] for c in (a - b) & out_letters)
            n_ = prod(letters[c] for c in (b - a) & out_letters)
            k = prod(letters[c] for c in (a & b) - out_letters)
            gemms = ((batch, m, k, n_),)
    return OpCount(flops, gemms)


def _pick_extent(a: Dim, b: Dim) -> Dim:
    if a == 1 or a is None:
        return b if b is not None else a
    return a


def _broadcast_extents(shapes: list[Shape]) -> Dim:
    if not shapes:
        return 1
    rank = max(len(s) for s in shapes)
    dims = []
    for i in range(rank):
        ds = [s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0]
        d = next((x for x in ds if x != 1 and isinstance(x, int)), None)
        if d is None:
            d = next((x for x in ds if x != 1), 1)
        dims.append(d)
    return prod(dims)


# -- recurrent ------------------------------------------------------------------------------


def _recurrent(node, ins, outs) -> OpCount:
    op = node.op_type
    x = _shape(ins, 0)
    if x is None or len(x) != 3:
        return OpCount(None)
    layout = get_attr(node, "layout", 0)
    seq, batch, inp = (x[1], x[0], x[2]) if layout else (x[0], x[1], x[2])
    w = _shape(ins, 1)
    dirs = _dim(w, 0) or (2 if get_attr(node, "direction", "forward") == "bidirectional" else 1)
    hidden = get_attr(node, "hidden_size")
    if hidden is None:
        r = _shape(ins, 2)
        hidden = _dim(r, 2) if op != "DynamicQuantizeLSTM" else _dim(r, 1)
    gates = {"LSTM": 4, "DynamicQuantizeLSTM": 4, "GRU": 3, "RNN": 1}[op]
    bh = _times(batch, hidden)
    gh = _times(gates, bh)
    step = _plus(_times(2, gh, _plus(inp, hidden)), gh)
    if _has(node, 3):
        step = _plus(step, _times(2, gh))
    step = _plus(step, _times({4: 9, 3: 8, 1: 1}[gates], bh))
    if op in ("LSTM", "DynamicQuantizeLSTM") and _has(node, 7):
        step = _plus(step, _times(6, bh))
    if op == "DynamicQuantizeLSTM":
        step = _plus(step, _times(5, batch, _plus(inp, hidden)))
    flops = _times(seq, dirs, step)
    gemms = ((1, _times(seq, batch), inp, _times(gates, hidden)), (1, batch, hidden, _times(gates, hidden)))
    return OpCount(flops, gemms)


# -- attention and other com.microsoft fused ops ------------------------------------------


def _attention(node, ins, outs) -> OpCount:
    """com.microsoft Attention: QKV projection, scaled QK^T (+mask), softmax, PV.

    FLOPs = 2*B*S*Din*Dt + B*S*Dt (bias) + 2*B*S*T*Dq + 7*B*N*S*T + 2*B*S*T*Dv, with
    Dt = Dq+Dk+Dv (qkv_hidden_sizes, else 3 equal parts), N heads, T = past + S.
    Fusion saves the Q/K/V and score tensors: 2*B*S*Dt + 4*B*N*S*T elements.
    """
    x, w = _shape(ins, 0), _shape(ins, 1)
    heads = get_attr(node, "num_heads", 1)
    b, s, din = _dim(x, 0), _dim(x, 1), _dim(x, 2)
    dt = _dim(w, 1)
    sizes = get_attr(node, "qkv_hidden_sizes")
    dq, dv = (sizes[0], sizes[2]) if sizes else (_div(dt, 3), _div(dt, 3))
    past = _shape(ins, 4)
    t = _plus(s, _dim(past, 3)) if past is not None and _has(node, 4) else s
    bs, bnst = _times(b, s), _times(b, heads, s, t)
    flops = _plus(
        _times(2, bs, din, dt),
        _times(bs, dt) if _has(node, 2) else 0,
        _times(2, bs, t, dq),
        _times(7, bnst),
        _times(2, bs, t, dv),
    )
    hq, hv = _div(dq, heads), _div(dv, heads)
    gemms = ((1, bs, din, dt), (_times(b, heads), s, hq, t), (_times(b, heads), s, t, hv))
    return OpCount(flops, gemms, _plus(_times(2, bs, dt), _times(4, bnst)))


def _multi_head_attention(node, ins, outs) -> OpCount:
    """com.microsoft MultiHeadAttention (and GroupQueryAttention): projected Q, K, V in.

    FLOPs = 2*B*S*L*D (QK^T) + 7*B*N*S*L (scale, mask, softmax) + 2*B*S*L*Dv (PV), plus the
    Q/K/V bias adds when a bias is given; L includes the past length. Fusion saves the
    score tensor: 4*B*N*S*L elements.
    """
    q, k, v = _shape(ins, 0), _shape(ins, 1), _shape(ins, 2)
    heads = get_attr(node, "num_heads", 1)
    b, s = _dim(q, 0), _dim(q, 1)
    if node.op_type == "GroupQueryAttention":
        kv_heads = get_attr(node, "kv_num_heads", heads)
        # packed QKV when there is no key: D_total = (N + 2*N_kv) * head
        d = _dim(q, 2) if _has(node, 1) else _times(_div(_dim(q, 2), heads + 2 * kv_heads), heads)
        past = _shape(ins, 3)
        length = _plus(s, _dim(past, 2)) if past is not None and _has(node, 3) else s
        dv = d
    else:
        if k is None or not _has(node, 1):  # packed QKV [B, S, N, 3, H]
            d = _times(_dim(q, 2), _dim(q, 4)) if q is not None and len(q) == 5 else None
            length, dv = s, d
        elif len(k) == 4:  # [B, N, L, H]
            d, length = _dim(q, 2), _dim(k, 2)
            dv = _times(_dim(v, 1), _dim(v, 3)) if v is not None and len(v) == 4 else d
        else:
            d, length = _dim(q, 2), _dim(k, 1)
            dv = _dim(v, 2) if v is not None else d
        past = _shape(ins, 6)
        if past is not None and _has(node, 6):
            length = _plus(length, _dim(past, 2))
    bnsl = _times(b, heads, s, length)
    flops = _plus(_times(2, b, s, length, d), _times(7, bnsl), _times(2, b, s, length, dv))
    if node.op_type == "MultiHeadAttention" and _has(node, 3):
        flops = _plus(flops, _times(b, s, d), _times(b, length, d), _times(b, length, dv))
    bn = _times(b, heads)
    gemms = ((bn, s, _div(d, heads), length), (bn, s, length, _div(dv, heads)))
    return OpCount(flops, gemms, _times(4, bnsl))


def _skip_layer_norm(node, ins, outs) -> OpCount:
    """SkipLayerNormalization: x + skip (+ bias), then LayerNorm: 8 (+1) per element.

    Simplified (RMS) variant: 5 (+1). Fusion saves the sum: 2 elements per element (+2 with bias).
    """
    n = numel(_shape(outs, 0)) or numel(_shape(ins, 0))
    bias_i = 4 if node.op_type == "SkipLayerNormalization" else 3
    per = (8 if node.op_type == "SkipLayerNormalization" else 5) + (1 if _has(node, bias_i) else 0)
    saved = 2 + (2 if _has(node, bias_i) else 0)
    return OpCount(_times(per, n), (), _times(saved, n))


def _embed_layer_norm(node, ins, outs) -> OpCount:
    """EmbedLayerNormalization: word + position (+ segment) gathers, add, LayerNorm: 9 per element."""
    n = numel(_shape(outs, 0))
    return OpCount(_times(9, n), (), _times(4, n))


def _fast_gelu(node, ins, outs) -> OpCount:
    n = numel(_shape(outs, 0))
    bias = _has(node, 1)
    return OpCount(_times(8 + (1 if bias else 0), n), (), _times(2, n) if bias else 0)


def _bias_add(node, ins, outs) -> OpCount:
    n = numel(_shape(outs, 0))
    return OpCount(_times(2, n), (), _times(2, n))


def _elementwise(node, ins, outs) -> OpCount:
    op = node.op_type
    per = ELEMENTWISE[op]
    if op == "Gelu" and get_attr(node, "approximate", "none") == "tanh":
        per = 8
    if op == "QuantizeLinear" or op == "DequantizeLinear" or op == "DynamicQuantizeLinear":
        n = numel(_shape(ins, 0))
    else:
        n = numel(_shape(outs, 0))
    saved: Dim = _times(_FUSED_ELEMENTWISE_SAVES[op], n) if op in _FUSED_ELEMENTWISE_SAVES else 0
    return OpCount(_times(per, n), (), saved)


def _variadic(node, ins, outs) -> OpCount:
    n_in = sum(1 for i in node.input if i)
    per = n_in if node.op_type == "Mean" else max(n_in - 1, 1)
    return OpCount(_times(per, numel(_shape(outs, 0))))


def _reduce(node, ins, outs) -> OpCount:
    return OpCount(_times(REDUCTIONS[node.op_type], numel(_shape(ins, 0))))


def _pool(node, ins, outs) -> OpCount:
    kernel = get_attr(node, "kernel_shape")
    if kernel is None:
        return OpCount(None)
    n = numel(_shape(outs, 0))
    flops = _times(prod(kernel), n)
    if node.op_type == "QLinearAveragePool":
        flops = _plus(flops, _times(5, n))
    return OpCount(flops)


def _global_pool(node, ins, outs) -> OpCount:
    flops = numel(_shape(ins, 0))
    if node.op_type == "QLinearGlobalAveragePool":
        flops = _plus(flops, _times(5, numel(_shape(outs, 0))))
    return OpCount(flops)


def _resize(node, ins, outs) -> OpCount:
    mode = get_attr(node, "mode", "nearest")
    if mode == "nearest":
        return OpCount(0)
    x, y = _shape(ins, 0), _shape(outs, 0)
    if x is None or y is None or len(x) != len(y):
        return OpCount(None)
    axes = sum(1 for a, b in zip(x, y, strict=True) if a != b) or 1
    return OpCount(_times(3 if mode == "linear" else 8, axes, numel(y)))


def _topk(node, ins, outs) -> OpCount:
    k = _dim(_shape(outs, 0), get_attr(node, "axis", -1))
    n = numel(_shape(ins, 0))
    if not isinstance(k, int):
        return OpCount(None if n is None or k is None else n)
    return OpCount(_times(max(1, k.bit_length()), n))


def _zero(node, ins, outs) -> OpCount:
    return OpCount(0)


FORMULAS: dict[str, Formula] = {
    "MatMul": _matmul,
    "MatMulInteger": _matmul_integer,
    "QLinearMatMul": _qlinear_matmul,
    "MatMulIntegerToFloat": _matmul_integer_to_float,
    "DynamicQuantizeMatMul": _dynamic_quantize_matmul,
    "MatMulNBits": _matmul_nbits,
    "FusedMatMul": _fused_matmul,
    "Gemm": _gemm,
    "QGemm": _gemm,
    "FusedGemm": _gemm,
    "Conv": _conv,
    "ConvInteger": _conv,
    "QLinearConv": _conv,
    "FusedConv": _conv,
    "ConvTranspose": _conv_transpose,
    "Einsum": _einsum,
    "LSTM": _recurrent,
    "GRU": _recurrent,
    "RNN": _recurrent,
    "DynamicQuantizeLSTM": _recurrent,
    "Attention": _attention,
    "MultiHeadAttention": _multi_head_attention,
    "GroupQueryAttention": _multi_head_attention,
    "SkipLayerNormalization": _skip_layer_norm,
    "SkipSimplifiedLayerNormalization": _skip_layer_norm,
    "EmbedLayerNormalization": _embed_layer_norm,
    "FastGelu": _fast_gelu,
    "BiasAdd": _bias_add,
    "Sum": _variadic,
    "Max": _variadic,
    "Min": _variadic,
    "Mean": _variadic,
    "MaxPool": _pool,
    "AveragePool": _pool,
    "LpPool": _pool,
    "QLinearAveragePool": _pool,
    "GlobalAveragePool": _global_pool,
    "GlobalMaxPool": _global_pool,
    "GlobalLpPool": _global_pool,
    "QLinearGlobalAveragePool": _global_pool,
    "Resize": _resize,
    "Upsample": _resize,
    "TopK": _topk,
    **dict.fromkeys(ELEMENTWISE.keys() - {"FastGelu"}, _elementwise),
    **dict.fromkeys(REDUCTIONS, _reduce),
    **dict.fromkeys(VIEWS | MOVEMENT | CONTROL_FLOW, _zero),
}


ATTRIBUTE_FREE: frozenset[Formula] = frozenset({_matmul, _variadic, _reduce, _zero})
"""Formulas that read no attribute: their result is a function of the op, inputs and shapes alone."""


def op_count(node: NodeProto, ins: Sequence[Shape | None], outs: Sequence[Shape | None]) -> OpCount | None:
    """The node's FLOPs and GEMM shapes, or None when its op is not modelled."""
    f = FORMULAS.get(node.op_type)
    return None if f is None else f(node, ins, outs)
