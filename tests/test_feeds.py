"""Feeds: distributions have the property they are named for, shapes and ranges follow the
documented rules, real data loads from every supported layout, and mistakes are one line."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import real_model_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph.io import load_model
from onnx_opscope.run.feeds import (
    DEFAULT_INT_RANGE,
    DISTRIBUTIONS,
    FeedSpec,
    check_feeds,
    default_ranges,
    describe_feeds,
    input_signature,
    iter_feeds,
    load_data,
    outlier_channels,
    resolve_shapes,
    synthetic_feeds,
)

SHAPE = (2, 64, 128)

# Sensible feeds for each real model (see shared real_models.md) and the shapes they give.
REAL_SPECS = {
    "ppocrv4_rec": (FeedSpec(shapes={"x": [1, 3, 48, 320]}), {"x": [1, 3, 48, 320]}),
    "ppocrv4_det": (FeedSpec(), {"x": [1, 3, 64, 64]}),
    "silero_vad_v6": (
        FeedSpec(shapes={"input": [1, 512], "state": [2, 1, 128]}, values={"sr": 16000}),
        {"input": [1, 512], "state": [2, 1, 128], "sr": []},
    ),
    "captcha_crnn": (FeedSpec(), {"image": [1, 3, 60, 160]}),
    "magika_standard_v3_3": (FeedSpec(), {"bytes": [1, 2048]}),
}


def draw(name: str, shape=SHAPE, seed: int = 0, step: int = 0) -> np.ndarray:
    return DISTRIBUTIONS[name](np.random.default_rng([seed, step]), shape)


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


def tiny_model(inputs, nodes, outputs, inits=(), ir_version=8, opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def vi(name, elem, dims):
    return helper.make_tensor_value_info(name, elem, dims)


# ---------------------------------------------------------------------------------------------
# Distributions


def test_gaussian_and_uniform_moments():
    g = draw("gaussian")
    assert g.dtype == np.float32 and g.shape == SHAPE
    assert abs(g.mean()) < 0.02 and abs(g.std() - 1) < 0.02
    u = draw("uniform")
    assert u.dtype == np.float32 and u.min() >= -1 and u.max() < 1
    assert abs(u.mean()) < 0.02 and abs(u.var() - 1 / 3) < 0.01


def test_sparse90_density():
    x = draw("sparse90")
    assert abs(np.count_nonzero(x) / x.size - 0.1) <= 0.02
    assert abs(np.count_nonzero(draw("gaussian")) / x.size - 0.1) > 0.5  # the check can fail


def coherence(x: np.ndarray) -> float:
    """Mean adjacent-row squared difference over mean per-row energy (rows along axis -2)."""
    return float(np.mean(np.diff(x, axis=-2) ** 2) / np.mean(x**2))


def test_coherent_rows_are_close():
    assert coherence(draw("coherent")) < 0.1
    assert coherence(draw("gaussian")) > 1.0  # independent rows: the ratio is about 2


def test_quantized_levels():
    x = draw("quantized", (8, 96, 512))
    assert len(np.unique(x)) <= 20
    assert np.all(np.mod(x * 2, 1) == 0)
    assert np.abs(x).max() <= 4 and len(np.unique(x)) <= 17  # saturated: 17 levels at any size
    assert len(np.unique(draw("gaussian"))) > 1000


def test_lowrank_rank_is_4():
    x = draw("lowrank")
    assert [np.linalg.matrix_rank(m) for m in x] == [4, 4]
    assert 0.8 < x.std() < 1.2
    assert np.linalg.matrix_rank(draw("gaussian")[0]) == 64


def channel_ratio(x: np.ndarray) -> float:
    peak = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)
    return float(peak.max() / peak.mean())


def test_outlier_channels_stand_out():
    x = draw("outlier")
    assert channel_ratio(x) > 6
    assert channel_ratio(draw("gaussian")) < 2
    peak = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)
    assert set(np.argsort(peak)[-len(outlier_channels(128)) :]) == set(outlier_channels(128).tolist())
    assert len(outlier_channels(128)) == 1 and len(outlier_channels(320)) == 3
    # the same channels at every step, as real activation outliers
    assert np.argmax(np.abs(draw("outlier", step=5)).reshape(-1, 128).max(0)) == outlier_channels(128)[0]


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_distributions_are_seeded(name):
    a, b = draw(name, step=3), draw(name, step=3)
    assert a.dtype == np.float32 and np.array_equal(a, b)
    assert not np.array_equal(a, draw(name, step=4))
    assert not np.array_equal(a, draw(name, seed=1, step=3))


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (1, 2, 3, 4)])
def test_distributions_take_any_rank(name, shape):
    x = draw(name, shape)
    assert x.shape == shape and x.dtype == np.float32 and np.all(np.isfinite(x))


# ---------------------------------------------------------------------------------------------
# Signatures and shapes


def test_signature_silero_unknown_dims_and_scalar():
    sig = {s.name: s for s in input_signature(real_model_path("silero_vad_v6"))}
    assert list(sig) == ["input", "state", "sr"]
    assert sig["input"].dims == [None, None]  # declared 0: unknown in practice
    assert sig["state"].dims == [2, None, 128]
    assert sig["sr"].dims == [] and sig["sr"].dtype == np.int64 and sig["sr"].rank == 0


def test_signature_rec_symbols_and_question_mark():
    (x,) = input_signature(real_model_path("ppocrv4_rec"))
    assert x.dtype == np.float32
    assert isinstance(x.dims[0], str) and x.dims[1] == 3 and x.dims[2] is None and isinstance(x.dims[3], str)


def test_signature_leaves_out_initializers_listed_as_inputs():
    w = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
    m = tiny_model(
        [vi("x", TensorProto.FLOAT, ["n", 4]), vi("w", TensorProto.FLOAT, [4, 2])],
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [vi("y", TensorProto.FLOAT, ["n", 2])],
        [w],
        ir_version=3,
        opset=9,
    )
    assert [s.name for s in input_signature(m)] == ["x"]
    check_feeds(m, {"x": np.ones((1, 4), np.float32), "w": np.ones((4, 2), np.float32)})  # an override


def shared_symbol_model() -> onnx.ModelProto:
    return tiny_model(
        [vi("a", TensorProto.FLOAT, ["batch", "seq"]), vi("b", TensorProto.FLOAT, [2, "batch", "seq"])],
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [vi("y", TensorProto.FLOAT, [2, "batch", "seq"])],
    )


def test_shapes_default_rule():
    assert resolve_shapes(real_model_path("ppocrv4_det")) == {"x": [1, 3, 64, 64]}
    assert resolve_shapes(real_model_path("silero_vad_v6")) == {
        "input": [1, 64],
        "state": [2, 64, 128],
        "sr": [],
    }
    # a symbol that is axis 0 anywhere is 1 everywhere; others 64
    assert resolve_shapes(shared_symbol_model()) == {"a": [1, 64], "b": [2, 1, 64]}


def test_shared_symbol_resolves_to_one_value():
    m = shared_symbol_model()
    assert resolve_shapes(m, dims={"batch": 4, "seq": 8}) == {"a": [4, 8], "b": [2, 4, 8]}
    assert resolve_shapes(m, shapes={"a": [3, 10]}) == {"a": [3, 10], "b": [2, 3, 10]}
    feeds = synthetic_feeds(m, FeedSpec(dims={"batch": 5}))
    assert feeds["a"].shape == (5, 64) and feeds["b"].shape == (2, 5, 64)


def test_shape_and_dim_errors():
    m = shared_symbol_model()
    with pytest.raises(OpscopeError) as e:
        resolve_shapes(m, dims={"btach": 4})
    assert "did you mean 'batch'" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        resolve_shapes(real_model_path("ppocrv4_rec"), shapes={"x": [1, 3, 48]})
    assert "rank 4" in one_line(e) and "[1,3,48]" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        resolve_shapes(real_model_path("ppocrv4_rec"), shapes={"x": [1, 4, 48, 320]})
    assert "dim 1 = 3" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        resolve_shapes(real_model_path("ppocrv4_rec"), shapes={"X": [1, 3, 48, 320]})
    assert "'X'" in one_line(e) and "did you mean 'x'" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        resolve_shapes(real_model_path("ppocrv4_rec"), dims={"batch": 2})
    assert "no input has a dim named 'batch'" in one_line(e)


# ---------------------------------------------------------------------------------------------
# Feeds for the real models


@pytest.mark.parametrize("name", list(REAL_SPECS))
def test_real_model_feeds(name):
    spec, shapes = REAL_SPECS[name]
    path = real_model_path(name)
    feeds = synthetic_feeds(path, spec, step=0)
    assert {k: list(v.shape) for k, v in feeds.items()} == shapes
    check_feeds(path, feeds)
    for s in input_signature(path):
        assert feeds[s.name].dtype == s.dtype
    again = synthetic_feeds(path, spec, step=0)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)
    other = synthetic_feeds(path, spec, step=1)
    assert any(not np.array_equal(feeds[k], other[k]) for k in feeds)


def test_real_model_fixture_signatures(real_model):
    sig = input_signature(real_model)
    assert sig and all(s.dtype is not None and s.dims is not None for s in sig)
    assert len(list(iter_feeds(real_model, REAL_SPECS[real_model.stem][0], batches=2))) == 2


def test_silero_sr_value_is_a_scalar():
    spec, _ = REAL_SPECS["silero_vad_v6"]
    feeds = synthetic_feeds(real_model_path("silero_vad_v6"), spec)
    assert feeds["sr"].shape == () and feeds["sr"].dtype == np.int64 and int(feeds["sr"]) == 16000


def test_magika_default_range_covers_bytes_and_padding():
    path = real_model_path("magika_standard_v3_3")
    # the int32 input is compared with a constant 0..256 (a jax2tf one-hot): [0, 257)
    assert default_ranges(path) == {"bytes": (0, 257)}
    x = synthetic_feeds(path)["bytes"]
    assert x.dtype == np.int32 and x.min() >= 0 and x.max() <= 256 and x.max() > 200
    y = synthetic_feeds(path, FeedSpec(ranges={"bytes": (0, 4)}))["bytes"]
    assert set(np.unique(y)) <= {0, 1, 2, 3}


def test_default_range_rules():
    table = numpy_helper.from_array(np.zeros((100, 8), np.float32), "table")
    depth = numpy_helper.from_array(np.array(10, np.int64), "depth")
    onoff = numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "onoff")
    m = tiny_model(
        [
            vi("ids", TensorProto.INT32, [1, 5]),
            vi("cls", TensorProto.INT64, [3]),
            vi("attention_mask", TensorProto.INT64, [1, 5]),
            vi("steps", TensorProto.INT64, [1]),
        ],
        [
            helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
            helper.make_node("Unsqueeze", ["ids64", "ax"], ["ids2"]),
            helper.make_node("Gather", ["table", "ids2"], ["emb"], axis=0),
            helper.make_node("OneHot", ["cls", "depth", "onoff"], ["hot"]),
            helper.make_node("Constant", [], ["ax"], value=numpy_helper.from_array(np.array([0], np.int64))),
        ],
        [vi("emb", TensorProto.FLOAT, None), vi("hot", TensorProto.FLOAT, None)],
        [table, depth, onoff],
    )
    assert default_ranges(m) == {
        "ids": (0, 100),
        "cls": (0, 10),
        "attention_mask": (0, 2),
        "steps": DEFAULT_INT_RANGE,
    }
    feeds = synthetic_feeds(m)
    assert feeds["ids"].dtype == np.int32 and feeds["ids"].max() < 100
    assert set(np.unique(feeds["attention_mask"])) <= {0, 1}


def test_bool_scalar_and_values():
    m = tiny_model(
        [
            vi("flag", TensorProto.BOOL, ["n", 64]),
            vi("k", TensorProto.INT64, []),
            vi("scales", TensorProto.FLOAT, [4]),
            vi("fill", TensorProto.FLOAT16, ["n", 3]),
        ],
        [helper.make_node("Identity", ["flag"], ["y"])],
        [vi("y", TensorProto.BOOL, ["n", 64])],
    )
    feeds = synthetic_feeds(m, FeedSpec(values={"scales": [1, 2, 2.5, 3], "fill": 0.5}, dims={"n": 2}))
    assert (
        feeds["flag"].dtype == np.bool_ and feeds["flag"].shape == (2, 64) and 20 < feeds["flag"].sum() < 108
    )
    assert feeds["k"].shape == () and feeds["k"].dtype == np.int64
    assert feeds["scales"].tolist() == [1, 2, 2.5, 3] and feeds["scales"].dtype == np.float32
    assert (
        feeds["fill"].dtype == np.float16 and feeds["fill"].shape == (2, 3) and np.all(feeds["fill"] == 0.5)
    )
    assert describe_feeds(feeds).startswith("flag bool[2,64], k int64[]")
    with pytest.raises(OpscopeError) as e:
        synthetic_feeds(m, FeedSpec(values={"k": 2.5}))
    assert "whole numbers" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        synthetic_feeds(m, FeedSpec(ranges={"scales": (0, 3)}))
    assert "integer inputs only" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        synthetic_feeds(m, FeedSpec(values={"K": 3}))
    assert "did you mean 'k'" in one_line(e)


def test_every_distribution_feeds_a_model():
    path = real_model_path("ppocrv4_det")
    for name in DISTRIBUTIONS:
        x = synthetic_feeds(path, FeedSpec(dist=name, seed=7))["x"]
        assert x.shape == (1, 3, 64, 64) and np.all(np.isfinite(x))
    with pytest.raises(OpscopeError) as e:
        FeedSpec(dist="sparse")
    assert "did you mean 'sparse90'" in one_line(e)


def test_iter_feeds_counts_and_steps():
    path = real_model_path("ppocrv4_det")
    batches = list(iter_feeds(path, FeedSpec(seed=3), batches=3))
    assert len(batches) == 3
    assert np.array_equal(batches[2]["x"], synthetic_feeds(path, FeedSpec(seed=3), step=2)["x"])
    assert len(list(iter_feeds(path, FeedSpec(batches=2)))) == 2
    assert len(list(iter_feeds(path))) == 4


# ---------------------------------------------------------------------------------------------
# Real data


def image(k: float) -> np.ndarray:
    return np.full((1, 3, 60, 160), k, np.float32)


def test_data_npz_file(tmp_path):
    np.savez(tmp_path / "one.npz", image=image(1))
    (batch,) = list(load_data(tmp_path / "one.npz"))
    assert list(batch) == ["image"] and batch["image"][0, 0, 0, 0] == 1
    np.savez(tmp_path / "positional.npz", image(2))  # arr_0: placed by position with a model
    path = real_model_path("captcha_crnn")
    (batch,) = list(iter_feeds(path, FeedSpec(data=tmp_path / "positional.npz")))
    assert batch["image"][0, 0, 0, 0] == 2


def test_data_folder_of_npz_in_natural_order(tmp_path):
    for k in (10, 2, 1):
        np.savez(tmp_path / f"b{k}.npz", image=image(k))
    path = real_model_path("captcha_crnn")
    got = [b["image"][0, 0, 0, 0] for b in iter_feeds(path, FeedSpec(data=tmp_path))]
    assert got == [1, 2, 10]
    assert len(list(iter_feeds(path, FeedSpec(data=tmp_path), batches=2))) == 2


def test_data_folder_of_npy_and_batch_folders(tmp_path):
    np.save(tmp_path / "image.npy", image(5))
    (batch,) = list(load_data(tmp_path))
    assert batch["image"][0, 0, 0, 0] == 5
    for k in (0, 1):
        (tmp_path / "many" / f"b{k}").mkdir(parents=True)
        np.save(tmp_path / "many" / f"b{k}" / "image.npy", image(k))
    got = [
        b["image"][0, 0, 0, 0]
        for b in iter_feeds(real_model_path("captcha_crnn"), FeedSpec(data=tmp_path / "many"))
    ]
    assert got == [0, 1]


def test_data_onnxruntime_test_data_sets(tmp_path):
    path = real_model_path("silero_vad_v6")
    for k in range(2):
        folder = tmp_path / f"test_data_set_{k}"
        folder.mkdir()
        tensors = [
            numpy_helper.from_array(np.full((1, 512), k, np.float32), "input"),
            numpy_helper.from_array(np.zeros((2, 1, 128), np.float32)),  # unnamed: position 1 = state
            numpy_helper.from_array(np.array(16000, np.int64), "sr"),
        ]
        for i, t in enumerate(tensors):
            (folder / f"input_{i}.pb").write_bytes(t.SerializeToString())
        (folder / "output_0.pb").write_bytes(
            numpy_helper.from_array(np.zeros(1, np.float32), "output").SerializeToString()
        )
    batches = list(iter_feeds(path, FeedSpec(data=tmp_path)))
    assert [b["input"][0, 0] for b in batches] == [0, 1]
    assert batches[0]["state"].shape == (2, 1, 128) and int(batches[1]["sr"]) == 16000
    (one,) = list(load_data(tmp_path / "test_data_set_1", path))
    assert set(one) == {"input", "state", "sr"}
    with pytest.raises(OpscopeError) as e:
        list(load_data(tmp_path))  # the unnamed tensor needs the model to be placed
    assert "no name" in one_line(e)


def test_data_values_fill_missing_inputs(tmp_path):
    np.savez(
        tmp_path / "b.npz", input=np.zeros((1, 512), np.float32), state=np.zeros((2, 1, 128), np.float32)
    )
    path = real_model_path("silero_vad_v6")
    (batch,) = list(iter_feeds(path, FeedSpec(data=tmp_path / "b.npz", values={"sr": 8000})))
    assert int(batch["sr"]) == 8000
    with pytest.raises(OpscopeError) as e:
        list(iter_feeds(path, FeedSpec(data=tmp_path / "b.npz")))
    assert "'sr'" in one_line(e) and "missing" in one_line(e)


def test_data_errors(tmp_path):
    with pytest.raises(OpscopeError) as e:
        load_data(tmp_path / "nope")
    assert "no such file" in one_line(e)
    with pytest.raises(OpscopeError) as e:
        load_data(tmp_path)
    assert "no .npz" in one_line(e)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(OpscopeError) as e:
        list(load_data(tmp_path / "bad.npz"))
    assert "bad.npz" in one_line(e)
    np.save(tmp_path / "x.npy", np.zeros(3))
    with pytest.raises(OpscopeError) as e:
        load_data(tmp_path)
    assert "mixes" in one_line(e)
    np.savez(tmp_path / "sub.npz", image=image(0))
    with pytest.raises(OpscopeError) as e:
        iter_feeds(
            real_model_path("captcha_crnn"),
            FeedSpec(data=tmp_path / "sub.npz", shapes={"image": [1, 3, 60, 160]}),
        )
    assert "--shape" in one_line(e)
    np.savez(tmp_path / "f64.npz", image=image(0).astype(np.float64))
    with pytest.raises(OpscopeError) as e:
        list(iter_feeds(real_model_path("captcha_crnn"), FeedSpec(data=tmp_path / "f64.npz")))
    assert "float64" in one_line(e) and "float32" in one_line(e)


# ---------------------------------------------------------------------------------------------
# check_feeds


def test_check_feeds_errors():
    path = real_model_path("ppocrv4_rec")
    good = {"x": np.zeros((1, 3, 48, 320), np.float32)}
    check_feeds(path, good)
    cases = [
        ({"X": good["x"]}, ["'X'", "did you mean 'x'", "inputs: x"]),
        ({"x": np.zeros((3, 48, 320), np.float32)}, ["'x'", "[3,48,320]", "rank 4"]),
        ({"x": np.zeros((1, 3, 48, 320), np.float64)}, ["'x'", "float64", "float32"]),
        ({"x": np.zeros((1, 4, 48, 320), np.float32)}, ["'x'", "dim 1 = 3"]),
        ({}, ["'x'", "missing"]),
    ]
    for feeds, words in cases:
        with pytest.raises(OpscopeError) as e:
            check_feeds(path, feeds)
        assert all(w in one_line(e) for w in words), (one_line(e), words)
    silero = real_model_path("silero_vad_v6")
    with pytest.raises(OpscopeError) as e:
        check_feeds(
            silero, {"input": np.zeros((1, 512), np.float32), "state": np.zeros((2, 1, 128), np.float32)}
        )
    assert "'sr'" in one_line(e) and "missing" in one_line(e)


def test_load_model_is_reused():
    m = load_model(real_model_path("captcha_crnn"))
    assert input_signature(m)[0].describe() == "image float32[batch, 3, 60, 160]"
