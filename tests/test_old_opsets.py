"""Opsets 7 to 10, tapped as they are (no version conversion): every sketch against its numpy reference.

The models are built here with onnx.helper at each opset and the IR version its exporters wrote
(opset 7 and 8: IR 3, where every initializer is also a graph input; 9: IR 4; 10: IR 5). What
the taps need that those opsets lack (Where, IsNaN, IsInf, Range, Compress, Unique, input-form
Slice and Clip, integer Less, float Equal) is spelled by `graph.build.Builder` with older ops;
the instrumented model must pass onnx's full check at the model's own opset (an op that does
not exist there fails it), keep the plain model's outputs, and give every sketch its numpy
reference value, non-finite tensors included (the masking branch, where Where is missing
before opset 9).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_inject import assert_same_outputs
from test_sketches import CASES, check_main_graph, check_taps, run_all, tensor_values

from onnx_opscope import inject
from onnx_opscope import sketch as sk
from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph import Builder, Names, iter_graphs
from onnx_opscope.graph.opset import MIN_TAP_OPSET, has_op
from onnx_opscope.instrument import decode_taps, host_values, unpacked
from onnx_opscope.sketch.tap import raw_dtype

F = TensorProto.FLOAT
OLD = (7, 8, 9, 10)
IR_OF = {7: 3, 8: 3, 9: 4, 10: 5, 11: 6}
NEWER_THAN = {
    "Where": 9,
    "IsNaN": 9,
    "IsInf": 10,
    "Range": 11,
    "Unique": 11,
    "ScatterElements": 11,
    "Mod": 10,
}


def _model(nodes, inputs, outputs, weights: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    vis = list(inputs)
    if IR_OF[opset] < 4:  # IR 3: every initializer is listed as a graph input too
        vis += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "old", vis, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="old-exporter")
    m.ir_version = IR_OF[opset]
    onnx.checker.check_model(m, full_check=True)
    return m


def old_model(opset: int, seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> Flatten -> Gemm; a sequence through Q/K/V MatMuls, scores, Softmax (attention)
    and probs @ V; an LSTM over the sequence; a TopK router over 4 experts."""
    rng = np.random.default_rng(seed)
    w = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.3  # noqa: E731
    h = 6
    weights = {
        "conv.w": w(4, 3, 3, 3),
        "conv.b": w(4),
        "fc.w": w(4 * 6 * 6, 10),
        "fc.b": w(10),
        "wq": w(8, 8),
        "wk": w(8, 8),
        "wv": w(8, 8),
        "lstm.w": w(1, 4 * h, 8),
        "lstm.r": w(1, 4 * h, h),
        "lstm.b": w(1, 8 * h),
        "gate.w": w(8, 4),
    }
    topk_k = {"k": 2} if opset < 10 else {}
    topk_in = ["gate"] if opset < 10 else ["gate", "k2"]
    if opset >= 10:
        weights["k2"] = np.array([2], np.int64)
    nodes = [
        helper.make_node("Conv", ["image", "conv.w", "conv.b"], ["conv"], name="conv", pads=[0, 0, 0, 0]),
        helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
        helper.make_node("Flatten", ["relu"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc"),
        helper.make_node("MatMul", ["seq", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["seq", "wk"], ["k"], name="k_proj"),
        helper.make_node("MatMul", ["seq", "wv"], ["v"], name="v_proj"),
        helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="scores"),
        helper.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=2),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"], name="ctx"),
        helper.make_node("Transpose", ["seq"], ["seq_t"], name="seq_t", perm=[1, 0, 2]),
        helper.make_node(
            "LSTM", ["seq_t", "lstm.w", "lstm.r", "lstm.b"], ["lstm_y"], name="lstm", hidden_size=h
        ),
        helper.make_node("MatMul", ["seq", "gate.w"], ["gate"], name="gate"),
        helper.make_node("TopK", topk_in, ["top_v", "top_i"], name="router", axis=-1, **topk_k),
    ]
    inputs = [
        helper.make_tensor_value_info("image", F, ["n", 3, 8, 8]),
        helper.make_tensor_value_info("seq", F, ["n", 5, 8]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", F, ["n", 10]),
        helper.make_tensor_value_info("ctx", F, ["n", 5, 8]),
        helper.make_tensor_value_info("lstm_y", F, [5, 1, "n", h]),
        helper.make_tensor_value_info("top_i", TensorProto.INT64, ["n", 5, 2]),
    ]
    return _model(nodes, inputs, outputs, weights, opset)


def old_feeds(seed: int = 1, n: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.standard_normal((n, 3, 8, 8)).astype(np.float32),
        "seq": rng.standard_normal((n, 5, 8)).astype(np.float32),
    }


def _ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for _, g in iter_graphs(model.graph) for n in g.node}


OPTIONS = {
    "sampled": sk.SketchOptions(),
    "exact": sk.SketchOptions(hist_mode="exact"),
    "exact-range": sk.SketchOptions(hist_mode="exact", hist_range=(-0.5, 2.0), hist_bins=10),
    "host": sk.SketchOptions(hist_mode="host"),
}


@pytest.mark.parametrize("opset", OLD)
@pytest.mark.parametrize("sketches", [None, ["all"]], ids=["default", "all"])
def test_old_opset_models_match_references(opset, sketches):
    model = old_model(opset)
    feeds = old_feeds()
    inst, manifest = inject(model, None, sketches)
    assert manifest.opset == opset and inst.ir_version == IR_OF[opset]
    assert [(o.domain, o.version) for o in inst.opset_import] == [("", opset)]
    onnx.checker.check_model(inst, full_check=True)  # every op exists at the model's opset
    assert not {op for op, since in NEWER_THAN.items() if since > opset} & _ops(inst)
    outs = unpacked(manifest, run_all(inst, feeds))
    assert_same_outputs(run_all(model, feeds), outs, True, f"opset {opset}")
    compared, constant = check_main_graph(model, feeds, manifest, outs)
    assert constant > 0
    ops = {s.op_type for s in manifest.sites}
    assert {"Conv", "Gemm", "MatMul", "LSTM", "Softmax", "TopK"} <= ops, ops
    assert compared > 0
    seen = {s for t in manifest.taps for s in t.sketches}  # nothing dropped at the old opset
    assert seen == set(sk.resolve(sketches)) | {"attn_qmax", "attn_krecv", "route_load"}


@pytest.mark.parametrize("opset", OLD)
@pytest.mark.parametrize("mode", list(OPTIONS))
def test_old_opset_histogram_modes(opset, mode):
    """Exact histograms at opsets without ScatterElements or Unique are counted on the host from
    the graph's bin indices (`sketch.for_opset`): the same counts, recorded in the manifest."""
    model, feeds, opts = old_model(opset), old_feeds(), OPTIONS[mode]
    inst, manifest = inject(model, None, ["hist", "min", "max"], opts)
    onnx.checker.check_model(inst, full_check=True)
    if opts.hist_mode == "exact":
        assert manifest.options["exact_counts"] == "host"
        assert not {"Unique", "ScatterElements"} & _ops(inst)
    outs = unpacked(manifest, run_all(inst, feeds))
    compared, _ = check_main_graph(model, feeds, manifest, outs)
    assert compared > 0


def _matmul(opset: int) -> onnx.ModelProto:
    w = (np.arange(32).reshape(8, 4) % 5 - 2).astype(np.float32)
    return _model(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        [helper.make_tensor_value_info("x", F, ["rows", 8])],
        [helper.make_tensor_value_info("y", F, ["rows", 4])],
        {"W": w},
        opset,
    )


@pytest.mark.parametrize("opset", OLD)
@pytest.mark.parametrize("case", list(CASES))
def test_old_opset_non_finite_tensors(opset, case):
    """NaN, ±Inf and float32-min values take the masking branch: before opset 9 it has no Where,
    IsNaN or IsInf, and must still give every sketch its reference value."""
    model = _matmul(opset)
    x = np.array(CASES[case], np.float32)
    inst, manifest = inject(model, None, ["all"], sk.SketchOptions(hist_mode="exact"))
    onnx.checker.check_model(inst, full_check=True)
    outs = unpacked(manifest, run_all(inst, {"x": x}))
    values = tensor_values(model, ["x", "W", "y"], {"x": x})
    assert (
        check_taps(manifest.taps, outs, values, manifest.sketch_options(), host_values(manifest, model)) > 30
    )


# --------------------------------------------------------------------------------------------
# the builders one by one, at every opset from 7


def _run_builder(
    opset: int, b: Builder, inputs: dict[str, np.ndarray], outs: dict[str, tuple[int, int]]
) -> dict:
    """Run the nodes of `b` as a model at `opset`; `outs`: name -> (element type, rank)."""
    vis = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in inputs.items()
    ]
    outputs = [helper.make_tensor_value_info(n, e, [None] * r) for n, (e, r) in outs.items()]
    m = helper.make_model(
        helper.make_graph(b.nodes, "g", vis, outputs), opset_imports=[helper.make_opsetid("", opset)]
    )
    m.ir_version = IR_OF.get(opset, 8)
    onnx.checker.check_model(m, full_check=True)
    return dict(zip(outs, run_all(m, inputs).values()))


@pytest.mark.parametrize("opset", [7, 8, 9, 10, 11, 13, 18])
def test_builder_helpers_at_every_opset(opset):
    x = np.array([[np.nan, np.inf, -np.inf, -3.4e38], [0.0, -1.5, 2.0, 7.0]], np.float32)
    n = np.array(11, np.int64)
    b = Builder(opset, Names({"x", "n"}), "t_")
    i64 = TensorProto.INT64
    got = _run_builder(
        opset,
        b,
        {"x": x, "n": n},
        {
            b.where(b.nonfinite("x"), b.const(0.0), "x"): (F, 2),
            b.where(b.isnan("x"), "x", b.const(5.0)): (F, 2),
            b.cast(b.isnan("x"), i64): (i64, 2),
            b.cast(b.isinf("x"), i64): (i64, 2),
            b.cast(b.nonfinite("x"), i64): (i64, 2),
            b.arange("n"): (i64, 1),
            b.arange("n", bound=16): (i64, 1),
            b.arange(b.i64(0)): (i64, 1),
            b.arange(b.i64(1)): (i64, 1),
            b.arange(b.i64(1000)): (i64, 1),
            b.where(b.op("Equal", ["n", b.i64(11)]), b.i64(3), "n", i64): (i64, 0),
            b.minimum("n", b.i64(4)): (i64, 0),
            b.maximum("n", b.i64(40)): (i64, 0),
            b.clip(b.where(b.nonfinite("x"), b.const(0.0), "x"), -1.0, 1.0): (F, 2),
            b.slice(b.op("Shape", ["x"]), -1, 2**62, 0): (i64, 1),
            b.strided(b.arange("n"), 4): (i64, 1),
        },
    )
    v = list(got.values())
    clean = np.where(np.isfinite(x), x, 0)
    np.testing.assert_array_equal(v[0], clean)
    np.testing.assert_array_equal(v[1], np.where(np.isnan(x), x, 5.0))
    np.testing.assert_array_equal(v[2], np.isnan(x))
    np.testing.assert_array_equal(v[3], np.isinf(x))
    np.testing.assert_array_equal(v[4], ~np.isfinite(x))
    for got_range, want in zip(v[5:10], (11, 11, 0, 1, 1000)):
        np.testing.assert_array_equal(got_range, np.arange(want))
    assert v[10] == 3 and v[11] == 4 and v[12] == 40
    np.testing.assert_array_equal(v[13], np.clip(clean, -1, 1))
    assert v[14].tolist() == [4]
    np.testing.assert_array_equal(v[15], (np.arange(4) * 11) // 4)
    ops = {nd.op_type for _, g in iter_graphs(helper.make_graph(b.nodes, "g", [], [])) for nd in g.node}
    assert all(has_op(op, opset) for op in ops), ops


@pytest.mark.parametrize("opset", [7, 9, 10, 11, 17])
@pytest.mark.parametrize("bins", [None, 5])
def test_route_load_at_every_opset(opset, bins):
    """Expert ids counted with Equal on int64 (float Equal needs opset 11); with no static E the
    bins are [0, max id] from `arange` (a Loop before Range exists)."""
    ids = np.array([[0, 3, 3], [1, 0, 3]], np.int64)
    b = Builder(opset, Names({"ids"}), "t_")
    info, opts = sk.TapInfo(2, TensorProto.INT64, bins=bins), sk.SketchOptions()
    raws = sk.build_tap(b, "ids", info, [sk.REGISTRY["route_load"]], opts).outputs
    got = _run_builder(opset, b, {"ids": ids}, {name: (raw_dtype(r, opts), 1) for r, name in raws.items()})
    raw = {r: np.asarray(got[name], np.float64).ravel() for r, name in raws.items()}
    np.testing.assert_array_equal(
        sk.finalize("route_load", raw, opts), sk.reference("route_load", ids, info, opts)
    )


def test_opset_below_7_is_refused():
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", F, [4, 4])],
        [helper.make_tensor_value_info("y", F, [4, 4])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", MIN_TAP_OPSET - 1)])
    with pytest.raises(OpscopeError, match=f"opset {MIN_TAP_OPSET - 1}.*opset {MIN_TAP_OPSET}"):
        inject(m)


@pytest.mark.parametrize("opset", [7, 8, 9, 10, 11])
def test_old_opset_taps_inside_if_and_loop_bodies(opset):
    """Taps in an If branch and a Loop body come out through the owner; the branch not taken
    returns empty raws, int64 ones included, which a Constant holds only from opset 9."""
    w = np.full((4, 4), 0.5, np.float32)
    then_g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["t_mm"], name="then_mm")], "then", [],
        [helper.make_tensor_value_info("t_mm", F, [2, 4])],
    )  # fmt: skip
    else_g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["e_relu"], name="else_relu")], "else", [],
        [helper.make_tensor_value_info("e_relu", F, [2, 4])],
    )  # fmt: skip
    body = helper.make_graph(
        [helper.make_node("MatMul", ["s_in", "W"], ["s_out"], name="body_mm")],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", F, [2, 4]),
        ],
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", F, [2, 4]),
        ],
    )
    nodes = [
        helper.make_node("If", ["flag"], ["branch"], name="if", then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["trips", "", "branch"], ["final"], name="loop", body=body),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", F, [2, 4]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
            helper.make_tensor_value_info("trips", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("final", F, [2, 4])],
        {"W": w},
        opset,
    )
    inst, manifest = inject(model, None, ["all"])
    onnx.checker.check_model(inst, full_check=True)
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 3
    for flag in (True, False):
        feeds = {"x": x, "flag": np.array(flag), "trips": np.array(3, np.int64)}
        outs = unpacked(manifest, run_all(inst, feeds))
        assert_same_outputs(run_all(model, feeds), outs, True, f"opset {opset} flag {flag}")
        decoded = decode_taps(manifest, outs, host_values(manifest, model))
        then_taps = [t for t in manifest.taps if t.graph.startswith("if/") and not t.constant]
        assert then_taps and all((decoded[t.id][1] is not None) == flag for t in then_taps)
        mm = next(t for t in manifest.taps if t.tensor == "s_out")
        got, shape = decoded[mm.id]
        assert shape == [2, 4] and mm.stacked == 1
        start = x @ w if flag else np.maximum(x, 0)
        steps = [start @ np.linalg.matrix_power(w, k) for k in (1, 2, 3)]  # each iteration's s_out
        assert got["min"][0] == min(s.min() for s in steps) and got["max"][0] == max(s.max() for s in steps)


@pytest.mark.parametrize("opset", [7, 10])
def test_record_an_old_opset_model(tmp_path, opset):
    """`record` end to end on an opset-7 / -10 model: the parity gate passes at the default
    optimization level and every site's default sketches are in the table."""
    from onnx_opscope.run import read_table, record
    from onnx_opscope.run.feeds import FeedSpec

    res = record(old_model(opset), out=tmp_path / "t.parquet", feeds=FeedSpec(dims={"n": 2}, batches=2))
    assert res.manifest.opset == opset
    rows = read_table(res.table).to_pylist()
    assert {r["step"] for r in rows} == {0, 1}
    stats = {r["stat"] for r in rows}
    assert set(sk.DEFAULT_SKETCHES) | {"attn_qmax", "attn_krecv", "route_load"} <= stats
    assert {r["op_type"] for r in rows} >= {"Conv", "Gemm", "MatMul", "LSTM", "Softmax", "TopK"}
    assert all(np.isfinite(r["value"]) for r in rows if r["stat"] not in ("min", "max", "mean"))
