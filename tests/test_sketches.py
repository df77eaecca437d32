"""Every sketch against its numpy reference, on real tensors of real and generated models.

The tapped tensors' true values come from the plain model run with those tensors added as
graph outputs (taps inside taken `If` branches: the branches are inlined first; taps in the
`loop` body: the body is run on its own, one iteration at a time). Tolerances are each
Sketch's `tol` = (rtol, atol), read as

    |got - ref| <= rtol * |ref| + atol * scale(stat)

with `scale` defined per stat in `scale_of` below. Graph optimizations are off here, so the
instrumented model computes the tapped tensors exactly as the plain one does.

The other test modules import `real_case` from here so each real model is injected once.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from conftest import REAL_NAMES, generated_model_path, real_model_path
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnx_opscope import sketch as sk
from onnx_opscope import zoo
from onnx_opscope.graph.io import load_model
from onnx_opscope.instrument import (
    HostValues,
    Manifest,
    TapRecord,
    decode_tap,
    decode_taps,
    host_values,
    inject,
    unpacked,
)
from onnx_opscope.run.session import RuntimeConfig, make_session
from onnx_opscope.sites import Selection
from onnx_opscope.sketch.channels import outlier_ratio
from onnx_opscope.sketch.context import SAMPLE_BLOCK, row_block

GRAPH = sk.SketchOptions(copy_out_max=0)  # taps built in the graph; copied-out taps: test_copy_out.py
CFG = RuntimeConfig(graph_opt="disable")


def real_feeds(name: str, seed: int = 0, **sizes) -> dict[str, np.ndarray]:
    """Valid feeds for each real model (real_models.md), small sizes to keep the tests fast."""
    rng = np.random.default_rng(seed)
    if name == "ppocrv4_rec":
        return {"x": rng.uniform(-1, 1, (sizes.get("n", 1), 3, 48, sizes.get("w", 64))).astype(np.float32)}
    if name == "ppocrv4_det":
        hw = sizes.get("hw", 64)
        return {"x": rng.uniform(-1, 1, (sizes.get("n", 1), 3, hw, hw)).astype(np.float32)}
    if name == "silero_vad_v6":
        n = sizes.get("n", 1)
        return {
            "input": rng.uniform(-0.5, 0.5, (n, 512)).astype(np.float32),
            "state": np.zeros((2, n, 128), np.float32),
            "sr": np.array(sizes.get("sr", 16000), np.int64),
        }
    if name == "captcha_crnn":
        return {"image": rng.uniform(0, 255, (sizes.get("n", 1), 3, 60, 160)).astype(np.float32)}
    if name == "magika_standard_v3_3":
        return {"bytes": rng.integers(0, 257, (sizes.get("n", 1), 2048)).astype(np.int32)}
    raise KeyError(name)


def run_all(model, feeds, config: RuntimeConfig = CFG, base_dir=None) -> dict[str, np.ndarray]:
    sess = make_session(model, config, base_dir=base_dir)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@functools.cache
def instrumented_real(name: str) -> tuple[onnx.ModelProto, Manifest]:
    """The real model `name` with every site tapped by the default sketches, injected once per session."""
    return inject(real_model_path(name), None, ["all"], GRAPH)


@functools.cache
def real_session(name: str, graph_opt: str = "disable"):
    return make_session(instrumented_real(name)[0], RuntimeConfig(graph_opt=graph_opt))


@functools.cache
def real_case(name: str) -> tuple[onnx.ModelProto, dict, onnx.ModelProto, Manifest, dict]:
    """(plain model, feeds, instrumented model, manifest, instrumented outputs with optimizations off)."""
    inst, manifest = instrumented_real(name)
    feeds = real_feeds(name)
    sess = real_session(name)
    outs = unpacked(manifest, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds))))
    return load_model(real_model_path(name)), feeds, inst, manifest, outs


# --------------------------------------------------------------------------------------------
# true values of tapped tensors


def tensor_values(model: onnx.ModelProto, names: list[str], feeds) -> dict[str, np.ndarray]:
    """Values of main-graph tensors `names` on `feeds`: initializers and Constants read, the rest run."""
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    out = {n: consts[n] for n in names if n in consts}
    rest = sorted(set(names) - set(out))
    if rest:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        del m.graph.output[:]
        m.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in rest)
        out.update(zip(rest, make_session(m, CFG).run(rest, feeds)))
    return out


def inline_taken_ifs(model: onnx.ModelProto, feeds) -> onnx.ModelProto:
    """A copy of `model` with every `If` that runs on `feeds` replaced by its taken branch, nested ones too.

    Then the taken branches' tensors are main-graph tensors whose values `tensor_values` can read.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    while ifs := [n for n in m.graph.node if n.op_type == "If"]:
        conds = tensor_values(m, sorted({n.input[0] for n in ifs}), feeds)
        nodes = []
        for node in m.graph.node:
            if node.op_type != "If":
                nodes.append(node)
                continue
            which = "then_branch" if bool(conds[node.input[0]]) else "else_branch"
            branch = next(a.g for a in node.attribute if a.name == which)
            m.graph.initializer.extend(branch.initializer)
            nodes.extend(branch.node)
            nodes.extend(
                helper.make_node("Identity", [o.name], [y], name=f"{node.name}_{y}_inline")
                for o, y in zip(branch.output, node.output)
            )
        del m.graph.node[:]
        m.graph.node.extend(nodes)
    return m


def loop_iterations(model: onnx.ModelProto, names: list[str], feeds) -> list[dict[str, np.ndarray]]:
    """Per iteration of the main graph's one Loop (constant trip count, state in, scan out), the body
    tensors `names`: the body run on its own as a model, outer-scope weights copied in."""
    loop = next(n for n in model.graph.node if n.op_type == "Loop")
    body = next(a.g for a in loop.attribute if a.name == "body")
    outer = tensor_values(model, list(loop.input), feeds)
    trips = int(outer[loop.input[0]])
    g = onnx.GraphProto()
    g.CopyFrom(body)
    inner = (
        {t.name for t in g.initializer} | {o for n in g.node for o in n.output} | {i.name for i in g.input}
    )
    used = {i for n in g.node for i in n.input if i and i not in inner}
    g.initializer.extend(
        numpy_helper.from_array(v, k) for k, v in tensor_values(model, sorted(used), {}).items()
    )
    del g.output[:]
    state_n = len(body.input) - 2
    wanted = [o.name for o in body.output[1 : 1 + state_n]] + list(names)
    g.output.extend(helper.make_empty_tensor_value_info(n) for n in wanted)
    m = helper.make_model(g, opset_imports=model.opset_import, ir_version=model.ir_version)
    sess = make_session(m, CFG)
    state = [outer[i] for i in loop.input[2:]]
    cond = outer[loop.input[1]] if loop.input[1] else np.array(True)
    per = []
    for i in range(trips):
        feed = dict(zip([x.name for x in body.input], [np.array(i, np.int64), cond, *state]))
        got = dict(zip(wanted, sess.run(wanted, feed)))
        per.append({n: got[n] for n in names})
        state = [got[o] for o in wanted[:state_n]]
    return per


# --------------------------------------------------------------------------------------------
# comparison


def scale_of(stat: str, ref: np.ndarray, x: np.ndarray) -> float:
    """The scale Sketch.tol's atol is a fraction of, per stat.

    mean: max|x| over finite x (the graph sums x / max|x|, so its error grows with max|x|,
    not with a mean that may be ~0); hist: the number of values counted (a bin-edge flip
    moves one count); every other stat: max|ref| over finite entries (sums of non-negative
    terms and per-row sums have no cancellation, exact stats have atol 0 anyway).
    """
    if stat == "mean":
        v = np.asarray(x, np.float64).ravel()
        v = v[np.isfinite(v)]
        return float(np.abs(v).max()) if v.size else 0.0
    if stat == "hist":
        return float(ref.sum())
    fin = ref[np.isfinite(ref)]
    return float(np.abs(fin).max()) if fin.size else 0.0


def assert_sketch(stat: str, got: np.ndarray, ref: np.ndarray, x, what: str = "") -> None:
    rtol, atol = sk.REGISTRY[stat].tol
    assert got.shape == ref.shape, f"{what} {stat}: shape {got.shape} != {ref.shape}"
    np.testing.assert_allclose(
        got, ref, rtol=rtol, atol=atol * scale_of(stat, ref, x), equal_nan=True, err_msg=f"{what} {stat}"
    )


def tapped_names(taps: list[TapRecord]) -> list[str]:
    """The tensors `check_taps` needs values of: each tap's tensor, and the scale and zero point of a QDQ tap."""
    names = {t.tensor for t in taps}
    names |= {n for t in taps if t.dequant for n in (t.dequant["scale"], t.dequant["zero_point"]) if n}
    return sorted(names)


def dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, attrs: dict) -> np.ndarray:
    """onnx's reference DequantizeLinear: an implementation independent of the one under test."""
    names = ["q", "s"] + (["z"] if zero_point is not None else [])
    node = helper.make_node("DequantizeLinear", names, ["y"], **attrs)
    feeds = {"q": q, "s": scale, **({"z": zero_point} if zero_point is not None else {})}
    return ReferenceEvaluator(node).run(None, feeds)[0]


def reference_input(tap: TapRecord, values: dict[str, np.ndarray]) -> np.ndarray:
    """What a tap sketches: its tensor, dequantized when it is a QDQ tap (`sites.qdq`)."""
    x = values[tap.tensor]
    if tap.dequant is None:
        return x
    dq = tap.dequant
    return dequantize(x, values[dq["scale"]], values.get(dq["zero_point"]), dq["attrs"])


def check_taps(
    taps: list[TapRecord],
    outs: dict,
    values: dict[str, np.ndarray],
    opts: sk.SketchOptions,
    host: HostValues | None = None,
) -> int:
    """Every sketch of every tap in `taps` equals its reference on `values[tap.tensor]`; returns the count.

    Weight taps (`constant`) take their values from `host` (weights.host_values): `values` reads
    the weights from the model on its own, so a host value taken from the wrong tensor fails.
    """
    n = 0
    for tap in taps:
        if tap.constant:
            assert host is not None, f"{tap.tensor}: a weight tap needs host values"
            got, shape = host[tap.id]
        else:
            got, shape = decode_tap(tap, outs, opts)
        x = reference_input(tap, values)
        assert shape == list(np.shape(x)), (tap.tensor, shape, np.shape(x))
        for stat in tap.sketches:
            assert_sketch(stat, got[stat], sk.reference(stat, x, tap.info(), opts), x, tap.tensor)
            n += 1
    return n


def check_main_graph(model, feeds, manifest: Manifest, outs: dict) -> tuple[int, int]:
    """Compare every main-graph tap, weights (from host_values on `model`) included; returns
    (stats compared, constant taps among them)."""
    taps = [t for t in manifest.taps if t.graph == ""]
    assert taps
    values = tensor_values(model, tapped_names(taps), feeds)
    host = host_values(manifest, model)
    return check_taps(taps, outs, values, manifest.sketch_options(), host), sum(t.constant for t in taps)


# --------------------------------------------------------------------------------------------
# real models: every default sketch, weights (constant taps) included


@pytest.mark.parametrize("name", [n for n in REAL_NAMES if n != "silero_vad_v6"])
def test_default_sketches_match_reference_on_real_models(name):
    model, feeds, _, manifest, outs = real_case(name)
    assert set(manifest.sketches) == set(sk.ALL_SKETCHES)
    compared, constant = check_main_graph(model, feeds, manifest, outs)
    assert compared >= 9 * len([t for t in manifest.taps if t.graph == ""]) and constant > 0
    # every default sketch is exercised on a rank-known tensor somewhere in the model
    seen = {s for t in manifest.taps for s in t.sketches}
    assert seen >= set(sk.ALL_SKETCHES), set(sk.ALL_SKETCHES) - seen


def test_silero_subgraph_taps_match_reference():
    """Silero's network sits in If branches: taps of the branches that ran equal numpy on the inlined model."""
    model, feeds, _, manifest, outs = real_case("silero_vad_v6")
    host = host_values(manifest, model)
    decoded = decode_taps(manifest, outs, host)
    ran = [t for t in manifest.taps if decoded[t.id][1] is not None]
    assert ran and all(t.graph for t in ran)
    assert any(t.constant for t in ran) and any(not t.constant for t in ran)
    # weights in the branch that did not run are left out like the rest of it
    assert len(ran) < len(manifest.taps) and any(t.constant and t not in ran for t in manifest.taps)
    flat = inline_taken_ifs(model, feeds)
    values = tensor_values(flat, sorted({t.tensor for t in ran}), feeds)
    assert check_taps(ran, outs, values, manifest.sketch_options(), host) > 100


GENERATED = ["transformer_block", "cnn", "gru", "quantized", "bool_int_inputs", "opset21_mlp", "moe"]


@pytest.mark.parametrize("name", GENERATED)
def test_default_sketches_match_reference_on_generated_models(name):
    model = zoo.build(name)
    feeds = zoo.example_feeds(name, model=model)
    inst, manifest = inject(model, None, ["all"], GRAPH)
    compared, _ = check_main_graph(model, feeds, manifest, unpacked(manifest, run_all(inst, feeds)))
    assert compared > 0


def test_bert_like_float32_min_mask():
    """HF-style mask bias (-3.4e38 added to scores) with a padded batch: nothing overflows."""
    model = zoo.bert_like(hidden=32, layers=1, heads=2, vocab=50, max_seq=16)
    ids = np.random.default_rng(0).integers(0, 50, (2, 16))
    mask = np.ones((2, 16), np.int64)
    mask[1, 10:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    inst, manifest = inject(model, None, ["all"], GRAPH)
    outs = unpacked(manifest, run_all(inst, feeds))
    compared, _ = check_main_graph(model, feeds, manifest, outs)
    assert compared > 0
    decoded = decode_taps(manifest, outs, host_values(manifest, model))
    rows = [v for t in manifest.taps for v in decoded[t.id][0].values()]
    assert all(np.isfinite(v[~np.isnan(v)]).all() for v in rows)


def test_loop_body_taps_merge_per_iteration():
    """Loop body taps come back once per iteration and merge with each sketch's rule (inject.py)."""
    model = zoo.build("loop")
    feeds = zoo.example_feeds("loop", model=model)
    inst, manifest = inject(model, None, ["all"], GRAPH)
    outs = unpacked(manifest, run_all(inst, feeds))
    opts = manifest.sketch_options()
    taps = [t for t in manifest.taps if t.graph == "loop/body"]
    assert {t.tensor for t in taps} == {"state_in", "loop.weight", "body_mm"}
    per = loop_iterations(model, sorted({t.tensor for t in taps}), feeds)
    assert len(per) == 3
    host = host_values(manifest, model)
    for tap in taps:
        if tap.constant:  # the outer-scope weight: one value from the host, not one per iteration
            assert tap.tensor == "loop.weight" and tap.stacked == 0 and not tap.outputs
            got, shape = decode_taps(manifest, outs, host)[tap.id]
            w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "loop.weight"))
            assert shape == [16, 16] and all(np.array_equal(it["loop.weight"], w) for it in per)
            for stat in tap.sketches:
                assert_sketch(stat, got[stat], sk.reference(stat, w, tap.info(), opts), w, "loop weight")
            assert got["sumsq"][0] == pytest.approx((w.astype(np.float64) ** 2).sum(), rel=1e-12)
            continue
        assert tap.stacked == 1
        got, shape = decode_tap(tap, outs, opts)
        assert shape == [4, 16] or shape == [16, 16]
        numels = [per[i][tap.tensor].size for i in range(3)]
        names = sk.with_sources(tap.sketches)
        refs = [{n: sk.reference(n, it[tap.tensor], tap.info(), opts) for n in names} for it in per]
        merged = sk.merge_parts(names, refs, numels)
        assert isinstance(
            sk.REGISTRY["chan_outlier"].merge, sk.Derived
        )  # recomputed from the merged chan_maxabs
        np.testing.assert_array_equal(merged["chan_outlier"], outlier_ratio(merged["chan_maxabs"]))
        for stat in tap.sketches:
            ref = merged[stat]
            x = np.stack([it[tap.tensor] for it in per])
            assert_sketch(stat, got[stat], ref, x, f"loop {tap.tensor}")
    # the merge rules, spelled out on one tap: min of mins, sum of sums, concat of rows
    mm = next(t for t in taps if t.tensor == "body_mm")
    got, _ = decode_tap(mm, outs, opts)
    allv = np.stack([it["body_mm"] for it in per]).astype(np.float64)
    assert got["min"][0] == allv.min() and got["max"][0] == allv.max()
    np.testing.assert_allclose(got["sumsq"][0], (allv**2).sum(), rtol=1e-4)
    np.testing.assert_allclose(got["pos_sumsq"], (allv**2).sum(-1).ravel(), rtol=1e-4)
    assert got["elemsig"].size == 16  # `first`: iteration 0's values
    np.testing.assert_array_equal(got["elemsig"], sk.reference("elemsig", per[0]["body_mm"], mm.info(), opts))


# --------------------------------------------------------------------------------------------
# histogram modes


HIST_OPTIONS = [
    sk.SketchOptions(copy_out_max=0, hist_mode="sampled"),
    sk.SketchOptions(copy_out_max=0, hist_mode="sampled", sample_size=100),
    sk.SketchOptions(copy_out_max=0, hist_mode="exact"),
    sk.SketchOptions(copy_out_max=0, hist_mode="host"),
    sk.SketchOptions(copy_out_max=0, hist_mode="exact", hist_range=(-0.5, 2.0), hist_bins=10),
    sk.SketchOptions(copy_out_max=0, hist_mode="sampled", hist_range=(-1.0, 1.0)),
    sk.SketchOptions(copy_out_max=0, hist_mode="exact", exact_counts="host"),
    sk.SketchOptions(
        copy_out_max=0, hist_mode="exact", exact_counts="host", hist_range=(-0.5, 2.0), hist_bins=10
    ),
]
# ppocrv4_rec is opset 12 (the exact histogram counts with Unique), captcha_crnn opset 17 (ScatterElements)
HIST_CASES = [("ppocrv4_rec", o) for o in HIST_OPTIONS] + [
    ("captcha_crnn", HIST_OPTIONS[2]),
    ("captcha_crnn", HIST_OPTIONS[4]),
    ("captcha_crnn", HIST_OPTIONS[6]),
]
HIST_IDS = [f"{n}-{o.hist_mode}-{o.exact_counts}-{o.hist_range}-{o.sample_size}" for n, o in HIST_CASES]


@pytest.mark.parametrize("name,opts", HIST_CASES, ids=HIST_IDS)
def test_hist_modes_match_reference(name, opts):
    """Exact and host modes bin every finite value; sampled bins sample_size strided values."""
    path = real_model_path(name)
    model = load_model(path)
    feeds = real_feeds(name)
    inst, manifest = inject(path, Selection(kinds=("gemm",), max_sites=12), ["hist"], opts)
    counted_by = {n.op_type for n in _all_nodes(inst)} & {"ScatterElements", "Unique"}
    if opts.hist_mode == "exact" and opts.exact_counts == "graph":
        assert counted_by == ({"ScatterElements"} if manifest.opset >= 16 else {"ScatterElements", "Unique"})
    else:  # host counting: the graph only computes bin indices, one byte each
        assert not counted_by
        hidx = [o for o in inst.graph.output if "hidx" in o.name]
        live = sum(not t.constant for t in manifest.taps)
        assert len(hidx) == (live if opts.exact_counts == "host" else 0)
        assert all(o.type.tensor_type.elem_type == TensorProto.UINT8 for o in hidx)
    outs = unpacked(manifest, run_all(inst, feeds))
    compared, _ = check_main_graph(model, feeds, manifest, outs)
    assert compared == len(manifest.taps) >= 12
    values = tensor_values(model, [t.tensor for t in manifest.taps], feeds)
    decoded = decode_taps(manifest, outs, host_values(manifest, path))
    for tap in manifest.taps:
        got = decoded[tap.id][0]["hist"]
        x = values[tap.tensor]
        assert got.size == opts.hist_bins
        if opts.hist_range is not None:
            lo, hi = np.float32(opts.hist_range[0]), np.float32(opts.hist_range[1])
            inside = np.count_nonzero((x >= lo) & (x <= hi))
            assert got.sum() <= inside if opts.hist_mode == "sampled" else got.sum() == inside
        elif opts.hist_mode == "sampled":  # whole blocks of 16: up to 15 elements over sample_size
            want = min(x.size, opts.sample_size)
            assert got.sum() == sk.sample_positions(x.size, opts.sample_size).size
            assert want <= got.sum() < want + SAMPLE_BLOCK
        else:
            assert got.sum() == x.size


def _all_nodes(model: onnx.ModelProto):
    from onnx_opscope.graph import iter_graphs

    for _, g in iter_graphs(model.graph):
        yield from g.node


def test_exact_hist_on_opset11_counts_with_unique():
    """ScatterElements(reduction=add) needs opset 16: at opset 11 the exact histogram uses Unique's counts."""
    model = onnx.load(generated_model_path("opset11_mlp"))
    assert model.opset_import[0].version == 11 and model.ir_version == 6
    opts = sk.SketchOptions(copy_out_max=0, hist_mode="exact")
    inst, manifest = inject(model, None, ["all"], opts)
    ops = {n.op_type for n in _all_nodes(inst)}
    assert "Unique" in ops
    onnx.checker.check_model(inst)
    feeds = zoo.example_feeds("opset11_mlp", model=model)
    outs = unpacked(manifest, run_all(inst, feeds))
    compared, _ = check_main_graph(model, feeds, manifest, outs)
    assert compared > 0
    hist_taps = [t for t in manifest.taps if "hist" in t.sketches]
    assert len(hist_taps) == 6  # x, fc1.weight, fc1 out, relu out, fc2.weight, fc2 out
    decoded = decode_taps(manifest, outs, host_values(manifest, inst))
    for tap in hist_taps:
        got, shape = decoded[tap.id]
        assert got["hist"].sum() == np.prod(shape)


# --------------------------------------------------------------------------------------------
# non-finite values, empty tensors, fp16 and int inputs: the rules of sketches.py's docstring


def matmul_model(
    x_dtype=TensorProto.FLOAT, k: int = 8, n: int = 4, weight: np.ndarray | None = None, opset: int = 17
) -> onnx.ModelProto:
    """y = x @ W with x a graph input [rows, k] and W an initializer [k, n]."""
    np_dtype = helper.tensor_dtype_to_np_dtype(x_dtype)
    w = weight if weight is not None else (np.arange(k * n).reshape(k, n) % 5 - 2).astype(np_dtype)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", x_dtype, ["rows", k])],
        [helper.make_tensor_value_info("y", x_dtype, ["rows", n])],
        [numpy_helper.from_array(w, "W")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def sketch_values(model, x: np.ndarray, opts: sk.SketchOptions | None = None):
    """(per tensor name: sketch values, the tensors' true values) with every default sketch on x, W, y."""
    opts = opts or sk.SketchOptions(copy_out_max=0, hist_mode="exact")
    inst, manifest = inject(model, None, ["all"], opts)
    outs = unpacked(manifest, run_all(inst, {"x": x}))
    values = tensor_values(model, ["x", "W", "y"], {"x": x})
    host = host_values(manifest, model)
    decoded = decode_taps(manifest, outs, host)
    got = {t.tensor: decoded[t.id][0] for t in manifest.taps}
    assert set(got) == {"x", "W", "y"}
    check_taps(manifest.taps, outs, values, opts, host)
    return got, values


NAN, INF = np.float32(np.nan), np.float32(np.inf)
BIG = np.float32(-3.4e38)
CASES = {
    "nan": [[NAN, 1, -2, 3, 0, 0, 5, -1]] * 2,
    "pos_inf": [[INF, 1, -2, 3, 0, 0, 5, -1], [1, 1, 1, 1, 1, 1, 1, 1]],
    "neg_inf": [[-INF, 1, -2, 3, 0, 0, 5, -1], [0, 0, 0, 0, 0, 0, 0, 4]],
    "float32_min": [[BIG, 1, -2, 3, 0, 0, 5, -1], [BIG, BIG, 0, 1, 2, 3, 4, 5]],
    "mix": [[NAN, INF, -INF, BIG, 0, 2, -3, 7], [NAN, NAN, 1, 2, -INF, 0, 0, 9], [1, 2, 3, 4, 5, 6, 7, INF]],
}


@pytest.mark.parametrize("case", list(CASES))
def test_non_finite_rules(case):
    """Counts are right, every other stat ignores NaN/Inf, nnz counts them, elemsig keeps them."""
    x = np.array(CASES[case], np.float32)
    got, values = sketch_values(matmul_model(), x)
    g = got["x"]
    fin = x[np.isfinite(x)].astype(np.float64)
    assert g["nan_count"][0] == np.isnan(x).sum() and g["inf_count"][0] == np.isinf(x).sum()
    assert g["min"][0] == fin.min() and g["max"][0] == fin.max()
    np.testing.assert_allclose(g["mean"][0], fin.mean(), rtol=1e-6, atol=1e-6 * np.abs(fin).max())
    np.testing.assert_allclose(g["sumsq"][0], (fin**2).sum(), rtol=1e-5)
    np.testing.assert_allclose(g["l1"][0], np.abs(fin).sum(), rtol=1e-5)
    assert g["nnz"][0] == np.count_nonzero(x)  # NaN and Inf are != 0
    assert g["hist"].sum() == fin.size  # exact mode: one count per finite value
    sampled = sk.sample_positions(x.size, 4096)  # every element here: 16 values spread over them
    pos = sampled[np.arange(min(sampled.size, 16)) * sampled.size // min(sampled.size, 16)]
    np.testing.assert_array_equal(g["elemsig"], x.ravel()[pos].astype(np.float64))
    clean = np.where(np.isfinite(x), x, 0).astype(np.float64)
    # per-row sums are taken on x / max|x| in float32: beside a -3.4e38 ("mix"), rows of ordinary
    # values underflow to 0, which the pos/adj tol (atol 1e-6 x the largest row) allows
    pos, adj = (clean**2).sum(1), (np.diff(clean, axis=0) ** 2).sum(1)
    np.testing.assert_allclose(g["pos_sumsq"], pos, rtol=1e-5, atol=1e-6 * pos.max())
    np.testing.assert_allclose(g["adj_sumsq"], adj, rtol=1e-5, atol=1e-6 * adj.max())
    chan = np.where(np.isfinite(x), np.abs(x), -np.inf).max(0).astype(np.float64)
    np.testing.assert_array_equal(g["chan_maxabs"], np.where(np.isfinite(chan), chan, np.nan))
    for tensor, vals in got.items():
        for stat, v in vals.items():
            if stat not in ("elemsig", "min", "max", "mean", "kurtosis", "chan_maxabs", "chan_outlier"):
                assert np.isfinite(v).all(), (case, tensor, stat, v)  # no overflow, even on -3.4e38
    if case == "float32_min":
        with np.errstate(over="ignore"):
            assert np.isinf(x.sum())  # the If's cheap ReduceSum overflows: the masking branch runs
        assert np.isfinite(g["sumsq"][0]) and g["sumsq"][0] > 2e77
        assert np.isfinite(got["y"]["sumsq"][0]) or got["y"]["inf_count"][0] > 0
    if case == "nan":  # channel 0 holds only NaN: no finite value
        assert np.isnan(g["chan_maxabs"][0]) and np.isfinite(g["chan_maxabs"][1:]).all()


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("rows", [197, 1500, 720, 14])
def test_chan_maxabs_channel_last_blocks(rows, opset):
    """Channel-last max|x| reduces the rows in blocks of `row_block(rows)` from opset 14 (1 for a prime count,
    15 for 1500, 16 for 720, 2 for 14), transposed before: equal to numpy either way, with a NaN, an Inf and a
    channel with no finite value (the masking branch) and without."""
    rng = np.random.default_rng(rows)
    x = rng.standard_t(3, (rows, 8)).astype(np.float32)
    dirty = x.copy()
    dirty[rows // 2, 2], dirty[-1, 5], dirty[:, 7] = NAN, INF, NAN
    assert [row_block(rows) for rows in (197, 1500, 720, 14)] == [1, 15, 16, 2]
    for v in (x, dirty):
        got, _ = sketch_values(matmul_model(opset=opset), v)
        chan = np.where(np.isfinite(v), np.abs(v), -np.inf).max(0).astype(np.float64)
        np.testing.assert_array_equal(got["x"]["chan_maxabs"], np.where(np.isfinite(chan), chan, np.nan))


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e4])
def test_kurtosis_far_from_zero(offset):
    """The fast branch centres and scales in one affine pass (x·a + b): a heavy-tailed tensor whose mean is
    10^4 standard deviations away from 0 still gets its kurtosis to 2e-3 (1e-4 measured)."""
    x = (offset + np.random.default_rng(1).standard_t(4, (512, 8))).astype(np.float32)
    got, _ = sketch_values(matmul_model(), x)
    d = x.astype(np.float64) - x.astype(np.float64).mean()
    ref = np.mean(d**4) / np.mean(d**2) ** 2
    assert ref > 5 and abs(got["x"]["kurtosis"][0] / ref - 1) < 2e-3


def test_all_nan_tensor():
    x = np.full((3, 8), np.nan, np.float32)
    got, _ = sketch_values(matmul_model(), x)
    g = got["x"]
    assert g["nan_count"][0] == 24 and g["inf_count"][0] == 0 and g["nnz"][0] == 24
    for stat in ("min", "max", "mean", "kurtosis", "chan_outlier"):
        assert np.isnan(g[stat]).all(), stat
    assert g["l1"][0] == 0 and g["sumsq"][0] == 0 and g["hist"].sum() == 0
    assert np.isnan(g["chan_maxabs"]).all() and g["chan_maxabs"].size == 8
    np.testing.assert_array_equal(g["pos_sumsq"], np.zeros(3))
    np.testing.assert_array_equal(g["adj_sumsq"], np.zeros(2))
    assert np.isnan(g["elemsig"]).all() and g["elemsig"].size == 16


@pytest.mark.parametrize("shape", [(0, 8), (3, 0)])
def test_empty_tensor_documented_values(shape):
    """Counts and sums 0; min, max, mean, kurtosis NaN; hist zeros; elemsig empty; chan_maxabs NaN per
    channel; pos_sumsq / adj_sumsq one 0 per row / pair, none when there are none."""
    x = np.zeros(shape, np.float32)
    got, _ = sketch_values(matmul_model(k=shape[1]), x)
    g = got["x"]
    for stat in ("nan_count", "inf_count", "nnz", "l1", "sumsq"):
        assert g[stat].tolist() == [0.0], stat
    for stat in ("min", "max", "mean", "kurtosis"):
        assert np.isnan(g[stat]).all() and g[stat].size == 1, stat
    assert g["hist"].tolist() == [0.0] * 32 and g["elemsig"].size == 0
    assert g["chan_maxabs"].size == shape[1] and np.isnan(g["chan_maxabs"]).all()
    assert g["pos_sumsq"].tolist() == [0.0] * shape[0]
    assert g["adj_sumsq"].tolist() == [0.0] * max(shape[0] - 1, 0)


def test_fp16_input():
    """fp16 tensors are read with their own fp16 values: 65504 stays finite, inf stays inf."""
    x = np.array([[65504, -65504, np.inf, np.nan, 1, 0, 0.5, 2], [1, 2, 3, 4, 5, 6, 7, -np.inf]], np.float16)
    got, values = sketch_values(matmul_model(TensorProto.FLOAT16), x)
    g = got["x"]
    assert g["nan_count"][0] == 1 and g["inf_count"][0] == 2
    assert g["max"][0] == 65504 and g["min"][0] == -65504
    np.testing.assert_allclose(
        g["sumsq"][0], 2 * 65504.0**2 + 1 + 0.25 + 4 + 1 + 4 + 9 + 16 + 25 + 36 + 49, rtol=1e-5
    )
    # y = x @ W in fp16 overflows to inf / nan in places: counted, never in the other stats
    y = values["y"].astype(np.float64)
    assert got["y"]["inf_count"][0] == np.isinf(y).sum() and got["y"]["nan_count"][0] == np.isnan(y).sum()


def test_int32_input_cast_to_float():
    """Integer tensors are measured as the tap casts them, to float32: exact below 2**24, rounded past it
    (the references cast the same way, so int32 extremes compare exactly too)."""
    x = np.array(
        [[-(2**24), 0, 3, -7, 0, 1, 2**24, 9], [2**31 - 1, -(2**31), 2**24 + 1, 0, 0, 0, 0, 5]], np.int32
    )
    w = (np.arange(32).reshape(8, 4) % 3 - 1).astype(np.int32)
    got, _ = sketch_values(matmul_model(TensorProto.INT32, weight=w), x)
    g = got["x"]
    assert g["min"][0] == -(2**31) and g["max"][0] == 2**31  # 2**31 - 1 rounds up in float32
    assert g["nnz"][0] == 10 and g["nan_count"][0] == 0 and g["inf_count"][0] == 0
    np.testing.assert_array_equal(g["elemsig"], x.ravel().astype(np.float32).astype(np.float64))
    assert g["chan_maxabs"][2] == 2**24  # 2**24 + 1 is not a float32


def test_constant_taps_with_non_finite_weights():
    """A weight tap adds nothing to the graph; its host values follow the non-finite rules."""
    w = (np.arange(32).reshape(8, 4) % 5 - 2).astype(np.float32)
    w[0, 0], w[3, 2], w[5, 1] = np.nan, np.inf, BIG
    model = matmul_model(weight=w)
    inst, manifest = inject(model, None, ["all"], sk.SketchOptions(copy_out_max=0, hist_mode="exact"))
    w_tap, x_tap = (next(t for t in manifest.taps if t.tensor == n) for n in ("W", "x"))
    assert w_tap.constant and not x_tap.constant
    assert w_tap.outputs == {} and w_tap.numel == 32 and w_tap.rank == 2 and x_tap.outputs
    assert not any(n.name.startswith(f"opscope_{w_tap.id}_") for n in inst.graph.node)
    assert [n.name for n in inst.graph.node if "W" in n.input] == ["mm"]
    assert any(n.name.startswith(f"opscope_{x_tap.id}_") for n in inst.graph.node if n.op_type == "If")
    got, _ = sketch_values(model, np.ones((2, 8), np.float32))
    g = got["W"]
    assert g["nan_count"][0] == 1 and g["inf_count"][0] == 1 and g["min"][0] == BIG
    assert g["hist"].sum() == 30
    assert g["nnz"][0] == np.count_nonzero(w) and g["max"][0] == 2
