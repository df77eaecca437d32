"""Weight taps: nothing in the graph, sketches computed once on the host (weights.host_values).

The values are held to the numpy references on the weights as read here, independently of
`host_values` (numpy_helper on the initializers, onnx.load with its external data), and to
plain numpy for min / max / sumsq, so a host value taken from the wrong tensor, the wrong
subgraph or the wrong bytes of a data file fails.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_sketches import run_all

from onnx_opscope import sketch as sk
from onnx_opscope import zoo
from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph import iter_graphs, load_model
from onnx_opscope.graph.proto import is_external
from onnx_opscope.instrument import (
    decode,
    decode_tap,
    decode_taps,
    host_values,
    inject,
    inject_file,
    load_manifest,
    unpacked,
)
from onnx_opscope.sites import Selection

F = TensorProto.FLOAT
SUMS = {"mean", "sumsq", "l1"}  # weights are read a chunk at a time: float64 sums in another order


def assert_reference(got: np.ndarray, ref: np.ndarray, stat: str, msg: str = "") -> None:
    """A host value equals its numpy reference: bit for bit, except sums (to 1e-12 relative)."""
    if stat in SUMS:
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0, err_msg=f"{msg} {stat}")
    else:
        np.testing.assert_array_equal(got, ref, err_msg=f"{msg} {stat}")


def bert_feeds(batch: int = 2, seq: int = 16, vocab: int = 100) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq))
    mask = np.ones((batch, seq), np.int64)
    mask[1, seq * 3 // 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def rows_by_key(rows) -> dict[tuple[str, str, str], tuple[np.ndarray, int, tuple]]:
    """(site, role, stat) -> (values, numel, (M, K, N))."""
    out: dict[tuple[str, str, str], tuple[list, int, tuple]] = {}
    cols = rows.to_pydict()
    for site, role, stat, v, numel, m, k, n in zip(
        cols["site"],
        cols["role"],
        cols["stat"],
        cols["value"],
        cols["numel"],
        cols["M"],
        cols["K"],
        cols["N"],
    ):
        out.setdefault((site, role, stat), ([], numel, (m, k, n)))[0].append(v)
    return {key: (np.asarray(v, np.float64), numel, dims) for key, (v, numel, dims) in out.items()}


def test_bert_like_weights_leave_the_graph_alone_and_decode_to_their_reference():
    model = zoo.bert_like(hidden=64, layers=2, heads=2, vocab=100, max_seq=16)
    inst, manifest = inject(model, Selection(op_types=("MatMul",)))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    # no tap node reads a weight: only the model's own nodes, the same ones as before
    own = {n.name for n in model.graph.node}
    readers = {n.name for _, g in iter_graphs(inst.graph) for n in g.node if set(n.input) & set(weights)}
    assert readers and readers <= own
    assert readers == {n.name for n in model.graph.node if set(n.input) & set(weights)}
    const = [t for t in manifest.taps if t.constant]
    assert len(const) == 12  # q, k, v, o, ffn in, ffn out per layer
    assert all(t.outputs == {} and t.stacked == 0 and t.tensor in weights for t in const)
    assert all(t.numel == weights[t.tensor].size and t.rank == 2 for t in const)
    assert len(inst.graph.output) == len(model.graph.output) + len(manifest.output_names())
    assert not set(manifest.output_names()) & set(weights)
    # the instrumented model keeps every weight: host values from it equal those from the source
    host = host_values(manifest, model)
    assert set(host) == {t.id for t in const}
    again = host_values(manifest, inst)
    for tid, (values, shape) in host.items():
        assert again[tid][1] == shape and again[tid][0].keys() == values.keys()
        for stat in values:
            np.testing.assert_array_equal(again[tid][0][stat], values[stat])

    rows = rows_by_key(decode(manifest, run_all(inst, bert_feeds()), host))
    opts = manifest.sketch_options()
    taps = {t.id: t for t in manifest.taps}
    checked = 0
    for site in manifest.sites:
        for role, tid in site.roles.items():
            tap = taps[tid]
            if not tap.constant:
                continue
            w = weights[tap.tensor]
            assert tap.sketches == list(sk.DEFAULT_SKETCHES)
            for stat in sk.DEFAULT_SKETCHES:
                got, numel, (m, k, n) = rows[(site.id, role, stat)]
                assert_reference(got, sk.reference(stat, w, tap.info(), opts), stat)
                assert numel == w.size and (k, n) == w.shape and m == 2 * 16
                checked += 1
            w64 = w.astype(np.float64)
            assert (
                rows[(site.id, role, "min")][0][0] == w.min()
                and rows[(site.id, role, "max")][0][0] == w.max()
            )
            np.testing.assert_allclose(rows[(site.id, role, "sumsq")][0][0], (w64**2).sum(), rtol=1e-12)
    assert checked == 12 * len(sk.DEFAULT_SKETCHES)


def test_decode_without_host_values_is_refused():
    model = zoo.build("mlp")
    inst, manifest = inject(model)
    outs = unpacked(manifest, run_all(inst, zoo.example_feeds("mlp", model=model)))
    assert any(t.constant for t in manifest.taps)
    with pytest.raises(OpscopeError, match=r"weight taps.*host=host_values\(manifest, model\)"):
        decode(manifest, outs)
    with pytest.raises(OpscopeError, match="host_values"):
        decode_taps(manifest, outs)
    w = next(t for t in manifest.taps if t.constant)
    with pytest.raises(OpscopeError, match="is a weight"):
        decode_tap(w, outs, manifest.sketch_options())
    with pytest.raises(OpscopeError, match=f"no entry for weight tap {w.id}"):
        decode(manifest, outs, {k: v for k, v in host_values(manifest, model).items() if k != w.id})
    # a model without weights needs nothing from the host
    g = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("a", F, [2, 3]), helper.make_tensor_value_info("b", F, [3, 4])],
        [helper.make_tensor_value_info("y", F, [2, 4])],
    )
    inst, manifest = inject(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    feeds = {"a": np.ones((2, 3), np.float32), "b": np.ones((3, 4), np.float32)}
    assert not any(t.constant for t in manifest.taps) and host_values(manifest, inst) == {}
    assert set(decode(manifest, run_all(inst, feeds)).role) == {"lhs", "rhs", "out"}


def test_shape_only_weight_taps_give_gemm_dims_without_nodes():
    """Roles left out by the selection keep their shape for M, K, N: a weight's comes from its dims."""
    model = zoo.build("mlp")
    inst, manifest = inject(model, Selection(roles=("lhs",)))
    shape_only = [t for t in manifest.taps if t.constant]
    assert shape_only and all(not t.sketches and not t.outputs for t in shape_only)
    readers = {
        n.name
        for _, g in iter_graphs(inst.graph)
        for n in g.node
        if {t.tensor for t in shape_only} & set(n.input)
    }
    assert all(not r.startswith("opscope_") for r in readers)
    host = host_values(manifest, model)
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    assert all(host[t.id] == ({}, weights[t.tensor]) for t in shape_only)
    feeds = zoo.example_feeds("mlp", model=model)
    rows = rows_by_key(decode(manifest, run_all(inst, feeds), host))
    for site in manifest.sites:
        rhs = weights[next(t.tensor for t in manifest.taps if t.id == site.shape_roles["rhs"])]
        dims = {d for (s, role, _), (_, _, d) in rows.items() if s == site.id}
        assert {role for (s, role, _) in rows if s == site.id} == {"lhs"}
        assert len(dims) == 1 and list(dims.pop()[1:]) == rhs, site.id


def test_external_weights_are_read_from_the_data_file(tmp_path):
    """host_values reads each external weight from its data file: from the source path, from the
    instrumented model written elsewhere (data linked beside it), and from an in-memory ModelProto
    given its folder; nothing is loaded into the model it is given."""
    src = zoo.write_external_weights_model(tmp_path / "src", total_bytes=3 * 4 * 48 * 48, n_tensors=3)
    full = onnx.load(str(src))  # onnx's own loader, external data included
    weights = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer}
    assert len(weights) == 3 and all(w.shape == (48, 48) for w in weights.values())
    out, mpath, manifest = inject_file(src, tmp_path / "out" / "tapped.onnx")
    manifest = load_manifest(mpath)
    const = {t.id: t for t in manifest.taps if t.constant}
    assert {t.tensor for t in const.values()} == set(weights)
    opts = manifest.sketch_options()
    proto = load_model(out)
    for label, host in (
        ("source path", host_values(manifest, src)),
        ("instrumented path", host_values(manifest, out)),
        ("in-memory, base_dir", host_values(manifest, proto, out.parent)),
    ):
        assert set(host) == set(const), label
        for tid, (values, shape) in host.items():
            tap, w = const[tid], weights[const[tid].tensor]
            assert shape == [48, 48], label
            for stat in tap.sketches:
                assert_reference(values[stat], sk.reference(stat, w, tap.info(), opts), stat, label)
            assert values["max"][0] == w.max() and values["min"][0] == w.min()
    mine = [t for t in proto.graph.initializer if t.name in weights]
    assert len(mine) == 3 and all(is_external(t) and not t.raw_data for t in mine)  # left as they were
    with pytest.raises(OpscopeError, match="external data.*base_dir"):
        host_values(manifest, proto)
    # the data file is where the rows come from: decode through the written model
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 48)).astype(np.float32)}
    rows = rows_by_key(decode(manifest, run_all(out, feeds), host_values(manifest, out)))
    site = next(s for s in manifest.sites if const.get(s.roles.get("rhs", "")) is not None)
    np.testing.assert_allclose(
        rows[(site.id, "rhs", "sumsq")][0][0],
        (weights[const[site.roles["rhs"]].tensor].astype(np.float64) ** 2).sum(),
        rtol=1e-12,
    )


def _branch(name: str, w: np.ndarray) -> onnx.GraphProto:
    """An If branch: y = x @ Wb, with its own initializer Wb (the same name in both branches)."""
    return helper.make_graph(
        [helper.make_node("MatMul", ["h", "Wb"], [f"{name}_y"], name=f"{name}/matmul")],
        name,
        [],
        [helper.make_tensor_value_info(f"{name}_y", F, None)],
        [numpy_helper.from_array(w, "Wb")],
    )


def test_weights_in_branches_of_an_unnamed_if_found_in_the_instrumented_model():
    """An unnamed If is `If_0` (the first unnamed If of its graph); the taps inserted before it in the
    instrumented model are named, so its id and its branches' paths stay the same there. Both branches
    define a weight `Wb`: each tap gets its own branch's weight, from the source or the instrumented
    model, and a weight follows its branch (left out when the branch did not run)."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((8, 8)).astype(np.float32)
    w_then, w_else = (rng.standard_normal((8, 4)) * s for s in (1.0, 10.0))
    node_if = helper.make_node(
        "If",
        ["flag"],
        ["y"],
        then_branch=_branch("then", w_then.astype(np.float32)),
        else_branch=_branch("else", w_else.astype(np.float32)),
    )
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W0"], ["h"], name="mm0"), node_if],
        "g",
        [
            helper.make_tensor_value_info("x", F, [2, 8]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(w0, "W0")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    inst, manifest = inject(model)
    assert [n.op_type for n in inst.graph.node].index("If") > 1  # moved past the taps of mm0
    wb = {t.graph: t for t in manifest.taps if t.tensor == "Wb"}
    assert set(wb) == {"If_0/then_branch", "If_0/else_branch"} and all(t.constant for t in wb.values())
    opts = manifest.sketch_options()
    for source in (model, inst):
        host = host_values(manifest, source)
        for path, w in (("If_0/then_branch", w_then), ("If_0/else_branch", w_else)):
            tap = wb[path]
            for stat in tap.sketches:
                ref = sk.reference(stat, w.astype(np.float32), tap.info(), opts)
                assert_reference(host[tap.id][0][stat], ref, stat, path)
    host = host_values(manifest, inst)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    for flag, ran, idle in ((True, "then", "else"), (False, "else", "then")):
        decoded = decode_taps(manifest, run_all(inst, {"x": x, "flag": np.array(flag)}), host)
        assert decoded[wb[f"If_0/{ran}_branch"].id][1] == [8, 4]
        assert decoded[wb[f"If_0/{idle}_branch"].id] == ({}, None)
        assert decoded[next(t.id for t in manifest.taps if t.tensor == "W0")][1] == [8, 8]


def test_constant_node_weights():
    """A weight given by a Constant node (value tensor, or value_floats) is read from the node."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    g = helper.make_graph(
        [
            helper.make_node("Constant", [], ["W"], name="c", value=numpy_helper.from_array(w, "W")),
            helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
            helper.make_node("Constant", [], ["b"], name="cb", value_floats=[1.0, -2.0, 0.0, 4.0]),
            helper.make_node("Add", ["h", "b"], ["h2"], name="add"),
            helper.make_node(
                "Constant", [], ["W2"], name="c2", value=numpy_helper.from_array(w.T.copy(), "W2")
            ),
            helper.make_node("MatMul", ["h2", "W2"], ["y"], name="mm2"),
        ],
        "g",
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("y", F, [2, 3])],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    inst, manifest = inject(model, Selection(op_types=("MatMul",)))
    const = {t.tensor: t for t in manifest.taps if t.constant}
    assert set(const) == {"W", "W2"}
    host = host_values(manifest, inst)
    opts = manifest.sketch_options()
    for name, arr in (("W", w), ("W2", w.T)):
        tap = const[name]
        assert host[tap.id][1] == list(arr.shape)
        for stat in tap.sketches:
            assert_reference(host[tap.id][0][stat], sk.reference(stat, arr, tap.info(), opts), stat)
    # a value_floats Constant, looked up directly
    from onnx_opscope.instrument.host import _array

    node = next(n for n in model.graph.node if n.name == "cb")
    np.testing.assert_array_equal(_array(node, const["W"], None), np.array([1.0, -2.0, 0.0, 4.0], np.float32))


def test_host_values_from_another_model_is_refused():
    model = zoo.build("mlp")
    _, manifest = inject(model)
    with pytest.raises(OpscopeError, match="is not an initializer or Constant of this model"):
        host_values(manifest, zoo.build("cnn"))
