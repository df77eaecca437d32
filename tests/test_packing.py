"""Packed outputs (instrument.packing): the main graph's small raws leave the model in four outputs, and
each reads back under its own name exactly as its own output would have given it."""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnx
import pytest
from conftest import real_model_path
from test_sketches import check_taps, real_feeds, run_all, tensor_values

from onnx_opscope import zoo
from onnx_opscope.errors import OpscopeError
from onnx_opscope.instrument import (
    decode,
    decode_tap,
    decode_taps,
    host_values,
    inject,
    load_manifest,
    unpacked,
)
from onnx_opscope.instrument.decode import rows_of
from onnx_opscope.instrument.manifest import VERSION
from onnx_opscope.instrument.packing import PACKS, pack_of
from onnx_opscope.sketch import SketchOptions
from onnx_opscope.sketch.histogram import sample_lengths, sample_positions

GRAPH = SketchOptions(copy_out_max=0)  # every tap in the graph: the packs get every main-graph tap


def with_members_exposed(inst: onnx.ModelProto, manifest) -> onnx.ModelProto:
    """A copy of `inst` whose packed members are graph outputs of their own too: the reference."""
    m = onnx.ModelProto()
    m.CopyFrom(inst)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(
        onnx.helper.make_empty_tensor_value_info(n) for n in sorted(manifest.layout.members - have)
    )
    return m


def check_members(inst, manifest, feeds) -> int:
    """Every packed member, read out of its pack, equals the tensor itself (values, dtype and shape), but
    for the clean raws of taps that took the masking branch: those read its raws (`Unpacked.overridden`)."""
    own = run_all(with_members_exposed(inst, manifest), feeds)
    packed = run_all(inst, feeds)
    assert set(packed) == set(manifest.original_outputs) | set(manifest.output_names())
    got = unpacked(manifest, packed)
    for name in manifest.layout.members - getattr(got, "overridden", set()):
        want = np.asarray(own[name])
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    return len(manifest.layout.members)


@pytest.mark.parametrize("dims", [{"batch": 1, "seq": 5}, {"batch": 3, "seq": 11}])
def test_members_read_back_as_their_own_outputs_at_two_shapes(dims):
    """Symbolic dims: the samples' offsets follow each run's shapes."""
    model = zoo.build("transformer_block")
    inst, manifest = inject(model, None, None, GRAPH)
    feeds = zoo.example_feeds("transformer_block", model=model, dims=dims)
    assert {p["pack"] for p in manifest.packed} == set(PACKS)
    assert check_members(inst, manifest, feeds) > 3 * len([t for t in manifest.taps if not t.constant])


def test_det_outputs_shrink_to_the_packs():
    """ppocrv4_det, default set, every tap in the graph: 8-9 outputs a tap become four in all."""
    path = real_model_path("ppocrv4_det")
    inst, manifest = inject(path, None, None, GRAPH)
    live = [t for t in manifest.taps if not t.constant]
    assert live and all(not t.graph for t in live)
    raws = sum(len(t.outputs) for t in live)
    own = [n for n in manifest.output_names() if not n.startswith("opscope_packed_")]
    assert len(manifest.output_names()) == len(PACKS) and not own and raws >= 8 * len(live)
    assert len(inst.graph.output) == len(manifest.original_outputs) + len(PACKS)
    assert check_members(inst, manifest, real_feeds("ppocrv4_det")) == raws


def test_a_tap_in_if_branches_packs_its_scalars_and_sample_alone():
    """A tap in If branches: its rank-0 float raws and then its sample in one vector of its own (an output
    of every If above it), its shape and per-channel vector outputs of their own; none in the main graph's
    packs. Decoded, its sketches (the histogram and elemsig read the sample) equal those of the same tensors
    copied out (numpy on the tensor itself), on both branches and the nested If's, and a branch not taken
    leaves its taps out as before."""
    model = zoo.build("if_model")
    chosen = ["min", "max", "mean", "sumsq", "nan_count", "hist", "elemsig", "chan_maxabs"]
    inst, manifest = inject(model, None, chosen, SketchOptions(copy_out_max=0))
    opts = manifest.sketch_options()
    sub = [t for t in manifest.taps if t.graph and not t.constant]
    assert sub and all(pack_of(t, raw, opts) is None for t in sub for raw in t.outputs)
    names = set(manifest.output_names())
    for t in sub:
        packs = [p for p in manifest.packed if any(tid == t.id for tid, _ in p["raws"])]
        assert len(packs) == 1 and packs[0]["pack"] == "tap" and packs[0]["output"] in names, t.id
        raws = [raw for _, raw in packs[0]["raws"]]
        assert {"min", "max"} <= set(raws) and len(raws) >= 5 and raws[-1] == "samples"
        assert not set(raws) & {"shape", "chan_abs"}
        assert all(t.outputs[r] in names for r in t.outputs if r not in raws)
    ref, ref_manifest = inject(
        model, None, chosen, SketchOptions(copy_out_max=4096), input_shapes={"x": [2, 16]}
    )
    assert all(t.copied for t in ref_manifest.taps if not t.constant)
    ran = set()
    for seed in range(6):
        feeds = zoo.example_feeds("if_model", model=model, seed=seed)
        got = _rows(inst, manifest, feeds)
        want = _rows(ref, ref_manifest, feeds)
        assert got.keys() == want.keys() and got, seed
        for key, value in got.items():
            np.testing.assert_allclose(value, want[key], rtol=1e-5, atol=1e-6, err_msg=str(key))
        ran |= {key[0] for key in got}
    assert len(ran) >= 3, ran  # then, else and the nested If's branches ran over the seeds


def test_taps_in_if_branches_leave_as_one_stream():
    """Every tap of the If branches (both levels) whose raws pack, and every copied tensor there, leaves in
    the branches' stream: two model outputs for all, two new outputs on each If. Decoded, the in-graph
    taps' rows equal those of the same tensors copied out, on every branch the seeds take, and a branch
    not taken leaves its taps out."""
    model = zoo.build("if_model")
    graph = inject(model, None, None, SketchOptions(copy_out_max=0))
    copied = inject(model, None, None, SketchOptions(copy_out_max=4096), input_shapes={"x": [2, 16]})
    for inst, manifest in (graph, copied):
        (stream,) = [p for p in manifest.packed if p["pack"] == "branches"]
        in_branches = {t.id for t in manifest.taps if t.graph and not t.constant}
        assert len(in_branches) >= 4
        assert {tid for _, listed in stream["graphs"] for tid, _ in listed} == in_branches
        names = set(manifest.output_names())
        assert {stream["output"], stream["shapes"]} <= names
        assert not names & {n for t in manifest.taps if t.graph for n in t.outputs.values()}
        for e in manifest.outputs():  # the JSON's view: in the stream, at no fixed place
            if e["tap"] in in_branches:
                assert (
                    e["output"] == stream["shapes" if e["stat"] == "shape" else "output"] and e["at"] is None
                )
        ifs = [n for n in inst.graph.node if n.op_type == "If"]
        assert [len(n.output) for n in ifs] == [3]  # y, the stream's values and ids
    ran = set()
    for seed in range(6):
        feeds = zoo.example_feeds("if_model", model=model, seed=seed)
        got, want = _rows(*graph, feeds), _rows(*copied, feeds)
        assert got.keys() == want.keys() and got, seed
        for key, value in got.items():
            np.testing.assert_allclose(value, want[key], rtol=1e-5, atol=1e-6, err_msg=str(key))
        ran |= {key[0] for key in got}
    assert len(ran) >= 3, ran  # then, else and the nested If's branches ran over the seeds


def _two_ifs() -> onnx.ModelProto:
    """Two Ifs side by side in the main graph, a MatMul in each branch: four branch graphs with taps."""
    h, f = onnx.helper, onnx.TensorProto.FLOAT
    rng = np.random.default_rng(0)

    def branch(name: str, nodes: list, out: str) -> onnx.GraphProto:
        return h.make_graph(nodes, name, [], [h.make_tensor_value_info(out, f, [2, 16])])

    def weight(name: str) -> onnx.TensorProto:
        return onnx.numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.3, name)

    if1 = h.make_node(
        "If", ["c1"], ["y1"],
        then_branch=branch("t1", [h.make_node("MatMul", ["x", "w1"], ["m1"]), h.make_node("Relu", ["m1"], ["r1"])], "r1"),
        else_branch=branch("e1", [h.make_node("MatMul", ["x", "w2"], ["m2"])], "m2"),
    )  # fmt: skip
    if2 = h.make_node(
        "If", ["c2"], ["y2"],
        then_branch=branch("t2", [h.make_node("Add", ["x", "x"], ["a2"]), h.make_node("MatMul", ["a2", "w2"], ["s2"])], "s2"),
        else_branch=branch("e2", [h.make_node("MatMul", ["x", "w1"], ["p2"])], "p2"),
    )  # fmt: skip
    graph = h.make_graph(
        [if1, if2],
        "two_ifs",
        [h.make_tensor_value_info("x", f, [2, 16]), *(h.make_tensor_value_info(c, onnx.TensorProto.BOOL, []) for c in ("c1", "c2"))],
        [h.make_tensor_value_info(y, f, [2, 16]) for y in ("y1", "y2")],
        [weight("w1"), weight("w2")],
    )  # fmt: skip
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_two_ifs_stream_and_nonfinite_values_in_branches():
    """Two Ifs in the main graph hand their streams to one concatenation; whichever branches run, with
    NaN and inf in the tensors or not, the in-graph taps' rows equal those of the tensors copied out."""
    model = _two_ifs()
    graph = inject(model, None, None, SketchOptions(copy_out_max=0))
    copied = inject(model, None, None, SketchOptions(copy_out_max=4096), input_shapes={"x": [2, 16]})
    for inst, manifest in (graph, copied):
        assert len(inst.graph.output) == 4 and len(manifest.layout.streams[0][2]) == 4
    rng = np.random.default_rng(1)
    for c1, c2, bad in itertools.product((True, False), (True, False), (False, True)):
        x = rng.standard_normal((2, 16)).astype(np.float32)
        if bad:
            x[0, 3], x[1, 5] = np.nan, np.inf
        feeds = {"x": x, "c1": np.array(c1), "c2": np.array(c2)}
        got, want = _rows(*graph, feeds), _rows(*copied, feeds)
        assert got.keys() == want.keys() and len({key[0] for key in got}) == 2, (c1, c2)
        for key, value in got.items():
            np.testing.assert_allclose(
                value, want[key], rtol=1e-5, atol=1e-6, err_msg=str((c1, c2, bad, key))
            )


def test_a_stream_that_does_not_add_up_is_an_error():
    model = zoo.build("if_model")
    inst, manifest = inject(model, None, None, SketchOptions(copy_out_max=0))
    outs = run_all(inst, zoo.example_feeds("if_model", model=model))
    (out, ids, graphs) = manifest.layout.streams[0]
    member = next(m[1] for members in graphs for m in members)
    assert unpacked(manifest, outs)[member] is not None  # as run, it adds up (and its cuts are kept)
    short = {**outs, out: outs[out][:-1]}
    with pytest.raises(ValueError, match="values where its members make"):
        unpacked(manifest, short)[member]
    cut = {**outs, ids: outs[ids][:-1]}  # a record one id short
    with pytest.raises(ValueError, match="ids where its members make"):
        unpacked(manifest, cut)[member]
    twice = {**outs, ids: np.concatenate([outs[ids], outs[ids][:1]])}  # a graph's id again, no record
    with pytest.raises(ValueError, match="each once"):
        unpacked(manifest, twice)[member]


def _rows(inst, manifest, feeds) -> dict[tuple, float]:
    """(site, role, stat, idx) -> value of one run's decoded rows."""
    rows = decode(manifest, run_all(inst, feeds), host_values(manifest, inst))
    return dict(zip(zip(rows.site, rows.role, rows.stat, rows.idx, strict=True), rows.value, strict=True))


def test_copied_tensors_leave_in_one_pack_and_vectors_keep_their_outputs():
    """The main graph's copied tensors leave as one vector and their shapes; per-channel vectors keep an
    output each; every copied tensor read out of its pack equals the tensor itself."""
    model = zoo.build("transformer_block")
    feeds = zoo.example_feeds("transformer_block", model=model)
    shapes = {k: v.shape for k, v in feeds.items()}
    inst, manifest = inject(
        model, None, ["min", "chan_maxabs"], SketchOptions(copy_out_max=1024), input_shapes=shapes
    )
    copied = [t for t in manifest.taps if t.copied]
    vectors = [t for t in manifest.taps if "chan_abs" in t.outputs]
    assert (
        copied and vectors and {p["pack"] for p in manifest.packed} == {"shapes", "scalars", "slow", "copied"}
    )
    (pack,) = [p for p in manifest.packed if p["pack"] == "copied"]
    assert pack["raws"] == [[t.id, "tensor"] for t in copied]
    names = set(manifest.output_names())
    assert {pack["output"], pack["shapes"]} <= names and not {t.outputs["tensor"] for t in copied} & names
    assert all(t.outputs["chan_abs"] in names for t in vectors)
    assert check_members(inst, manifest, feeds) > len(copied)


def test_copied_pack_cut_once_per_dims_and_checked_every_run():
    """The copied pack's cuts are worked out once per dims and reused; values or dims that do not add up
    are an error on every run, the cuts kept or not."""
    model = zoo.build("transformer_block")
    feeds = zoo.example_feeds("transformer_block", model=model)
    inst, manifest = inject(
        model,
        None,
        ["min"],
        SketchOptions(copy_out_max=1024),
        input_shapes={k: v.shape for k, v in feeds.items()},
    )
    (pack,) = [p for p in manifest.packed if p["pack"] == "copied"]
    outs = run_all(inst, feeds)
    member = manifest.layout.copied[pack["output"]][1][0]
    first = unpacked(manifest, outs)[member]
    assert len(manifest.layout.cuts) == 1
    again = unpacked(manifest, {k: v.copy() for k, v in outs.items()})[member]
    assert len(manifest.layout.cuts) == 1 and np.array_equal(
        first, again
    )  # the same cuts, a new run's values
    with pytest.raises(ValueError, match="values where its members make"):
        unpacked(manifest, {**outs, pack["output"]: outs[pack["output"]][:-1]})[member]
    with pytest.raises(ValueError, match="dims where its"):
        unpacked(manifest, {**outs, pack["shapes"]: outs[pack["shapes"]][:-1]})[member]


def test_sample_lengths_are_those_of_the_sample_positions():
    n = np.array([0, 1, 15, 16, 17, 100, 4096, 4097, 4112, 65536, 65537, 10**6])
    for size in (100, 4096):
        want = [sample_positions(int(k), size).size for k in n]
        assert sample_lengths(n, size).tolist() == want


def test_a_pack_of_the_wrong_length_is_an_error():
    model = zoo.build("transformer_block")
    inst, manifest = inject(model, None, None, GRAPH)
    outs = run_all(inst, zoo.example_feeds("transformer_block", model=model))
    samples = next(p["output"] for p in manifest.packed if p["pack"] == "samples")
    outs[samples] = outs[samples][:-1]
    member = manifest.layout.samples[1][0]
    with pytest.raises(ValueError, match="values where its members' shapes make"):
        unpacked(manifest, outs)[member]


def test_manifest_lists_each_member_in_its_pack(tmp_path):
    """The JSON's `outputs` view says where each member lies; the packs survive a save and load."""
    model = zoo.build("transformer_block")
    _, manifest = inject(model, None, None, GRAPH)
    path = manifest.save(tmp_path / "m.manifest.json")
    entries = json.loads(path.read_text())["outputs"]
    packs = {p["output"]: p["pack"] for p in manifest.packed}
    scalars = [e for e in entries if packs.get(e["output"]) == "scalars"]
    assert scalars and [e["at"] for e in scalars] == [[i, i + 1] for i in range(len(scalars))]
    assert all(e["at"] is None for e in entries if packs.get(e["output"]) == "samples")
    again = load_manifest(path)
    assert again.packed == manifest.packed and again.output_names() == manifest.output_names()


def test_an_older_manifest_is_refused(tmp_path):
    _, manifest = inject(zoo.build("mlp"))
    path = manifest.save(tmp_path / "m.manifest.json")
    d = json.loads(path.read_text())
    d["version"] = 2
    path.write_text(json.dumps(d))
    with pytest.raises(OpscopeError, match=f"manifest version 2 is not {VERSION}") as err:
        load_manifest(path)
    assert "opscope inject" in err.value.hint  # says how to get a manifest of this version


def test_decode_tap_on_packed_outputs_read_raw_says_how_to_read_them():
    """decode_tap has no manifest: given the run's outputs as they come, it says to unpack them."""
    model = zoo.build("transformer_block")
    inst, manifest = inject(model, None, None, GRAPH)
    outs = run_all(inst, zoo.example_feeds("transformer_block", model=model))
    tap = next(t for t in manifest.taps if not t.constant)
    with pytest.raises(OpscopeError, match="is not among the run's outputs") as err:
        decode_tap(tap, outs, manifest.sketch_options())
    assert "unpacked(manifest, outputs)" in err.value.hint
    values, shape = decode_tap(tap, unpacked(manifest, outs), manifest.sketch_options())
    assert shape and set(values) == set(tap.sketches)


def three_matmuls() -> onnx.ModelProto:
    """y_i = x_i @ W for three inputs x_i [rows, 8]: six main-graph taps and a weight."""
    w = (np.arange(32).reshape(8, 4) % 5 - 2).astype(np.float32)
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", [f"x{i}", "W"], [f"y{i}"], name=f"mm{i}") for i in range(3)],
        "g",
        [onnx.helper.make_tensor_value_info(f"x{i}", onnx.TensorProto.FLOAT, ["rows", 8]) for i in range(3)],
        [onnx.helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, ["rows", 4]) for i in range(3)],
        [onnx.numpy_helper.from_array(w, "W")],
    )
    return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_taps_that_took_the_masking_branch_read_its_values():
    """A main-graph tap's clean branch runs outside its If; the taps whose Σx² is not finite (NaN, Inf, a
    square that overflows) read the masking branch's raws instead, cut from the one slow pack between
    taps that took the clean branch, equal to the numpy references, batched decode and one by one."""
    rng = np.random.default_rng(0)
    feeds = {f"x{i}": rng.normal(size=(6, 8)).astype(np.float32) for i in range(3)}
    feeds["x0"][1, 2], feeds["x0"][4, 7] = np.nan, -np.inf
    feeds["x2"][3, 5] = np.float32(-3.4e38)  # finite, but its square overflows
    model = three_matmuls()
    inst, manifest = inject(model, None, ["all"], GRAPH)
    outs = run_all(inst, feeds)
    got = unpacked(manifest, outs)
    took = {t.tensor for t in manifest.taps if t.slow and got[t.outputs["slow"]].size}
    assert took == {"x0", "y0", "x2", "y2"}
    assert any(got[t.outputs["chan_abs"]].size > 1 for t in manifest.taps if t.tensor == "x0")  # a vector raw
    check_members(inst, manifest, feeds)
    assert got.overridden >= {t.outputs["min"] for t in manifest.taps if t.tensor in took}
    host = host_values(manifest, model)
    values = tensor_values(model, [*feeds, "W", "y0", "y1", "y2"], feeds)
    assert check_taps(manifest.taps, got, values, manifest.sketch_options(), host) > 6 * 10
    fast = decode(manifest, outs, host).to_pydict()
    plain = rows_of(manifest, decode_taps(manifest, outs, host)).to_pydict()
    assert fast.keys() == plain.keys() and len(fast["value"]) == len(plain["value"]) > 0
    for k in fast:
        a, b = np.asarray(fast[k]), np.asarray(plain[k])
        assert (
            a.tolist() == b.tolist() if a.dtype.kind not in "fc" else np.array_equal(a, b, equal_nan=True)
        ), k


def test_a_slow_pack_that_does_not_add_up_is_an_error():
    """A slow pack whose length is not what the taps that took the masking branch make: one clear error."""
    feeds = {f"x{i}": np.ones((2, 8), np.float32) for i in range(3)}
    feeds["x1"][0, 0] = np.nan
    inst, manifest = inject(three_matmuls(), None, None, GRAPH)
    outs = run_all(inst, feeds)
    out = manifest.layout.slow[0]
    outs[out] = outs[out][:-1]
    with pytest.raises(ValueError, match="masking branch"):
        unpacked(manifest, outs)
