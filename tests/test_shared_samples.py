"""Sample indices shared by the taps of one shape (`instrument.samples`): one index per shape, and
every tap's sample still the one `sample_positions` defines, at every input size."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from conftest import real_model_path
from onnx import TensorProto, helper, numpy_helper
from test_sketches import check_taps, real_feeds, run_all, tapped_names, tensor_values

from onnx_opscope import sketch as sk
from onnx_opscope.graph.io import load_model
from onnx_opscope.instrument import inject, unpacked
from onnx_opscope.shapes import infer_shapes
from onnx_opscope.shapes.symbolic import Poly, prod

SAMPLED = ["hist", "elemsig", "min", "max"]
OPTS = sk.SketchOptions(copy_out_max=0, sample_size=256)  # 256: most of these tensors are sampled, not whole


def opscope_ops(model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node if n.name.startswith("opscope"))


@pytest.mark.parametrize("sizes", [{"hw": 64}, {"hw": 96, "n": 2}])
def test_det_taps_share_one_index_per_shape(sizes):
    """ppocrv4_det's Conv taps have symbolic shapes (batch, height, width): one Range per distinct
    shape, not per tap, and every sample equals numpy's at two input sizes the shapes never saw."""
    model = load_model(real_model_path("ppocrv4_det"))
    inst, manifest = inject(model, None, SAMPLED, OPTS)
    live = [t for t in manifest.taps if not t.constant and t.graph == ""]
    table = infer_shapes(model)
    shapes = {prod(table.shape(t.tensor)) for t in live}
    assert None not in shapes and all(isinstance(n, Poly) for n in shapes)
    assert len(shapes) < len(live) / 3  # the sharing is worth something here
    assert opscope_ops(inst)["Range"] == len(shapes)
    feeds = real_feeds("ppocrv4_det", **sizes)
    values = tensor_values(model, tapped_names(live), feeds)
    assert check_taps(live, unpacked(manifest, run_all(inst, feeds)), values, OPTS) == sum(
        len(t.sketches) for t in live
    )


def static_model() -> tuple:
    """Three MatMuls on static shapes, two of them [6, 40] outputs (240 elements: g = 16) and one
    [6, 7] (42: g = 1), plus their inputs."""
    rng = np.random.default_rng(3)
    w1, w2, w3 = (rng.standard_normal(s).astype(np.float32) for s in ((40, 40), (40, 40), (40, 7)))
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["a"]),
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["b"]),
            helper.make_node("MatMul", ["b", "w3"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 7])],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_static_shapes_take_constant_indices():
    """Static shapes: the index is two initializers per shape, no index node at all."""
    model = static_model()
    opts = sk.SketchOptions(copy_out_max=0, sample_size=64)
    inst, manifest = inject(model, None, SAMPLED, opts)
    ops = opscope_ops(inst)
    assert ops["Range"] == ops["Floor"] == ops["Size"] == 0 and ops["Gather"] == 5  # x, a, r, b, y
    live = [t for t in manifest.taps if not t.constant]
    feeds = {"x": np.random.default_rng(0).standard_normal((6, 40)).astype(np.float32)}
    values = tensor_values(model, tapped_names(live), feeds)
    assert check_taps(live, unpacked(manifest, run_all(inst, feeds)), values, opts) == len(live) * len(
        SAMPLED
    )


def test_unknown_shapes_keep_their_own_index():
    """A tap whose shape the table does not know computes its own index, as before the sharing."""
    model = static_model()
    for v in (model.graph.input[0], model.graph.output[0]):  # rank unknown: every shape unknown
        v.type.tensor_type.ClearField("shape")
    inst, manifest = inject(model, None, SAMPLED, sk.SketchOptions(copy_out_max=0, sample_size=64))
    live = [t for t in manifest.taps if not t.constant]
    assert opscope_ops(inst)["Range"] == len(live)
    feeds = {"x": np.random.default_rng(1).standard_normal((6, 40)).astype(np.float32)}
    values = tensor_values(model, tapped_names(live), feeds)
    check_taps(live, unpacked(manifest, run_all(inst, feeds)), values, manifest.sketch_options())
