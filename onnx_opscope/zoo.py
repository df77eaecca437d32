"""Small deterministic ONNX models that exercise what opscope has to handle.

Every builder returns an `onnx.ModelProto` made with `onnx.helper` / `onnx.numpy_helper`
only, with weights drawn from `np.random.default_rng(seed)`, so the same call always
gives the same bytes. Two families:

* the committed zoo (`MODELS`, written to `models/<name>.onnx` by
  `scripts/make_models.py`): each under 1 MB, one per feature (GEMM kinds, attention,
  MoE routing, convolutions, recurrent ops, control flow, old and new opsets,
  quantized ops, a contrib op, int/bool/scalar inputs);
* builders for benchmarks and big-model tests, made at run time and never committed:
  `bert_like`, `resnet_like`, `gpt2_like`, `wide_graph` and
  `write_external_weights_model` (multi-GiB external weights written in chunks).

Node names are stable and readable (`block1/attn/softmax`); a node's outputs are named
`<node name>_output_<i>`, like the PyTorch exporter does, and a dense layer `<prefix>`
has nodes `<prefix>/matmul`, `<prefix>/add` and initializers `<prefix>.weight`, `<prefix>.bias`.

Opset note: the opset-dependent forms (Reduce* axes as an attribute or an input, Shape
start/end) come from `graph.build.Builder` and `graph.opset`, as for the taps.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx import GraphProto, ModelProto, TensorProto, ValueInfoProto, helper, numpy_helper

from .graph.build import Builder, Constants
from .graph.index import Names
from .graph.opset import shape_takes_range

__all__ = [
    "F32_MIN",
    "MODELS",
    "GraphBuilder",
    "ZooModel",
    "bert_like",
    "build",
    "describe",
    "example_feeds",
    "feeds_for",
    "gpt2_like",
    "resnet_like",
    "wide_graph",
    "write_external_weights_model",
]

FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
BOOL = TensorProto.BOOL

F32_MIN = -3.4028234663852886e38  # float32 min: what HF exports add for masked-out keys
"""float32's most negative value, as HF BERT / GPT-2 exports use for masked attention scores."""

PRODUCER = "onnx-opscope-zoo"
_EXTERNAL_ALIGN = 1 << 16  # align each external tensor to 64 KiB (mmap friendly on every OS)

Dim = int | str | None
Shape = Sequence[Dim]


# --------------------------------------------------------------------------------------------
# Graph building
# --------------------------------------------------------------------------------------------


class GraphBuilder(Builder):
    """Collects nodes, initializers, inputs and outputs of one (sub)graph: `graph.build.Builder` (and its
    opset-aware helpers) with the zoo's naming.

    Every node is named explicitly (node names become opscope's site ids) and its outputs are
    `<name>_output_<i>`; small constants are initializers `<graph>/const_<k>`, shared per value.
    """

    def __init__(self, name: str, opset: int):
        self.name = name
        self.initializers: list[TensorProto] = []
        self.inputs: list[ValueInfoProto] = []
        self.outputs: list[ValueInfoProto] = []
        names = Names()
        super().__init__(opset, names, constants=Constants(names, f"{name}/const_", self.initializers))

    # ---- values ---------------------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: Shape | None) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: Shape | None) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """Add `array` as an initializer called `name` (its dtype is kept)."""
        # (np.ascontiguousarray would turn a rank-0 array into shape [1])
        self.initializers.append(numpy_helper.from_array(np.asarray(array, order="C"), name))
        return name

    # ---- nodes: the zoo always names them -------------------------------------------------
    def ops(  # type: ignore[override]
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        outs: int | Sequence[str] = 1,
        *,
        domain: str = "",
        **attrs: object,
    ) -> list[str]:
        """Add one node; `outs` is the number of outputs (auto-named) or their names."""
        if isinstance(outs, int):
            return super().ops(op_type, inputs, outs, name=name, domain=domain, **attrs)
        return super().ops(op_type, inputs, name=name, outs=list(outs), domain=domain, **attrs)

    def op(  # type: ignore[override]
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        *,
        out: str | None = None,
        domain: str = "",
        **attrs: object,
    ) -> str:
        """Add a one-output node and return its output name (`out`, or `<name>_output_0`)."""
        return self.ops(op_type, inputs, name, [out] if out else 1, domain=domain, **attrs)[0]

    def reduce(  # type: ignore[override]
        self,
        op_type: str,
        x: str,
        axes: Sequence[int],
        name: str,
        *,
        keepdims: int = 1,
        out: str | None = None,
    ) -> str:
        return super().reduce(op_type, x, axes, keepdims, name=name, out=out)

    def unsqueeze(self, x: str, axes: Sequence[int], name: str) -> str:  # type: ignore[override]
        return super().unsqueeze(x, axes, name=name)

    def squeeze(self, x: str, axes: Sequence[int], name: str) -> str:  # type: ignore[override]
        return super().squeeze(x, axes, name=name)

    def shape_dim(self, x: str, axis: int, name: str) -> str:
        """A 1-D int64 [1] tensor holding dimension `axis` of `x` (Shape start/end where the opset has them)."""
        if shape_takes_range(self.opset):
            return self.op("Shape", [x], name, start=axis, end=axis + 1)
        shape = self.op("Shape", [x], f"{name}/shape")
        c = self.const
        return self.op("Slice", [shape, c([axis], np.int64), c([axis + 1], np.int64), c([0], np.int64)], name)

    def graph(self) -> GraphProto:
        return helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)


def _model(
    g: GraphBuilder, doc: str, extra_opsets: Mapping[str, int] | None = None, ir_version: int | None = None
) -> ModelProto:
    opsets = [helper.make_opsetid("", g.opset)]
    opsets += [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    ir = ir_version or helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    model = helper.make_model(
        g.graph(),
        opset_imports=opsets,
        ir_version=ir,
        producer_name=PRODUCER,
        producer_version="1",
        doc_string=doc,
    )
    return model


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0].strip() if doc else ""


def _normal(rng: np.random.Generator, shape: Sequence[int], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Reusable pieces (dense layers, layer norm, attention, MLP)
# --------------------------------------------------------------------------------------------


def _linear(
    g: GraphBuilder,
    x: str,
    n_in: int,
    n_out: int,
    name: str,
    rng: np.random.Generator,
    *,
    scale: float = 1.0,
    bias: bool = True,
    out: str | None = None,
) -> str:
    """x @ W (+ b), W [n_in, n_out] ~ N(0, 1/n_in) times `scale`; initializers `<name>.weight/.bias`."""
    w = g.weight(f"{name}.weight", _normal(rng, (n_in, n_out), scale / math.sqrt(n_in)))
    if not bias:
        return g.op("MatMul", [x, w], f"{name}/matmul", out=out)
    y = g.op("MatMul", [x, w], f"{name}/matmul")
    b = g.weight(f"{name}.bias", _normal(rng, (n_out,), 0.02 * scale))
    return g.op("Add", [y, b], f"{name}/add", out=out)


def _layer_norm(
    g: GraphBuilder,
    x: str,
    dim: int,
    name: str,
    rng: np.random.Generator,
    *,
    decomposed: bool = False,
    eps: float = 1e-5,
) -> str:
    """LayerNormalization (opset 17+) or its opset-12-export form ReduceMean/Sub/Pow/Sqrt/Div."""
    gamma = g.weight(f"{name}.weight", (1.0 + _normal(rng, (dim,), 0.05)).astype(np.float32))
    beta = g.weight(f"{name}.bias", _normal(rng, (dim,), 0.02))
    if not decomposed:
        return g.op("LayerNormalization", [x, gamma, beta], name, axis=-1, epsilon=eps)
    mean = g.reduce("ReduceMean", x, [-1], f"{name}/mean")
    centred = g.op("Sub", [x, mean], f"{name}/sub")
    sq = g.op("Pow", [centred, g.const(2.0)], f"{name}/pow")
    var = g.reduce("ReduceMean", sq, [-1], f"{name}/var")
    std = g.op("Sqrt", [g.op("Add", [var, g.const(eps)], f"{name}/add_eps")], f"{name}/sqrt")
    normed = g.op("Div", [centred, std], f"{name}/div")
    return g.op("Add", [g.op("Mul", [normed, gamma], f"{name}/mul_gamma"), beta], f"{name}/add_beta")


def _activation(g: GraphBuilder, x: str, kind: str, name: str) -> str:
    """relu, gelu_erf (x/2 (1 + erf(x/sqrt 2)), as BERT exports) or gelu_tanh (GPT-2's gelu_new)."""
    if kind == "relu":
        return g.op("Relu", [x], f"{name}/relu")
    if kind == "gelu_erf":
        e = g.op("Erf", [g.op("Div", [x, g.const(math.sqrt(2.0))], f"{name}/div")], f"{name}/erf")
        y = g.op("Mul", [x, g.op("Add", [e, g.const(1.0)], f"{name}/add_one")], f"{name}/mul")
        return g.op("Mul", [y, g.const(0.5)], f"{name}/mul_half")
    if kind == "gelu_tanh":
        cube = g.op("Pow", [x, g.const(3.0)], f"{name}/pow")
        inner = g.op("Add", [x, g.op("Mul", [cube, g.const(0.044715)], f"{name}/mul_c")], f"{name}/add")
        t = g.op(
            "Tanh", [g.op("Mul", [inner, g.const(math.sqrt(2.0 / math.pi))], f"{name}/mul_s")], f"{name}/tanh"
        )
        y = g.op("Mul", [x, g.op("Add", [t, g.const(1.0)], f"{name}/add_one")], f"{name}/mul")
        return g.op("Mul", [y, g.const(0.5)], f"{name}/mul_half")
    raise ValueError(f"unknown activation {kind!r}")


def _mlp(
    g: GraphBuilder,
    x: str,
    hidden: int,
    inner: int,
    name: str,
    rng: np.random.Generator,
    *,
    act: str,
    out_scale: float = 1.0,
) -> str:
    h = _activation(g, _linear(g, x, hidden, inner, f"{name}/fc1", rng), act, f"{name}/act")
    return _linear(g, h, inner, hidden, f"{name}/fc2", rng, scale=out_scale)


def _self_attention(
    g: GraphBuilder,
    x: str,
    hidden: int,
    heads: int,
    name: str,
    rng: np.random.Generator,
    *,
    out_scale: float = 1.0,
    fused_qkv: bool = False,
    score_bias: Sequence[str] = (),
    keep_mask: str | None = None,
) -> str:
    """Multi-head self-attention on x [batch, seq, hidden].

    Q/K/V are separate MatMuls (or one fused MatMul + Split), heads via Reshape/Transpose,
    scores = Q·Kᵀ · 1/sqrt(d) (+ each of `score_bias`, broadcast to [batch, heads, seq, seq]),
    masked with Where(`keep_mask`, scores, float32 min) when given, Softmax over the last
    axis (node `<name>/softmax`), attn·V, merge heads, output projection scaled by `out_scale`.
    """
    hd = hidden // heads
    if fused_qkv:
        qkv = _linear(g, x, hidden, 3 * hidden, f"{name}/qkv", rng)
        q, k, v = g.ops("Split", [qkv, g.const([hidden] * 3, np.int64)], f"{name}/split", 3, axis=-1)
    else:
        q, k, v = (_linear(g, x, hidden, hidden, f"{name}/{p}_proj", rng) for p in "qkv")
    head_shape = g.const([0, 0, heads, hd], np.int64)

    def split_heads(t: str, tag: str, perm: list[int]) -> str:
        r = g.op("Reshape", [t, head_shape], f"{name}/{tag}_reshape")
        return g.op("Transpose", [r], f"{name}/{tag}_transpose", perm=perm)

    qh = split_heads(q, "q", [0, 2, 1, 3])  # [b, h, s, d]
    kt = split_heads(k, "k", [0, 2, 3, 1])  # [b, h, d, s]
    vh = split_heads(v, "v", [0, 2, 1, 3])  # [b, h, s, d]
    scores = g.op("MatMul", [qh, kt], f"{name}/qk_matmul")
    scores = g.op("Mul", [scores, g.const(1.0 / math.sqrt(hd))], f"{name}/scale")
    for i, bias in enumerate(score_bias):
        scores = g.op("Add", [scores, bias], f"{name}/score_bias{i}")
    if keep_mask is not None:
        scores = g.op("Where", [keep_mask, scores, g.const(F32_MIN)], f"{name}/causal_where")
    probs = g.op("Softmax", [scores], f"{name}/softmax", axis=-1)
    ctx = g.op("MatMul", [probs, vh], f"{name}/av_matmul")
    ctx = g.op("Transpose", [ctx], f"{name}/ctx_transpose", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const([0, 0, hidden], np.int64)], f"{name}/ctx_reshape")
    return _linear(g, ctx, hidden, hidden, f"{name}/o_proj", rng, scale=out_scale)


def _pre_ln_block(
    g: GraphBuilder,
    x: str,
    hidden: int,
    heads: int,
    name: str,
    rng: np.random.Generator,
    *,
    act: str = "gelu_erf",
    ffn_mult: int = 4,
    out_scale: float = 1.0,
    fused_qkv: bool = False,
    score_bias: Sequence[str] = (),
    keep_mask: str | None = None,
    out: str | None = None,
) -> str:
    """x + attn(LN(x)) (node `<name>/attn_residual`), then + mlp(LN(.)) (node `<name>/mlp_residual`)."""
    h = _layer_norm(g, x, hidden, f"{name}/ln1", rng)
    a = _self_attention(
        g,
        h,
        hidden,
        heads,
        f"{name}/attn",
        rng,
        out_scale=out_scale,
        fused_qkv=fused_qkv,
        score_bias=score_bias,
        keep_mask=keep_mask,
    )
    x = g.op("Add", [x, a], f"{name}/attn_residual")
    h = _layer_norm(g, x, hidden, f"{name}/ln2", rng)
    m = _mlp(g, h, hidden, ffn_mult * hidden, f"{name}/mlp", rng, act=act, out_scale=out_scale)
    return g.op("Add", [x, m], f"{name}/mlp_residual", out=out)


def _slice_leading(g: GraphBuilder, table: str, lengths: str, n_axes: int, name: str) -> str:
    """table[:L0, :L1, ...] where `lengths` is an int64 [n_axes] tensor."""
    zeros = g.const([0] * n_axes, np.int64)
    return g.op("Slice", [table, zeros, lengths, g.const(list(range(n_axes)), np.int64)], name)


# --------------------------------------------------------------------------------------------
# The committed zoo
# --------------------------------------------------------------------------------------------


def mlp(seed: int = 0) -> ModelProto:
    """MatMul+Add+Relu, MatMul+Add and a Gemm(transB=1): the plain GEMM kinds.

    Input `x` float32 [batch, 64]; output `logits` [batch, 10]. Weights `fc1.weight`
    [64, 128], `fc1.bias`, `fc2.weight` [128, 64], `fc2.bias`, `head.weight` [10, 64]
    (Gemm, transposed), `head.bias` [10].
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("mlp", 17)
    x = g.input("x", FLOAT, ["batch", 64])
    h = g.op("Relu", [_linear(g, x, 64, 128, "fc1", rng)], "fc1/relu")
    h = _linear(g, h, 128, 64, "fc2", rng)
    w = g.weight("head.weight", _normal(rng, (10, 64), 1 / 8))
    b = g.weight("head.bias", _normal(rng, (10,), 0.02))
    g.op("Gemm", [h, w, b], "head/gemm", out="logits", transB=1)
    g.output("logits", FLOAT, ["batch", 10])
    return _model(g, mlp.__doc__ or "", ir_version=8)


def transformer_block(seed: int = 0) -> ModelProto:
    """One pre-LN transformer block: LayerNormalization, Q/K/V, 4 heads, Softmax, GELU(Erf) MLP, residuals.

    Input `x` float32 [batch, seq, 64]; output `y` [batch, seq, 64]. Attention softmax
    node `block/attn/softmax`, residual Adds `block/attn_residual` and `block/mlp_residual`.
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("transformer_block", 17)
    x = g.input("x", FLOAT, ["batch", "seq", 64])
    _pre_ln_block(g, x, 64, 4, "block", rng, act="gelu_erf", out="y")
    g.output("y", FLOAT, ["batch", "seq", 64])
    return _model(g, transformer_block.__doc__ or "")


TINY_LM_VOCAB = 100
TINY_LM_MAX_SEQ = 64
TINY_LM_SINK_BIAS = 6.0


def transformer_tiny_lm(seed: int = 0) -> ModelProto:
    """Tiny causal LM: Gather embedding, 2 blocks (block2 near-identity), key 0 an attention sink.

    Input `input_ids` int64 [batch, seq] (values < 100, seq <= 64); output `logits`
    [batch, seq, 100]. Hidden 32, 2 heads. Block 1 is strong; block 2's attention and MLP
    output projections (initializers `block2/attn/o_proj.weight|bias`, `block2/mlp/fc2.weight|bias`)
    are scaled by 1e-3, so skipping block 2 barely changes the logits. Each block adds
    `blockN/attn/key_bias` ([64], +6 at key position 0) to its scores, so key 0 takes most
    of the attention mass (softmax nodes `block1/attn/softmax`, `block2/attn/softmax`). Causal mask: additive
    -1e4 above the diagonal.
    """
    rng = np.random.default_rng(seed)
    hidden, heads, vocab, max_seq = 32, 2, TINY_LM_VOCAB, TINY_LM_MAX_SEQ
    g = GraphBuilder("transformer_tiny_lm", 17)
    ids = g.input("input_ids", INT64, ["batch", "seq"])
    emb = g.weight("embed.weight", _normal(rng, (vocab, hidden), 1.0))
    x = g.op("Gather", [emb, ids], "embed/gather", axis=0)
    seq = g.shape_dim(ids, 1, "seq_len")
    seq2 = g.op("Concat", [seq, seq], "seq_len2", axis=0)
    causal = g.weight("causal_bias", np.triu(np.full((max_seq, max_seq), -1e4, np.float32), k=1))
    causal = _slice_leading(g, causal, seq2, 2, "causal_bias/slice")
    for i, scale in ((1, 1.0), (2, 1e-3)):
        sink = np.zeros(max_seq, np.float32)
        sink[0] = TINY_LM_SINK_BIAS
        key_bias = _slice_leading(
            g, g.weight(f"block{i}/attn/key_bias", sink), seq, 1, f"block{i}/key_bias/slice"
        )
        x = _pre_ln_block(
            g,
            x,
            hidden,
            heads,
            f"block{i}",
            rng,
            act="gelu_erf",
            out_scale=scale,
            score_bias=[key_bias, causal],
        )
    x = _layer_norm(g, x, hidden, "ln_f", rng)
    _linear(g, x, hidden, vocab, "lm_head", rng, bias=False, out="logits")
    g.output("logits", FLOAT, ["batch", "seq", vocab])
    return _model(g, transformer_tiny_lm.__doc__ or "")


MOE_EXPERTS = 8
MOE_ROUTER_BIAS = (2.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, -8.0)


def moe(seed: int = 0) -> ModelProto:
    """Mixture of experts: router MatMul, Softmax, TopK(k=2) of 8, Gather of stacked experts, MatMul, sum.

    Input `x` float32 [tokens, 32]; output `y` [tokens, 32]. Router `router.weight` [32, 8]
    plus `router.bias` favouring experts 0 and 1 and starving expert 7; softmax node
    `router/softmax`, TopK node `router/topk`; experts `experts.weight` [8, 32, 32].
    """
    rng = np.random.default_rng(seed)
    d, e = 32, MOE_EXPERTS
    g = GraphBuilder("moe", 17)
    x = g.input("x", FLOAT, ["tokens", d])
    logits = _linear(g, x, d, e, "router", rng, scale=0.6, bias=False)
    logits = g.op(
        "Add", [logits, g.weight("router.bias", np.array(MOE_ROUTER_BIAS, np.float32))], "router/add"
    )
    probs = g.op("Softmax", [logits], "router/softmax", axis=-1)
    vals, idx = g.ops("TopK", [probs, g.const([2], np.int64)], "router/topk", 2, axis=-1)
    experts = g.weight("experts.weight", _normal(rng, (e, d, d), 1 / math.sqrt(d)))
    w = g.op("Gather", [experts, idx], "experts/gather", axis=0)  # [tokens, 2, d, d]
    xe = g.unsqueeze(x, [1, 2], "experts/x_unsqueeze")  # [tokens, 1, 1, d]
    ye = g.squeeze(g.op("MatMul", [xe, w], "experts/matmul"), [2], "experts/squeeze")  # [tokens, 2, d]
    weighted = g.op("Mul", [ye, g.unsqueeze(vals, [2], "experts/gate_unsqueeze")], "experts/gate_mul")
    g.reduce("ReduceSum", weighted, [1], "experts/sum", keepdims=0, out="y")
    g.output("y", FLOAT, ["tokens", d])
    return _model(g, moe.__doc__ or "")


def cnn(seed: int = 0) -> ModelProto:
    """Conv, grouped Conv (group=4), depthwise Conv, Relu, ConvTranspose, GlobalAveragePool, Flatten, Gemm.

    Input `image` float32 [batch, 3, 32, 32]; output `logits` [batch, 10].
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("cnn", 13)
    x = g.input("image", FLOAT, ["batch", 3, 32, 32])

    def conv(x: str, cin: int, cout: int, k: int, name: str, *, group: int = 1, stride: int = 1) -> str:
        fan_in = cin // group * k * k
        w = g.weight(f"{name}.weight", _normal(rng, (cout, cin // group, k, k), math.sqrt(2 / fan_in)))
        b = g.weight(f"{name}.bias", _normal(rng, (cout,), 0.02))
        y = g.op(
            "Conv",
            [x, w, b],
            f"{name}/conv",
            kernel_shape=[k, k],
            pads=[k // 2] * 4,
            strides=[stride] * 2,
            group=group,
        )
        return g.op("Relu", [y], f"{name}/relu")

    x = conv(x, 3, 16, 3, "conv1")  # [b, 16, 32, 32]
    x = conv(x, 16, 32, 3, "grouped", group=4, stride=2)  # [b, 32, 16, 16]
    x = conv(x, 32, 32, 3, "depthwise", group=32)  # [b, 32, 16, 16]
    # ConvTranspose weights are [cin, cout, k, k]
    wt = g.weight("up.weight", _normal(rng, (32, 16, 2, 2), math.sqrt(2 / 32)))
    bt = g.weight("up.bias", _normal(rng, (16,), 0.02))
    x = g.op("ConvTranspose", [x, wt, bt], "up/convtranspose", kernel_shape=[2, 2], strides=[2, 2])
    x = g.op("Relu", [x], "up/relu")  # [b, 16, 32, 32]
    x = g.op("GlobalAveragePool", [x], "pool")
    x = g.op("Flatten", [x], "flatten", axis=1)
    w = g.weight("head.weight", _normal(rng, (10, 16), 0.25))
    b = g.weight("head.bias", _normal(rng, (10,), 0.02))
    g.op("Gemm", [x, w, b], "head/gemm", out="logits", transB=1)
    g.output("logits", FLOAT, ["batch", 10])
    return _model(g, cnn.__doc__ or "")


def gru(seed: int = 0) -> ModelProto:
    """Three chained recurrent ops: GRU (hidden 24), LSTM, RNN, then a MatMul.

    Input `x` float32 [seq, batch, 16]; output `y` [seq, batch, 8].
    """
    rng = np.random.default_rng(seed)
    h = 24
    g = GraphBuilder("gru", 14)
    x = g.input("x", FLOAT, ["seq", "batch", 16])

    def recurrent(op_type: str, x: str, n_in: int, gates: int, name: str) -> str:
        w = g.weight(f"{name}.W", _normal(rng, (1, gates * h, n_in), 1 / math.sqrt(n_in)))
        r = g.weight(f"{name}.R", _normal(rng, (1, gates * h, h), 1 / math.sqrt(h)))
        b = g.weight(f"{name}.B", _normal(rng, (1, 2 * gates * h), 0.05))
        y, _ = g.ops(op_type, [x, w, r, b], f"{name}/{op_type.lower()}", 2, hidden_size=h)
        return g.squeeze(y, [1], f"{name}/squeeze")  # [seq, 1, batch, h] -> [seq, batch, h]

    x = recurrent("GRU", x, 16, 3, "gru")
    x = recurrent("LSTM", x, h, 4, "lstm")
    x = recurrent("RNN", x, h, 1, "rnn")
    _linear(g, x, h, 8, "head", rng, bias=False, out="y")
    g.output("y", FLOAT, ["seq", "batch", 8])
    return _model(g, gru.__doc__ or "")


def loop(seed: int = 0) -> ModelProto:
    """Loop (trip count 3) whose body does MatMul with an outer-scope weight + Tanh, with a scan output.

    Input `x` float32 [4, 16]; outputs `final_state` [4, 16] and `scan_out` [3, 4, 16]
    (the body's pre-Tanh MatMul result at each step). Body node `body/matmul` reads the
    outer initializer `loop.weight` [16, 16].
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("loop", 16)
    x = g.input("x", FLOAT, [4, 16])
    w = g.weight("loop.weight", _normal(rng, (16, 16), 1.2 / 4))
    b = g.weight("loop.bias", _normal(rng, (16,), 0.1))
    body = GraphBuilder("loop_body", 16)
    body.input("iter", INT64, [])
    cond_in = body.input("cond_in", BOOL, [])
    state = body.input("state_in", FLOAT, [4, 16])
    mm = body.op("MatMul", [state, w], "body/matmul", out="body_mm")
    body.op("Tanh", [body.op("Add", [mm, b], "body/add")], "body/tanh", out="state_out")
    body.op("Identity", [cond_in], "body/cond", out="cond_out")
    body.output("cond_out", BOOL, [])
    body.output("state_out", FLOAT, [4, 16])
    body.output("body_mm", FLOAT, [4, 16])
    trip, cond = g.const(3, np.int64), g.const(True, np.bool_)
    g.ops("Loop", [trip, cond, x], "loop", ["final_state", "scan_out"], body=body.graph())
    g.output("final_state", FLOAT, [4, 16])
    g.output("scan_out", FLOAT, [3, 4, 16])
    return _model(g, loop.__doc__ or "")


def scan(seed: int = 0) -> ModelProto:
    """Scan over the sequence axis; its body is a small RNN cell (two MatMuls + Tanh).

    Input `x` float32 [batch, seq, 16]; outputs `h_final` [batch, 16] and `ys`
    [batch, seq, 16]. The initial state is the mean of `x` over the sequence; body nodes
    `body/x_matmul` and `body/h_matmul` read outer initializers `cell.wx`, `cell.wh`.
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("scan", 16)
    x = g.input("x", FLOAT, ["batch", "seq", 16])
    wx = g.weight("cell.wx", _normal(rng, (16, 16), 0.25))
    wh = g.weight("cell.wh", _normal(rng, (16, 16), 0.2))
    h0 = g.reduce("ReduceMean", x, [1], "h0_mean", keepdims=0)
    body = GraphBuilder("scan_body", 16)
    h = body.input("h_in", FLOAT, ["batch", 16])
    xt = body.input("x_t", FLOAT, ["batch", 16])
    s = body.op(
        "Add",
        [body.op("MatMul", [xt, wx], "body/x_matmul"), body.op("MatMul", [h, wh], "body/h_matmul")],
        "body/add",
    )
    h_new = body.op("Tanh", [s], "body/tanh", out="h_out")
    body.op("Identity", [h_new], "body/y", out="y_t")
    body.output("h_out", FLOAT, ["batch", 16])
    body.output("y_t", FLOAT, ["batch", 16])
    g.ops(
        "Scan",
        [h0, x],
        "scan",
        ["h_final", "ys"],
        body=body.graph(),
        num_scan_inputs=1,
        scan_input_axes=[1],
        scan_output_axes=[1],
    )
    g.output("h_final", FLOAT, ["batch", 16])
    g.output("ys", FLOAT, ["batch", "seq", 16])
    return _model(g, scan.__doc__ or "")


def if_model(seed: int = 0) -> ModelProto:
    """If with MatMul+Relu / MatMul branches and a nested If inside the then-branch (two levels).

    Inputs `x` float32 [batch, 16] and `flag` bool scalar (rank 0); output `y` [batch, 16].
    Then: MatMul(`then.weight`)+Relu, then an inner If on mean(relu) > 0.5 choosing
    MatMul(`inner_then.weight`, a subgraph initializer) or Mul by 2. Else: MatMul(`else.weight`).
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("if_model", 16)
    x = g.input("x", FLOAT, ["batch", 16])
    flag = g.input("flag", BOOL, [])
    w_then = g.weight("then.weight", _normal(rng, (16, 16), 0.35))
    w_else = g.weight("else.weight", _normal(rng, (16, 16), 0.25))
    threshold = g.weight("inner.threshold", np.array(0.5, np.float32))  # about the median for N(0, 1) x

    then = GraphBuilder("then_branch", 16)
    r = then.op("Relu", [then.op("MatMul", [x, w_then], "then/matmul")], "then/relu")
    mean = then.reduce("ReduceMean", r, [0, 1], "then/mean", keepdims=0)
    inner_cond = then.op("Greater", [mean, threshold], "then/greater")
    inner_then = GraphBuilder("inner_then_branch", 16)
    w_inner = inner_then.weight("inner_then.weight", _normal(rng, (16, 16), 0.25))
    inner_then.op("MatMul", [r, w_inner], "inner_then/matmul", out="inner_then_y")
    inner_then.output("inner_then_y", FLOAT, ["batch", 16])
    inner_else = GraphBuilder("inner_else_branch", 16)
    inner_else.op("Mul", [r, inner_else.const(2.0)], "inner_else/mul", out="inner_else_y")
    inner_else.output("inner_else_y", FLOAT, ["batch", 16])
    then.op(
        "If",
        [inner_cond],
        "then/inner_if",
        out="then_y",
        then_branch=inner_then.graph(),
        else_branch=inner_else.graph(),
    )
    then.output("then_y", FLOAT, ["batch", 16])

    els = GraphBuilder("else_branch", 16)
    els.op("MatMul", [x, w_else], "else/matmul", out="else_y")
    els.output("else_y", FLOAT, ["batch", 16])
    g.op("If", [flag], "if", out="y", then_branch=then.graph(), else_branch=els.graph())
    g.output("y", FLOAT, ["batch", 16])
    return _model(g, if_model.__doc__ or "")


def _small_mlp(name: str, opset: int, seed: int) -> GraphBuilder:
    rng = np.random.default_rng(seed)
    g = GraphBuilder(name, opset)
    x = g.input("x", FLOAT, ["batch", 32])
    h = g.op("Relu", [_linear(g, x, 32, 64, "fc1", rng)], "fc1/relu")
    h = _linear(g, h, 64, 16, "fc2", rng)
    mean = g.reduce("ReduceMean", h, [1], "center/mean", keepdims=1)
    centred = g.op("Sub", [h, mean], "center/sub")
    g.op("Softmax", [centred], "softmax", out="probs", axis=1)
    g.output("probs", FLOAT, ["batch", 16])
    return g


def opset11_mlp(seed: int = 0) -> ModelProto:
    """Old-opset forms (opset 11, IR 6): MatMul/Add/Relu, ReduceMean with `axes` attribute, Softmax.

    Input `x` float32 [batch, 32]; output `probs` [batch, 16].
    """
    return _model(_small_mlp("opset11_mlp", 11, seed), opset11_mlp.__doc__ or "", ir_version=6)


def opset21_mlp(seed: int = 0) -> ModelProto:
    """New-opset forms (opset 21, IR 10): MatMul/Add/Relu, ReduceMean with axes as an input, Softmax.

    Input `x` float32 [batch, 32]; output `probs` [batch, 16].
    """
    return _model(_small_mlp("opset21_mlp", 21, seed), opset21_mlp.__doc__ or "", ir_version=10)


def quantized(seed: int = 0) -> ModelProto:
    """Quantized GEMMs: DynamicQuantizeLinear+MatMulInteger, QLinearMatMul, DequantizeLinear(weight)+MatMul.

    Input `x` float32 [batch, 32]; output `y` float32 [batch, 16], the sum of three paths:
    (a) DynamicQuantizeLinear(x) -> MatMulInteger(int8 `mmi.weight`) -> Cast -> Mul scales;
    (b) QuantizeLinear(x) -> QLinearMatMul(int8 `qlm.weight`) -> DequantizeLinear;
    (c) DequantizeLinear(int8 `dq.weight`, per-channel scale) -> MatMul.
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("quantized", 13)
    x = g.input("x", FLOAT, ["batch", 32])

    def int8_weight(shape: tuple[int, int], limit: int = 127) -> np.ndarray:
        return np.clip(np.round(rng.standard_normal(shape) * 40 * limit / 127), -limit, limit).astype(np.int8)

    # (a) dynamic quantization of the activation, integer matmul, rescale
    xq, xs, xzp = g.ops("DynamicQuantizeLinear", [x], "a/dynamic_quantize", 3)
    # 7-bit weights, as onnxruntime's quantizer writes with reduce_range: on x86 CPUs without VNNI the
    # uint8 x int8 kernel sums pairs of products in int16 and saturates on full-range weights (0.24
    # relative error measured on an AVX2-only EPYC).
    wa = g.weight("mmi.weight", int8_weight((32, 16), limit=63))
    acc = g.op("MatMulInteger", [xq, wa, xzp, g.const(0, np.int8)], "a/matmul_integer")
    a = g.op("Cast", [acc], "a/cast", to=FLOAT)
    a = g.op("Mul", [a, xs], "a/mul_x_scale")
    a = g.op("Mul", [a, g.weight("mmi.scale", np.array(0.005, np.float32))], "a/mul_w_scale")
    # (b) static quantization, QLinearMatMul, dequantize
    x_scale, x_zp = g.const(0.05), g.const(128, np.uint8)
    xq2 = g.op("QuantizeLinear", [x, x_scale, x_zp], "b/quantize")
    wb = g.weight("qlm.weight", int8_weight((32, 16)))
    y_scale, y_zp = g.const(0.05), g.const(128, np.uint8)
    yq = g.op(
        "QLinearMatMul",
        [
            xq2,
            x_scale,
            x_zp,
            wb,
            g.weight("qlm.scale", np.array(0.005, np.float32)),
            g.const(0, np.int8),
            y_scale,
            y_zp,
        ],
        "b/qlinear_matmul",
    )
    b = g.op("DequantizeLinear", [yq, y_scale, y_zp], "b/dequantize")
    # (c) weight-only quantization: dequantize an int8 weight (per output channel), float MatMul
    wc = g.weight("dq.weight", int8_weight((32, 16)))
    wc_scale = g.weight("dq.scale", (0.004 + 0.002 * rng.random(16)).astype(np.float32))
    wc_f = g.op(
        "DequantizeLinear",
        [wc, wc_scale, g.weight("dq.zero_point", np.zeros(16, np.int8))],
        "c/dequantize_weight",
        axis=1,
    )
    c = g.op("MatMul", [x, wc_f], "c/matmul")
    g.op("Add", [g.op("Add", [a, b], "sum_ab"), c], "sum_abc", out="y")
    g.output("y", FLOAT, ["batch", 16])
    return _model(g, quantized.__doc__ or "")


def attention_contrib(seed: int = 0) -> ModelProto:
    """A com.microsoft Attention contrib op (num_heads=2, weights [32, 96], bias [96]) then a MatMul.

    Input `x` float32 [batch, seq, 32]; output `y` [batch, seq, 32]. Runs on onnxruntime
    only (not in the ONNX standard), so the checker's full check cannot infer its shapes.
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("attention_contrib", 17)
    x = g.input("x", FLOAT, ["batch", "seq", 32])
    w = g.weight("attn.weight", _normal(rng, (32, 96), 1 / math.sqrt(32)))
    b = g.weight("attn.bias", _normal(rng, (96,), 0.02))
    a = g.op("Attention", [x, w, b], "attn/attention", domain="com.microsoft", num_heads=2)
    _linear(g, a, 32, 32, "out", rng, bias=False, out="y")
    g.output("y", FLOAT, ["batch", "seq", 32])
    return _model(g, attention_contrib.__doc__ or "", extra_opsets={"com.microsoft": 1})


def bool_int_inputs(seed: int = 0) -> ModelProto:
    """int32 ids into a Gather embedding, a bool mask via Where, a rank-0 float scale: non-float inputs.

    Inputs `ids` int32 [batch, 8] (values 0..49), `mask` bool [batch, 8], `scale` float32
    scalar (rank 0); output `y` float32 [batch, 8, 16].
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("bool_int_inputs", 17)
    ids = g.input("ids", INT32, ["batch", 8])
    mask = g.input("mask", BOOL, ["batch", 8])
    scale = g.input("scale", FLOAT, [])
    emb = g.weight("embed.weight", _normal(rng, (50, 16), 1.0))
    h = g.op("Gather", [emb, ids], "embed/gather", axis=0)
    h = _linear(g, h, 16, 16, "proj", rng, bias=False)
    keep = g.unsqueeze(mask, [2], "mask/unsqueeze")
    h = g.op("Where", [keep, h, g.const(0.0)], "mask/where")
    g.op("Mul", [h, scale], "scale/mul", out="y")
    g.output("y", FLOAT, ["batch", 8, 16])
    return _model(g, bool_int_inputs.__doc__ or "")


@dataclass(frozen=True)
class ZooModel:
    """One committed zoo model: its builder and the exclusive upper bound of each integer input."""

    name: str
    builder: Callable[[], ModelProto]
    int_high: Mapping[str, int] = field(default_factory=dict)

    @property
    def description(self) -> str:
        return _first_line(self.builder.__doc__)


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel("mlp", mlp),
        ZooModel("transformer_block", transformer_block),
        ZooModel("transformer_tiny_lm", transformer_tiny_lm, {"input_ids": TINY_LM_VOCAB}),
        ZooModel("moe", moe),
        ZooModel("cnn", cnn),
        ZooModel("gru", gru),
        ZooModel("loop", loop),
        ZooModel("scan", scan),
        ZooModel("if_model", if_model),
        ZooModel("opset11_mlp", opset11_mlp),
        ZooModel("opset21_mlp", opset21_mlp),
        ZooModel("quantized", quantized),
        ZooModel("attention_contrib", attention_contrib),
        ZooModel("bool_int_inputs", bool_int_inputs, {"ids": 50}),
    ]
}
"""The committed zoo, by name (the names are a contract: `models/<name>.onnx`)."""


def build(name: str) -> ModelProto:
    """Build the committed zoo model `name`."""
    if name not in MODELS:
        raise KeyError(f"no zoo model {name!r}; have {', '.join(MODELS)}")
    return MODELS[name].builder()


def describe(name: str) -> str:
    """One line: what the zoo model `name` exercises."""
    return MODELS[name].description


# --------------------------------------------------------------------------------------------
# Feeds
# --------------------------------------------------------------------------------------------

DEFAULT_DIMS: dict[str, int] = {"batch": 2, "seq": 8, "tokens": 16}


def feeds_for(
    model: ModelProto,
    *,
    seed: int = 0,
    dims: Mapping[str, int] | None = None,
    int_high: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """A seeded feed for every graph input (initializers excluded).

    Symbolic dims take their size from `dims` (default batch=2, seq=8, tokens=16, other 2);
    floats are N(0, 1), rank-0 floats U(0.5, 1.5), bools fair coins, integers
    uniform in [0, int_high[name]) (default 10).
    """
    rng = np.random.default_rng(seed)
    sizes = {**DEFAULT_DIMS, **(dims or {})}
    inits = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else sizes.get(d.dim_param, 2) for d in tt.shape.dim
        )
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if dtype == np.bool_:
            feeds[vi.name] = np.asarray(rng.random(shape) < 0.5)
        elif np.issubdtype(dtype, np.integer):
            high = (int_high or {}).get(vi.name, 10)
            feeds[vi.name] = rng.integers(0, high, shape).astype(dtype)
        elif not shape:
            feeds[vi.name] = np.asarray(0.5 + rng.random(), dtype=dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def example_feeds(
    name: str, *, seed: int = 0, dims: Mapping[str, int] | None = None, model: ModelProto | None = None
) -> dict[str, np.ndarray]:
    """A seeded, valid feed for the zoo model `name` (integer inputs stay within their tables)."""
    entry = MODELS[name]
    return feeds_for(
        model if model is not None else entry.builder(), seed=seed, dims=dims, int_high=entry.int_high
    )


# --------------------------------------------------------------------------------------------
# Run-time builders for benchmarks and big-model tests (never committed)
# --------------------------------------------------------------------------------------------


def bert_like(
    hidden: int = 256, layers: int = 4, heads: int = 4, vocab: int = 1000, max_seq: int = 128, seed: int = 0
) -> ModelProto:
    """BERT-style encoder as HF exports it at opset 14 (post-LN, Erf GELU, float32-min mask bias).

    Inputs `input_ids` int64 [batch, seq] (< vocab, seq <= max_seq) and `attention_mask`
    int64 [batch, seq] (1 keep, 0 pad); output `last_hidden_state` [batch, seq, hidden].
    The mask becomes (1 - mask) * -3.4028234663852886e38 added to the scores. LayerNorm is
    decomposed (ReduceMean/Sub/Pow/Add/Sqrt/Div/Mul/Add) as opset-12-style exports write it.
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("bert_like", 14)
    ids = g.input("input_ids", INT64, ["batch", "seq"])
    mask = g.input("attention_mask", INT64, ["batch", "seq"])
    word = g.op(
        "Gather",
        [g.weight("embeddings.word.weight", _normal(rng, (vocab, hidden), 0.5)), ids],
        "embeddings/word_gather",
        axis=0,
    )
    pos_table = g.weight("embeddings.position.weight", _normal(rng, (max_seq, hidden), 0.1))
    pos = _slice_leading(g, pos_table, g.shape_dim(ids, 1, "seq_len"), 1, "embeddings/position_slice")
    x = g.op("Add", [word, pos], "embeddings/add")
    x = _layer_norm(g, x, hidden, "embeddings/ln", rng, decomposed=True, eps=1e-12)
    m = g.op("Cast", [mask], "mask/cast", to=FLOAT)
    m = g.op("Sub", [g.const(1.0), m], "mask/sub")
    m = g.op("Mul", [m, g.const(F32_MIN)], "mask/mul")
    bias = g.unsqueeze(m, [1, 2], "mask/unsqueeze")  # [b, 1, 1, s]
    for i in range(layers):
        name = f"layer{i}"
        a = _self_attention(g, x, hidden, heads, f"{name}/attn", rng, score_bias=[bias])
        x = _layer_norm(
            g,
            g.op("Add", [x, a], f"{name}/attn_residual"),
            hidden,
            f"{name}/attn_ln",
            rng,
            decomposed=True,
            eps=1e-12,
        )
        f = _mlp(g, x, hidden, 4 * hidden, f"{name}/mlp", rng, act="gelu_erf", out_scale=0.5)
        x = _layer_norm(
            g,
            g.op("Add", [x, f], f"{name}/mlp_residual"),
            hidden,
            f"{name}/mlp_ln",
            rng,
            decomposed=True,
            eps=1e-12,
        )
    g.op("Identity", [x], "output", out="last_hidden_state")
    g.output("last_hidden_state", FLOAT, ["batch", "seq", hidden])
    return _model(g, bert_like.__doc__ or "")


def resnet_like(blocks: int = 4, width: int = 64, classes: int = 10, seed: int = 0) -> ModelProto:
    """ResNet-style CNN: 7x7/2 stem, MaxPool, basic residual blocks (width doubles every 2), GAP, Gemm.

    Input `image` float32 [batch, 3, 64, 64]; output `logits` [batch, classes]. Blocks 2, 4, ...
    halve the resolution with a strided conv and a 1x1 projection shortcut.
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("resnet_like", 13)
    x = g.input("image", FLOAT, ["batch", 3, 64, 64])

    def conv(x: str, cin: int, cout: int, k: int, name: str, stride: int = 1, gain: float = 1.0) -> str:
        w = g.weight(f"{name}.weight", _normal(rng, (cout, cin, k, k), gain * math.sqrt(2 / (cin * k * k))))
        b = g.weight(f"{name}.bias", _normal(rng, (cout,), 0.01))
        return g.op(
            "Conv",
            [x, w, b],
            f"{name}/conv",
            kernel_shape=[k, k],
            pads=[k // 2] * 4,
            strides=[stride, stride],
        )

    x = g.op("Relu", [conv(x, 3, width, 7, "stem", stride=2)], "stem/relu")
    x = g.op("MaxPool", [x], "stem/maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = width
    for i in range(blocks):
        down = i > 0 and i % 2 == 0
        cout = cin * 2 if down else cin
        name = f"block{i}"
        h = g.op("Relu", [conv(x, cin, cout, 3, f"{name}/conv1", stride=2 if down else 1)], f"{name}/relu1")
        h = conv(h, cout, cout, 3, f"{name}/conv2", gain=0.5)
        shortcut = conv(x, cin, cout, 1, f"{name}/shortcut", stride=2) if down else x
        x = g.op("Relu", [g.op("Add", [h, shortcut], f"{name}/residual")], f"{name}/relu2")
        cin = cout
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x], "pool")], "flatten", axis=1)
    w = g.weight("fc.weight", _normal(rng, (classes, cin), 1 / math.sqrt(cin)))
    g.op(
        "Gemm", [x, w, g.weight("fc.bias", np.zeros(classes, np.float32))], "fc/gemm", out="logits", transB=1
    )
    g.output("logits", FLOAT, ["batch", classes])
    return _model(g, resnet_like.__doc__ or "")


def gpt2_like(
    hidden: int = 64, layers: int = 2, heads: int = 4, vocab: int = 500, max_seq: int = 128, seed: int = 0
) -> ModelProto:
    """GPT-2-style decoder (opset 17): fused QKV + Split, causal Where(mask, s, float32 min), gelu_new.

    Input `input_ids` int64 [batch, seq] (< vocab, seq <= max_seq); output `logits`
    [batch, seq, vocab]. Pre-LN blocks with LayerNormalization, learned positions, final LN.
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("gpt2_like", 17)
    ids = g.input("input_ids", INT64, ["batch", "seq"])
    wte = g.weight("wte.weight", _normal(rng, (vocab, hidden), 0.5))
    x = g.op("Gather", [wte, ids], "wte/gather", axis=0)
    seq = g.shape_dim(ids, 1, "seq_len")
    pos = _slice_leading(g, g.weight("wpe.weight", _normal(rng, (max_seq, hidden), 0.1)), seq, 1, "wpe/slice")
    x = g.op("Add", [x, pos], "embeddings/add")
    causal = g.weight("causal_mask", np.tril(np.ones((max_seq, max_seq), np.bool_)))
    keep = _slice_leading(g, causal, g.op("Concat", [seq, seq], "seq_len2", axis=0), 2, "causal_mask/slice")
    for i in range(layers):
        x = _pre_ln_block(
            g, x, hidden, heads, f"h{i}", rng, act="gelu_tanh", fused_qkv=True, keep_mask=keep, out_scale=0.5
        )
    x = _layer_norm(g, x, hidden, "ln_f", rng)
    _linear(g, x, hidden, vocab, "lm_head", rng, bias=False, out="logits")
    g.output("logits", FLOAT, ["batch", "seq", vocab])
    return _model(g, gpt2_like.__doc__ or "")


_WIDE_PATTERN = ("MatMul", "Add", "Mul", "Tanh")


def wide_graph(n_nodes: int, *, width: int = 8, dim: int = 16, seed: int = 0) -> ModelProto:
    """Exactly `n_nodes` nodes: `width` parallel chains of MatMul/Add/Mul/Tanh joined by one Sum.

    Input `x` float32 [batch, dim]; output `y` [batch, dim]. Weights come from a small shared
    pool (orthogonal MatMul weights, Tanh every 4th node), so values stay bounded however
    long the chains. Nodes are appended to the protobuf directly, so 160k nodes take about
    a second.
    """
    if n_nodes < 1:
        raise ValueError("wide_graph needs n_nodes >= 1")
    rng = np.random.default_rng(seed)
    chains = max(1, min(width, (n_nodes - 1) // 2))
    body = n_nodes - 1 if chains > 1 else n_nodes
    pool = 8
    weights: dict[str, np.ndarray] = {}
    for k in range(pool):
        weights[f"w{k}"] = np.linalg.qr(rng.standard_normal((dim, dim)))[0].astype(np.float32)
        weights[f"b{k}"] = _normal(rng, (dim,), 0.1)
        weights[f"s{k}"] = (0.9 + 0.2 * rng.random(dim)).astype(np.float32)
    used: set[str] = set()
    graph = GraphProto(name="wide_graph")
    graph.input.append(helper.make_tensor_value_info("x", FLOAT, ["batch", dim]))
    graph.output.append(helper.make_tensor_value_info("y", FLOAT, ["batch", dim]))
    ends: list[str] = []
    for c in range(chains):
        length = body // chains + (1 if c < body % chains else 0)
        prev = "x"
        for i in range(length):
            op_type = _WIDE_PATTERN[i % 4]
            node = graph.node.add()
            node.op_type = op_type
            node.name = f"c{c}/n{i}"
            k = (c + i // 4) % pool
            second = {"MatMul": f"w{k}", "Add": f"b{k}", "Mul": f"s{k}"}.get(op_type)
            node.input.extend([prev, second] if second else [prev])
            if second:
                used.add(second)
            prev = f"c{c}/t{i}"
            node.output.append(prev)
        ends.append(prev)
    if chains > 1:
        node = graph.node.add()
        node.op_type, node.name = "Sum", "sum"
        node.input.extend(ends)
        node.output.append("y")
    else:
        graph.node[-1].output[0] = "y"
    graph.initializer.extend(numpy_helper.from_array(weights[n], n) for n in weights if n in used)
    opsets = [helper.make_opsetid("", 17)]
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=8, producer_name=PRODUCER, producer_version="1"
    )


def write_external_weights_model(
    folder: str | os.PathLike,
    total_bytes: int = 2 * 1024**3,
    n_tensors: int = 8,
    *,
    seed: int = 0,
    chunk_bytes: int = 64 * 1024**2,
) -> Path:
    """Write `folder/big.onnx` and `folder/big.onnx.data`: x [1, d] @ W_0 @ ... @ W_{n-1}, W_i [d, d].

    d = isqrt(total_bytes / (4 n_tensors)), so the weights take about `total_bytes`. The
    data file is written `chunk_bytes` at a time (never the whole weights in memory),
    each tensor starting at a 64 KiB-aligned offset; the TensorProtos carry only
    location/offset/length. W entries are U(-sqrt(3/d), sqrt(3/d)) (variance 1/d), so
    |x W| stays near |x| along the chain. Input `x` float32 [1, d]; output `y` [1, d].
    Returns the path of `big.onnx`.
    """
    if n_tensors < 1 or total_bytes < 4 * n_tensors:
        raise ValueError("need n_tensors >= 1 and total_bytes >= 4 * n_tensors")
    out_dir = Path(folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = max(1, math.isqrt(total_bytes // (4 * n_tensors)))
    path, data_name = out_dir / "big.onnx", "big.onnx.data"
    rng = np.random.default_rng(seed)
    bound = math.sqrt(3.0 / d)
    rows_per_chunk = max(1, chunk_bytes // (4 * d))
    weights: list[TensorProto] = []
    offset = 0
    with open(out_dir / data_name, "wb") as f:
        for i in range(n_tensors):
            pad = -offset % _EXTERNAL_ALIGN
            f.write(b"\0" * pad)
            offset += pad
            for r0 in range(0, d, rows_per_chunk):
                block = rng.random((min(rows_per_chunk, d - r0), d), dtype=np.float32)
                block *= 2 * bound
                block -= bound
                f.write(block.astype("<f4", copy=False).tobytes())
                del block
            length = 4 * d * d
            weights.append(_external_tensor(f"W{i}", [d, d], data_name, offset, length))
            offset += length
    g = GraphBuilder("big", 17)
    x = g.input("x", FLOAT, [1, d])
    for i in range(n_tensors):
        x = g.op("MatMul", [x, f"W{i}"], f"matmul{i}", out="y" if i == n_tensors - 1 else None)
    g.output("y", FLOAT, [1, d])
    g.initializers.extend(weights)
    model = _model(g, f"chain of {n_tensors} MatMuls with [{d}, {d}] float32 weights in {data_name}")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def _external_tensor(name: str, dims: Iterable[int], location: str, offset: int, length: int) -> TensorProto:
    t = TensorProto(name=name, data_type=FLOAT, data_location=TensorProto.EXTERNAL)
    t.dims.extend(dims)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t
