"""The graph layer on its own: the model index, the wire-level splice, exposing subgraph tensors, the builder."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import generated_model_path, real_model_path
from onnx import GraphProto, TensorProto, helper, numpy_helper

from onnx_opscope import zoo
from onnx_opscope.graph import Builder, ModelIndex, Names, iter_graphs, node_ids
from onnx_opscope.graph.expose import expose
from onnx_opscope.graph.wire import Chunk, count_in_strings, node_entry, splice, varint
from onnx_opscope.run.session import RuntimeConfig, make_session

F = TensorProto.FLOAT
CFG = RuntimeConfig(graph_opt="disable")


def _if_model() -> onnx.ModelProto:
    """x -> unnamed If (then: Relu + a Loop whose body multiplies by a weight of the main graph; else: Neg)."""
    w = numpy_helper.from_array(np.full((2, 2), 0.5, np.float32), "w")
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond"], ["cond_out"]),
            helper.make_node("MatMul", ["state", "w"], ["mm"], name="body_mm"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state", F, [2, 2]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("mm", F, [2, 2]),
        ],
    )
    trips = numpy_helper.from_array(np.array(3, np.int64), "trips")
    then = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Loop", ["trips", "", "r"], ["then_y"], body=body),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("then_y", F, [2, 2])],
        [trips],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["else_y"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_y", F, [2, 2])],
    )
    g = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["x2"], name="pre"),
            helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", F, [2, 2]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", F, [2, 2])],
        [w],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = make_session(model, CFG)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


# --------------------------------------------------------------------------------------------
# the model index


def test_index_paths_ids_owners_and_scopes():
    m = _if_model()
    index = ModelIndex(m)
    # depth first, a node's graphs in attribute order (onnx.helper sorts them: else_branch first)
    assert list(index.graphs) == ["", "If_0/else_branch", "If_0/then_branch", "If_0/then_branch/Loop_0/body"]
    body = index["If_0/then_branch/Loop_0/body"]
    assert body.parent == "If_0/then_branch" and body.owner.op_type == "Loop" and body.attr == "body"
    assert body.owner_index == 1 and body.carried
    assert body.ids == ["If_0/then_branch/Loop_0/body/Identity_0", "If_0/then_branch/Loop_0/body/body_mm"]
    assert [e.path for e in index.scopes(body.path)] == [body.path, "If_0/then_branch", ""]
    # constants seen from a body include the enclosing graphs' initializers
    assert index.is_constant(body.path, "w") and index.is_constant(body.path, "trips")
    assert not index.is_constant("", "trips") and index.constant_dims(body.path, "w") == [2, 2]
    assert index.defines(body.path, "x2") and not index.defines("", "r")
    assert [c.path for c in index.children("", 1)] == ["If_0/else_branch", "If_0/then_branch"]
    assert index.main.producer("x2").name == "pre" and [n.op_type for n in index.main.consumers("flag")] == [
        "If"
    ]


def test_index_walk_orders():
    index = ModelIndex(_if_model())
    pre = [n.op_type for _, _, n in index.nodes()]
    post = [n.op_type for _, _, n in index.nodes(subgraphs_first=True)]
    assert pre == ["Relu", "If", "Neg", "Relu", "Loop", "Identity", "MatMul"]
    assert post == ["Relu", "Neg", "Relu", "Identity", "MatMul", "Loop", "If"]
    assert [p for p, _ in iter_graphs(_if_model().graph)] == list(index.graphs)


def test_node_ids_are_stable_when_named_nodes_are_inserted():
    """Unnamed nodes count among the unnamed of their op type, so named taps do not shift them."""
    g = GraphProto()
    g.node.extend(
        [
            helper.make_node("Relu", ["a"], ["b"]),
            helper.make_node("Relu", ["b"], ["c"]),
            helper.make_node("Relu", ["c"], ["d"], name="r"),
        ]
    )
    before = node_ids(g)
    g.node.insert(1, helper.make_node("Relu", ["b"], ["t"], name="opscope_t0_n_Relu"))
    after = node_ids(g)
    assert before == ["Relu_0", "Relu_1", "r"] and after == ["Relu_0", "opscope_t0_n_Relu", "Relu_1", "r"]
    g.node.append(helper.make_node("Relu", ["d"], ["e"], name="r"))
    g.node.append(helper.make_node("Relu", ["e"], ["f"], name="Relu_0"))
    assert node_ids(g, "p")[-2:] == ["p/r#2", "p/Relu_0#2"]


def test_index_names_and_allocator():
    names = ModelIndex(_if_model()).names()
    for used in ("x", "w", "then_y", "body_mm", "mm", "trips", "pre"):
        assert used in names
    assert names.fresh("x") == "x_1" and names.fresh("x") == "x_2" and names.fresh("new") == "new"
    assert "" not in names and names.any_startswith("body")


def test_index_marks_graphs_that_cannot_carry_outputs():
    beam = helper.make_node(
        "BeamSearch", ["x"], ["y"], domain="com.microsoft", decoder=helper.make_graph([], "d", [], [])
    )
    g = helper.make_graph(
        [beam],
        "g",
        [helper.make_tensor_value_info("x", F, [1])],
        [helper.make_tensor_value_info("y", F, [1])],
    )
    index = ModelIndex(helper.make_model(g))
    assert not index["BeamSearch_0/decoder"].carried and index.main.carried


# --------------------------------------------------------------------------------------------
# wire-level encoding


@pytest.mark.parametrize("payload", [0, 100, 200, 20_000, 3_000_000])
def test_node_entry_round_trips_every_length_class(payload):
    """One- to four-byte varint lengths: the entry parses back as the same node inside a GraphProto."""
    node = helper.make_node("Identity", ["a"], ["b"], name="n" * max(payload, 1))
    data = node.SerializeToString()
    g = GraphProto.FromString(node_entry(data) + node_entry(data))
    assert len(g.node) == 2 and g.node[0] == node and g.node[1] == node


def test_varint_matches_protobuf():
    for n in (0, 1, 127, 128, 300, 16383, 16384, 2**21, 2**31):
        t = TensorProto()
        t.dims.append(n)
        assert t.SerializeToString() == b"\x08" + varint(n)  # TensorProto.dims is field 1, varint


def test_splice_positions_and_chunks():
    g = helper.make_graph(
        [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"n{i}") for i in range(3)], "g", [], []
    )
    mk = lambda name: helper.make_node("Identity", ["t0"], [name], name=name)  # noqa: E731
    chunk_g = GraphProto()
    chunk_g.node.extend([mk("c1"), mk("c2")])
    moved = splice(g, {-1: [mk("first")], 0: [Chunk(chunk_g.SerializeToString(), 2)], 2: [mk("last")]})
    assert [n.name for n in g.node] == ["first", "n0", "c1", "c2", "n1", "n2", "last"]
    assert moved == [1, 4, 5]
    assert [g.node[i].name for i in moved] == ["n0", "n1", "n2"]


def test_count_in_strings_sees_names_not_raw_bytes():
    ph = "\x1e\x1d\x1d"
    sub = helper.make_graph([helper.make_node("Neg", [ph + "a"], [ph + "b"])], "s", [], [])
    t = numpy_helper.from_array(
        np.frombuffer(ph.encode(), np.uint8).copy(), "c"
    )  # the placeholder as raw data
    n = helper.make_node("If", [ph], [ph + "y"], name=ph, then_branch=sub, else_branch=sub)
    g = GraphProto()
    g.node.append(n)
    g.initializer.append(t)
    counts = count_in_strings(g, (ph,))
    assert counts == [7]  # name, input, output, and the two branches' input and output
    assert g.SerializeToString().count(ph.encode()) == 8  # the raw bytes hold one more: not a name


# --------------------------------------------------------------------------------------------
# expose and the builder


def test_expose_carries_tensors_out_of_if_and_loop():
    m = _if_model()
    index = ModelIndex(m)
    names = index.names()
    out_r, stacked_r = expose(index, "If_0/then_branch", "r", F, 2, names)
    out_mm, stacked_mm = expose(index, "If_0/then_branch/Loop_0/body", "mm", F, 2, names)
    assert stacked_r == 0 and stacked_mm == 1
    assert [o.name for o in m.graph.output] == ["y", out_r, out_mm]
    onnx.checker.check_model(m)
    x = np.array([[1.0, -2.0], [3.0, -4.0]], np.float32)
    on = _run(m, {"x": x, "flag": np.array(True)})
    np.testing.assert_array_equal(on[out_r], np.maximum(x, 0))
    state, want = np.maximum(x, 0), []
    for _ in range(3):
        state = state @ np.full((2, 2), 0.5, np.float32)
        want.append(state)
    np.testing.assert_allclose(on[out_mm], np.stack(want), rtol=1e-6)
    off = _run(m, {"x": x, "flag": np.array(False)})
    assert off[out_r].size == 0 and off[out_mm].size == 0  # the branch that did not run: empty


def test_builder_reduce_and_minimum_at_old_and_new_opsets():
    """One call at every opset: axes as attribute or input, Min on int64 or Where."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for opset in (7, 8, 9, 10, 11, 13, 17, 18, 21):
        b = Builder(opset, Names({"x"}), "t_")
        s = b.reduce("ReduceSum", "x", [1], keepdims=0)
        mx = b.reduce("ReduceMax", "x", [0], keepdims=0)
        k = b.minimum(b.op("Shape", ["x"]), b.i64([2, 2]))
        g = helper.make_graph(
            b.nodes,
            "g",
            [helper.make_tensor_value_info("x", F, [3, 4])],
            [
                helper.make_tensor_value_info(n, e, [None])
                for n, e in ((s, F), (mx, F), (k, TensorProto.INT64))
            ],
        )
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
        onnx.checker.check_model(m)
        got = make_session(m, CFG).run(None, {"x": x})
        np.testing.assert_array_equal(got[0], x.sum(1))
        np.testing.assert_array_equal(got[1], x.max(0))
        np.testing.assert_array_equal(got[2], [2, 2])
        reduce_sum = next(n for n in b.nodes if n.op_type == "ReduceSum")
        assert (len(reduce_sum.input) == 2) == (opset >= 13), opset


def test_zoo_builds_on_the_one_builder():
    assert issubclass(zoo.GraphBuilder, Builder)
    with pytest.raises(ValueError, match="duplicate node name"):
        g = zoo.GraphBuilder("g", 17)
        g.op("Relu", ["x"], "same")
        g.op("Relu", ["x"], "same")


def test_index_on_real_models_matches_the_old_walk():
    """Every graph is found once, with every node: silero's nested Ifs and a big plain graph."""
    for model in (
        onnx.load(str(real_model_path("silero_vad_v6"))),
        onnx.load(str(generated_model_path("scan"))),
    ):
        index = ModelIndex(model)
        seen = sum(len(e.graph.node) for e in index.graphs.values())
        assert seen == sum(1 for _ in index.nodes())
        ids = [i for e in index.graphs.values() for i in e.ids]
        assert len(ids) == len(set(ids))
