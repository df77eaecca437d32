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
from onnx_opscope.instrument import inject
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
    assert check_taps(live, run_all(inst, feeds), values, OPTS) == sum(len(t.sketches) for t in live)


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
    assert check_taps(live, run_all(inst, feeds), values, opts) == len(live) * len(SAMPLED)


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
    check_taps(live, run_all(inst, feeds), values, manifest.sketch_options())


ROWS = ["pos_sumsq", "adj_sumsq"]


def row_groups(model, live) -> set:
    """The (graph, shape, axes) of the taps that read rows: one shared index each."""
    table = infer_shapes(model)
    return {
        (t.graph, tuple(table.shape(t.tensor)), t.info().axes()) for t in live if sk.reads_rows(t.sketches)
    }


def ranges(model) -> tuple[int, int]:
    """(Range nodes of the shared indices, Range nodes inside the taps' If branches)."""
    shared = sum(n.op_type == "Range" and n.name.startswith("opscope_r") for n in model.graph.node)
    own = 0
    stack = [a.g for n in model.graph.node for a in n.attribute if a.g.node]
    while stack:
        g = stack.pop()
        own += sum(n.op_type == "Range" for n in g.node)
        stack.extend(a.g for n in g.node for a in n.attribute if a.g.node)
    return shared, own


@pytest.mark.parametrize("sizes", [{"hw": 64}, {"hw": 96, "n": 2}])
def test_det_taps_share_one_row_index_per_shape(sizes):
    """pos_sumsq and adj_sumsq on ppocrv4_det's symbolic shapes: three Ranges (rows, pairs, the pairs'
    rows) per distinct (shape, axes), not per tap; every value equals numpy's at two input sizes."""
    model = load_model(real_model_path("ppocrv4_det"))
    inst, manifest = inject(model, None, ROWS, OPTS)
    live = [t for t in manifest.taps if not t.constant and t.graph == ""]
    groups = row_groups(model, live)
    assert len(groups) < len(live) / 3
    assert ranges(inst) == (3 * len(groups), 0)
    feeds = real_feeds("ppocrv4_det", **sizes)
    values = tensor_values(model, tapped_names(live), feeds)
    assert check_taps(live, run_all(inst, feeds), values, OPTS) == sum(len(t.sketches) for t in live)


def test_bert_like_row_index_shared_at_two_sequence_lengths():
    """A transformer's [batch, seq, hidden] taps (channel last, rows along seq) share their rows and
    pairs; the values still equal numpy's at a sequence length the shared index was not built for."""
    from onnx_opscope import zoo
    from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds

    model = zoo.bert_like(hidden=64, layers=2, heads=2, vocab=100, max_seq=64)
    inst, manifest = inject(model, None, [*ROWS, "min"], OPTS)
    live = [t for t in manifest.taps if not t.constant]
    groups = row_groups(model, live)
    assert ranges(inst) == (3 * len(groups), 0) and len(groups) < len(live) / 3
    for seq in (7, 33):
        feeds = synthetic_feeds(model, FeedSpec(dims={"batch": 2, "seq": seq}), seq)
        values = tensor_values(model, tapped_names(live), feeds)
        assert check_taps(live, run_all(inst, feeds), values, OPTS) == sum(len(t.sketches) for t in live)


def test_static_shapes_take_constant_row_indices():
    """Static shapes: rows and pairs are initializers, no index node at all."""
    model = static_model()
    inst, manifest = inject(model, None, ROWS, sk.SketchOptions(copy_out_max=0, max_rows=5, adj_pairs=3))
    assert ranges(inst) == (0, 0)
    live = [t for t in manifest.taps if not t.constant]
    feeds = {"x": np.random.default_rng(2).standard_normal((6, 40)).astype(np.float32)}
    values = tensor_values(model, tapped_names(live), feeds)
    assert check_taps(live, run_all(inst, feeds), values, manifest.sketch_options()) == len(live) * len(ROWS)


def test_unknown_shapes_keep_their_own_row_index():
    """Taps of unknown rank (read as [rows, channels]) compute their own rows and pairs, as before."""
    model = static_model()
    for v in (model.graph.input[0], model.graph.output[0]):
        v.type.tensor_type.ClearField("shape")
    inst, manifest = inject(model, None, ROWS, sk.SketchOptions(copy_out_max=0))
    live = [t for t in manifest.taps if not t.constant]
    assert ranges(inst) == (0, 2 * 3 * len(live))  # rows, pairs and the pairs' rows in either branch
    feeds = {"x": np.random.default_rng(4).standard_normal((6, 40)).astype(np.float32)}
    values = tensor_values(model, tapped_names(live), feeds)
    check_taps(live, run_all(inst, feeds), values, manifest.sketch_options())
