"""Synthetic feeds that a model can run: index inputs in range of the axis they index, and feeds
too large for memory refused in one line before anything is allocated."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run import record
from onnx_opscope.run.feeds import (
    DEFAULT_INT_RANGE,
    FEED_BUDGET_ENV,
    FeedSpec,
    default_ranges,
    feed_budget,
    iter_feeds,
    memory_bytes,
    synthetic_feeds,
)

F = 8  # node feature width


def vi(name, elem, dims):
    return helper.make_tensor_value_info(name, elem, dims)


def const(name, value, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def gnn_model() -> onnx.ModelProto:
    """One message-passing layer as graph-network exports write it, N nodes and E edges symbolic.

    x [N, F] node features, edge_index int64 [2, E] (row 0 sources, row 1 targets). The sources
    reach Gather through Gather(edge_index, 0); the targets through Slice -> Reshape -> Cast ->
    Cast -> Unsqueeze -> Expand, then index GatherElements (axis -2) and ScatterElements (reduction
    add) into a buffer made by ConstantOfShape(Shape(x)), and GatherND on the transformed features
    h = x @ W: three of the four indexed tensors are intermediates whose N only shape inference
    with the feeds' shapes can tell.
    """
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((F, F)).astype(np.float32), "W")
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    nodes = [
        helper.make_node("Gather", ["edge_index", "row0"], ["src"], axis=0),
        helper.make_node("Slice", ["edge_index", "one", "two", "axis0"], ["dst_row"]),
        helper.make_node("Reshape", ["dst_row", "flat"], ["dst"]),
        helper.make_node("Cast", ["dst"], ["dst32"], to=TensorProto.INT32),
        helper.make_node("Cast", ["dst32"], ["dst64"], to=TensorProto.INT64),
        helper.make_node("MatMul", ["x", "W"], ["h"], name="lin"),
        helper.make_node("Gather", ["h", "src"], ["msg"], axis=0),
        helper.make_node("Unsqueeze", ["dst64", "axis1"], ["dst_col"]),
        helper.make_node("Shape", ["msg"], ["msg_shape"]),
        helper.make_node("Expand", ["dst_col", "msg_shape"], ["dst_idx"]),
        helper.make_node("GatherElements", ["x", "dst_idx"], ["x_dst"], axis=-2),
        helper.make_node("Mul", ["msg", "x_dst"], ["m"]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("ConstantOfShape", ["x_shape"], ["zeros"], value=zero),
        helper.make_node("ScatterElements", ["zeros", "dst_idx", "m"], ["agg"], axis=0, reduction="add"),
        helper.make_node("MatMul", ["agg", "W"], ["y"], name="out"),
        helper.make_node("Reshape", ["dst_row", "col"], ["nd_idx"]),
        helper.make_node("GatherND", ["h", "nd_idx"], ["z"]),
    ]
    inits = [
        w,
        const("row0", 0),
        const("one", [1]),
        const("two", [2]),
        const("axis0", [0]),
        const("axis1", [1]),
        const("flat", [-1]),
        const("col", [-1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "gnn",
        [vi("x", TensorProto.FLOAT, ["N", F]), vi("edge_index", TensorProto.INT64, [2, "E"])],
        [vi("y", TensorProto.FLOAT, ["N", F]), vi("z", TensorProto.FLOAT, ["E", F])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def run_plain(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


# ---------------------------------------------------------------------------------------------
# Index inputs


def test_gnn_edge_index_range_follows_the_node_count():
    m = gnn_model()
    # N defaults to 1 (axis 0): every edge index must be 0 (DEFAULT_INT_RANGE [0, 16) is out of bounds)
    assert default_ranges(m) == {"edge_index": (0, 1)}
    assert default_ranges(m, {"x": [50, F], "edge_index": [2, 300]}) == {"edge_index": (0, 50)}
    # N resolved at feed time from another input's shape: --dim, or --shape of x
    for spec, n in ((FeedSpec(dims={"N": 50, "E": 400}), 50), (FeedSpec(shapes={"x": [37, F]}), 37)):
        for feeds in iter_feeds(m, spec, batches=2):
            e = feeds["edge_index"]
            assert feeds["x"].shape[0] == n and e.dtype == np.int64
            assert e.min() >= 0 and e.max() <= n - 1 and e.max() >= n // 2  # in range, and using it
            y, z = run_plain(m, feeds)
            assert y.shape == (n, F) and z.shape == (e.shape[1], F) and np.isfinite(y).all()


def test_gnn_records_on_default_synthetic_feeds(tmp_path):
    m = gnn_model()
    run_plain(m, synthetic_feeds(m))  # onnxruntime accepts the defaults (N = 1, E = 64)
    res = record(m, out=tmp_path / "t.parquet")
    assert res.batches == 4 and res.rows > 0
    res = record(m, out=tmp_path / "t2.parquet", feeds=FeedSpec(dims={"N": 24}, batches=2))
    assert res.batches == 2 and res.rows > 0


def test_gnn_record_cli(tmp_path, capsys):
    path = tmp_path / "gnn.onnx"
    onnx.save(gnn_model(), path)
    code = main(
        ["record", str(path), "-o", str(tmp_path / "t.parquet"), "--dim", "N=40", "--batches", "2", "-q"]
    )
    assert code == 0, capsys.readouterr().err


def index_model() -> onnx.ModelProto:
    """Each indexing op on its own, its indices a graph input: axis attributes, negative axes,
    GatherND / ScatterND over several axes, batch_dims."""
    table = numpy_helper.from_array(np.zeros((3, 9), np.float32), "table")
    grid = numpy_helper.from_array(np.zeros((7, 5), np.float32), "grid")
    cube = numpy_helper.from_array(np.zeros((4, 6, 3), np.float32), "cube")
    upd2 = numpy_helper.from_array(np.ones((3,), np.float32), "upd2")
    upd1 = numpy_helper.from_array(np.ones((3, 5), np.float32), "upd1")
    nodes = [
        helper.make_node("Gather", ["table", "cols"], ["g1"], axis=1),
        helper.make_node("Gather", ["table", "cols_neg"], ["g2"], axis=-1),
        helper.make_node("ScatterND", ["grid", "nd2", "upd2"], ["s2"]),  # (row, col) pairs: [0, min(7, 5))
        helper.make_node("ScatterND", ["grid", "nd1", "upd1"], ["s1"]),  # rows only: [0, 7)
        helper.make_node("GatherND", ["cube", "bnd"], ["g3"], batch_dims=1),  # axis 1 of cube: [0, 6)
        helper.make_node("GatherElements", ["grid", "ge"], ["g4"], axis=1),  # [0, 5)
    ]
    inputs = [
        vi("cols", TensorProto.INT64, [4]),
        vi("cols_neg", TensorProto.INT32, [4]),
        vi("nd2", TensorProto.INT64, [3, 2]),
        vi("nd1", TensorProto.INT64, [3, 1]),
        vi("bnd", TensorProto.INT64, [4, 1]),
        vi("ge", TensorProto.INT64, [7, 2]),
        vi("other", TensorProto.INT64, [2]),
    ]
    outputs = [vi(n, TensorProto.FLOAT, None) for n in ("g1", "g2", "s2", "s1", "g3", "g4")]
    graph = helper.make_graph(nodes, "idx", inputs, outputs, [table, grid, cube, upd2, upd1])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_index_ranges_per_op():
    m = index_model()
    assert default_ranges(m) == {
        "cols": (0, 9),
        "cols_neg": (0, 9),
        "nd2": (0, 5),
        "nd1": (0, 7),
        "bnd": (0, 6),
        "ge": (0, 5),
        "other": DEFAULT_INT_RANGE,
    }
    for step in range(3):
        run_plain(m, synthetic_feeds(m, step=step))  # no index out of bounds


def test_scatter_of_an_input_buffer_takes_its_size():
    """The indexed tensor is itself an input: its size comes from the shape the feeds give it."""
    nodes = [helper.make_node("ScatterElements", ["buf", "idx", "upd"], ["out"], axis=1, reduction="add")]
    graph = helper.make_graph(
        nodes,
        "s",
        [
            vi("buf", TensorProto.FLOAT, ["b", "slots"]),
            vi("idx", TensorProto.INT64, ["b", "k"]),
            vi("upd", TensorProto.FLOAT, ["b", "k"]),
        ],
        [vi("out", TensorProto.FLOAT, ["b", "slots"])],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    feeds = synthetic_feeds(m, FeedSpec(dims={"b": 3, "slots": 11, "k": 40}))
    assert feeds["idx"].max() <= 10 and feeds["idx"].max() >= 5
    run_plain(m, feeds)
    assert default_ranges(m) == {"idx": (0, 64)}  # slots defaults to 64


# ---------------------------------------------------------------------------------------------
# Feeds too large for memory


def relu_model(dims, elem=TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", elem, dims)], [vi("y", elem, None)]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_huge_declared_shape_is_one_line_before_allocation(monkeypatch):
    monkeypatch.delenv(FEED_BUDGET_ENV, raising=False)
    m = relu_model([100000, 100000, 8])
    for spec in (FeedSpec(), FeedSpec(values={"x": 0.5})):  # a scalar --value fills the shape too
        with pytest.raises(OpscopeError) as exc:
            synthetic_feeds(m, spec)
        text = str(exc.value)
        assert "\n" not in text
        assert "'x' float32[100000, 100000, 8]" in text and "298.0 GiB" in text and "feed budget" in text
        assert "--data" in exc.value.hint and FEED_BUDGET_ENV in exc.value.hint
    with pytest.raises(OpscopeError, match="298.0 GiB"):
        iter_feeds(m)  # raised when the iterator is made, before any batch


def test_budget_names_the_flag_that_shrinks_the_input(monkeypatch):
    monkeypatch.setenv(FEED_BUDGET_ENV, "1G")
    m = relu_model(["batch", 1024, 1024])
    assert synthetic_feeds(m)["x"].shape == (1, 1024, 1024)  # 4 MiB
    with pytest.raises(OpscopeError, match=r"'x' float32\[512, 1024, 1024\] needs 2.0 GiB") as exc:
        synthetic_feeds(m, FeedSpec(dims={"batch": 512}))
    assert "--dim batch=N" in exc.value.hint and "OPSCOPE_FEED_BUDGET=1G" in str(exc.value)
    with pytest.raises(OpscopeError) as exc:
        synthetic_feeds(
            relu_model([None, 1024, 1024], TensorProto.DOUBLE), FeedSpec(shapes={"x": [300, 1024, 1024]})
        )
    assert "float64[300, 1024, 1024]" in str(exc.value) and "--shape x:" in exc.value.hint


def test_budget_counts_every_input(monkeypatch):
    monkeypatch.setenv(FEED_BUDGET_ENV, "10M")
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "g",
        [vi("a", TensorProto.FLOAT, [1024, 2048]), vi("b", TensorProto.FLOAT, [1024, 1024])],
        [vi("y", TensorProto.FLOAT, None)],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(
        OpscopeError, match=r"the synthetic feeds need 12.0 MiB per batch, the largest input 'a'"
    ):
        synthetic_feeds(m)
    monkeypatch.setenv(FEED_BUDGET_ENV, "12MiB")
    assert set(synthetic_feeds(m)) == {"a", "b"}


def test_budget_setting(monkeypatch):
    monkeypatch.delenv(FEED_BUDGET_ENV, raising=False)
    memory = memory_bytes()
    assert memory is not None and memory > 1 << 28
    assert feed_budget()[0] == memory // 4
    for text, n in (("64G", 64 << 30), ("200GiB", 200 << 30), ("1.5m", 3 << 19), ("4096", 4096)):
        monkeypatch.setenv(FEED_BUDGET_ENV, text)
        assert feed_budget()[0] == n
    monkeypatch.setenv(FEED_BUDGET_ENV, "lots")
    with pytest.raises(OpscopeError, match=f"{FEED_BUDGET_ENV}=lots"):
        feed_budget()


def test_huge_shape_cli_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(FEED_BUDGET_ENV, raising=False)
    w = numpy_helper.from_array(np.eye(8, dtype=np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [vi("x", TensorProto.FLOAT, ["n", 100000, 8])],
        [vi("y", TensorProto.FLOAT, None)],
        [w],
    )
    path = tmp_path / "huge.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    code = main(["record", str(path), "-o", str(tmp_path / "t.parquet"), "--dim", "n=100000"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: input 'x' float32[100000, 100000, 8] needs 298.0 GiB")
    assert lines[1].startswith("hint: ") and "--dim n=N" in lines[1]
    assert "Traceback" not in err
