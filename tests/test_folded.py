"""Tensors made from weights alone are tapped as weights (`instrument.folded`): no nodes, no outputs,
sketched once on the host, and every sketch equal to its reference on the tensor the model makes."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import real_model_path
from onnx import TensorProto, helper, numpy_helper
from test_sketches import check_taps, inline_taken_ifs, real_feeds, run_all, tensor_values

from onnx_opscope import sketch as sk
from onnx_opscope.graph.index import ModelIndex
from onnx_opscope.instrument import decode_taps, host_values, inject, unpacked
from onnx_opscope.instrument.folded import chain
from onnx_opscope.sites import Selection

OPTS = sk.SketchOptions(copy_out_max=0)


def weight_layouts_model() -> onnx.ModelProto:
    """y = x @ Cast(Transpose(W)); z = y @ Relu(V): the first weight is a layout change of an
    initializer (folded), the second goes through an op that is not foldable (stays in the graph)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 8)).astype(np.float16)
    v = rng.standard_normal((6, 5)).astype(np.float32)
    g = helper.make_graph(
        [
            helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]),
            helper.make_node("Cast", ["wt"], ["w32"], to=TensorProto.FLOAT),
            helper.make_node("MatMul", ["x", "w32"], ["y"]),
            helper.make_node("Relu", ["V"], ["vr"]),
            helper.make_node("MatMul", ["y", "vr"], ["z"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 5])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_layout_changes_of_a_weight_are_weight_taps():
    model = weight_layouts_model()
    inst, manifest = inject(model, Selection(op_types=("MatMul",)), None, OPTS)
    taps = {t.tensor: t for t in manifest.taps}
    assert taps["w32"].constant and not taps["w32"].outputs  # folded: no node, no output
    assert not taps["vr"].constant and taps["vr"].outputs  # Relu is not a layout change
    assert not taps["x"].constant and not taps["y"].constant
    reads = {i for n in inst.graph.node if n.name.startswith("opscope") for i in n.input}
    assert "w32" not in reads and "vr" in reads
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)}
    values = tensor_values(model, sorted(taps), feeds)
    host = host_values(manifest, model)
    got, shape = host[taps["w32"].id]
    assert shape == [8, 6]
    np.testing.assert_array_equal(values["w32"], np.asarray(model_w(model).T, np.float32))
    assert check_taps(manifest.taps, unpacked(manifest, run_all(inst, feeds)), values, OPTS, host) > 0
    # the instrumented model's own host values are the same (its chain is untouched)
    again = host_values(manifest, inst)
    for name in taps["w32"].sketches:
        np.testing.assert_array_equal(again[taps["w32"].id][0][name], got[name])


def model_w(model: onnx.ModelProto) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))


def test_a_tensor_reading_an_input_is_not_folded():
    model = weight_layouts_model()
    index = ModelIndex(model)
    assert [n.op_type for n in chain(index, "", "w32") or []] == ["Transpose", "Cast"]
    assert chain(index, "", "W") is None  # a constant itself
    assert chain(index, "", "y") is None  # reads x
    assert chain(index, "", "vr") is None  # Relu


def test_silero_lstm_weights_are_folded():
    """silero_vad_v6's LSTMs read W, R and B sliced and unsqueezed from initializers inside their `If`
    branches: weight taps, and those of the branches that ran equal numpy on the tensors the model made
    (test_sketches.test_silero_subgraph_taps_match_reference checks every tap the same way)."""
    path = real_model_path("silero_vad_v6")
    model = onnx.load(path)
    inst, manifest = inject(path, Selection(op_types=("LSTM",)), None, OPTS)
    index = ModelIndex(model)
    folded = [t for t in manifest.taps if chain(index, t.graph, t.tensor) is not None]
    assert len(folded) == 8 and all(t.constant and not t.outputs for t in folded)
    feeds = real_feeds("silero_vad_v6")  # 16 kHz
    host = host_values(manifest, model)
    outs = unpacked(manifest, run_all(inst, feeds))
    decoded = decode_taps(manifest, outs, host)
    ran = [t for t in folded if decoded[t.id][1] is not None]
    assert len(ran) == 2  # W and R of the one LSTM whose branches ran
    values = tensor_values(inline_taken_ifs(model, feeds), sorted({t.tensor for t in ran}), feeds)
    assert check_taps(ran, outs, values, OPTS, host) == sum(len(t.sketches) for t in ran)


def test_a_chain_over_the_weight_budget_stays_in_the_graph(monkeypatch):
    """The host would hold the chain's weights while evaluating it: above MAX_LEAF_BYTES the tap keeps
    its nodes (and still equals its reference)."""
    from onnx_opscope.instrument import folded

    model = weight_layouts_model()
    assert chain(ModelIndex(model), "", "w32") is not None
    monkeypatch.setattr(folded, "MAX_LEAF_BYTES", 6 * 8 * 2 - 1)  # W is 6 x 8 float16: 96 bytes
    assert chain(ModelIndex(model), "", "w32") is None
    inst, manifest = inject(model, Selection(op_types=("MatMul",)), None, OPTS)
    tap = next(t for t in manifest.taps if t.tensor == "w32")
    assert not tap.constant and tap.outputs
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)}
    values = tensor_values(model, ["w32"], feeds)
    assert check_taps([tap], unpacked(manifest, run_all(inst, feeds)), values, OPTS) == len(tap.sketches)
