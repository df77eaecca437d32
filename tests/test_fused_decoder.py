"""The onnxruntime-fused SmolLM2 decoder (scripts/make_decoder_fused.py, 2 layers) and its fused ops as sites.

The fused decoder is held against the plain export (same greedy tokens, logits within 1e-4), the
instrumented one against the plain fused one (logits and presents), and the fused ops' taps against
numpy references on the tapped tensors, read back with those tensors made graph outputs. The
GroupQueryAttention shadow softmax is held against the op's own probabilities (its `output_qk`
with qk_output=2, an output the plain model does not ask for) on a decode step with a real past.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
import pytest
from conftest import DECODER_PROMPT, decoder_path
from onnx import TensorProto, helper
from test_inference_sites import CFG, _check_shadow, _np_softmax, assert_matches, intermediates, tap_values

from onnx_opscope import generate, inject, read_table
from onnx_opscope.graph.io import load_model
from onnx_opscope.instrument import unpacked
from onnx_opscope.run.session import make_session
from onnx_opscope.sites import SHADOW_SUFFIX, Selection, find_sites

PROMPT = DECODER_PROMPT
STEPS = 6
LAYERS = 2
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
FUSED = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2 * LAYERS,
         "RotaryEmbedding": 2 * LAYERS, "GroupQueryAttention": LAYERS}  # fmt: skip


@pytest.fixture(scope="session")
def decoders():
    """(plain, fused) 2-layer decoders, built once and cached beside the real models."""
    return decoder_path(layers=LAYERS), decoder_path("fused", LAYERS)


@pytest.fixture(scope="session")
def plain_runs(decoders):
    return [generate(m, PROMPT, steps=STEPS, keep_logits=True) for m in decoders]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_fused_ops_replace_the_exported_attention(decoders):
    plain, fused = (onnx.load(str(p), load_external_data=False) for p in decoders)
    ops = Counter(n.op_type for n in fused.graph.node)
    assert {op: ops[op] for op in FUSED} == FUSED
    assert ops["Softmax"] == 0 and ops["CumSum"] == 1  # the exported attention and rotary are gone
    gqa = [n for n in fused.graph.node if n.op_type == "GroupQueryAttention"]
    assert [list(n.output[1:]) for n in gqa] == [
        [f"present.{i}.key", f"present.{i}.value"] for i in range(LAYERS)
    ]
    for a, b in ((plain.graph.input, fused.graph.input), (plain.graph.output, fused.graph.output)):
        assert [v.SerializeToString() for v in a] == [
            v.SerializeToString() for v in b
        ]  # a drop-in for generate


def test_greedy_tokens_and_logits_equal_the_plain_decoder(plain_runs):
    plain, fused = plain_runs
    assert fused.tokens.tolist() == plain.tokens.tolist()
    assert _rel(fused.logits, plain.logits) < 1e-4


def test_instrumented_fused_decoder_keeps_logits_and_presents(decoders, plain_runs, tmp_path):
    fused, plain = decoders[1], plain_runs[1]
    out = tmp_path / "fused.parquet"
    rec = generate(fused, PROMPT, steps=STEPS, out=out, keep_logits=True)  # default optimization level
    assert rec.tokens.tolist() == plain.tokens.tolist()
    assert _rel(rec.logits, plain.logits) < 1e-4
    assert (
        rec.parity is not None and rec.parity.ok and rec.parity.max_rel < 1e-4
    )  # prefill: logits and presents
    table = read_table(out).to_pandas()
    roles = table.groupby("op_type").role.unique().map(sorted).to_dict()
    assert roles["SkipSimplifiedLayerNormalization"] == ["in", "out", "skip"]
    assert roles["SimplifiedLayerNormalization"] == roles["RotaryEmbedding"] == ["in", "out"]
    assert roles["GroupQueryAttention"] == ["attn", "key", "value"]  # the shadow, and the presents (kind kv)
    # the shadow holds one step's probabilities: [1, heads, S, T] at the prefill, [1, heads, 1, T] after
    numel = table[table.role == "attn"].groupby("step").numel.first()
    p = len(PROMPT)
    assert numel.tolist() == [HEADS * p * p] + [HEADS * (p + k + 1) for k in range(STEPS - 1)]


def test_fused_ops_are_sites_with_their_roles(decoders):
    model = load_model(decoders[1])
    nodes = {n.name: n for n in model.graph.node}
    sites = [s for s in find_sites(model) if s.kind not in ("gemm", "kv")]
    assert Counter(s.op_type for s in sites) == FUSED
    for s in sites:
        node = nodes[s.node]
        taps = {t.role: t.tensor for t in s.taps}
        if s.kind == "attn":
            assert s.attrs["shadow_of"] == "GroupQueryAttention" and list(taps) == ["attn"]
            continue
        assert s.kind == ("rotary" if s.op_type == "RotaryEmbedding" else "norm")
        expected = {"in": node.input[0], "out": node.output[0]}
        if s.op_type.startswith("Skip"):
            expected["skip"] = node.input[1]
        assert taps == expected
    assert [s.id for s in sites if s.kind == "norm"][-1] == "/norm/SkipSimplifiedLayerNormalization"


def _with_probs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of `model` whose GroupQueryAttention nodes also output their softmax (qk_output=2), and
    those outputs by node name: the op's own probabilities, to hold the shadow against."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probs = {}
    for node in probe.graph.node:
        if node.op_type == "GroupQueryAttention":
            node.attribute.append(helper.make_attribute("qk_output", 2))
            node.output.append(probs.setdefault(node.name, node.name + "/output_qk"))
            probe.graph.output.append(helper.make_empty_tensor_value_info(probs[node.name]))
    return probe, probs


def _run(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_fused_op_sketches_equal_numpy(decoders):
    """Every sketch of every fused-op tap on a decode step (the last prompt token over the real past of
    the others) equals its reference on the tensor; the shadow's on the op's own probabilities."""
    model = load_model(decoders[1])
    probe, probs = _with_probs(model)
    probe_sess = make_session(probe, CFG)
    pasts = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
    ids = np.array([PROMPT[:-1]], np.int64)
    empty = {n: np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32) for n in pasts}
    prefill = _run(probe_sess, {"input_ids": ids, "attention_mask": np.ones_like(ids), **empty})
    feeds = {"input_ids": np.array([PROMPT[-1:]]), "attention_mask": np.ones((1, len(PROMPT)), np.int64),
             **{n: prefill[n.replace("past_key_values", "present")] for n in pasts}}  # fmt: skip
    own_probs = _run(probe_sess, feeds)
    sketches = ["min", "max", "mean", "sumsq", "chan_maxabs", "attn_qmax", "attn_krecv"]
    instrumented, manifest = inject(model, Selection(kinds=("norm", "rotary", "attn")), sketches)
    outs = unpacked(manifest, _run(make_session(instrumented, CFG), feeds))
    ref = intermediates(
        model, [t.tensor for t in manifest.taps if not t.tensor.endswith(SHADOW_SUFFIX)], feeds
    )
    checked = Counter()
    for site in manifest.sites:
        for role in site.roles:
            values, tensor, info = tap_values(manifest, outs, site.id, role)
            x = own_probs[probs[site.node]] if role == "attn" else ref[tensor]
            assert x.shape[-2] == 1  # a decode step: one query row
            for name in values:
                assert_matches(name, values[name], x, info)
            checked[site.op_type, role] += 1
    assert checked == {**{(op, r): n for op, n in FUSED.items() if op != "GroupQueryAttention" for r in ("in", "out")},
                       ("SkipSimplifiedLayerNormalization", "skip"): 2 * LAYERS,
                       ("GroupQueryAttention", "attn"): LAYERS}  # fmt: skip


def test_multi_head_attention_shadow_with_past():
    """com.microsoft MultiHeadAttention with a past key / value: one step's scores over past + new keys."""
    b, s, p, h, d = 1, 2, 3, 2, 4
    rng = np.random.default_rng(5)
    feeds = {
        "q": rng.standard_normal((b, s, h * d)).astype(np.float32),
        "k": rng.standard_normal((b, s, h * d)).astype(np.float32),
        "v": rng.standard_normal((b, s, h * d)).astype(np.float32),
        "past_k": rng.standard_normal((b, h, p, d)).astype(np.float32),
        "past_v": rng.standard_normal((b, h, p, d)).astype(np.float32),
    }
    F = TensorProto.FLOAT
    shapes = {n: list(a.shape) for n, a in feeds.items()}
    names = ["q", "k", "v", "", "", "", "past_k", "past_v"]
    node = helper.make_node("MultiHeadAttention", names, ["y", "present_k", "present_v"], "fused",
                            domain="com.microsoft", num_heads=h, unidirectional=1)  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, F, shapes[n]) for n in feeds],
        [helper.make_tensor_value_info(n, F, None) for n in node.output],
    )  # fmt: skip
    ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=ops, ir_version=10)
    qh = feeds["q"].reshape(b, s, h, d).transpose(0, 2, 1, 3).astype(np.float64)
    kh = np.concatenate([feeds["past_k"], feeds["k"].reshape(b, s, h, d).transpose(0, 2, 1, 3)], axis=2)
    causal = np.where(np.arange(p + s)[None, :] > np.arange(s)[:, None] + p, -10000.0, 0.0)
    _check_shadow(model, feeds, _np_softmax(qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(d) + causal))
