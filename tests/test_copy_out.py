"""Copied-out taps: small main-graph tensors come back whole and are sketched on the host, all of a
batch's together (`sketch.batched_references`). Checked against the per-tensor numpy references on
real tensors and edge cases, and against the taps built in the graph on real models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import real_model_path
from onnx import TensorProto

from onnx_opscope import sketch as sk
from onnx_opscope import zoo
from onnx_opscope.errors import OpscopeError
from onnx_opscope.instrument import decode_tap, decode_taps, host_values, inject, unpacked
from onnx_opscope.run import FeedSpec, RuntimeConfig, make_session, read_table, record

NAMES = sk.resolve(None) + ["l1", "nnz"]  # every sketch with a segmented form, plus one without
ALL = list(sk.resolve(["all"]))
HIST_OPTIONS = [
    sk.SketchOptions(),
    sk.SketchOptions(hist_bins=10, hist_range=(-0.5, 2.0)),
    sk.SketchOptions(hist_mode="exact", hist_bins=7),
]


def edge_arrays(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        np.array([np.nan, 1, np.inf, -2, 0, -np.inf], np.float32),
        np.full(7, np.nan, np.float32),
        np.zeros((0, 3), np.float32),
        np.zeros(16, np.float32),
        (rng.standard_normal((3, 17)) * 300).astype(np.float16),
        np.arange(-10, 10, dtype=np.int64).reshape(4, 5),
        np.array([3.0e38, -3.4e38, 1.0], np.float32),
        rng.standard_normal(5000).astype(np.float32),  # over sample_size: the per-tensor path
        rng.standard_normal((64, 64)).astype(np.float32),  # exactly sample_size
    ]


def assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name in want:
        g, w = np.asarray(got[name]), np.asarray(want[name])
        assert g.shape == w.shape, (what, name, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=0, equal_nan=True, err_msg=f"{what} {name}")


@pytest.mark.parametrize("opts", HIST_OPTIONS, ids=["default", "range", "exact"])
def test_batched_equals_references_on_edge_cases(opts):
    arrays = edge_arrays(np.random.default_rng(0))
    infos = [sk.TapInfo(a.ndim, TensorProto.FLOAT, 0, 0, None) for a in arrays]
    names = [NAMES] * len(arrays)
    for a, got, info in zip(arrays, sk.batched_references(names, arrays, infos, opts), infos, strict=True):
        assert_same(got, sk.references(NAMES, a, info, opts), f"{a.dtype}{a.shape}")


def test_stacked_shape_bound_sketches_equal_references():
    """chan_maxabs, chan_outlier, pos_sumsq, adj_sumsq and kurtosis of tensors of one shape, computed
    over their stack (`batched.stacked`, `segmented`): NaN, Inf, a channel with no finite value, an
    all-zero tensor (outlier NaN), one row (no pair), other dtypes, channel-last and unknown rank."""
    rng = np.random.default_rng(3)
    same = [rng.standard_normal((6, 5)).astype(np.float32) for _ in range(4)]
    same[1][2, 3], same[1][4, 0] = np.nan, np.inf
    same[2][:, 1] = np.nan
    same[3][:] = 0
    arrays = [*same, np.ones((1, 5), np.float32), np.arange(30).reshape(6, 5), same[0].astype(np.float16)]
    infos = [sk.TapInfo(2, TensorProto.FLOAT, 1, 0, None)] * len(arrays)
    last = [rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3)]
    arrays += last + last
    infos += [sk.TapInfo(3, TensorProto.FLOAT, -1, -2, None)] * 3 + [sk.TapInfo(None, TensorProto.FLOAT)] * 3
    got = sk.batched_references([ALL] * len(arrays), arrays, infos, sk.SketchOptions())
    for k, (a, g, info) in enumerate(zip(arrays, got, infos, strict=True)):
        assert_same(g, sk.references(ALL, a, info, sk.SketchOptions()), f"{k}: {a.dtype}{a.shape}")
    assert np.isnan(got[3]["chan_outlier"]).all() and got[4]["adj_sumsq"].size == 0


def small_activations(name: str, feeds: dict) -> tuple[list[np.ndarray], list[str]]:
    """Every main-graph float activation of a real model with at most sample_size elements, run for real."""
    model = onnx.load(real_model_path(name))
    inst, manifest = inject(model, None, ["all"], input_shapes={k: v.shape for k, v in feeds.items()})
    copied = [t for t in manifest.taps if t.copied]
    sess = make_session(inst, RuntimeConfig(graph_opt="disable"))
    outs = unpacked(manifest, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds))))
    return [np.asarray(outs[t.outputs["tensor"]]) for t in copied], [t.tensor for t in copied]


def test_batched_equals_references_on_real_tensors():
    feeds = {"image": np.random.default_rng(0).uniform(0, 255, (1, 3, 60, 160)).astype(np.float32)}
    arrays, tensors = small_activations("captcha_crnn", feeds)
    assert len(arrays) > 100  # the unrolled BiLSTM's Gemm operands
    infos = [sk.TapInfo(a.ndim, TensorProto.FLOAT, 1, 0, None) for a in arrays]
    got = sk.batched_references([ALL] * len(arrays), arrays, infos, sk.SketchOptions())
    for a, g, info, tensor in zip(arrays, got, infos, tensors, strict=True):
        assert_same(g, sk.references(ALL, a, info, sk.SketchOptions()), tensor)


def test_inject_copies_small_main_graph_tensors_only():
    """Static or at the given shapes; never weights, subgraph tensors, or on providers other than the CPU."""
    model = zoo.build("transformer_block")  # x: [batch, seq, 64]
    small = {"x": [2, 32, 64]}  # 4096 elements per activation: copied
    _, manifest = inject(model, None, None, input_shapes=small)
    copied = [t for t in manifest.taps if t.copied]
    assert copied and all(not t.constant and t.graph == "" for t in copied)
    assert all(t.outputs == {"tensor": t.outputs["tensor"]} for t in copied)
    assert not any(t.copied for t in manifest.taps if t.constant)
    big = inject(model, None, None, input_shapes={"x": [4, 32, 64]}).manifest
    assert not any(t.copied for t in big.taps)
    assert not any(t.copied for t in inject(model, None, None).manifest.taps)  # symbolic, no shapes given
    cuda = inject(model, None, None, providers=["CUDAExecutionProvider"], input_shapes=small).manifest
    assert not any(t.copied for t in cuda.taps) and cuda.options["copy_out_max"] == 0
    off = inject(model, None, None, sk.SketchOptions(copy_out_max=0), input_shapes=small).manifest
    assert not any(t.copied for t in off.taps)
    loop = inject(zoo.build("loop"), None, ["all"]).manifest
    assert not any(t.copied for t in loop.taps if t.graph)
    with pytest.raises(ValueError, match="copy_out_max"):
        sk.SketchOptions(copy_out_max=5000)


def test_decode_tap_of_a_copied_tap():
    model = zoo.build("transformer_block")
    inst, manifest = inject(model, None, ["all"], input_shapes={"x": [2, 32, 64]})
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 32, 64)).astype(np.float32)}
    sess = make_session(inst, RuntimeConfig(graph_opt="disable"))
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    tap = next(t for t in manifest.taps if t.copied and t.tensor == "x")
    with pytest.raises(OpscopeError, match="is not among the run.s outputs") as err:  # as the run gives them
        decode_tap(tap, outs, manifest.sketch_options())
    assert "unpacked(manifest, outputs)" in err.value.hint
    values, shape = decode_tap(tap, unpacked(manifest, outs), manifest.sketch_options())
    assert shape == [2, 32, 64]
    assert_same(values, sk.references(tap.sketches, feeds["x"], tap.info(), manifest.sketch_options()), "x")
    assert host_values(manifest, model) is not None


@pytest.mark.parametrize(
    "name,dims", [("captcha_crnn", None), ("transformer_block", {"batch": 2, "seq": 32})]
)
def test_record_with_copied_taps_equals_graph_taps(tmp_path, name, dims):
    """The same rows whether small tensors are copied out or sketched in the graph; values within the
    sketches' tolerances (sums in float64 on the host, float32 in the graph); parity holds."""
    if name == "captcha_crnn":
        path = real_model_path(name)
        feeds = FeedSpec(batches=2)
    else:
        path = tmp_path / f"{name}.onnx"
        onnx.save(zoo.build(name), path)
        feeds = FeedSpec(batches=2, dims=dims)
    tables = {}
    for mode, cap in (("graph", 0), ("copied", None)):
        res = record(path, out=tmp_path / f"{mode}.parquet", feeds=feeds, sketches=["all"],
                     options=sk.SketchOptions(copy_out_max=cap), run_id="r")  # fmt: skip
        assert res.parity is not None and res.parity.ok
        tables[mode] = (read_table(res.table).to_pylist(), res.manifest)
    graph, copied = tables["graph"][0], tables["copied"][0]
    assert sum(t.copied for t in tables["copied"][1].taps) > 0
    assert not any(t.copied for t in tables["graph"][1].taps)
    key = lambda r: (r["step"], r["site"], r["role"], r["stat"], r["idx"])  # noqa: E731
    assert sorted(map(key, graph)) == sorted(map(key, copied))
    by_key = {key(r): r for r in copied}
    for r in graph:
        c = by_key[key(r)]
        assert (c["numel"], c["M"], c["K"], c["N"]) == (r["numel"], r["M"], r["K"], r["N"])
        tol = sk.REGISTRY[r["stat"]].tol
        scale = max(abs(r["value"]), 1.0) if r["stat"] not in ("hist",) else 1.0
        assert abs(c["value"] - r["value"]) <= max(tol.rtol * scale, tol.atol * scale, 1e-6 * scale) or (
            np.isnan(c["value"]) and np.isnan(r["value"])
        ), (key(r), r["value"], c["value"])


@pytest.mark.parametrize("flag", [True, False])
def test_copied_taps_in_if_branches(flag):
    """Tensors of If branches (two levels) are copied too; the branch not taken leaves its taps out, the
    taken one's values are the numpy references of the real tensors, as the graph's taps give."""
    model = zoo.build("if_model")
    feeds = {
        "x": np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32),
        "flag": np.array(flag),
    }
    runs = {}
    for mode, cap in (("graph", 0), ("copied", None)):
        opts = sk.SketchOptions(copy_out_max=cap)
        inst, manifest = inject(model, None, ["all"], opts, input_shapes={"x": [4, 16]})
        sess = make_session(inst, RuntimeConfig(graph_opt="disable"))
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        runs[mode] = (manifest, decode_taps(manifest, outs, host_values(manifest, model)))
    manifest, copied = runs["copied"]
    in_branches = [t for t in manifest.taps if t.copied and t.graph]
    assert len({t.graph.count("/") for t in in_branches}) >= 2  # the outer If's branches and the nested one's
    graph_manifest, graph = runs["graph"]
    by_tensor = {(t.graph, t.tensor): t.id for t in graph_manifest.taps}
    for t in manifest.taps:
        want, got = graph[by_tensor[(t.graph, t.tensor)]], copied[t.id]
        assert (got[1] is None) == (want[1] is None), t.tensor  # ran in both or in neither
        if got[1] is not None:
            assert got[1] == want[1]
            for name in t.sketches:
                tol = sk.REGISTRY[name].tol
                np.testing.assert_allclose(got[0][name], want[0][name], rtol=max(tol.rtol, 1e-5), atol=1e-5,
                                           equal_nan=True, err_msg=f"{t.tensor} {name}")  # fmt: skip
    assert any(copied[t.id][1] is None for t in in_branches)  # the branch not taken
    assert any(copied[t.id][1] is not None for t in in_branches)


def test_batched_exact_dtypes_share_one_float32_concatenation():
    """float16, int8, uint8 and bool tensors concatenate straight to float32 with float32 ones (every
    value exact there); each sketch still equals its reference tensor by tensor."""
    rng = np.random.default_rng(5)
    arrays = [
        (rng.standard_normal((3, 17)) * 300).astype(np.float16),
        rng.integers(-128, 128, (4, 6)).astype(np.int8),
        rng.integers(0, 256, 9).astype(np.uint8),
        rng.integers(0, 2, (2, 5)).astype(bool),
        rng.standard_normal(33).astype(np.float32),
    ]
    infos = [sk.TapInfo(a.ndim, TensorProto.FLOAT, 0, 0, None) for a in arrays]
    opts = sk.SketchOptions()
    got = sk.batched_references([NAMES] * len(arrays), arrays, infos, opts)
    for a, g, info in zip(arrays, got, infos, strict=True):
        assert_same(g, sk.references(NAMES, a, info, opts), f"{a.dtype}{a.shape}")


W = np.random.default_rng(9).standard_normal((8, 8)).astype(np.float32)


def rank_by_batch_model() -> onnx.ModelProto:
    """y = Relu(If(Shape(x)[0] == 1, Squeeze(x, 0), Unsqueeze(x, 0)) @ W) + 2: the If's branches disagree
    on the rank; the input shape alone decides it."""
    from onnx import helper, numpy_helper

    h = helper
    then_g = h.make_graph([h.make_node("Squeeze", ["x", "zero"], ["sq"])], "then", [],
                          [h.make_tensor_value_info("sq", TensorProto.FLOAT, None)])  # fmt: skip
    else_g = h.make_graph([h.make_node("Unsqueeze", ["x", "zero"], ["same"])], "else", [],
                          [h.make_tensor_value_info("same", TensorProto.FLOAT, None)])  # fmt: skip
    nodes = [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Gather", ["s", "zero_s"], ["b"], axis=0),
        h.make_node("Equal", ["b", "one"], ["is1"]),
        h.make_node("If", ["is1"], ["picked"], then_branch=then_g, else_branch=else_g),
        h.make_node("MatMul", ["picked", "w"], ["m"]),
        h.make_node("Relu", ["m"], ["r"]),
        h.make_node("Add", ["r", "two"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array(0, np.int64), "zero_s"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(W, "w"),
    ]
    g = h.make_graph(nodes, "rank_by_batch", [h.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)  # fmt: skip
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [1, 3])
def test_copied_tensor_whose_rank_follows_the_batch(batch):
    """The MatMul's output is rank 1 at batch 1 and rank 3 otherwise: copied at the first batch's shape,
    it equals numpy at that batch and at one whose If takes the other branch (the output's declared
    rank is whatever inference said; onnxruntime returns the tensor as it is)."""
    model = rank_by_batch_model()
    inst, manifest = inject(model, None, None, input_shapes={"x": [batch, 8]})
    tap = next(t for t in manifest.taps if t.tensor == "m")
    assert tap.copied
    sess = make_session(inst, RuntimeConfig(graph_opt="all"))
    for n in (batch, 4 - batch):  # the first shape, then one whose If takes the other branch
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
        m = (x[0] if n == 1 else x[None]) @ W
        values, shape = decode_taps(manifest, outs, host_values(manifest, model))[tap.id]
        assert shape == list(m.shape)
        assert_same(values, sk.references(tap.sketches, m, tap.info(), manifest.sketch_options()), f"n={n}")


def test_silero_decoder_taps_are_copied_at_the_recorded_shapes():
    """silero_vad_v6's decoder LSTM and its head sit behind Ifs decided by the state's and the encoder's
    shapes: at the recorded input shapes every activation of the 16 kHz branch is copied out, and the
    taps of the branches that ran equal numpy on the tensors the model made."""
    from test_sketches import check_taps, inline_taken_ifs, real_feeds, run_all, tensor_values

    from onnx_opscope.sites import Selection

    path = real_model_path("silero_vad_v6")
    model = onnx.load(path)
    feeds = real_feeds("silero_vad_v6")  # 16 kHz
    shapes = {k: list(v.shape) for k, v in feeds.items()}  # as record passes them
    inst, manifest = inject(path, Selection(op_types=("Conv", "LSTM")), None, input_shapes=shapes)
    taken = [t for t in manifest.taps if t.graph.startswith("If_0/then_branch") and not t.constant]
    assert any(t.tensor.endswith("decoder/rnn/LSTM_output_0") for t in taken)
    assert any(t.rank is None for t in taken) and all(t.copied for t in taken)
    # those of unknown rank too leave in their graph's pack, which tells for all whether their branch ran
    assert not any("shape" in t.outputs for t in taken)
    outs = run_all(inst, feeds)
    host = host_values(manifest, model)
    decoded = decode_taps(manifest, outs, host)
    ran = [t for t in manifest.taps if decoded[t.id][1] is not None and not t.constant]
    assert {t.id for t in ran} <= {t.id for t in taken} and len(ran) >= 12
    values = tensor_values(inline_taken_ifs(model, feeds), sorted({t.tensor for t in ran}), feeds)
    opts = manifest.sketch_options()
    assert check_taps(ran, unpacked(manifest, outs), values, opts, host) == sum(len(t.sketches) for t in ran)


@pytest.mark.parametrize("sr,n", [(16000, 512), (8000, 256)])
def test_silero_branch_stream_at_either_rate(sr, n):
    """silero_vad_v6 instrumented at the 16 kHz shapes: its 16 kHz decoder's tensors are copied, the 8 kHz
    decoder's taps stay in the graph, and all leave in one stream (two outputs). Run at either rate, the
    taps of the branches that ran equal numpy on the tensors the model made; the others are left out."""
    from test_sketches import check_taps, inline_taken_ifs, real_feeds, run_all, tensor_values

    from onnx_opscope.sites import Selection

    path = real_model_path("silero_vad_v6")
    model = onnx.load(path)
    shapes = {"input": [1, 512], "state": [2, 1, 128], "sr": []}
    inst, manifest = inject(path, Selection(op_types=("Conv", "LSTM")), None, input_shapes=shapes)
    (stream,) = [p for p in manifest.packed if p["pack"] == "branches"]
    kinds = {vector is None for _, listed in stream["graphs"] for _, vector in listed}
    assert kinds == {True, False}  # copied tensors and in-graph taps
    assert len(inst.graph.output) == len(model.graph.output) + 2
    feeds = {**real_feeds("silero_vad_v6", sr=sr), "input": real_feeds("silero_vad_v6")["input"][:, :n]}
    outs = run_all(inst, feeds)
    decoded = decode_taps(manifest, outs, host_values(manifest, model))
    ran = [t for t in manifest.taps if decoded[t.id][1] is not None and not t.constant]
    branch = "If_0/then_branch" if sr == 16000 else "If_0/else_branch"
    assert len(ran) >= 6 and all(t.graph.startswith(branch) for t in ran if t.graph)
    values = tensor_values(inline_taken_ifs(model, feeds), sorted({t.tensor for t in ran}), feeds)
    opts = manifest.sketch_options()
    assert check_taps(ran, unpacked(manifest, outs), values, opts, host_values(manifest, model)) == sum(
        len(t.sketches) for t in ran
    )
