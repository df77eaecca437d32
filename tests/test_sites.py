"""Sites: roles and channel/seq axes per op, selection, errors that teach, stable unique ids."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import generated_model_path, real_model_path
from onnx import TensorProto, helper, numpy_helper
from test_sketches import run_all

from onnx_opscope import sketch as sk
from onnx_opscope import zoo
from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph.io import load_model
from onnx_opscope.instrument import decode_tap, decode_taps, host_values, inject, unpacked
from onnx_opscope.sites import Selection, find_sites, select

F = TensorProto.FLOAT


def axes(site) -> dict[str, tuple[int, int]]:
    return {t.role: (t.channel_axis, t.seq_axis) for t in site.taps}


def tensors(site) -> dict[str, str]:
    return {t.role: t.tensor for t in site.taps}


def one_node_model(node, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph([node], "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


# --------------------------------------------------------------------------------------------
# roles and axes


def test_matmul_roles():
    (site,) = [s for s in find_sites(zoo.build("mlp")) if s.id == "fc1/matmul"]
    assert site.kind == "gemm" and site.op_type == "MatMul"
    assert tensors(site) == {"lhs": "x", "rhs": "fc1.weight", "out": "fc1/matmul_output_0"}
    assert axes(site) == {"lhs": (-1, -2), "rhs": (-1, -2), "out": (-1, -2)}


def gemm_model(trans_a: int, trans_b: int, m: int = 5, k: int = 6, n: int = 3) -> onnx.ModelProto:
    a_shape = [k, m] if trans_a else [m, k]
    b = np.random.default_rng(1).standard_normal([n, k] if trans_b else [k, n]).astype(np.float32)
    node = helper.make_node("Gemm", ["a", "b"], ["y"], name="gemm", transA=trans_a, transB=trans_b)
    return one_node_model(
        node,
        [helper.make_tensor_value_info("a", F, a_shape)],
        [helper.make_tensor_value_info("y", F, [m, n])],
        [numpy_helper.from_array(b, "b")],
    )


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_transpose_axes(trans_a, trans_b):
    """The channel of `a` is K and of `b` is N whatever the layout, so per-channel and per-row sketches
    of the same logical matrix agree between transposed and plain Gemms."""
    (site,) = find_sites(gemm_model(trans_a, trans_b))
    ax = axes(site)
    assert ax["a"] == ((0, 1) if trans_a else (1, 0))
    assert ax["b"] == ((0, 1) if trans_b else (1, 0))
    assert ax["out"] == (1, 0)
    a = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)  # logical [M, K]
    got = {}
    for ta in (0, 1):
        model = gemm_model(ta, trans_b)
        inst, manifest = inject(model, None, ["all"])
        outs = unpacked(manifest, run_all(inst, {"a": a.T.copy() if ta else a}))
        tap = next(t for t in manifest.taps if t.tensor == "a")
        got[ta] = decode_tap(tap, outs, manifest.sketch_options())[0]
    for stat in ("chan_maxabs", "pos_sumsq", "adj_sumsq", "sumsq"):
        np.testing.assert_allclose(got[0][stat], got[1][stat], rtol=1e-6, err_msg=stat)
    np.testing.assert_array_equal(got[0]["chan_maxabs"], np.abs(a).max(0))  # one per K
    assert got[0]["pos_sumsq"].size == 5  # one per M row


def test_conv_and_conv_transpose_axes():
    sites = {s.id: s for s in find_sites(zoo.build("cnn"))}
    conv, up = sites["conv1/conv"], sites["up/convtranspose"]
    assert tensors(conv)["weight"] == "conv1.weight"
    assert axes(conv) == {"in": (1, -1), "weight": (0, -1), "out": (1, -1)}  # weight [Cout, Cin/g, kh, kw]
    assert axes(up) == {"in": (1, -1), "weight": (1, -1), "out": (1, -1)}  # weight [Cin, Cout/g, kh, kw]
    assert [s.op_type for s in sites.values()] == ["Conv", "Conv", "Conv", "ConvTranspose", "Gemm"]


def test_recurrent_axes():
    sites = find_sites(zoo.build("gru"))
    rec = [s for s in sites if s.op_type in ("GRU", "LSTM", "RNN")]
    assert [s.op_type for s in rec] == ["GRU", "LSTM", "RNN"]
    for s in rec:
        assert set(tensors(s)) == {"x", "w", "r", "y"}
        assert axes(s) == {"x": (-1, 0), "w": (1, -1), "r": (1, -1), "y": (-1, 0)}  # time-major rows
    # layout=1 (batch-major): the rows run along axis 1
    node = helper.make_node("LSTM", ["x", "W", "R"], ["y"], name="lstm", hidden_size=4, layout=1)
    w = numpy_helper.from_array(np.zeros((1, 16, 3), np.float32), "W")
    r = numpy_helper.from_array(np.zeros((1, 16, 4), np.float32), "R")
    model = one_node_model(
        node,
        [helper.make_tensor_value_info("x", F, [2, 5, 3])],
        [helper.make_tensor_value_info("y", F, None)],
        [w, r],
    )
    (site,) = find_sites(model)
    assert axes(site)["x"] == (-1, 1) and axes(site)["y"] == (-1, 1)


def test_quantized_roles():
    sites = {s.op_type: s for s in find_sites(zoo.build("quantized"))}
    mmi, qlm = sites["MatMulInteger"], sites["QLinearMatMul"]
    assert tensors(mmi) == {
        "lhs": "a/dynamic_quantize_output_0",
        "rhs": "mmi.weight",
        "out": "a/matmul_integer_output_0",
        "lhs_float": "x",  # the float tensor DynamicQuantizeLinear read
    }
    assert tensors(qlm)["rhs"] == "qlm.weight"  # input 3, not a scale or zero point
    assert tensors(qlm)["lhs_float"] == "x" and "out_float" not in tensors(qlm)
    # QOperator operands are read through the op's own scales and zero points
    dq = {t.role: t.dequant for t in qlm.taps}
    node = next(n for n in zoo.build("quantized").graph.node if n.op_type == "QLinearMatMul")
    assert (dq["lhs"].scale, dq["lhs"].zero_point) == (node.input[1], node.input[2])
    assert (dq["rhs"].scale, dq["rhs"].zero_point) == (node.input[4], node.input[5])
    assert (dq["out"].scale, dq["out"].zero_point) == (node.input[6], node.input[7])
    assert dq["lhs_float"] is None and mmi.role("lhs").dequant is None
    model = zoo.build("quantized")
    feeds = zoo.example_feeds("quantized", model=model)
    inst, manifest = inject(model)
    outs = unpacked(manifest, run_all(inst, feeds))
    lhs = next(t for t in manifest.taps if t.tensor == "a/dynamic_quantize_output_0")
    assert lhs.elem_type == TensorProto.UINT8
    got = decode_tap(lhs, outs, manifest.sketch_options())[0]
    assert 0 <= got["min"][0] <= got["max"][0] <= 255 and got["max"][0] == int(got["max"][0])


@pytest.mark.parametrize("name", ["cnn", "gru"])
def test_models_without_matmul_are_instrumented_by_default(name):
    model = onnx.load(generated_model_path(name))
    assert not any(n.op_type == "MatMul" for n in model.graph.node if name == "cnn")
    inst, manifest = inject(model)
    kinds = {s.op_type for s in manifest.sites}
    assert kinds >= ({"Conv", "ConvTranspose", "Gemm"} if name == "cnn" else {"GRU", "LSTM", "RNN"})
    feeds = zoo.example_feeds(name, model=model)
    outs = unpacked(manifest, run_all(inst, feeds))
    decoded = decode_taps(manifest, outs, host_values(manifest, model))
    assert any(t.constant for t in manifest.taps)
    for t in manifest.taps:
        values, shape = decoded[t.id]
        assert shape is not None and set(values) == set(t.sketches)


# --------------------------------------------------------------------------------------------
# selection


def test_select_by_op_type_glob_size_max_and_roles():
    sites = find_sites(zoo.build("cnn"))
    assert [s.id for s in select(sites, Selection(op_types=("conv",)))] == [
        "conv1/conv",
        "grouped/conv",
        "depthwise/conv",
    ]
    assert [s.id for s in select(sites, Selection(names=("*wise*", "head/*")))] == [
        "depthwise/conv",
        "head/gemm",
    ]
    assert [s.id for s in select(sites, Selection(max_sites=2))] == ["conv1/conv", "grouped/conv"]
    only_w = select(sites, Selection(roles=("weight",)))
    assert all([t.role for t in s.taps] == ["weight"] for s in only_w) and len(only_w) == 4
    assert all({t.role for t in s.shape_only} == {"in", "out"} for s in only_w)  # still shaped for M, K, N
    numel = {"conv1.weight": 8 * 3 * 3 * 3, "image": 10_000, "conv1/conv_output_0": 10}
    big = select(sites[:1], Selection(min_numel=100), numel)
    assert [t.role for t in big[0].taps] == ["in", "weight"]  # out (10) dropped; unknown sizes stay


def test_select_through_inject_uses_static_sizes():
    model = zoo.build("mlp")
    _, manifest = inject(model, Selection(min_numel=16 * 32 + 1))
    assert {r for s in manifest.sites for r in s.roles} <= {"lhs", "rhs", "out", "a", "b"}
    taps = {t.tensor: t for t in manifest.taps}
    assert all(t.numel is None or t.numel > 16 * 32 for t in taps.values())


@pytest.mark.parametrize(
    "sel,pattern",
    [
        (Selection(op_types=("Convv",)), r"--op 'Convv' is not an op we can tap \(did you mean 'Conv'\?\)"),
        (
            Selection(op_types=("LSTM",)),
            r"--op 'LSTM' matches no node; the model has: Conv \(3\), ConvTranspose \(1\)",
        ),
        (
            Selection(names=("conv1/cnv",)),
            r"--name 'conv1/cnv' matches no site \(did you mean 'conv1/conv'\?\); sites: ",
        ),
        (
            Selection(roles=("weights",)),
            r"--role 'weights' matches no tap \(did you mean 'weight'\?\); roles here: ",
        ),
        (Selection(kinds=("atn",)), r"--kind 'atn' is not a site kind \(did you mean 'attn'\?\)"),
        (Selection(kinds=("attn",)), r"--kind attn matches no site; the model has: gemm \(5\)"),
    ],
)
def test_unmatched_selectors_teach(sel, pattern):
    model = zoo.build("cnn")
    with pytest.raises(OpscopeError, match=pattern) as err:
        inject(model, sel)
    assert "\n" not in str(err.value)


def test_min_numel_leaving_nothing_is_an_error():
    """Only static sizes can be filtered: on a fully static Gemm a huge minimum leaves nothing."""
    with pytest.raises(
        OpscopeError, match=r"the selection leaves no tensor to tap \(min size 1000 elements\)"
    ):
        inject(gemm_model(0, 0), Selection(min_numel=1000))
    _, manifest = inject(zoo.build("cnn"), Selection(min_numel=10**9))  # symbolic batch: sizes unknown, kept
    assert {r for s in manifest.sites for r in s.roles} == {"in", "out", "a"}


def test_unknown_sketch_name_teaches():
    with pytest.raises(OpscopeError, match=r"unknown sketch 'hsit' \(did you mean 'hist'\?\); known: "):
        inject(zoo.build("mlp"), None, ["hsit"])


def test_real_model_sites():
    rec = find_sites(load_model(real_model_path("ppocrv4_rec")))
    by_op = {}
    for s in rec:
        by_op[s.op_type] = by_op.get(s.op_type, 0) + 1
    assert by_op["MatMul"] > 10 and by_op["Conv"] > 10 and by_op["Softmax"] == 3
    captcha = find_sites(load_model(real_model_path("captcha_crnn")))
    assert sum(s.op_type == "Gemm" for s in captcha) == 80


# --------------------------------------------------------------------------------------------
# ids


def test_site_ids_stable_across_loads():
    path = real_model_path("ppocrv4_rec")
    a = [s.id for s in find_sites(load_model(path))]
    b = [s.id for s in find_sites(onnx.load(path))]
    assert a == b and len(set(a)) == len(a)


def test_site_ids_unique_with_repeated_and_empty_names():
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y1"], name="mm"),
        helper.make_node("MatMul", ["y1", "w"], ["y2"], name="mm"),  # repeated name
        helper.make_node("MatMul", ["y2", "w"], ["y3"]),  # no name
        helper.make_node("MatMul", ["y3", "w"], ["y4"], name=""),
        helper.make_node("MatMul", ["y4", "w"], ["y5"], name="MatMul_0"),  # looks like a generated id
        helper.make_node("MatMul", ["y5", "w"], ["y6"], name="solo"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, [2, 4])],
        [helper.make_tensor_value_info("y6", F, [2, 4])],
        [w],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    ids = [s.id for s in find_sites(model)]
    assert len(ids) == 6 and len(set(ids)) == 6, ids
    # the model index's ids: a repeated name gets #2, unnamed nodes count per op type, and a real name
    # that looks like a generated id gets #2 too
    assert ids == ["mm", "mm#2", "MatMul_0", "MatMul_1", "MatMul_0#2", "solo"]
    assert ids == [s.id for s in find_sites(model)]  # stable
    inst, manifest = inject(model)
    assert [s.id for s in manifest.sites] == ids
    onnx.checker.check_model(inst)  # (onnxruntime itself refuses repeated node names, tapped or not)
    assert [s.node for s in manifest.sites] == ["mm", "mm", "", "", "MatMul_0", "solo"]


def test_subgraph_site_ids_carry_their_path():
    assert [s.id for s in find_sites(zoo.build("if_model"))] == [
        "if/else_branch/else/matmul",
        "if/then_branch/then/matmul",
        "if/then_branch/then/inner_if/then_branch/inner_then/matmul",
    ]
    assert {s.graph for s in find_sites(zoo.build("loop"))} == {"loop/body"}


def test_tap_info_for_rank_unknown_matmul_operand_is_rows():
    """A MatMul operand of unknown rank is viewed as [-1, C]: pos_sumsq has one value per row."""
    info = sk.TapInfo(None)
    assert info.as_rows and info.axes() == (1, 0)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_allclose(
        sk.reference("pos_sumsq", x, info, sk.SketchOptions()), (x.reshape(6, 4) ** 2).sum(1)
    )
    assert sk.TapInfo(None, channel_axis=1, seq_axis=-1).axes() is None  # channel-first: not a row view
