"""Weight plans applied: each node pattern against the plan's own reconstruction, and end-to-end parity.

The reference for every rewrite is the model with each planned weight replaced by
`weights.menu.reconstruct` of its option (numpy, `folded` below): MatMulNBits, DequantizeLinear and
the two-matmul low rank must compute that model's outputs to float tolerance. Sessions run at
graph_opt "basic", where onnxruntime does not fuse DequantizeLinear + MatMul into its int8-activation
MatMulNBits; the parity tests score at the default ("all"), as a user would run.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import generated_model_path, real_model_path
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph.index import ModelIndex
from onnx_opscope.graph.io import load_model, opset_version
from onnx_opscope.graph.proto import attr, constant_value
from onnx_opscope.run.feeds import FeedSpec, input_signature, synthetic_feeds
from onnx_opscope.run.parity import parity_models
from onnx_opscope.run.session import RuntimeConfig, make_session
from onnx_opscope.transform.weight_plan import apply_weight_plan
from onnx_opscope.weights.matrix import WeightView, find_weights, from_matrix
from onnx_opscope.weights.menu import Option, option_from_dict, reconstruct

EXACT = RuntimeConfig(graph_opt="basic")
GEMMS = ("MatMul", "Gemm")
CONVS = ("Conv", "ConvTranspose", "Gemm")


def option(kind: str, **params) -> dict:
    return Option(kind, kind, 0.0, 0, 0, params).to_dict()


def plan_for(model, kind: str, ops=GEMMS, **params) -> dict:
    """One option for every weight read by `ops`."""
    return {
        "layers": [
            {"weight": v.name, "graph": v.graph, "shape": list(v.shape), "option": option(kind, **params)}
            for v, _ in find_weights(model)
            if v.op in ops
        ]
    }


def feeds_for(model, batch: int = 4) -> dict[str, np.ndarray]:
    dims = {d: batch for s in input_signature(model) for d in s.dims or () if isinstance(d, str)}
    return synthetic_feeds(model, FeedSpec(dims=dims))


def outputs(model, feeds, base_dir=None) -> dict[str, np.ndarray]:
    sess = make_session(model, EXACT, base_dir=base_dir)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def max_rel(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(a[k]).max(), 1e-30)) for k in a)


def folded(model, plan: dict) -> ModelProto:
    """The model with each planned weight replaced by its option's reconstruction, nothing else changed."""
    m = ModelProto()
    m.CopyFrom(load_model(model))
    chosen = {(p["graph"], p["weight"]): option_from_dict(p["option"]) for p in plan["layers"]}
    index = ModelIndex(m)
    for view, load in find_weights(m, min_elements=1):
        if (view.graph, view.name) not in chosen:
            continue
        array = from_matrix(view, reconstruct(load(), chosen[view.graph, view.name])).astype(view.dtype)
        src = index[view.graph].constants[view.name]
        target = src if isinstance(src, TensorProto) else constant_value(src)
        target.CopyFrom(numpy_helper.from_array(array, target.name))
    return m


def stored(model: ModelProto, view: WeightView) -> np.ndarray:
    src = ModelIndex(model)[view.graph].constants[view.name]
    return numpy_helper.to_array(src if isinstance(src, TensorProto) else constant_value(src))


def gemm_opset21() -> ModelProto:
    """y = 0.5 x @ W^T + b, W [16, 40] (Gemm transB=1, alpha 0.5: not a MatMulNBits) at opset 21."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((16, 40)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="fc", alpha=0.5, transB=1)],
        "gemm21",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        [w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


# --------------------------------------------------------------------------------------------
# every node pattern computes the reconstruction


PATTERNS = [
    # model, kind, params, ops, how the planned weights end up
    ("mlp", "int8_channel", {"bits": 8}, GEMMS, {"DequantizeLinear int8 per-axis"}),
    ("mlp", "int4_group", {"bits": 4, "group": 32}, GEMMS, {"MatMulNBits"}),  # the Gemm's bias goes along
    ("cnn", "int4_channel", {"bits": 4}, ("Conv",), {"folded"}),  # int4 DequantizeLinear is 21+
    ("transformer_block", "int4_group", {"bits": 4, "group": 32}, GEMMS, {"MatMulNBits"}),
    ("transformer_block", "int4_channel", {"bits": 4}, GEMMS, {"MatMulNBits"}),
    ("opset21_mlp", "int4_group", {"bits": 4, "group": 8}, GEMMS, {"DequantizeLinear int4 blocked"}),
    ("opset21_mlp", "int8_group", {"bits": 8, "group": 16}, GEMMS, {"DequantizeLinear int8 blocked"}),
    ("opset11_mlp", "int8_channel", {"bits": 8}, GEMMS, {"folded"}),  # per-axis DequantizeLinear is 13+
    ("cnn", "int8_channel", {"bits": 8}, CONVS, {"DequantizeLinear int8 per-axis"}),  # ConvTranspose: axis 1
    ("mlp", "lowrank", {"rank": 8}, GEMMS, {"two MatMuls", "two Gemms"}),
    ("if_model", "int4_group", {"bits": 4, "group": 16}, GEMMS, {"MatMulNBits"}),  # readers in If branches
    ("loop", "lowrank", {"rank": 4}, GEMMS, {"two MatMuls"}),  # reader in a Loop body
    ("cnn", "lowrank", {"rank": 2}, ("Conv",), {"folded"}),
]


@pytest.mark.parametrize(
    ("name", "kind", "params", "ops", "hows"),
    PATTERNS,
    ids=lambda x: str(sorted(x) if isinstance(x, set) else x)[:24],  # sets: the same id in every worker
)
def test_pattern_computes_the_reconstruction(name, kind, params, ops, hows):
    path = generated_model_path(name)
    plan = plan_for(path, kind, ops, **params)
    model, applied = apply_weight_plan(path, plan)
    assert {a.how for a in applied.layers} == hows
    assert all(bool(a.note) == (a.how == "folded") for a in applied.layers)
    onnx.checker.check_model(model)
    assert opset_version(model) == opset_version(load_model(path)) == applied.opset  # never upgraded
    assert any(o.domain == "com.microsoft" for o in model.opset_import) == ("MatMulNBits" in hows)
    feeds = feeds_for(path)
    ref, got, base = outputs(folded(path, plan), feeds), outputs(model, feeds), outputs(path, feeds)
    assert max_rel(ref, got) < 1e-5
    assert max_rel(base, ref) > 1e-4  # the option does change the model: the match above means something


def test_weight_read_both_ways():
    """W [16, 16] read as Gemm(transB=1) B and as MatMul B: the view is the Gemm's ([N, K] = W), so the
    MatMul reads its transpose. Low rank factors B itself (both readers get it); MatMulNBits does not apply."""
    rng = np.random.default_rng(5)
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "W"], ["y1"], name="gemm", transB=1),
            helper.make_node("MatMul", ["x", "W"], ["y2"], name="matmul"),
        ],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["batch", 16]) for y in ("y1", "y2")],
        [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "W")],
    )
    src = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": rng.standard_normal((8, 16)).astype(np.float32)}
    for kind, params, how in [
        ("int4_group", {"bits": 4, "group": 16}, "folded"),
        ("lowrank", {"rank": 5}, "two Gemms / MatMuls"),
    ]:
        plan = plan_for(src, kind, **params)
        model, applied = apply_weight_plan(src, plan)
        assert [a.how for a in applied.layers] == [how]
        assert max_rel(outputs(folded(src, plan), feeds), outputs(model, feeds)) < 1e-5


def test_int4_dequantize_linear_on_a_gemm_at_opset_21():
    src = gemm_opset21()
    feeds = {"x": np.random.default_rng(0).standard_normal((8, 40)).astype(np.float32)}
    for kind, params, how in [
        ("int4_channel", {"bits": 4}, "DequantizeLinear int4 per-axis"),
        ("int4_group", {"bits": 4, "group": 16}, "DequantizeLinear int4 blocked"),  # along axis 1 (transB)
        ("int8_channel", {"bits": 8}, "DequantizeLinear int8 per-axis"),
    ]:
        plan = plan_for(src, kind, **params)
        model, applied = apply_weight_plan(src, plan)
        assert [a.how for a in applied.layers] == [how]
        dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
        assert attr(dq, "axis") == (1 if "blocked" in how else 0)
        assert max_rel(outputs(folded(src, plan), feeds), outputs(model, feeds)) < 1e-5


def unpack_nbits(model: ModelProto, node) -> np.ndarray:
    """The [N, K] weight a MatMulNBits node computes with: (code - 8) * scale, unpacked with numpy."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    packed, scales = inits[node.input[1]], inits[node.input[2]]
    k, n, block = attr(node, "K"), attr(node, "N"), attr(node, "block_size")
    blocks = -(-k // block)
    assert packed.shape == (n, blocks, block // 2) and scales.shape == (n * blocks,)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, blocks * block).astype(np.float32)
    return ((codes - 8) * np.repeat(scales.reshape(n, blocks), block, axis=1))[:, :k]


@pytest.mark.parametrize(
    ("kind", "params"), [("int4_group", {"bits": 4, "group": 128}), ("int4_channel", {"bits": 4})]
)
def test_matmul_nbits_packs_the_reconstruction(kind, params):
    """captcha_crnn: its LSTM Gemms (transB=1, each weight read by 20, a bias each) and its MatMul on a
    Constant [200, 37]; unpacked by hand, every MatMulNBits holds exactly the reconstructed weight."""
    path = real_model_path("captcha_crnn")
    plan = plan_for(path, kind, **params)
    model, applied = apply_weight_plan(path, plan)
    src = load_model(path)
    views = {v.name: (v, load) for v, load in find_weights(path)}
    readers = {n.name: n for n in src.graph.node}
    packed = [a for a in applied.layers if a.how == "MatMulNBits"]
    assert len(packed) == 4 and sum(len(a.nodes) for a in packed) == 61
    assert [a.note for a in applied.layers if a.how == "folded"] == [
        "int4 DequantizeLinear needs opset 21, the model has 17"
    ]
    nodes = {n.name: n for n in model.graph.node}
    for layer, entry in zip(applied.layers, plan["layers"]):
        if layer.how != "MatMulNBits":
            continue
        view, load = views[layer.weight]
        expect = reconstruct(load(), option_from_dict(entry["option"]))
        assert not any(
            n.output and n.output[0] == layer.weight for n in model.graph.node
        )  # Constant gone too
        assert layer.weight not in {t.name for t in model.graph.initializer}
        for node_id in layer.nodes:
            node, before = nodes[node_id], readers[node_id]
            block = (
                params.get("group") or 1 << (view.cols - 1).bit_length()
            )  # per channel: all of K in one block
            assert (node.op_type, attr(node, "block_size"), attr(node, "bits")) == ("MatMulNBits", block, 4)
            assert node.input[0] == before.input[0] and list(node.output) == list(before.output)
            assert list(node.input[5:]) == list(before.input[2:])  # a Gemm's bias
            np.testing.assert_array_equal(unpack_nbits(model, node), expect)
        blocks = -(-view.cols // block)
        assert layer.bytes_after == view.rows * blocks * (block // 2 + 4)  # codes and a float32 scale a block
    summary = parity_models(path, model, FeedSpec(batches=2), layers=False).summary()
    assert summary["cosine"] > 0.99 and summary["top1"] >= 0.95
    assert applied.bytes_after < 0.2 * applied.bytes_before


FOLDED = {
    "transformer_block": {
        "block/attn/q_proj.weight": option("ternary"),
        "block/attn/k_proj.weight": option("sparse_2_4", n=2, m=4),
        "block/attn/v_proj.weight": option("monarch", blocks=8),
        "block/mlp/fc1.weight": option("tt", row_factors=[16, 16], col_factors=[8, 8], ranks=[1, 8, 1]),
    },
    "cnn": {
        "grouped.weight": option("tucker", ranks=[8, 2], shape=[32, 4, 3, 3]),
        "depthwise.weight": option("lowrank", rank=3),  # a Conv kernel is not two matmuls
    },
}


@pytest.mark.parametrize("name", sorted(FOLDED))
def test_folded_kinds_are_exactly_the_reconstruction(name):
    """ternary, 2:4, Monarch, TT, Tucker (and low rank on a Conv): the weight becomes `reconstruct`, same dtype."""
    path = generated_model_path(name)
    plan = {"layers": [{"weight": w, "option": o} for w, o in FOLDED[name].items()]}
    model, applied = apply_weight_plan(path, plan)
    assert [a.how for a in applied.layers] == ["folded"] * len(plan["layers"])
    views = {v.name: (v, load) for v, load in find_weights(path)}
    for layer in applied.layers:
        view, load = views[layer.weight]
        expect = from_matrix(view, reconstruct(load(), option_from_dict(FOLDED[name][layer.weight])))
        got = stored(model, view)
        assert got.dtype == np.float32 and got.shape == view.shape
        np.testing.assert_array_equal(got, expect)
        assert np.abs(got - stored(load_model(path), view)).max() > 1e-3
        assert layer.bytes_after == layer.bytes_before == view.dense_bytes


# --------------------------------------------------------------------------------------------
# end to end


def test_dense_plan_is_a_no_op():
    for path in (generated_model_path("mlp"), real_model_path("captcha_crnn")):
        src = load_model(path)
        plan = {
            "layers": [
                {"weight": v.name, "graph": v.graph, "option": option("dense")} for v, _ in find_weights(src)
            ]
        }
        model, applied = apply_weight_plan(src, plan)
        assert model is not src and model.SerializeToString() == src.SerializeToString()
        assert {a.how for a in applied.layers} == {"unchanged"}
        assert applied.bytes_after == applied.bytes_before == sum(v.dense_bytes for v, _ in find_weights(src))


@pytest.mark.parametrize(
    ("name", "ops"),
    [
        ("captcha_crnn", (*GEMMS, "Conv")),
        ("transformer_block", GEMMS),
        ("mlp", GEMMS),
        ("cnn", ("Conv", "Gemm")),
    ],
)
def test_int8_per_channel_keeps_the_outputs(name, ops):
    path = real_model_path(name) if name == "captcha_crnn" else generated_model_path(name)
    plan = plan_for(path, "int8_channel", ops, bits=8)
    model, applied = apply_weight_plan(path, plan)
    assert {a.how for a in applied.layers} == {"DequantizeLinear int8 per-axis"}
    for layer, v in zip(applied.layers, (v for v, _ in find_weights(path) if v.op in ops)):
        assert layer.bytes_after == v.size + 4 * v.rows  # int8 codes + a float32 scale per output channel
    summary = parity_models(path, model, FeedSpec(batches=2), layers=False).summary()
    assert summary["cosine"] > 0.99
    assert summary["top1"] is None or summary["top1"] >= 0.95


def test_full_rank_low_rank_reproduces_the_model():
    for path, hows in [
        (
            real_model_path("captcha_crnn"),
            {"two Gemms", "two MatMuls"},
        ),  # 20 Gemms (transB=1) share each weight
        (generated_model_path("transformer_block"), {"two MatMuls"}),
    ]:
        layers = [
            {"weight": v.name, "graph": v.graph, "option": option("lowrank", rank=min(v.rows, v.cols))}
            for v, _ in find_weights(path)
            if v.op in GEMMS and v.size < 10**6  # the 400 x 4096 SVDs would take most of this file's time
        ]
        model, applied = apply_weight_plan(path, {"layers": layers})
        assert {a.how for a in applied.layers} == hows
        assert all(a.bytes_after > a.bytes_before for a in applied.layers)  # full rank stores more
        report = parity_models(
            path, model, FeedSpec(batches=2), RuntimeConfig(graph_opt="basic"), layers=False
        )
        assert report.summary()["max_rel"] < 1e-4


def test_external_data_and_input_left_alone(tmp_path):
    src = load_model(generated_model_path("mlp"))
    copy = ModelProto()
    copy.CopyFrom(src)  # onnx.save_model moves the weights out of the proto it saves
    onnx.save_model(
        copy, tmp_path / "mlp.onnx", save_as_external_data=True, location="mlp.data", size_threshold=0
    )
    path = tmp_path / "mlp.onnx"
    on_disk = load_model(path)
    before = on_disk.SerializeToString()
    plan = plan_for(path, "int8_channel", ("MatMul",), bits=8)
    model, applied = apply_weight_plan(path, plan)
    externals = {t.name for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert externals == {t.name for t in on_disk.graph.initializer} - {a.weight for a in applied.layers}
    feeds = feeds_for(path)
    inline, _ = apply_weight_plan(src, plan)
    assert max_rel(outputs(inline, feeds), outputs(model, feeds, base_dir=tmp_path)) == 0
    model2, _ = apply_weight_plan(on_disk, plan, base_dir=tmp_path)
    assert model2.SerializeToString() == model.SerializeToString()
    assert on_disk.SerializeToString() == before
    with pytest.raises(OpscopeError, match="external data"):
        apply_weight_plan(on_disk, plan)


# --------------------------------------------------------------------------------------------
# errors


def test_plan_errors_are_one_line():
    path = generated_model_path("mlp")
    good = plan_for(path, "int8_channel", bits=8)
    cases = [
        (
            {"layers": [{"weight": "fc1.weigth", "option": option("int8_channel", bits=8)}]},
            "did you mean 'fc1.weight'",
        ),
        (
            {
                "layers": [
                    {"weight": "fc1.weight", "option": option("int8_channel", bits=8) | {"kind": "int3"}}
                ]
            },
            "unknown kind 'int3'",
        ),
        (
            {"layers": [{**good["layers"][0], "shape": [1, 2]}]},
            r"\[64, 128\] in the model, \[1, 2\] in the plan",
        ),
        (
            {"layers": [{"weight": "fc1.weight", "option": option("int4_group", bits=4)}]},
            "without an integer params.group",
        ),
        ({"layers": [good["layers"][0], good["layers"][0]]}, "planned twice"),
        ({"budget": 0.5}, "'layers' list"),
    ]
    for plan, message in cases:
        with pytest.raises(OpscopeError, match=message) as err:
            apply_weight_plan(path, plan)
        assert "\n" not in str(err.value)
