"""Weight probes and the weights' matrix views (weights.probes, weights.matrix).

Each probe is held to a direct numpy reference written here (loops over rows, groups and chunks,
np.unique, np.linalg.svd), on constructed weights with a known answer and on the real models'
weights; the views are held to the op's own channel axis on tiny onnx.helper models, so a wrong
axis, a wrong group boundary or the wrong bytes of a data file fails.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pyarrow.parquet as pq
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph import iter_graphs
from onnx_opscope.weights import matrix, probes
from onnx_opscope.weights.matrix import WeightView, as_matrix, find_weights, from_matrix, iter_weights
from onnx_opscope.weights.probes import (
    cardinality,
    nm_error,
    outlier_channels,
    probe,
    probe_weights,
    probes_table,
    quant_error,
    stable_rank,
    ternary_error,
)

F = TensorProto.FLOAT
RNG = np.random.default_rng(14)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same numbers whichever tests run before it."""
    global RNG
    RNG = np.random.default_rng(14)


def normal(*shape: int, scale: float = 0.05) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# --------------------------------------------------------------------------------------------
# references


def ref_quant(w: np.ndarray, bits: int, granularity: str, group: int = 128) -> float:
    """Symmetric quantization, one slice at a time: the whole tensor, each row, or each group of a row."""
    levels = 2 ** (bits - 1) - 1
    w = w.astype(np.float64)
    if granularity == "tensor":
        slices = [w]
    elif granularity == "channel":
        slices = list(w)
    else:
        slices = [row[c : c + group] for row in w for c in range(0, w.shape[1], group)]
    err = 0.0
    for s in slices:
        amax = np.abs(s).max()
        if amax == 0:
            continue
        scale = np.float32(amax / levels)
        q = np.clip(np.round(s.astype(np.float32) / scale), -levels, levels) * scale
        err += float(((s - q) ** 2).sum())
    return math.sqrt(err / float((w**2).sum()))


def ref_nm(w: np.ndarray, n: int = 2, m: int = 4) -> float:
    """Each chunk of m columns (the last one maybe shorter), every row at once: sort, drop all but n."""
    w = w.astype(np.float64)
    dropped = 0.0
    for c in range(0, w.shape[1], m):
        chunk = np.sort(w[:, c : c + m] ** 2, axis=1)
        dropped += chunk[:, : max(chunk.shape[1] - n, 0)].sum()
    return math.sqrt(dropped / float((w**2).sum()))


def ref_ternary(w: np.ndarray) -> float:
    a = np.abs(w.astype(np.float64))
    delta = 0.7 * a.mean()
    alpha = a[a > delta].mean()
    q = np.where(a > delta, alpha * np.sign(w), 0.0)
    return math.sqrt(((w - q) ** 2).sum() / (w.astype(np.float64) ** 2).sum())


def ref_stable_rank(w: np.ndarray) -> float:
    s = np.linalg.svd(w.astype(np.float64), compute_uv=False)
    return float((s**2).sum() / s[0] ** 2)


def two_four_sparse(rows: int, cols: int) -> np.ndarray:
    w = normal(rows, cols)
    for r in range(rows):
        for c in range(0, cols, 4):
            drop = RNG.choice(4, 2, replace=False)
            w[r, c + drop] = 0
    return w


# --------------------------------------------------------------------------------------------
# probes on constructed weights


def test_two_four_sparse_weights_have_nm_error_zero():
    w = two_four_sparse(24, 64)
    assert nm_error(w) == 0.0
    assert probe(view_of(w), w).hint == probes.HINT_SPARSE


@pytest.mark.parametrize("cols", [64, 66, 7])
def test_nm_error_matches_a_loop_over_chunks(cols):
    w = normal(13, cols)  # 66 and 7: a short last chunk, padded with zeros
    assert nm_error(w) == pytest.approx(ref_nm(w), rel=1e-5)
    assert nm_error(w, 1, 4) == pytest.approx(ref_nm(w, 1, 4), rel=1e-5)


def test_cardinality_counts_distinct_rounded_values():
    palette = ((np.arange(16) - 8) * 0.037).astype(np.float32)
    w = palette[RNG.integers(0, 16, (40, 50))]
    assert len(np.unique(w)) == 16
    assert cardinality(w) == 16
    assert probe(view_of(w), w).hint == probes.HINT_LUT
    v = normal(70, 90, scale=0.3)
    assert cardinality(v) == len(np.unique(np.round(v.astype(np.float64) * 1000)))
    assert cardinality(v, round_to=100) == len(np.unique(np.round(v.astype(np.float64) * 100)))


def test_small_weights_with_few_rounded_values_are_no_palette():
    w = normal(128, 32, scale=1e-4)  # |w| < 1e-3: a handful of values at x1000, none of them the weight's
    assert cardinality(w) <= 3
    grid = np.round(w.astype(np.float64) * 1000) / 1000
    assert probes.rounding_error(w) == pytest.approx(np.linalg.norm(w - grid) / np.linalg.norm(w), rel=1e-5)
    assert probe(view_of(w), w).hint != probes.HINT_LUT


def test_cardinality_stops_at_the_cap_on_either_path():
    v = normal(100, 100, scale=1.0)
    assert cardinality(v, cap=50) == 50
    # a range too wide for the bitmap: the sorted-merge path, exact below the cap and capped above it
    wide = np.array([[-3000.0, 0.5, 2000.0, 2000.0]], np.float32).repeat(5, axis=0)
    span = (2000 + 3000) * 10_000
    assert span > probes.BITMAP_MAX
    assert cardinality(wide, round_to=10_000) == 3
    assert cardinality(v * 1e4, round_to=10_000, cap=500) == 500


@pytest.mark.parametrize("shape", [(64, 40), (300, 600), (700, 280)])
def test_stable_rank_of_rank_one_is_one_and_of_random_matches_svd(shape):
    # (64, 40): the Gram matrix formed; (300, 600) and (700, 280): sides over GRAM_MAX, products
    u, v = normal(shape[0], 1), normal(1, shape[1])
    assert stable_rank(u @ v) == pytest.approx(1.0, rel=1e-4)
    w = normal(*shape)
    w[:, 0] += 1.0  # a clear top singular value: power iteration converges within 30 steps
    assert stable_rank(w) == pytest.approx(ref_stable_rank(w), rel=1e-3)


def test_low_rank_weight_hints_a_factored_matmul():
    w = normal(128, 8, scale=0.5) @ normal(8, 128, scale=0.5)
    p = probe(view_of(w), w)
    assert p.stable_rank < 8
    assert p.hint == probes.HINT_LOWRANK


def test_per_row_int8_round_trip_matches_numpy():
    w = normal(32, 96)
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    q = np.clip(np.round(w / scale), -127, 127) * scale
    direct = math.sqrt(((w - q) ** 2).sum(dtype=np.float64) / (w**2).sum(dtype=np.float64))
    assert quant_error(w, 8, "channel") == pytest.approx(direct, rel=1e-5)


@pytest.mark.parametrize("granularity,group", [("tensor", 0), ("channel", 0), ("group", 32), ("group", 128)])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_quant_error_matches_a_loop_over_slices(granularity, group, bits):
    w = normal(9, 300)  # 300 columns: a short last group for both 32 and 128
    w[4, 130:200] *= 20  # groups of very different ranges
    w[7, 256:] = 0  # an all-zero group
    got = quant_error(w, bits, granularity, group or 128)
    assert got == pytest.approx(ref_quant(w, bits, granularity, group or 128), rel=1e-5)


def test_finer_scales_never_cost_more_error():
    w = normal(16, 512)
    w[:, ::37] *= 10
    errors = [
        quant_error(w, 4, g, k) for g, k in [("tensor", 0), ("channel", 0), ("group", 128), ("group", 32)]
    ]
    assert errors == sorted(errors, reverse=True)
    assert errors[0] > errors[-1]


def test_best_bits_is_the_fewest_under_budget():
    w = normal(20, 64)
    refs = {b: ref_quant(w, b, "channel") for b in (3, 4, 6, 8)}
    for budget in (0.5, 0.1, 0.02, 1e-6):
        want = next((b for b in (3, 4, 6, 8) if refs[b] < budget), None)
        assert probes.best_bits(w, budget) == want
    assert probes.best_bits(w, 1e-6) is None


def test_ternary_error_matches_twn():
    for w in (normal(17, 33), normal(8, 200) ** 3):
        assert ternary_error(w) == pytest.approx(ref_ternary(w), rel=1e-5)


def test_outlier_column_planted_is_found():
    w = normal(64, 48)
    w[:, 29] *= 40
    cols, ratio = outlier_channels(w)
    colmax = np.abs(w).max(axis=0)
    assert cols.tolist() == [29]
    assert ratio == pytest.approx(colmax.max() / np.median(colmax), rel=1e-6)


def test_one_large_weight_hints_mixed_int4():
    """A single large weight (what an activation outlier channel leaves in W): outlier column, high
    max / median, and not enough energy to make the matrix low rank."""
    w = normal(512, 256)
    w[100, 77] = 30 * 0.05
    p = probe(view_of(w), w)
    assert 77 in p.outliers and p.outlier_ratio > 8
    assert p.stable_rank > 0.1 * 256
    assert p.hint == probes.HINT_MIXED


def test_all_zero_weight():
    w = np.zeros((8, 20), np.float32)
    p = probe(view_of(w), w)
    assert p.stable_rank == 0 and p.nm_error == 0 and p.ternary_error == 0 and p.rounding_error == 0
    assert set(p.quant.values()) == {0.0}
    assert p.cardinality == 1 and p.outliers == () and p.outlier_ratio == 0
    assert p.hint == probes.HINT_ZERO


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_weight_is_an_error_naming_it(bad):
    w = normal(300, 1000)  # past the first row block
    w[299, 5] = bad
    with pytest.raises(OpscopeError, match="'W_bad'.*NaN or inf"):
        probe(view_of(w, "W_bad"), w)


def test_bad_probe_arguments_are_errors():
    w = normal(4, 8)
    with pytest.raises(OpscopeError, match="bits"):
        quant_error(w, 1)
    with pytest.raises(OpscopeError, match="granularity"):
        quant_error(w, 4, "row")
    with pytest.raises(OpscopeError, match="N:M"):
        nm_error(w, 5, 4)


def test_probe_fields_and_hint_order():
    w = normal(40, 64)
    p = probe(view_of(w), w, bits=(6,))
    assert sorted(p.quant) == sorted(
        f"int{b}_{g}" for b in (4, 6, 8) for g in ("tensor", "channel", "g32", "g128")
    )
    assert p.best_bits == (6 if ref_quant(w, 6, "channel") < 0.02 else None)
    assert p.quant["int8_channel"] == pytest.approx(ref_quant(w, 8, "channel"), rel=1e-5)
    assert p.hint == (probes.HINT_INT8 if p.quant["int8_channel"] < 0.02 else probes.HINT_KEEP)
    bias = normal(64)
    assert probe(view_of(bias.reshape(64, 1)), bias.reshape(64, 1)).hint == probes.HINT_KEEP


def view_of(w: np.ndarray, name: str = "W") -> WeightView:
    return WeightView(name, "", "MatMul", "mm", w.shape, "float32", 0, *w.shape)


# --------------------------------------------------------------------------------------------
# views: the consumer's channel axis


def model_of(nodes, weights: dict[str, np.ndarray], inputs=("x",), outputs=("y",), opset=17):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(i, F, None) for i in inputs],
        [helper.make_tensor_value_info(o, F, None) for o in outputs],
        [numpy_helper.from_array(a, n) for n, a in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def views_by_name(model, **kw) -> dict[str, tuple[WeightView, np.ndarray]]:
    return {v.name: (v, m) for v, m in iter_weights(model, **kw)}


def test_channel_axes_of_matmul_gemm_conv_and_friends():
    b, bb = normal(32, 48), normal(3, 32, 48)
    g0, g1, a = normal(32, 24), normal(24, 32), normal(10, 32)
    conv, convt, emb = normal(16, 4, 3, 3), normal(8, 6, 2, 2), normal(50, 12)
    lstm_w, lstm_r = normal(2, 4 * 5, 7), normal(2, 4 * 5, 5)
    nodes = [
        helper.make_node("MatMul", ["x", "B"], ["m1"], name="mm"),
        helper.make_node("MatMul", ["x", "BB"], ["m2"]),
        helper.make_node("Gemm", ["x", "G0"], ["g0"], transB=0),
        helper.make_node("Gemm", ["x", "G1"], ["g1"], transB=1),
        helper.make_node("MatMul", ["A", "x"], ["m3"]),
        helper.make_node("Conv", ["x", "C"], ["c"]),
        helper.make_node("ConvTranspose", ["x", "CT"], ["ct"]),
        helper.make_node("Gather", ["E", "x"], ["e"]),
        helper.make_node("LSTM", ["x", "LW", "LR"], ["l"], hidden_size=5, direction="bidirectional"),
        helper.make_node("Sum", ["m1", "m2", "g0", "g1", "m3", "c", "ct", "e", "l"], ["y"]),
    ]
    weights = dict(B=b, BB=bb, G0=g0, G1=g1, A=a, C=conv, CT=convt, E=emb, LW=lstm_w, LR=lstm_r)
    found = views_by_name(model_of(nodes, weights))
    assert set(found) == set(weights)
    want = {  # name: (op, out_axis, the matrix built here by hand)
        "B": ("MatMul", 1, b.T),
        "BB": ("MatMul", 2, np.concatenate(list(bb), axis=0).T),
        "G0": ("Gemm", 1, g0.T),
        "G1": ("Gemm", 0, g1),
        "A": ("MatMul", 0, a),
        "C": ("Conv", 0, conv.reshape(16, -1)),
        "CT": ("ConvTranspose", 1, np.stack([convt[:, m].ravel() for m in range(6)])),
        "E": ("Gather", 0, emb),
        "LW": ("LSTM", 1, np.stack([lstm_w[d, h] for h in range(20) for d in range(2)])),
        "LR": ("LSTM", 1, np.stack([lstm_r[d, h] for h in range(20) for d in range(2)])),
    }
    for name, (op, axis, expect) in want.items():
        view, m = found[name]
        assert (view.op, view.out_axis, view.rows, view.cols) == (op, axis, *expect.shape), name
        np.testing.assert_array_equal(m, expect, err_msg=name)
        np.testing.assert_array_equal(from_matrix(view, m), weights[name], err_msg=name)
        np.testing.assert_array_equal(as_matrix(view, weights[name]), m, err_msg=name)
    assert found["B"][0].node == "mm" and found["G0"][0].node == "Gemm_0"
    assert found["B"][0].dense_bytes == b.nbytes


def test_first_consumer_with_an_axis_decides_and_shared_weights_appear_once():
    w, bias = normal(16, 8), normal(8)
    nodes = [
        helper.make_node("Mul", ["x", "W"], ["s"]),
        helper.make_node("Gemm", ["x", "W", "bias"], ["g"], transB=1),
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["s", "g"], ["y"]),
    ]
    found = list(iter_weights(model_of(nodes, {"W": w, "bias": bias}), min_elements=8))
    assert [v.name for v, _ in found] == ["W", "bias"]
    view = found[0][0]
    assert (view.op, view.out_axis, view.rows) == ("Gemm", 0, 16)
    assert (found[1][0].op, found[1][0].node, found[1][0].rows, found[1][0].cols) == ("", "", 8, 1)
    assert [v.name for v, _ in iter_weights(model_of(nodes, {"W": w, "bias": bias}))] == ["W"]  # 8 < 16


def test_constant_node_and_subgraph_weights_are_found():
    wc, w_then, w_body, outer = normal(6, 5), normal(4, 6), normal(5, 5), normal(5, 7)
    then = helper.make_graph(
        [helper.make_node("MatMul", ["x", "Wt"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", F, None)], [numpy_helper.from_array(w_then, "Wt")],
    )  # fmt: skip
    other = helper.make_graph(
        [helper.make_node("MatMul", ["x", "Wo"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", F, None)],
    )
    body = helper.make_graph(
        [
            helper.make_node("Constant", [], ["Wb"], value=numpy_helper.from_array(w_body)),
            helper.make_node("MatMul", ["v_in", "Wb"], ["v1"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["v1"], ["v_out"]),
        ],
        "body",
        [helper.make_tensor_value_info(n, t, None) for n, t in
         [("i", TensorProto.INT64), ("cond_in", TensorProto.BOOL), ("v_in", F)]],
        [helper.make_tensor_value_info(n, t, None) for n, t in [("cond_out", TensorProto.BOOL), ("v_out", F)]],
    )  # fmt: skip
    nodes = [
        helper.make_node("Constant", [], ["Wc"], value=numpy_helper.from_array(wc)),
        helper.make_node("MatMul", ["x", "Wc"], ["a"]),
        helper.make_node("If", ["cond"], ["b"], name="branch", then_branch=then, else_branch=other),
        helper.make_node("Loop", ["", "cond", "x"], ["c"], name="loop", body=body),
        helper.make_node("Sum", ["a", "b", "c"], ["y"]),
    ]
    model = model_of(nodes, {"Wo": outer}, inputs=("x", "cond"))
    found = views_by_name(model)
    assert set(found) == {"Wc", "Wt", "Wb", "Wo"}
    assert (found["Wc"][0].graph, found["Wc"][0].op) == ("", "MatMul")
    assert (found["Wt"][0].graph, found["Wt"][0].node) == (
        "branch/then_branch",
        "branch/then_branch/MatMul_0",
    )
    assert (found["Wb"][0].graph, found["Wb"][0].rows) == ("loop/body", 5)
    # an outer weight read only inside a branch takes its view from that reader
    assert (found["Wo"][0].graph, found["Wo"][0].op, found["Wo"][0].node) == (
        "",
        "MatMul",
        "branch/else_branch/MatMul_0",
    )
    for name, w in [("Wc", wc), ("Wt", w_then), ("Wb", w_body), ("Wo", outer)]:
        np.testing.assert_array_equal(found[name][1], w.T)


def test_quantized_weights_and_their_scales_are_skipped():
    q = RNG.integers(-127, 128, (16, 32)).astype(np.int8)
    scale, zp = np.full(32, 0.01, np.float32), np.zeros(32, np.int8)
    packed, nbits_scales = RNG.integers(0, 256, (32, 2, 8)).astype(np.uint8), normal(64)
    nodes = [
        helper.make_node("DequantizeLinear", ["Q", "S", "Z"], ["wq"], axis=1),
        helper.make_node("MatMul", ["x", "wq"], ["m"]),
        helper.make_node("MatMul", ["m", "W"], ["y"]),
        helper.make_node(
            "MatMulNBits", ["m", "P", "PS"], ["y2"], domain="com.microsoft", K=32, N=32, bits=4, block_size=16
        ),
    ]
    w = normal(32, 32)
    found = views_by_name(
        model_of(nodes, {"Q": q, "S": scale, "Z": zp, "W": w, "P": packed, "PS": nbits_scales})
    )
    assert list(found) == ["W"]


def test_float16_bfloat16_and_float64_are_read_as_float32():
    w = normal(8, 16)
    bf = helper.make_tensor("WB", TensorProto.BFLOAT16, w.shape, w.ravel().tolist())
    model = model_of(
        [helper.make_node("MatMul", ["x", n], [f"o{n}"]) for n in ("WH", "WD", "WB")]
        + [helper.make_node("Sum", ["oWH", "oWD", "oWB"], ["y"])],
        {"WH": w.astype(np.float16), "WD": w.astype(np.float64)},
    )
    model.graph.initializer.append(bf)
    found = views_by_name(model)
    assert {n: v.dtype for n, (v, _) in found.items()} == {"WH": "float16", "WD": "float64", "WB": "bfloat16"}
    assert found["WH"][0].dense_bytes == w.size * 2 and found["WB"][0].dense_bytes == w.size * 2
    np.testing.assert_array_equal(found["WH"][1], w.astype(np.float16).astype(np.float32).T)
    np.testing.assert_array_equal(found["WD"][1], w.T)
    np.testing.assert_allclose(found["WB"][1], w.T, rtol=2**-7)
    assert all(m.dtype == np.float32 for _, m in found.values())


# --------------------------------------------------------------------------------------------
# external data


def external_model(tmp_path, weights: dict[str, np.ndarray], bfloat16: dict[str, np.ndarray] | None = None):
    """A MatMul per weight, every weight in m.bin; `bfloat16` ones stored as bfloat16."""
    names = [*weights, *(bfloat16 or {})]
    nodes = [helper.make_node("MatMul", ["x", n], [f"o_{n}"]) for n in names]
    nodes.append(helper.make_node("Sum", [f"o_{n}" for n in names], ["y"]))
    model = model_of(nodes, weights)
    for n, w in (bfloat16 or {}).items():  # as raw bytes: onnx.save leaves int32_data tensors inline
        bits = numpy_helper.to_array(helper.make_tensor(n, TensorProto.BFLOAT16, w.shape, w.ravel().tolist()))
        raw = bits.view(np.uint16).tobytes()
        model.graph.initializer.append(helper.make_tensor(n, TensorProto.BFLOAT16, w.shape, raw, raw=True))
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="m.bin", size_threshold=0)
    return path


def test_external_data_is_read_one_tensor_at_a_time(tmp_path, monkeypatch):
    weights = {
        "W1": normal(24, 40),
        "W2": normal(40, 40).astype(np.float16),
        "W3": normal(40, 8).astype(np.float64),
    }
    bf16 = {"W4": normal(40, 16)}
    path = external_model(tmp_path, weights, bf16)
    proto = onnx.load(str(path), load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in proto.graph.initializer)
    inline = numpy_helper.to_array(
        helper.make_tensor("b", TensorProto.BFLOAT16, [640], bf16["W4"].ravel().tolist())
    )
    weights["W4"] = inline.astype(np.float32).reshape(40, 16)  # what bfloat16 holds of W4
    reads: list[str] = []
    real, chunks = matrix.read_external_tensor, matrix.tensor_chunks
    monkeypatch.setattr(matrix, "read_external_tensor", lambda t, base: reads.append(t.name) or real(t, base))
    monkeypatch.setattr(
        matrix, "tensor_chunks", lambda t, *a, **k: reads.append(t.name) or chunks(t, *a, **k)
    )
    found = find_weights(path)
    assert reads == []  # finding reads no data
    it = iter_weights(path)
    for k, name in enumerate(weights):
        view, m = next(it)
        assert view.name == name and reads == list(weights)[: k + 1]
        np.testing.assert_array_equal(m, weights[name].astype(np.float32).T)
    # a ModelProto with its folder given, and without it
    assert {v.name for v, _ in iter_weights(proto, base_dir=tmp_path)} == set(weights)
    with pytest.raises(OpscopeError, match="external data.*base_dir"):
        next(iter_weights(proto))
    assert len(found) == 4


def test_external_data_outside_the_folder_is_refused(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    path = external_model(inner, {"W": normal(16, 16)})
    (tmp_path / "stolen.bin").write_bytes((inner / "m.bin").read_bytes())
    model = onnx.load(str(path), load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "../stolen.bin"
    onnx.save(model, str(path))
    with pytest.raises(OpscopeError, match="outside the model's folder"):
        list(iter_weights(path))
    with pytest.raises(OpscopeError, match="outside the model's folder"):
        probe_weights(model, base_dir=inner)


# --------------------------------------------------------------------------------------------
# the real models


def float_constants(model: onnx.ModelProto) -> set[str]:
    """Names of the float initializers and Constant values of 16+ elements, every graph (onnx's own walk)."""
    floats = {F, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
    names = set()
    for _, g in iter_graphs(model.graph):
        tensors = [(t.name, t) for t in g.initializer]
        tensors += [
            (n.output[0], a.t)
            for n in g.node
            if n.op_type == "Constant"
            for a in n.attribute
            if a.name == "value"
        ]
        names.update(n for n, t in tensors if t.data_type in floats and math.prod(t.dims) >= 16)
    return names


def tensor_named(model: onnx.ModelProto, name: str) -> TensorProto:
    for _, g in iter_graphs(model.graph):
        for t in g.initializer:
            if t.name == name:
                return t
        for n in g.node:
            if n.op_type == "Constant" and n.output[0] == name:
                return n.attribute[0].t
    raise KeyError(name)


def test_probes_run_on_every_weight_of_every_real_model(real_model, tmp_path):
    calls: list[tuple[int, int, str]] = []
    found = probe_weights(real_model, progress=lambda *a: calls.append(a))
    model = onnx.load(str(real_model), load_external_data=False)
    assert {p.name for p in found} == float_constants(model)
    assert [c[:2] for c in calls] == [(k, len(found)) for k in range(1, len(found) + 1)]
    for p in found:
        values = [p.stable_rank, p.nm_error, p.ternary_error, p.rounding_error, *p.quant.values()]
        assert all(math.isfinite(x) and x >= 0 for x in values), p.name
        assert all(0 <= e <= 1 for e in (p.nm_error, p.ternary_error, *p.quant.values())), p.name
        assert 1 - 1e-4 <= p.stable_rank <= min(p.rows, p.cols) * (1 + 1e-4) or p.stable_rank == 0, p.name
        assert 1 <= p.cardinality <= min(p.rows * p.cols, 100_000), p.name
        assert p.outlier_ratio >= 1 or p.outlier_ratio == 0, p.name
        assert p.hint in {v for k, v in vars(probes).items() if k.startswith("HINT_")}, p.name
    # the largest weight's probes against the references, on its matrix as read here
    big = max(found, key=lambda p: p.rows * p.cols)
    w = next(m for v, m in iter_weights(real_model) if v.name == big.name)
    ref = numpy_helper.to_array(tensor_named(model, big.name))
    np.testing.assert_array_equal(from_matrix(big.view, w), ref)
    assert big.quant["int4_channel"] == pytest.approx(ref_quant(w, 4, "channel"), rel=1e-4)
    assert big.quant["int8_g32"] == pytest.approx(ref_quant(w, 8, "group", 32), rel=1e-4)
    assert big.nm_error == pytest.approx(ref_nm(w), rel=1e-4)
    assert big.ternary_error == pytest.approx(ref_ternary(w), rel=1e-4)
    assert big.cardinality == min(len(np.unique(np.round(w.astype(np.float64) * 1000))), 100_000)
    # the table: one flat row per weight, read back from Parquet
    table = probes_table(found)
    pq.write_table(table, tmp_path / "p.parquet")
    back = pq.read_table(tmp_path / "p.parquet")
    assert back.num_rows == len(found) and back.schema == table.schema
    assert all(not str(f.type).startswith(("list", "struct", "map")) for f in back.schema)
    assert back.column("int4_channel").to_pylist() == [p.quant["int4_channel"] for p in found]
