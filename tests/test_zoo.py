"""The generated model zoo: committed files are valid, small, current and run; builders do what they say."""

from __future__ import annotations

import importlib.util
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import ROOT, generated_model_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope import zoo
from onnx_opscope.graph import iter_graphs, load_model

NAMES = list(zoo.MODELS)
CONTRACT = {
    "mlp",
    "transformer_block",
    "transformer_tiny_lm",
    "moe",
    "cnn",
    "gru",
    "loop",
    "scan",
    "if_model",
    "opset11_mlp",
    "opset21_mlp",
    "quantized",
    "attention_contrib",
    "bool_int_inputs",
}


def session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    src = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every initializer of the model, subgraphs included, by name."""
    return {t.name: numpy_helper.to_array(t) for _, g in iter_graphs(model.graph) for t in g.initializer}


def with_outputs(
    model: onnx.ModelProto, names: list[str], elem_type: int = TensorProto.FLOAT
) -> onnx.ModelProto:
    """A copy of `model` that also returns the intermediate tensors `names`."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.extend(helper.make_tensor_value_info(n, elem_type, None) for n in names)
    return out


def zeroed(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    hit = set()
    for t in out.graph.initializer:
        if t.name in names:
            t.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(t)), t.name))
            hit.add(t.name)
    assert hit == names
    return out


def uses_contrib(model: onnx.ModelProto) -> bool:
    return any(n.domain == "com.microsoft" for _, g in iter_graphs(model.graph) for n in g.node)


# ---- every committed model -----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_committed_model_is_valid_small_and_current(name: str) -> None:
    path = generated_model_path(name)
    assert path.stat().st_size < 1_000_000
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=not uses_contrib(model))
    assert path.read_bytes() == zoo.build(name).SerializeToString(deterministic=True), (
        f"{path.name} is stale: run `python scripts/make_models.py`"
    )
    names = [n.name for _, g in iter_graphs(model.graph) for n in g.node]
    assert all(names) and len(set(names)) == len(names), "node names must be unique and non-empty"


@pytest.mark.parametrize("name", NAMES)
def test_committed_model_runs_with_finite_outputs(name: str) -> None:
    model = onnx.load(str(generated_model_path(name)))
    feeds = zoo.example_feeds(name, seed=1, model=model)
    outs = session(model).run(None, feeds)
    assert len(outs) == len(model.graph.output)
    for vi, arr in zip(model.graph.output, outs, strict=True):
        assert np.isfinite(arr).all(), vi.name
        dims = vi.type.tensor_type.shape.dim
        assert arr.ndim == len(dims)
        for d, n in zip(dims, arr.shape, strict=True):
            if d.HasField("dim_value"):
                assert n == d.dim_value, (vi.name, arr.shape)


def test_contract_names_opsets_and_ir() -> None:
    assert set(NAMES) == CONTRACT
    expect = {
        "mlp": (17, 8),
        "opset11_mlp": (11, 6),
        "opset21_mlp": (21, 10),
        "cnn": (13, None),
        "gru": (14, None),
        "loop": (16, None),
        "quantized": (13, None),
    }
    for name, (opset, ir) in expect.items():
        m = zoo.build(name)
        assert [o.version for o in m.opset_import if o.domain in ("", "ai.onnx")] == [opset]
        if ir is not None:
            assert m.ir_version == ir
    domains = {o.domain: o.version for o in zoo.build("attention_contrib").opset_import}
    assert domains == {"": 17, "com.microsoft": 1}


def test_example_feeds_respect_tables_and_types() -> None:
    f = zoo.example_feeds("bool_int_inputs", dims={"batch": 64})
    assert f["ids"].dtype == np.int32 and f["ids"].shape == (64, 8)
    assert f["ids"].min() >= 0 and f["ids"].max() < 50 and f["ids"].max() > 40
    assert f["mask"].dtype == np.bool_ and f["mask"].any() and not f["mask"].all()
    assert f["scale"].shape == () and f["scale"].dtype == np.float32
    ids = zoo.example_feeds("transformer_tiny_lm", dims={"batch": 8, "seq": 64})["input_ids"]
    assert ids.dtype == np.int64 and ids.max() < 100


# ---- behaviour of particular models --------------------------------------------------------


def test_mlp_matches_numpy_forward() -> None:
    model = onnx.load(str(generated_model_path("mlp")))
    w = weights(model)
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    (got,) = session(model).run(None, {"x": x})
    h = np.maximum(x @ w["fc1.weight"] + w["fc1.bias"], 0)
    h = h @ w["fc2.weight"] + w["fc2.bias"]
    want = h @ w["head.weight"].T + w["head.bias"]
    assert got.shape == (5, 10)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 2 and "Relu" in ops
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    assert helper.get_attribute_value(next(a for a in gemm.attribute if a.name == "transB")) == 1


def test_moe_router_favours_experts_0_and_1() -> None:
    model = onnx.load(str(generated_model_path("moe")))
    w = weights(model)
    x = zoo.example_feeds("moe", dims={"tokens": 1024}, seed=5)["x"]
    y, probs, top_idx = session(
        with_outputs(
            with_outputs(model, ["router/softmax_output_0"]), ["router/topk_output_1"], TensorProto.INT64
        )
    ).run(None, {"x": x})
    logits = x @ w["router.weight"] + w["router.bias"]
    ref = np.exp(logits - logits.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    np.testing.assert_allclose(probs, ref, rtol=1e-4, atol=1e-6)
    load = np.bincount(top_idx.ravel(), minlength=8) / top_idx.size
    assert load[0] + load[1] > 0.8, load
    assert load[0] > 0.3 and load[1] > 0.3
    assert load[7] < 0.005 and probs[:, 7].mean() < 1e-3
    # the output really is the TopK-weighted sum of the gathered experts
    vals = np.take_along_axis(probs, top_idx, axis=1)
    want = np.einsum("td,tkde,tk->te", x, w["experts.weight"][top_idx], vals)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


def test_tiny_lm_key_zero_is_an_attention_sink() -> None:
    model = zoo.transformer_tiny_lm()
    names = ["block1/attn/softmax_output_0", "block2/attn/softmax_output_0"]
    feeds = zoo.example_feeds("transformer_tiny_lm", dims={"batch": 4, "seq": 32}, model=model)
    _, p1, p2 = session(with_outputs(model, names)).run(None, feeds)
    for p in (p1, p2):
        assert p.shape == (4, 2, 32, 32)
        np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
        assert np.triu(p[0, 0], k=1).max() < 1e-3  # causal
        sink = p[:, :, 1:, 0]  # queries that could look elsewhere
        assert sink.mean() > 0.5, sink.mean()
        per_key = p[:, :, 1:, :].mean(axis=(0, 1, 2))  # mean mass each key receives
        assert per_key[0] > 5 * per_key[1:].max()


def test_tiny_lm_block2_is_near_identity_and_block1_is_not() -> None:
    model = zoo.transformer_tiny_lm()
    feeds = zoo.example_feeds("transformer_tiny_lm", dims={"batch": 4, "seq": 24}, model=model)
    (base,) = session(model).run(None, feeds)

    def rel_change(block: int) -> float:
        branch = {
            f"block{block}/attn/o_proj.weight",
            f"block{block}/attn/o_proj.bias",
            f"block{block}/mlp/fc2.weight",
            f"block{block}/mlp/fc2.bias",
        }
        (out,) = session(zeroed(model, branch)).run(None, feeds)
        return float(np.abs(out - base).max() / np.abs(base).max())

    assert rel_change(2) < 5e-3
    assert rel_change(1) > 0.1


@pytest.mark.parametrize("flag", [True, False])
def test_if_model_branches_match_numpy(flag: bool) -> None:
    model = onnx.load(str(generated_model_path("if_model")))
    w = weights(model)
    sess = session(model)
    inner_taken = set()
    for seed in range(12):
        x = np.random.default_rng(seed).standard_normal((3, 16)).astype(np.float32)
        (got,) = sess.run(None, {"x": x, "flag": np.array(flag)})
        if flag:
            r = np.maximum(x @ w["then.weight"], 0)
            inner = bool(r.mean() > w["inner.threshold"])
            inner_taken.add(inner)
            want = r @ w["inner_then.weight"] if inner else 2 * r
        else:
            want = x @ w["else.weight"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if flag:
        assert inner_taken == {True, False}, "both nested branches should be reachable"
    depth = max(p.count("/") for p, _ in iter_graphs(model.graph))
    assert depth >= 2  # an If inside an If branch


def test_loop_and_scan_match_numpy() -> None:
    model = onnx.load(str(generated_model_path("loop")))
    w = weights(model)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    final, scans = session(model).run(None, {"x": x})
    state, want_scans = x, []
    for _ in range(3):
        mm = state @ w["loop.weight"]
        want_scans.append(mm)
        state = np.tanh(mm + w["loop.bias"])
    np.testing.assert_allclose(final, state, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scans, np.stack(want_scans), rtol=1e-5, atol=1e-6)

    model = onnx.load(str(generated_model_path("scan")))
    w = weights(model)
    x = np.random.default_rng(1).standard_normal((2, 7, 16)).astype(np.float32)
    h_final, ys = session(model).run(None, {"x": x})
    h, want = x.mean(1), []
    for t in range(7):
        h = np.tanh(x[:, t] @ w["cell.wx"] + h @ w["cell.wh"])
        want.append(h)
    np.testing.assert_allclose(h_final, h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ys, np.stack(want, axis=1), rtol=1e-5, atol=1e-6)


def test_quantized_paths_approximate_their_float_matmuls() -> None:
    model = onnx.load(str(generated_model_path("quantized")))
    w = weights(model)
    x = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    names = ["a/mul_w_scale_output_0", "b/dequantize_output_0", "c/matmul_output_0"]
    y, a, b, c = session(with_outputs(model, names)).run(None, {"x": x})
    ops = {n.op_type for n in model.graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger", "QuantizeLinear", "QLinearMatMul"} <= ops
    for got, wq, scale in (
        (a, "mmi.weight", "mmi.scale"),
        (b, "qlm.weight", "qlm.scale"),
        (c, "dq.weight", "dq.scale"),
    ):
        assert w[wq].dtype == np.int8
        want = x @ (w[wq].astype(np.float32) * w[scale])
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 0.05, (wq, err)
    np.testing.assert_allclose(y, a + b + c, rtol=1e-5, atol=1e-5)


def test_old_and_new_opset_mlps_compute_the_same() -> None:
    m11, m21 = (
        onnx.load(str(generated_model_path("opset11_mlp"))),
        onnx.load(str(generated_model_path("opset21_mlp"))),
    )
    reduce11 = next(n for n in m11.graph.node if n.op_type == "ReduceMean")
    reduce21 = next(n for n in m21.graph.node if n.op_type == "ReduceMean")
    assert [a.name for a in reduce11.attribute if a.name == "axes"] == ["axes"] and len(reduce11.input) == 1
    assert not [a for a in reduce21.attribute if a.name == "axes"] and len(reduce21.input) == 2
    x = np.random.default_rng(4).standard_normal((6, 32)).astype(np.float32)
    (p11,), (p21,) = session(m11).run(None, {"x": x}), session(m21).run(None, {"x": x})
    np.testing.assert_allclose(p11, p21, rtol=1e-6)
    np.testing.assert_allclose(p11.sum(1), 1.0, rtol=1e-5)


def test_bool_int_inputs_mask_and_scale() -> None:
    model = onnx.load(str(generated_model_path("bool_int_inputs")))
    w = weights(model)
    f = zoo.example_feeds("bool_int_inputs", seed=3, model=model)
    (y,) = session(model).run(None, f)
    want = w["embed.weight"][f["ids"]] @ w["proj.weight"] * f["mask"][..., None] * f["scale"]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert (y[~f["mask"]] == 0).all()


# ---- run-time builders ---------------------------------------------------------------------


def test_bert_like_mask_hides_padded_tokens() -> None:
    model = zoo.bert_like(hidden=64, layers=2, heads=4, vocab=50, max_seq=16)
    onnx.checker.check_model(model, full_check=True)
    assert "LayerNormalization" not in {n.op_type for n in model.graph.node}  # decomposed, opset-12 style
    assert any(
        t.name.startswith("bert_like/const") and numpy_helper.to_array(t).item() == zoo.F32_MIN
        for t in model.graph.initializer
        if not t.dims
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (2, 10))
    mask = np.ones((2, 10), np.int64)
    mask[:, 7:] = 0
    sess = session(model)
    (a,) = sess.run(None, {"input_ids": ids, "attention_mask": mask})
    ids2 = ids.copy()
    ids2[:, 7:] = rng.integers(0, 50, (2, 3))
    (b,) = sess.run(None, {"input_ids": ids2, "attention_mask": mask})
    assert a.shape == (2, 10, 64) and np.isfinite(a).all()
    np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=1e-5, atol=1e-5)
    assert np.abs(a[:, 7:] - b[:, 7:]).max() > 1e-2


def test_gpt2_like_is_causal() -> None:
    model = zoo.gpt2_like(hidden=32, layers=2, heads=4, vocab=60, max_seq=32)
    onnx.checker.check_model(model, full_check=True)
    ids = np.random.default_rng(0).integers(0, 60, (2, 9))
    sess = session(model)
    (a,) = sess.run(None, {"input_ids": ids})
    ids[:, -1] = (ids[:, -1] + 1) % 60
    (b,) = sess.run(None, {"input_ids": ids})
    assert a.shape == (2, 9, 60) and np.isfinite(a).all()
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], rtol=1e-5, atol=1e-5)
    assert np.abs(a[:, -1] - b[:, -1]).max() > 1e-3


def test_resnet_like_runs() -> None:
    model = zoo.resnet_like(blocks=3, width=8)
    onnx.checker.check_model(model, full_check=True)
    assert sum(n.name.endswith("/residual") for n in model.graph.node) == 3
    (y,) = session(model).run(None, zoo.feeds_for(model, seed=0))
    assert y.shape == (2, 10) and np.isfinite(y).all() and y.std() > 0


def test_wide_graph_has_the_asked_node_count() -> None:
    model = zoo.wide_graph(2000)
    assert abs(len(model.graph.node) - 2000) <= 20
    onnx.checker.check_model(model, full_check=True)
    assert {n.op_type for n in model.graph.node} >= {"MatMul", "Add", "Mul"}
    (y,) = session(model).run(None, zoo.feeds_for(model))
    assert y.shape == (2, 16) and np.isfinite(y).all()
    for n in (1, 2, 7):
        small = zoo.wide_graph(n)
        onnx.checker.check_model(small, full_check=True)
        assert len(small.graph.node) == n


def test_external_weights_model_runs_and_stays_small(tmp_path: Path) -> None:
    total = 4 * 1024**2
    path = zoo.write_external_weights_model(tmp_path, total_bytes=total, n_tensors=4)
    assert path == tmp_path / "big.onnx"
    data = tmp_path / "big.onnx.data"
    assert path.stat().st_size < 16 * 1024
    assert 0.9 * total <= data.stat().st_size <= total + 4 * 65536
    model = load_model(path)  # checks every location/offset/length against the data file
    onnx.checker.check_model(str(path))
    d = model.graph.initializer[0].dims[0]
    x = np.random.default_rng(0).standard_normal((1, d)).astype(np.float32)
    (y,) = session(path).run(None, {"x": x})
    want = x.astype(np.float64)
    for t in model.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        assert t.data_location == TensorProto.EXTERNAL and int(info["offset"]) % 4096 == 0
        w = np.fromfile(data, dtype="<f4", count=d * d, offset=int(info["offset"])).reshape(d, d)
        want = want @ w
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    assert 0.5 < np.linalg.norm(y) / np.linalg.norm(x) < 2  # variance-1/d weights keep the scale


def test_external_weights_are_written_in_chunks(tmp_path: Path) -> None:
    tracemalloc.start()
    try:
        zoo.write_external_weights_model(tmp_path, total_bytes=48 * 1024**2, n_tensors=3, chunk_bytes=1024**2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024**2, f"peak {peak / 2**20:.1f} MiB for 48 MiB of weights"


def test_make_models_script_writes_models_and_readme(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_models", ROOT / "scripts" / "make_models.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["mlp", "moe", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.onnx")) == ["mlp.onnx", "moe.onnx"]
    readme = (tmp_path / "README.md").read_text(encoding="utf-8")
    for name in NAMES:
        assert f"| `{name}` |" in readme
    assert "`ids` int32 [batch, 8]" in readme and "`flag` bool []" in readme
    assert script.main(["--check", "--out", str(tmp_path)]) == 1  # the other models are missing there
    assert script.main(["--check"]) == 0, "models/ is stale: run `python scripts/make_models.py`"
