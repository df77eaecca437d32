"""Sessions: providers by name with clear refusals and a working fallback, in-memory models
with external data, and model failures reported as one line naming the node."""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import real_model_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph.io import load_model
from onnx_opscope.run import session as runtime
from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds
from onnx_opscope.run.session import (
    CPU,
    ProviderFallbackWarning,
    RuntimeConfig,
    for_tapped,
    make_session,
    resolve_providers,
    run,
    session_signature,
)

AVAILABLE = ort.get_available_providers()
REAL_SPECS = {
    "ppocrv4_rec": FeedSpec(shapes={"x": [1, 3, 48, 320]}),
    "ppocrv4_det": FeedSpec(),
    "silero_vad_v6": FeedSpec(shapes={"input": [1, 512], "state": [2, 1, 128]}, values={"sr": 16000}),
    "captcha_crnn": FeedSpec(),
    "magika_standard_v3_3": FeedSpec(),
}


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


# ---------------------------------------------------------------------------------------------
# Providers


def test_provider_names():
    assert resolve_providers("cpu") == [CPU]
    assert resolve_providers(" CPU ") == [CPU]
    assert resolve_providers("CPUExecutionProvider") == [CPU]
    assert resolve_providers(["cpu", "cpu"]) == [CPU]
    assert resolve_providers("") == [CPU]
    with pytest.raises(OpscopeError) as e:
        resolve_providers("cdua")
    assert "'cdua'" in one_line(e) and "did you mean 'cuda'" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        resolve_providers("cpu,quantum")
    assert "'quantum'" in one_line(e) and "cuda" in one_line(e)


@pytest.mark.parametrize(
    "short, full", [("cuda", "CUDAExecutionProvider"), ("coreml", "CoreMLExecutionProvider")]
)
def test_unavailable_provider_is_refused_with_the_available_ones(short, full):
    if full in AVAILABLE:
        pytest.skip(f"{full} is available here")
    with pytest.raises(OpscopeError) as e:
        resolve_providers(f"{short},cpu")
    text = one_line(e)
    assert full in text and "not available" in text and all(p in text for p in AVAILABLE)
    assert "--fallback" in e.value.hint
    with pytest.raises(OpscopeError):
        make_session(real_model_path("magika_standard_v3_3"), RuntimeConfig(providers=short))


@pytest.mark.parametrize(
    "short, full", [("cuda", "CUDAExecutionProvider"), ("coreml", "CoreMLExecutionProvider")]
)
def test_fallback_drops_unavailable_and_keeps_cpu_last(short, full):
    if full in AVAILABLE:
        pytest.skip(f"{full} is available here")
    with pytest.warns(ProviderFallbackWarning, match=full):
        assert resolve_providers(short, fallback=True) == [CPU]
    with pytest.warns(ProviderFallbackWarning):
        assert resolve_providers(f"{short},cpu", fallback=True) == [CPU]
    config = RuntimeConfig(providers=short, fallback=True)
    with pytest.warns(ProviderFallbackWarning):
        session = make_session(real_model_path("magika_standard_v3_3"), config)
    assert session.get_providers() == [CPU]
    record = config.to_record(session)
    assert record["providers"] == [CPU] and record["providers_requested"] == [short]
    path = real_model_path("magika_standard_v3_3")
    (out,) = run(session, synthetic_feeds(path))
    assert np.all(np.isfinite(out))


def test_no_warning_when_nothing_is_dropped():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_providers("cpu", fallback=True) == [CPU]


# ---------------------------------------------------------------------------------------------
# Config


def test_runtime_config_and_record():
    config = RuntimeConfig(providers="cpu", graph_opt="basic", threads=2)
    so = config.session_options()
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert so.intra_op_num_threads == 2
    record = config.to_record()
    assert record == {
        "providers": [CPU],
        "providers_requested": ["cpu"],
        "graph_opt": "basic",
        "threads": 2,
        "fallback": False,
        "mem_pattern": True,
        "execution_order": "default",
        "onnxruntime": ort.__version__,
    }
    assert so.enable_mem_pattern and not RuntimeConfig(mem_pattern=False).session_options().enable_mem_pattern
    tapped = for_tapped(RuntimeConfig(threads=2))
    assert (tapped.threads, tapped.mem_pattern, tapped.execution_order) == (2, True, "priority")
    assert tapped.session_options().execution_order == ort.ExecutionOrder.PRIORITY_BASED
    with pytest.raises(OpscopeError) as e:
        RuntimeConfig(execution_order="fast")
    assert "unknown execution order 'fast'" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        RuntimeConfig(graph_opt="extnded")
    assert "did you mean 'extended'" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        RuntimeConfig(threads=0)
    assert "threads" in one_line(e)


# ---------------------------------------------------------------------------------------------
# Sessions and external data


def external_model(folder) -> tuple[str, np.ndarray]:
    """A MatMul whose weight lives in `weights.bin` beside the model."""
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 100
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = os.path.join(folder, "ext.onnx")
    onnx.save(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    return path, w


def test_in_memory_model_with_external_data(tmp_path, monkeypatch):
    path, w = external_model(tmp_path)
    proto = load_model(path)
    assert proto.graph.initializer[0].data_location == TensorProto.EXTERNAL  # weights stayed on disk
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the data must be found from base_dir, not from the working folder
    before = sorted(p.name for p in tmp_path.rglob("*"))
    session = make_session(proto, base_dir=tmp_path)
    x = np.random.default_rng(0).standard_normal((2, 64), dtype=np.float32)
    (y,) = run(session, {"x": x})
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-4)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing copied or left behind
    assert os.stat(tmp_path / "weights.bin").st_nlink == 1
    with pytest.raises(OpscopeError) as e:
        make_session(proto)
    assert "base_dir" in one_line(e)


def test_external_data_through_hard_links_when_the_key_is_ignored(tmp_path, monkeypatch):
    path, w = external_model(tmp_path)
    proto = load_model(path)
    monkeypatch.setattr(runtime, "_EXTERNAL_FOLDER_KEY", "session.opscope_test_unknown_key")
    monkeypatch.chdir(tmp_path.parent)
    session = make_session(proto, base_dir=tmp_path)
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(run(session, {"x": x})[0], x @ w, rtol=1e-5)
    assert os.stat(tmp_path / "weights.bin").st_nlink == 1  # the temporary link is gone


def test_in_memory_and_path_sessions_agree():
    path = real_model_path("captcha_crnn")
    feeds = synthetic_feeds(path)
    a = run(make_session(path), feeds)[0]
    b = run(make_session(load_model(path)), feeds)[0]
    np.testing.assert_array_equal(a, b)


def test_session_creation_failures_are_one_line(tmp_path):
    bad = helper.make_model(
        helper.make_graph(
            [helper.make_node("NoSuchOp", ["x"], ["y"], name="weird")],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    bad.ir_version = 8
    with pytest.raises(OpscopeError) as e:
        make_session(bad)
    assert "onnxruntime cannot load the model" in one_line(e) and "NoSuchOp" in one_line(e)
    onnx.save(bad, tmp_path / "bad.onnx")
    with pytest.raises(OpscopeError) as e:
        make_session(tmp_path / "bad.onnx")
    assert "bad.onnx" in one_line(e) and "NoSuchOp" in one_line(e)
    (tmp_path / "junk.onnx").write_bytes(b"\x00junk")
    with pytest.raises(OpscopeError) as e:
        make_session(tmp_path / "junk.onnx")
    assert "not an ONNX model" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        make_session(tmp_path / "missing.onnx")
    assert "no such file" in one_line(e)


# ---------------------------------------------------------------------------------------------
# Running


def test_every_real_model_runs(real_model):
    spec = REAL_SPECS[real_model.stem]
    config = RuntimeConfig()
    session = make_session(real_model, config)
    assert [s.name for s in session_signature(session)] == list(synthetic_feeds(real_model, spec))
    outputs = run(session, synthetic_feeds(real_model, spec, step=1))
    assert outputs and all(np.all(np.isfinite(o)) for o in outputs)
    assert config.to_record(session)["providers"] == [CPU]


def test_magika_runs_on_its_default_range():
    path = real_model_path("magika_standard_v3_3")
    feeds = synthetic_feeds(path)
    assert feeds["bytes"].max() > 16  # the default rule found [0, 257), not the generic [0, 16)
    (probs,) = run(make_session(path), feeds)
    assert probs.shape == (1, 214) and np.all(np.isfinite(probs))


def test_det_with_wrong_size_fails_in_one_line():
    session = make_session(real_model_path("ppocrv4_det"))
    with pytest.raises(OpscopeError) as e:
        run(session, {"x": np.zeros((1, 3, 100, 100), np.float32)})
    text = one_line(e)
    assert text.startswith("the model itself failed in node '")
    assert "x float32[1,3,100,100]" in text and "broadcast" in text
    assert "onnxruntime_src" not in text and "::" not in text  # no C++ source noise
    assert "multiples" in e.value.hint and "x:1,3,96,96" in e.value.hint


def test_failure_inside_a_subgraph_names_the_inner_node():
    session = make_session(real_model_path("silero_vad_v6"))
    feeds = {
        "input": np.zeros((1, 64), np.float32),  # too short for its STFT padding
        "state": np.zeros((2, 1, 128), np.float32),
        "sr": np.array(16000, np.int64),
    }
    with pytest.raises(OpscopeError) as e:
        run(session, feeds)
    assert "Pad" in one_line(e) and "inside If 'If_0'" in one_line(e)


def test_run_checks_feeds_and_output_names():
    session = make_session(real_model_path("ppocrv4_rec"))
    x = np.zeros((1, 3, 48, 320), np.float32)
    with pytest.raises(OpscopeError) as e:
        run(session, {"X": x})
    assert "did you mean 'x'" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        run(session, {"x": x.astype(np.float64)})
    assert "float64" in one_line(e) and "float32" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        run(session, {"x": x[0]})
    assert "rank 4" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        run(session, {"x": x}, output_names=["softmax"])
    assert "'softmax'" in one_line(e) and "softmax_11.tmp_0" in one_line(e)
    (out,) = run(session, {"x": x}, output_names=["softmax_11.tmp_0"])
    assert out.shape == (1, 40, 6625)


BROADCAST = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Add node. "
    "Name:'a' Status Message: "
    "/onnxruntime_src/onnxruntime/core/providers/cpu/math/element_wise_ops.h:563 "
    "void onnxruntime::BroadcastIterator::Init(ptrdiff_t, ptrdiff_t) "
    "axis == 1 || axis == largest was false. "
    "Attempting to broadcast an axis by a dimension other than 1. 7 by 8\n"
)
BAD_DIMS = (
    "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x "
    "for the following indices\n index: 1 Got: 4 Expected: 3\n "
    "Please fix either the inputs/outputs or the model."
)
RESHAPE = (
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
    "Reshape node. Name:'r' Status Message: "
    "/src/onnxruntime/core/providers/cpu/tensor/reshape_helper.h:47 "
    "onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::TensorShape&, "
    "onnxruntime::TensorShapeVector&, bool) input_shape_size == size was false. "
    "The input tensor cannot be reshaped to the requested shape."
)
NO_ASSERT = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Conv node. "
    "Name:'c' Status Message: /src/onnxruntime/core/providers/cpu/nn/conv.cc:99 "
    "onnxruntime::common::Status onnxruntime::Conv<float>::Compute(onnxruntime::OpKernelContext*) const "
    "Invalid input shape: {1,3}"
)


@pytest.mark.parametrize(
    "message, expected",
    [
        (BROADCAST, "Attempting to broadcast an axis by a dimension other than 1. 7 by 8"),
        (
            BAD_DIMS,
            "Got invalid dimensions for input: x for the following indices index: 1 Got: 4 Expected: 3 "
            "Please fix either the inputs/outputs or the model.",
        ),
        (RESHAPE, "The input tensor cannot be reshaped to the requested shape."),
        (NO_ASSERT, "Invalid input shape: {1,3}"),
    ],
)
def test_onnxruntime_messages_become_one_line(message, expected):
    assert runtime._one_line(RuntimeError(message)) == expected


def test_take_weights_moves_embedded_weights_into_the_session():
    """The big initializers go to onnxruntime as arrays: same outputs, and the proto is left
    holding no weight bytes (small ones stay)."""
    from onnx_opscope import zoo

    model = zoo.bert_like(layers=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (2, 16)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones((2, 16), np.int64)}
    want = make_session(model).run(None, feeds)
    big = [t.name for t in model.graph.initializer if len(t.raw_data) >= 64 * 1024]
    assert big
    got = make_session(model, take_weights=True).run(None, feeds)
    np.testing.assert_array_equal(got[0], want[0])
    moved = {t.name: t for t in model.graph.initializer}
    assert all(not moved[n].raw_data and moved[n].data_location == TensorProto.EXTERNAL for n in big)
    assert any(t.raw_data for t in model.graph.initializer)  # small constants stay embedded


def test_a_weightless_copy_borrows_its_sources_weights():
    """make_session(without_weight_data(m), weights_from=m): the same outputs as m's own session, and m
    keeps every byte (the calibration passes tap a weightless copy instead of a deep one)."""
    import onnx

    from onnx_opscope.graph.io import without_weight_data
    from onnx_opscope.run.feeds import FeedSpec, iter_feeds

    path = real_model_path("captcha_crnn")
    source = onnx.load(path)
    before = sum(len(t.raw_data) for t in source.graph.initializer)
    light = without_weight_data(source)
    assert sum(len(t.raw_data) for t in light.graph.initializer) < before // 10
    borrowed = make_session(light, RuntimeConfig(graph_opt="disable"), weights_from=source)
    own = make_session(path, RuntimeConfig(graph_opt="disable"))
    feed = next(iter(iter_feeds(path, FeedSpec(batches=1))))
    for a, b in zip(own.run(None, feed), borrowed.run(None, feed)):
        np.testing.assert_array_equal(a, b)
    assert sum(len(t.raw_data) for t in source.graph.initializer) == before
