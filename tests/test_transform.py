"""Rewrites: residual-block skip (dead code really gone) and int8 fake-quant against numpy, with quality."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import real_model_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope import zoo
from onnx_opscope.compare import compare_outputs
from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph.io import load_model, save_model
from onnx_opscope.run.session import RuntimeConfig, make_session
from onnx_opscope.transform import fake_quant, fake_quant_reference, prune, residual_sites, skip_blocks

CFG = RuntimeConfig(graph_opt="disable")


def outputs(model, feeds, base_dir=None) -> dict[str, np.ndarray]:
    sess = make_session(model, CFG, base_dir=base_dir)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@pytest.fixture(scope="module")
def tiny_lm():
    model = zoo.build("transformer_tiny_lm")
    feeds = zoo.example_feeds("transformer_tiny_lm", dims={"batch": 4, "seq": 16})
    return model, feeds, outputs(model, feeds)


# --------------------------------------------------------------------------------------------
# skip


def test_skip_near_identity_block_keeps_outputs(tiny_lm):
    model, feeds, ref = tiny_lm
    before = model.SerializeToString()
    report = skip_blocks(model, ["block2/*"])
    skipped = report.model
    assert model.SerializeToString() == before  # the input is not touched
    assert [s.site for s in report.skipped] == ["block2/attn_residual", "block2/mlp_residual"]
    inits = {t.name for t in skipped.graph.initializer}
    assert not any(n.startswith("block2/") and n != "block2/attn/key_bias" for n in inits)
    assert not any(n.name.startswith("block2/") and n.op_type != "Identity" for n in skipped.graph.node)
    assert report.pruned.ops_removed["MatMul"] == 8 and report.pruned.params_removed > 10_000
    assert [o.name for o in skipped.graph.output] == ["logits"]
    onnx.checker.check_model(skipped)
    q = compare_outputs(ref, outputs(skipped, feeds))["logits"]
    assert q["max_rel"] < 0.01 and q["cosine"] > 0.9999 and q["top1"] >= 0.99


def test_skip_strongest_block_does_not(tiny_lm):
    model, feeds, ref = tiny_lm
    skipped = skip_blocks(model, ["block1/attn_residual", "block1/mlp_residual"]).model
    q = compare_outputs(ref, outputs(skipped, feeds))["logits"]
    assert q["cosine"] < 0.9 and q["top1"] < 0.8


def test_skip_by_index_and_errors(tiny_lm):
    model = tiny_lm[0]
    assert [s.id for s in residual_sites(model)][3] == "block2/mlp_residual"
    report = skip_blocks(model, ["3"])
    assert [s.site for s in report.skipped] == ["block2/mlp_residual"]
    with pytest.raises(OpscopeError, match="did you mean 'block2/mlp_residual'"):
        skip_blocks(model, ["block2/mlp_residul"])
    with pytest.raises(OpscopeError, match="has 4 residual Adds"):
        skip_blocks(model, ["9"])


def test_skip_keeps_external_weights_on_disk(tmp_path, tiny_lm):
    model, feeds, ref = tiny_lm
    src = tmp_path / "src" / "lm.onnx"
    src.parent.mkdir()
    onnx.save(
        model,
        str(src),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="lm.data",
        size_threshold=256,
    )
    report = skip_blocks(src, ["block2/*"])
    skipped = report.model
    assert any(t.data_location == TensorProto.EXTERNAL for t in skipped.graph.initializer)
    assert all(
        t.data_location == TensorProto.EXTERNAL
        for t in skipped.graph.initializer
        if not t.raw_data and t.dims
    )
    assert report.pruned.bytes_removed > 0
    out = save_model(skipped, tmp_path / "out" / "skip.onnx", base_dir=src.parent)
    q = compare_outputs(ref, outputs(out, feeds))["logits"]
    assert q["cosine"] > 0.9999


def test_prune_keeps_outer_scope_references():
    for name in ("loop", "if_model", "scan"):
        m = zoo.build(name)
        copy = onnx.ModelProto()
        copy.CopyFrom(m)
        assert prune(copy).nodes_removed == 0, name
        assert len(copy.graph.initializer) == len(m.graph.initializer), name


# --------------------------------------------------------------------------------------------
# fake-quant


def _matmul_model(x_shape, w: np.ndarray, gemm_trans_a: bool = False) -> onnx.ModelProto:
    if gemm_trans_a:
        node = helper.make_node("Gemm", ["x", "w"], ["y"], "gemm", transA=1)
    else:
        node = helper.make_node("MatMul", ["x", "w"], ["y"], "matmul")
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _per_row_int8(x: np.ndarray) -> np.ndarray:
    """Plain numpy per-row symmetric int8: scale = max|row| / 127."""
    s = np.abs(x).max(axis=-1, keepdims=True) / 127.0
    return np.clip(np.round(x / s), -127, 127) * s


def test_fake_quant_matches_numpy_per_row_int8():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    model = _matmul_model(x.shape, w)
    report = fake_quant(model)
    fq = report.model
    assert [(q.operand, q.kind) for q in report.quantized] == [("A", "activation")]
    y = outputs(fq, {"x": x})["y"]
    ref = _per_row_int8(x.astype(np.float64)) @ w
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.01
    np.testing.assert_allclose(y, fake_quant_reference(x, (-1,)) @ w, rtol=1e-5, atol=1e-6)
    exact = x @ w
    assert 0 < np.linalg.norm(y - exact) / np.linalg.norm(exact) < 0.02  # it did quantize


def test_fake_quant_channel_gemm_and_weights():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    fq = fake_quant(_matmul_model(x.shape, w), mode="channel").model
    np.testing.assert_allclose(
        outputs(fq, {"x": x})["y"], fake_quant_reference(x, (0,)) @ w, rtol=1e-5, atol=1e-6
    )
    report = fake_quant(_matmul_model(x.shape, w), weights=True)
    fq = report.model
    assert [q.kind for q in report.quantized] == ["activation", "weight"]
    want = fake_quant_reference(x, (-1,)) @ fake_quant_reference(w, (0,))  # weights per output column
    np.testing.assert_allclose(outputs(fq, {"x": x})["y"], want, rtol=1e-5, atol=1e-6)
    xt = np.ascontiguousarray(x.T)  # Gemm transA: the activation is [K, M], K on axis 0
    fq = fake_quant(_matmul_model(xt.shape, w, gemm_trans_a=True)).model
    np.testing.assert_allclose(
        outputs(fq, {"x": xt})["y"], fake_quant_reference(xt, (0,)).T @ w, rtol=1e-5, atol=1e-6
    )


def test_fake_quant_inside_loop_body():
    m = zoo.build("loop")
    feeds = zoo.example_feeds("loop")
    report = fake_quant(m, weights=True)
    fq = report.model
    assert any(q.graph for q in report.quantized)  # the body's MatMul
    ref, got = outputs(m, feeds), outputs(fq, feeds)
    for name, q in compare_outputs(ref, got).items():
        assert q["cosine"] > 0.999 and q["max_rel"] > 0, name


def test_fake_quant_on_real_model():
    path = real_model_path("ppocrv4_rec")
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 48, 320)).astype(np.float32)
    ref = outputs(path, {"x": x})
    for mode, weights in (("token", False), ("channel", True)):
        report = fake_quant(path, mode, weights)
        fq = report.model
        assert len([q for q in report.quantized if q.kind == "activation"]) == 17
        q = next(iter(compare_outputs(ref, outputs(fq, {"x": x}, base_dir=path.parent)).values()))
        assert q["cosine"] > 0.999 and q["top1"] >= 0.97 and 0 < q["max_rel"] < 0.1, (mode, q)
    assert load_model(path).graph.node[0].op_type  # the source file is untouched and still loads
