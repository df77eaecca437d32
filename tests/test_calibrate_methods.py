"""Histograms in the graph against numpy, and percentile / entropy / mse ranges against onnxruntime's calibrators.

Tolerances: counts exact (np.histogram on the same range); percentile within one of our bins
(symmetric: onnxruntime's |x| histogram starts at min |x|, ours at 0; measured 0.002 bins);
entropy within 1% (measured: equal, since one `collect_data` call histograms every batch at
once, on the global range, as we do).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import tracemalloc

import numpy as np
import onnx
import pytest
from conftest import generated_model_path, real_model_path
from onnx import TensorProto, helper
from onnxruntime.quantization.calibrate import CalibrationDataReader, CalibrationMethod, create_calibrator

from onnx_opscope.calibration.histograms import Histogram, counting_range, histogram_pass
from onnx_opscope.calibration.methods import compute_ranges, mse_range
from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph import load_model
from onnx_opscope.run.session import make_session, run

CASES = {  # model -> (input name, batch shapes, tensors checked (None: all))
    "transformer_block": ("x", [(2, 8, 64)] * 3, None),
    "cnn": ("image", [(2, 3, 32, 32)] * 2, None),
    "captcha_crnn": ("image", [(1, 3, 60, 160)] * 2, 40),
}


def _path(name: str):
    return real_model_path(name) if name == "captcha_crnn" else generated_model_path(name)


def _feeds(name: str, shapes=None) -> list[dict[str, np.ndarray]]:
    inp, default, _ = CASES[name]
    rng = np.random.default_rng(0)
    return [{inp: rng.standard_normal(s).astype(np.float32)} for s in shapes or default]


def _float_tensors(model: onnx.ModelProto) -> list[str]:
    """Float32 node outputs of the main graph (typed by shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    typed = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.value_info, *g.output]}
    seen: dict[str, None] = {}
    for n in model.graph.node:
        for o in n.output:
            if typed.get(o) == TensorProto.FLOAT:
                seen.setdefault(o)
    return list(seen)


def _values(path, names: list[str], feeds) -> list[dict[str, np.ndarray]]:
    """The tensors themselves, exposed as outputs of the plain model (the reference's input)."""
    model = onnx.ModelProto()
    model.CopyFrom(load_model(path))
    have = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    for n in names:
        if n not in have:
            model.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    session = make_session(model)
    outs = {o.name for o in session.get_outputs()}
    return [
        {n: (run(session, f, [n])[0] if n in outs else f[n]) for n in names}  # graph inputs: the feed
        for f in feeds
    ]


def _minmax(vals, names) -> dict[str, tuple[float, float]]:
    return {
        n: (min(float(np.nanmin(v[n])) for v in vals), max(float(np.nanmax(v[n])) for v in vals))
        for n in names
    }


class _Reader(CalibrationDataReader):
    def __init__(self, feeds):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)


_OPS = {"captcha_crnn": {"op_types": ["Conv"]}}  # onnxruntime takes 200 s over all of its tensors


def _ort_ranges(path, feeds, method, op_types=None, **extra) -> dict[str, tuple[float, float]]:
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
        aug = os.path.join(d, "aug.onnx")
        cal = create_calibrator(str(path), op_types, aug, calibrate_method=method, extra_options=extra)
        cal.collect_data(_Reader(feeds))
        data = cal.compute_data().data
    return {k: (float(v.range_value[0]), float(v.range_value[1])) for k, v in data.items()}


def _subset(name: str, names: list[str]) -> list[str]:
    k = CASES[name][2]
    return names if k is None else names[:: max(1, len(names) // k)][:k]


# --------------------------------------------------------------------------------------------
# counts


@pytest.mark.parametrize(
    ("name", "mode"),
    [(m, "symmetric") for m in CASES] + [("transformer_block", "absolute"), ("transformer_block", "minmax")],
)
def test_counts_equal_numpy_histogram(name, mode):
    path, feeds = _path(name), _feeds(name)
    names = _subset(name, _float_tensors(load_model(path)))
    vals = _values(path, names, feeds)
    ranges = _minmax(vals, names)
    hists = histogram_pass(path, ranges, feeds, bins=2048, mode=mode)
    for n in names:
        lo, hi = counting_range(*ranges[n], mode)
        x = np.concatenate([v[n].ravel() for v in vals])
        ref, _ = np.histogram(
            np.abs(x) if mode == "absolute" else x, 2048, range=(np.float32(lo), np.float32(hi))
        )
        assert hists[n].counts.dtype == np.int64
        np.testing.assert_array_equal(hists[n].counts, ref, err_msg=f"{name} {n} {mode}")
        assert hists[n].nonfinite == 0


def test_mixed_sequence_lengths_and_flat_memory():
    """Batches of different lengths merge (onnxruntime's calibrators fail on them); the state is
    one int64 [bins] array per tensor, so peak host memory does not grow with the batch count."""
    path = generated_model_path("transformer_block")
    names = _float_tensors(load_model(path))
    few = _feeds("transformer_block", [(2, s, 64) for s in (3, 8, 5)])
    vals = _values(path, names, few)
    ranges = _minmax(vals, names)
    hists = histogram_pass(path, ranges, few, bins=512)
    for n in names:
        x = np.concatenate([v[n].ravel() for v in vals])
        t = max(abs(np.float32(ranges[n][0])), abs(np.float32(ranges[n][1])))
        np.testing.assert_array_equal(hists[n].counts, np.histogram(x, 512, range=(-t, t))[0])
        assert hists[n].counts.shape == (512,)

    def peak(n_batches: int) -> int:
        rng = np.random.default_rng(1)
        gen = (
            {"x": np.clip(rng.standard_normal((2, 3 + i % 7, 64)), -1, 1).astype(np.float32)}
            for i in range(n_batches)
        )
        tracemalloc.start()
        histogram_pass(path, ranges, gen, bins=512)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(3), peak(30)
    assert large - small < 256 * 1024, (small, large)


def test_nonfinite_and_mask_values():
    """NaN / inf are not counted (and are reported); a -3.4e38 mask counts in the lowest bin."""
    path = generated_model_path("transformer_block")
    x = np.random.default_rng(2).standard_normal((1, 4, 64)).astype(np.float32)
    x[0, 0, :3] = [np.nan, np.inf, -np.inf]
    x[0, 1, 0] = -3.4e38
    hist = histogram_pass(
        path, {"x": (-3.4e38, float(np.nanmax(x[np.isfinite(x)])))}, [{"x": x}], bins=64, mode="minmax"
    )["x"]
    assert hist.nonfinite == 3
    assert hist.counts.sum() == x.size - 3
    assert (
        hist.counts[0] == 1 and hist.counts[-1] == x.size - 4
    )  # the range spans 3.4e38: the rest in the top bin


# --------------------------------------------------------------------------------------------
# methods against onnxruntime


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("symmetric", [True, False])
def test_percentile_within_one_bin_of_onnxruntime(name, symmetric):
    path, feeds = _path(name), _feeds(name)
    ref = _ort_ranges(
        path, feeds, CalibrationMethod.Percentile, symmetric=symmetric, percentile=99.9, **_OPS.get(name, {})
    )
    names = list(ref)
    ranges = _minmax(_values(path, names, feeds), names)
    hists = histogram_pass(path, ranges, feeds, bins=2048, mode="absolute" if symmetric else "symmetric")
    ours = compute_ranges("percentile", hists, percentile=99.9, symmetric=symmetric)
    for n in names:
        err = max(abs(ours[n][0] - ref[n][0]), abs(ours[n][1] - ref[n][1]))
        assert err <= hists[n].width, (n, ours[n], ref[n], hists[n].width)
        if not symmetric:  # the same global range, so the same edges: equal (to the float32 ulp)
            np.testing.assert_allclose(ours[n], ref[n], rtol=1e-6, err_msg=n)


@pytest.mark.parametrize("name", ["transformer_block", "cnn"])
def test_entropy_within_one_percent_of_onnxruntime(name):
    path, feeds = _path(name), _feeds(name)
    ref = _ort_ranges(path, feeds, CalibrationMethod.Entropy, num_bins=512, num_quantized_bins=128)
    names = list(ref)
    ranges = _minmax(_values(path, names, feeds), names)
    ours = compute_ranges("entropy", histogram_pass(path, ranges, feeds, bins=512), num_quantized_bins=128)
    for n in names:
        span = max(abs(ref[n][0]), abs(ref[n][1]))
        assert abs(ours[n][0] - ref[n][0]) <= 0.01 * span and abs(ours[n][1] - ref[n][1]) <= 0.01 * span, n


# --------------------------------------------------------------------------------------------
# entropy-trt


def _trt_amax_loop(counts: np.ndarray, edges: np.ndarray, start: int = 128, nq: int = 128) -> float:
    """TensorRT's entropy amax cut by cut, as pytorch-quantization states it (its `_compute_amax_entropy`):
    zero bin := first bin, p = bins[:i] + outliers on the last, q = per-group mean over nonzero bins,
    scipy's entropy, the last minimum. The reference the prefix-sum form is held to; a NaN (q all 0,
    where NVIDIA's argmin would pick the NaN) counts as infinite, as `methods` says."""
    from scipy.stats import entropy

    b = counts.astype(np.float64).copy()
    b[0] = b[1]
    kls = []
    for i in range(start, b.size + 1):
        group = np.digitize(np.arange(i), np.linspace(0, i, nq + 1)) - 1
        nz = b[:i] != 0
        sums = np.bincount(group[nz], weights=b[:i][nz], minlength=nq)
        members = np.bincount(group[nz], minlength=nq)
        q = np.where(nz, sums[group] / np.maximum(members[group], 1), 0.0)
        p = b[:i].copy()
        p[-1] += b[i:].sum()
        kls.append(entropy(p, q))
    kls = np.nan_to_num(np.asarray(kls), nan=np.inf)
    return float(edges[start + kls.size - 1 - int(np.argmin(kls[::-1]))])


@pytest.mark.parametrize("name", ["transformer_block", "captcha_crnn"])
def test_entropy_trt_equals_the_loop_reference_on_real_tensors(name):
    path, feeds = _path(name), _feeds(name)
    names = _subset(name, _float_tensors(load_model(path)))[::3][:6]
    ranges = _minmax(_values(path, names, feeds), names)
    hists = histogram_pass(path, ranges, feeds, bins=2048, mode="absolute")
    ours = compute_ranges("entropy-trt", hists)
    for n in names:
        h = hists[n]
        amax = _trt_amax_loop(h.counts, h.edges)
        assert ours[n] == (-amax, amax), n


def test_entropy_trt_cuts_a_heavy_tail_and_keeps_a_uniform_range():
    """Equal to the loop reference on: Laplace values (the amax clips the tail well inside max|x|), the
    same after a ReLU (its spike of zeros is what the zero-bin rule is for), uniform values (nothing to
    clip), and values far from 0 like a sigmoid's (empty cuts are infinite: the amax is not below them)."""
    rng = np.random.default_rng(5)
    lap = rng.laplace(size=200_000)
    cases = {
        "laplace": (lap, lambda amax, t: amax < 0.85 * t),
        "relu": (np.maximum(lap, 0), lambda amax, t: True),
        "uniform": (rng.uniform(-1, 1, 200_000), lambda amax, t: amax > 0.95 * t),
        "sigmoid-like": (rng.uniform(0.2, 1.0, 50_000), lambda amax, t: amax >= 0.2),
    }
    for case, (x, expected) in cases.items():
        t = float(np.abs(x).max())
        counts, _ = np.histogram(np.abs(x).astype(np.float32), 2048, range=(0, np.float32(t)))
        h = Histogram(counts.astype(np.int64), 0.0, t, "absolute", float(x.min()), float(x.max()))
        lo, hi = compute_ranges("entropy-trt", {"x": h})["x"]
        assert (lo, hi) == (-hi, hi) and hi == pytest.approx(_trt_amax_loop(h.counts, h.edges)), case
        assert expected(hi, t), (case, hi, t)
    with pytest.raises(OpscopeError, match="histogram of \\|x\\|"):
        compute_ranges("entropy-trt", {"x": Histogram(counts.astype(np.int64), -t, t, "symmetric")})


# --------------------------------------------------------------------------------------------
# mse


def _mse(x: np.ndarray, t: float) -> float:
    s = t / 127
    return float(np.mean((np.clip(np.round(x / s), -127, 127) * s - x) ** 2))


def test_mse_threshold_is_near_the_best_on_the_raw_values():
    """On a Laplace tensor the chosen T clips the tail (T < max|x|) and its error on the raw values is
    within 2% of the best of 200 thresholds tried on the raw values."""
    x = np.random.default_rng(3).laplace(size=200_000).astype(np.float32)
    t_max = float(np.abs(x).max())
    counts, _ = np.histogram(x, 2048, range=(-np.float32(t_max), np.float32(t_max)))
    h = Histogram(counts.astype(np.int64), -t_max, t_max, "symmetric", float(x.min()), float(x.max()))
    lo, hi = mse_range(h)
    t = max(-lo, hi)
    assert t < 0.9 * t_max
    best = min(_mse(x, c) for c in np.linspace(t_max / 16, t_max, 200))
    assert _mse(x, t) <= 1.02 * best, (_mse(x, t), best)
    assert compute_ranges("mse", {"x": h})["x"] == (lo, hi)


@pytest.mark.parametrize("c", [2.5, -2.5, 0.0])
def test_constant_tensor_ranges_do_not_invert(c):
    """A constant tensor: onnxruntime's clipping to [min, max] would give a symmetric percentile
    range with lo > hi; every method here returns an ordered range holding the value."""
    x = np.full(1000, c, np.float32)
    for mode, method, extra in [
        ("absolute", "percentile", {"symmetric": True}),
        ("symmetric", "percentile", {}),
        ("symmetric", "entropy", {}),
        ("symmetric", "mse", {}),
    ]:
        lo, hi = counting_range(c, c, mode)
        edges = np.histogram_bin_edges(np.zeros(0, np.float32), 256, range=(np.float32(lo), np.float32(hi)))
        counts, _ = np.histogram(np.abs(x) if mode == "absolute" else x, 256, range=(edges[0], edges[-1]))
        h = Histogram(counts.astype(np.int64), float(edges[0]), float(edges[-1]), mode, c, c)
        r = compute_ranges(method, {"x": h}, **extra)["x"]
        assert r[0] <= c <= r[1], (method, mode, r)


def test_nothing_counted_gives_the_tensor_range():
    """Every value NaN (or a branch that never ran): no distribution, so the pass-1 range itself."""
    h = Histogram(np.zeros(64, np.int64), -1.0, 1.0, "symmetric", -0.5, 1.0, nonfinite=10)
    for method in ("percentile", "entropy"):
        assert compute_ranges(method, {"x": h})["x"] == (-0.5, 1.0)


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize(
    ("lo", "hi", "bins"),
    [(-2.7, 2.7, 128), (-3.0, 7.3, 2048), (0.0, 1e-3, 7), (1000.0, 1000.5, 256), (-3.4e38, 5.0, 64)],
)
def test_every_edge_and_its_neighbours_binned_as_numpy(lo, hi, bins, host):
    """Values on every float32 edge and one ulp either side, zeros and the range's ends: the
    arithmetic edge test (and, for spans no error bound covers, the table) gives np.histogram's
    counts, whether the host counts the indices or ScatterElements does."""
    from onnx_opscope.calibration.histograms import _accumulate, _histogram, add_histogram_taps, bin_edges
    from onnx_opscope.run.session import RuntimeConfig, make_session

    edges = bin_edges(lo, hi, bins)
    x = np.concatenate(
        [edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(-np.inf)), [0.0, 0.0]]
    ).astype(np.float32)
    x = x[(x >= edges[0]) & (x <= edges[-1])]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    taps = add_histogram_taps(
        model, {"y": (float(edges[0]), float(edges[-1]))}, bins, "minmax", host_counts=host
    )
    assert taps[0].host == host
    got = make_session(model, RuntimeConfig(graph_opt="all")).run([taps[0].counts], {"x": x})[0]
    acc = np.zeros(bins + 2, np.int64)
    _accumulate(acc, got, taps[0])
    ref, _ = np.histogram(x, bins, range=(edges[0], edges[-1]))
    np.testing.assert_array_equal(_histogram(acc, taps[0], "minmax").counts, ref)
