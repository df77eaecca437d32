"""`per_token`: a decoder's prefill and decode-step costs as polynomials, held against hand formulas.

Two decoders: a one-layer attention decoder with a past KV cache written here with onnx.helper
(every FLOP countable by hand), and SmolLM2-135M's first 2 layers exported by
scripts/make_decoder.py (its config, in build.json, gives the formulas). The KV bytes per token are
also measured on the presents onnxruntime returns for a real prefill.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import ROOT, decoder_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope import OpscopeError, analyze
from onnx_opscope.analysis.bandwidth import Measured
from onnx_opscope.analysis.decoder import per_token
from onnx_opscope.cli import main
from onnx_opscope.shapes import Poly

SEQ, PAST = Poly.symbol("seq"), Poly.symbol("past")
V, E, H, D = 50, 16, 2, 8  # the hand-built decoder: vocabulary, hidden, heads, head dim
HD = H * D
PROJ = 3 * E * HD + HD * E + E * V  # weights of its MatMuls: q, k, v, o and the LM head


def tiny_decoder(named: bool = True) -> onnx.ModelProto:
    """embed -> q/k/v -> concat the past -> softmax(q k^T) v -> o -> LM head, one layer, no scale or mask.

    `named`: the cache's sequence axes are called past / total, else left unnamed (no dim_param)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("emb", [V, E]), ("wq", [E, HD]), ("wk", [E, HD]), ("wv", [E, HD]), ("wo", [HD, E]),
                          ("lm", [E, V]))]  # fmt: skip
    inits += [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("heads", [0, 0, H, D]), ("flat", [0, 0, HD]))
    ]
    n = helper.make_node
    nodes = [n("Gather", ["emb", "input_ids"], ["x"])]
    for w in "qkv":
        nodes += [n("MatMul", ["x", f"w{w}"], [f"{w}2"]), n("Reshape", [f"{w}2", "heads"], [f"{w}4"]),
                  n("Transpose", [f"{w}4"], [f"{w}h"], perm=[0, 2, 1, 3])]  # fmt: skip
    nodes += [
        n("Concat", ["past_key_values.0.key", "kh"], ["present.0.key"], axis=2),
        n("Concat", ["past_key_values.0.value", "vh"], ["present.0.value"], axis=2),
        n("Transpose", ["present.0.key"], ["kt"], perm=[0, 1, 3, 2]),
        n("MatMul", ["qh", "kt"], ["scores"]),
        n("Softmax", ["scores"], ["probs"], axis=-1),
        n("MatMul", ["probs", "present.0.value"], ["ctx"]),
        n("Transpose", ["ctx"], ["ctx2"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx2", "flat"], ["ctx3"]),
        n("MatMul", ["ctx3", "wo"], ["o"]),
        n("MatMul", ["o", "lm"], ["logits"]),
    ]
    past, present = (
        (["batch", H, "past", D], ["batch", H, "total", D]) if named else (["batch", H, None, D],) * 2
    )
    vi = helper.make_tensor_value_info
    inputs = [
        vi("input_ids", TensorProto.INT64, ["batch", "seq"]),
        vi("attention_mask", TensorProto.INT64, ["batch", "total"]),
        vi("past_key_values.0.key", TensorProto.FLOAT, past),
        vi("past_key_values.0.value", TensorProto.FLOAT, past),
    ]
    outputs = [vi("logits", TensorProto.FLOAT, ["batch", "seq", V]), vi("present.0.key", TensorProto.FLOAT, present),
               vi("present.0.value", TensorProto.FLOAT, present)]  # fmt: skip
    graph = helper.make_graph(nodes, "tiny_decoder", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(scope="session")
def decoder():
    """The 2-layer SmolLM2 decoder, built once and cached beside the real models."""
    return decoder_path()


@pytest.fixture(scope="session")
def smollm(decoder):
    return per_token(decoder, seq=512, past=1024)


@pytest.fixture(scope="session")
def config(decoder):
    return json.loads((decoder.parent / "build.json").read_text())["config"]


def test_hand_built_decoder_matches_the_hand_formulas():
    costs = per_token(tiny_decoder(), seq=64, past=100)
    pre, dec = costs.prefill, costs.decode
    # projections 2 x weights per token; scores and values 2 x head_dim each per (query, key) pair and head
    assert pre.flops_by_op["MatMul"] == 2 * PROJ * SEQ + 4 * H * D * SEQ * SEQ
    assert dec.flops_by_op["MatMul"] == 2 * PROJ + 4 * H * D * (PAST + 1)
    # softmax: max, sub, exp, sum, div per score; nothing else here computes
    assert pre.flops_poly == pre.flops_by_op["MatMul"] + 5 * H * SEQ * SEQ
    assert dec.flops_poly == dec.flops_by_op["MatMul"] + 5 * H * (PAST + 1)
    # every weight read once a step, the embedding one row per token
    assert pre.weight_bytes_poly == 4 * PROJ + 4 * E * SEQ
    assert dec.weight_bytes_poly == 4 * PROJ + 4 * E
    assert costs.kv_bytes_per_token == 2 * 1 * H * D * 4
    # the numbers are the polynomials at the lengths asked, per token over the tokens produced
    s, p = 64, 100
    assert pre.flops == 2 * PROJ * s + 4 * H * D * s * s + 5 * H * s * s
    assert pre.flops_per_token == pytest.approx(pre.flops / s)
    assert dec.flops == 2 * PROJ + 4 * H * D * (p + 1) + 5 * H * (p + 1)
    assert dec.intensity == pytest.approx(dec.flops / dec.bytes)
    assert costs.symbols == {"batch": ["batch"], "seq": ["seq"], "past": ["past"], "total": ["total"]}


def test_unnamed_cache_axes_are_recognised():
    """Exporters that leave the cache's sequence axes unnamed: the same polynomials as the named graph's."""
    named, unnamed = (
        per_token(tiny_decoder(), seq=64, past=100),
        per_token(tiny_decoder(named=False), seq=64, past=100),
    )
    assert unnamed.symbols["past"] == ["past_key_values_0_key_2", "past_key_values_0_value_2"]
    for a, b in zip(named.phases, unnamed.phases, strict=True):
        assert (a.flops_poly, a.bytes_poly, a.flops, a.bytes) == (
            b.flops_poly,
            b.bytes_poly,
            b.flops,
            b.bytes,
        )
    assert unnamed.kv_bytes_per_token == named.kv_bytes_per_token


def test_polynomials_equal_the_analysis_at_concrete_dims():
    """The substitution (total = seq + past, then past = 0 or seq = 1) against analyze fed those numbers."""
    model = tiny_decoder()
    costs = per_token(model, seq=37, past=211, batch=3)
    for phase, dims in ((costs.prefill, {"seq": 37, "past": 0, "total": 37}),
                        (costs.decode, {"seq": 1, "past": 211, "total": 212})):  # fmt: skip
        totals = analyze(model, dims={"batch": 3, **dims}).totals
        assert phase.flops == totals["flops"] and phase.bytes == totals["bytes"]
    assert costs.decode.tokens == 3 and costs.prefill.tokens == 3 * 37
    assert costs.kv_cache_bytes(10) == 3 * 10 * costs.kv_bytes_per_token


def test_smollm2_matches_its_config(smollm, config):
    layers, h, inter, heads, kv_heads, vocab = (config[k] for k in ("layers", "hidden", "intermediate", "heads",
                                                                     "kv_heads", "vocab"))  # fmt: skip
    hd = h // heads
    proj = (
        layers * (2 * h * h + 2 * h * kv_heads * hd + 3 * h * inter) + h * vocab
    )  # q, o, k, v, MLP, LM head
    attn = 4 * layers * heads * hd  # per (query, key) pair: scores and values
    assert smollm.prefill.flops_by_op["MatMul"] == 2 * proj * SEQ + attn * SEQ * SEQ
    assert smollm.decode.flops_by_op["MatMul"] == 2 * proj + attn * (PAST + 1)
    assert smollm.kv_bytes_per_token == 2 * layers * kv_heads * hd * 4
    # a decode step reads every weight (norm scales and shape constants beside the MatMuls: < 0.1%)
    assert 4 * proj <= smollm.decode.weight_bytes < 4 * proj * 1.001
    assert smollm.prefill.weight_bytes - smollm.decode.weight_bytes == 4 * h * (512 - 1)  # embedding rows
    assert smollm.params == pytest.approx(proj + 5 * h, rel=1e-3)


def test_decode_is_memory_bound_and_prefill_compute_bound(smollm):
    pre, dec = smollm.prefill, smollm.decode
    assert dec.roofline == "memory" and pre.roofline == "compute"  # on the cpu preset, ridge 16
    assert dec.intensity < 1 < smollm.device.ridge < pre.intensity
    assert dec.intensity < pre.intensity / 50
    # the decode step's bytes are mostly the weights: its time is the weights over the bandwidth
    assert dec.weight_bytes / dec.bytes > 0.7
    assert dec.est_time_s == pytest.approx(dec.bytes / smollm.device.bandwidth)


def test_kv_bytes_per_token_are_those_of_the_presents(decoder, smollm):
    session = ort.InferenceSession(str(decoder), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 9690, 198, 2683, 359]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    feeds |= {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs()[2:]}
    names = [o.name for o in session.get_outputs() if o.name.startswith("present.")]
    presents = session.run(names, feeds)
    assert sorted(smollm.kv_bytes) == sorted(names)
    assert sum(a.nbytes for a in presents) == smollm.kv_bytes_per_token * ids.shape[1]
    assert {n: a.nbytes // ids.shape[1] for n, a in zip(names, presents, strict=True)} == smollm.kv_bytes


def test_the_ridge_decides_the_class():
    model = tiny_decoder()
    fast_memory = per_token(model, seq=512, ridge=1e-3)
    assert fast_memory.prefill.roofline == fast_memory.decode.roofline == "compute"
    slow_memory = Measured("CPUExecutionProvider", bandwidth=1e9, peak_flops=1e13, source="test")
    measured = per_token(model, seq=512, measured=slow_memory)
    assert measured.device.ridge == 1e4 and measured.prefill.roofline == "memory"
    assert measured.decode.est_time_s == pytest.approx(measured.decode.bytes / 1e9)


def test_not_a_decoder(tmp_path):
    plain = tiny_decoder()
    del plain.graph.input[2:]  # no past inputs
    with pytest.raises(OpscopeError) as err:
        per_token(plain)
    message = str(err.value)
    assert "not a decoder" in message and "input_ids" in message and "attention_mask" in message
    assert "\n" not in message and "past_key_values" in err.value.hint
    static = tiny_decoder()
    static.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 4
    with pytest.raises(
        OpscopeError, match=r"not \[batch, seq\] with a symbolic seq; inputs: input_ids int64\[batch, 4\]"
    ):
        per_token(static)
    with pytest.raises(OpscopeError, match="sets the batch, sequence and past itself"):
        per_token(tiny_decoder(), dims={"seq": 4})
    with pytest.raises(OpscopeError, match="seq must be a positive"):
        per_token(tiny_decoder(), seq=0)


def test_cli(tmp_path, capsys):
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_decoder(), path)
    assert main(["analyze", str(path), "--decoder", "--seq", "64", "--past", "32"]) == 0
    printed = capsys.readouterr().out
    assert "prefill" in printed and "decode" in printed and "128 B per token" in printed
    assert main(["analyze", str(path), "--decoder", "--seq", "64", "--past", "32", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == json.loads(per_token(str(path), seq=64, past=32).to_json())
    assert [p["phase"] for p in got["phases"]] == ["prefill", "decode"]
    out = tmp_path / "costs.csv"
    assert main(["analyze", str(path), "--decoder", "-o", str(out), "--format", "csv", "-q"]) == 0
    assert out.read_text().count("\n") == 3  # header and one row per phase
    assert main(["analyze", str(path), "--seq", "64"]) == 2
    assert main(["analyze", str(path), "--decoder", "--motifs"]) == 2
    assert main(["analyze", str(ROOT / "models" / "mlp.onnx"), "--decoder"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and "need --decoder" in err and "not a decoder" in err
