"""Calibration: the tensors onnxruntime's quantizer calibrates, minmax ranges equal to its
MinMaxCalibrater's bit for bit, caches it loads without calibrating, and QDQ models as good as its own.

onnxruntime's own calibrator is the reference throughout: its `select_tensors_to_calibrate` on the
shape-inferred model, and `MinMaxCalibrater` run on the same feed dicts.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import generated_model_path, real_model_path
from onnx import TensorProto, helper
from onnxruntime.quantization import calibrate as ort_calibrate
from onnxruntime.quantization import quantize_static
from onnxruntime.quantization.calibrate import CalibrationMethod, MinMaxCalibrater, load_tensors_data
from onnxruntime.quantization.quant_utils import load_model_with_shape_infer

import onnx_opscope
from onnx_opscope.calibration import (
    default_op_types,
    onnxruntime_selection,
    quantize_qdq,
    tensors_to_calibrate,
    write_ranges,
)
from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run import FeedSpec, iter_feeds


class Reader:
    """A CalibrationDataReader over a list of feed dicts, as users write them."""

    def __init__(self, feeds):
        self.it = iter(feeds)

    def get_next(self):
        return next(self.it, None)


def _path(name: str) -> Path:
    return real_model_path(name.split("/")[1]) if name.startswith("real/") else generated_model_path(name)


def _ort_minmax(path: Path, feeds: list[dict], tmp: Path, op_types=None):
    c = MinMaxCalibrater(
        path, list(op_types or default_op_types()), augmented_model_path=str(tmp / "aug.onnx")
    )
    c.augment_graph()
    c.create_inference_session()
    c.collect_data(Reader(feeds))
    return c.compute_data()


def _same_floats(ours, theirs) -> list[str]:
    """Tensors whose range differs in any bit (or that one side lacks)."""
    bad = sorted(set(ours) ^ set(theirs.keys()))
    for k in theirs:
        lo, hi = theirs[k].range_value
        if k in ours and not (
            np.asarray(ours[k][0]).tobytes() == lo.tobytes()
            and np.asarray(ours[k][1]).tobytes() == hi.tobytes()
        ):
            bad.append(k)
    return bad


# --- which tensors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "cnn",
        "gru",
        "mlp",
        "moe",
        "opset11_mlp",
        "transformer_block",
        "quantized",
        "if_model",
        "real/ppocrv4_det",
        "real/captcha_crnn",
        "real/silero_vad_v6",
    ],  # fmt: skip
)
def test_selection_equals_onnxruntimes(name, tmp_path):
    path = _path(name)
    for op_types in (None, ["Conv", "MatMul", "Gemm"]):
        c = MinMaxCalibrater(
            path, op_types or list(default_op_types()), augmented_model_path=str(tmp_path / "a.onnx")
        )
        theirs, _ = c.select_tensors_to_calibrate(load_model_with_shape_infer(path))
        ours = tensors_to_calibrate(path, op_types)
        assert onnxruntime_selection(ours) == theirs
        assert len({(t.path, t.name) for t in ours}) == len(ours)


def test_selection_reaches_into_bodies():
    """onnxruntime sees nothing in If / Loop bodies; we apply its rule there."""
    loop = tensors_to_calibrate(generated_model_path("loop"))
    assert {t.path for t in loop} == {"loop/body"} and onnxruntime_selection(loop) == set()
    vad = tensors_to_calibrate(real_model_path("silero_vad_v6"))
    assert len(vad) > 100 and len(onnxruntime_selection(vad)) < 10


# --- minmax equals MinMaxCalibrater ------------------------------------------------------------------

MODELS = {
    "transformer_block": FeedSpec(batches=3),
    "real/ppocrv4_det": FeedSpec(batches=2),
    "real/captcha_crnn": FeedSpec(batches=2),
}


@pytest.fixture(scope="module", params=list(MODELS))
def calibrated(request, tmp_path_factory):
    name = request.param
    path = _path(name)
    feeds = list(iter_feeds(path, MODELS[name]))
    tmp = tmp_path_factory.mktemp(name.replace("/", "_"))
    ours = onnx_opscope.calibrate(path, Reader(feeds))
    return name, path, feeds, ours, _ort_minmax(path, feeds, tmp), tmp


def test_minmax_equals_minmaxcalibrater_bit_for_bit(calibrated):
    name, _, feeds, ours, theirs, _ = calibrated
    assert len(ours.ranges) == len(theirs.data) > 10
    assert _same_floats(ours.ranges, theirs) == []
    assert ours.batches == len(feeds) and not ours.unobserved


def test_feed_forms_agree():
    """A FeedSpec, a list of dicts and a CalibrationDataReader of the same batches give the same ranges."""
    path = generated_model_path("cnn")
    spec = FeedSpec(batches=3, seed=5)
    a = onnx_opscope.calibrate(path, spec).ranges
    b = onnx_opscope.calibrate(path, list(iter_feeds(path, spec))).ranges
    c = onnx_opscope.calibrate(path, Reader(iter_feeds(path, spec))).ranges
    assert a == b == c


def test_mixed_sequence_lengths_and_symmetric(tmp_path):
    path = generated_model_path("transformer_block")
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, s, 64)).astype(np.float32)} for s in (5, 17, 9)]
    ours = onnx_opscope.calibrate(path, feeds)
    assert _same_floats(ours.ranges, _ort_minmax(path, feeds, tmp_path)) == []
    sym = onnx_opscope.calibrate(path, feeds, symmetric=True)
    for k, (lo, hi) in sym.ranges.items():
        m = max(abs(ours.ranges[k][0]), abs(ours.ranges[k][1]))
        assert lo == -m and hi == m


def _masked_attention(path: Path) -> Path:
    """scores + mask -> Softmax -> MatMul: the -3.4e38 additive mask of exported attention."""
    nodes = [
        helper.make_node("MatMul", ["q", "k"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["y"]),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "masked",
        [helper.make_tensor_value_info(n, f, s) for n, s in (("q", [4, 8]), ("k", [8, 4]), ("mask", [4, 4]), ("v", [4, 8]))],
        [helper.make_tensor_value_info("y", f, [4, 8])],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_float32_lowest_mask(tmp_path):
    path = _masked_attention(tmp_path / "masked.onnx")
    rng = np.random.default_rng(0)
    mask = np.triu(np.full((4, 4), np.finfo(np.float32).min, np.float32), 1)
    feeds = [
        {
            n: rng.standard_normal(s).astype(np.float32)
            for n, s in (("q", (4, 8)), ("k", (8, 4)), ("v", (4, 8)))
        }
        | {"mask": mask}
        for _ in range(3)
    ]
    ours = onnx_opscope.calibrate(path, feeds)
    assert ours.ranges["mask"][0] == np.finfo(np.float32).min
    assert ours.ranges["masked"][0] < -3e38 and np.isfinite(ours.ranges["masked"][0])
    assert _same_floats(ours.ranges, _ort_minmax(path, feeds, tmp_path)) == []
    write_ranges(ours, tmp_path / "r.json")
    assert load_tensors_data(tmp_path / "r.json")["mask"].range_value[0][0] == np.finfo(np.float32).min


def test_taps_inside_if_and_loop_bodies():
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    r = onnx_opscope.calibrate(
        generated_model_path("if_model"), [{"x": x, "flag": np.array(f)} for f in (True, False)]
    )
    assert {"else_y", "then/matmul_output_0", "then/relu_output_0"} <= set(r.ranges)
    relu, mm = r.ranges["then/relu_output_0"], r.ranges["then/matmul_output_0"]
    assert relu == (0.0, mm[1]) and mm[0] < 0  # Relu of the MatMul, seen through the taps
    assert r.unobserved == ["inner_else_y"]  # the inner branch not taken has no range
    only_else = onnx_opscope.calibrate(generated_model_path("if_model"), [{"x": x, "flag": np.array(False)}])
    assert "then/relu_output_0" in only_else.unobserved and "else_y" in only_else.ranges
    loop = onnx_opscope.calibrate(generated_model_path("loop"), FeedSpec(batches=2))
    assert set(loop.ranges) == {"state_in", "body_mm", "body/add_output_0"}
    assert all(np.isfinite(lo) and lo < hi for lo, hi in loop.ranges.values())


def test_unknown_method_and_op_types_are_one_line_errors():
    with pytest.raises(OpscopeError, match="unknown calibration method 'minmx'.*did you mean 'minmax'"):
        onnx_opscope.calibrate(generated_model_path("cnn"), method="minmx")
    with pytest.raises(OpscopeError, match="no float tensor to calibrate"):
        onnx_opscope.calibrate(generated_model_path("cnn"), op_types=["NoSuchOp"])


# --- caches and QDQ --------------------------------------------------------------------------------


def _no_calibration(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("quantize_static calibrated on its own")

    monkeypatch.setattr(ort_calibrate, "create_calibrator", refuse)
    monkeypatch.setattr(ort_calibrate.MinMaxCalibrater, "collect_data", refuse)
    import sys

    monkeypatch.setattr(sys.modules["onnxruntime.quantization.quantize"], "create_calibrator", refuse)


def test_cache_loads_in_quantize_static_without_calibration(tmp_path, monkeypatch):
    path = generated_model_path("cnn")
    ours = onnx_opscope.calibrate(path, FeedSpec(batches=2))
    cache = write_ranges(ours, tmp_path / "ranges.json")
    loaded = load_tensors_data(cache)
    assert loaded.calibration_method == CalibrationMethod.MinMax
    assert _same_floats(ours.ranges, loaded) == []
    _no_calibration(monkeypatch)
    out = tmp_path / "q.onnx"
    quantize_static(str(path), str(out), calibration_data_reader=None, calibration_cache_path=str(cache))
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count("QuantizeLinear") >= 4 and ops.count("DequantizeLinear") >= 8
    assert json.loads(cache.read_text())["smooth_quant"] is False


@pytest.mark.parametrize(
    "method, theirs",
    [("entropy", CalibrationMethod.Entropy), ("percentile", CalibrationMethod.Percentile)],
)
def test_histogram_method_caches_load_in_quantize_static(method, theirs, tmp_path, monkeypatch):
    """An entropy / percentile cache is loaded by quantize_static given the same method, with no
    calibration of its own, and the QDQ model's scales come from our ranges."""
    path = generated_model_path("cnn")
    ours = onnx_opscope.calibrate(path, FeedSpec(batches=2), method=method, bins=512)
    cache = write_ranges(ours, tmp_path / f"{method}.json")
    assert load_tensors_data(cache).calibration_method == theirs
    _no_calibration(monkeypatch)
    out = tmp_path / "q.onnx"
    quantize_static(
        str(path),
        str(out),
        calibration_data_reader=None,
        calibrate_method=theirs,
        calibration_cache_path=str(cache),
    )
    q = onnx.load(out)
    scales = {
        t.name.removesuffix("_scale"): onnx.numpy_helper.to_array(t)
        for t in q.graph.initializer
        if t.name.endswith("_scale") and t.name.removesuffix("_scale") in ours.ranges
    }
    assert len(scales) >= 4
    # each activation scale quantize_static wrote is (max(hi, 0) - min(lo, 0)) / 255 of our range
    for name, scale in scales.items():
        lo, hi = (float(v) for v in ours.ranges[name])
        np.testing.assert_allclose(float(scale), (max(hi, 0.0) - min(lo, 0.0)) / 255, rtol=1e-6, err_msg=name)


def test_tensorrt_caches(tmp_path):
    ours = onnx_opscope.calibrate(generated_model_path("cnn"), FeedSpec(batches=2))
    lines = write_ranges(ours, tmp_path / "c.trt", "trt").read_text().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2" and len(lines) == len(ours.ranges) + 1
    for line in lines[1:]:
        name, hexed = line.split(": ")
        scale = struct.unpack(">f", bytes.fromhex(hexed))[0]
        lo, hi = ours.ranges[name]
        assert scale == np.float32(max(abs(float(lo)), abs(float(hi))) / 127.0)
    folder = write_ranges(ours, tmp_path / "ep", "trt-ep")
    assert {p.name for p in folder.iterdir()} == {
        "calibration.json",
        "calibration.flatbuffers",
        "calibration.cache",
    }
    amax = dict(line.rsplit(" ", 1) for line in (folder / "calibration.cache").read_text().splitlines())
    assert {k: float(v) for k, v in amax.items()} == {
        k: float(np.float32(max(abs(float(lo)), abs(float(hi))))) for k, (lo, hi) in ours.ranges.items()
    }
    write_ranges(ours, folder, "trt-ep")  # its own earlier output may be replaced
    with pytest.raises(OpscopeError, match="it is a folder"):
        write_ranges(ours, tmp_path, "ort")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("name", ["transformer_block", "cnn", "gru"])
def test_qdq_from_our_ranges_matches_onnxruntimes_own(name, tmp_path, monkeypatch):
    """Held-out feeds: our QDQ model and onnxruntime's (from its own MinMax calibration) agree with the
    float model equally well (cosine within 0.5%). Synthetic noise makes the real models' outputs
    meaningless after int8 (ppocrv4_det's probabilities are ~1e-8), so these are the bundled ones."""
    path = generated_model_path(name)
    feeds = list(iter_feeds(path, FeedSpec(batches=4)))
    ort_cache = tmp_path / "theirs.json"
    ort_calibrate.save_tensors_data(_ort_minmax(path, feeds, tmp_path), ort_cache)
    ort_q = tmp_path / "theirs.onnx"
    quantize_static(
        str(path), str(ort_q), calibration_data_reader=None, calibration_cache_path=str(ort_cache)
    )
    ours = onnx_opscope.calibrate(path, feeds)
    _no_calibration(monkeypatch)
    our_q = quantize_qdq(path, ours, tmp_path / "ours.onnx")
    sessions = [ort.InferenceSession(str(p)) for p in (path, our_q, ort_q)]
    for feed in iter_feeds(path, FeedSpec(batches=2, seed=99)):
        ref, a, b = (s.run(None, feed)[0] for s in sessions)
        ca, cb = _cosine(ref, a), _cosine(ref, b)
        assert ca > 0.9 and abs(ca - cb) <= 0.005 * cb, (ca, cb)


def test_cli_entropy_trt_writes_tensorrt_scales_of_its_amax(tmp_path):
    """`--method entropy-trt --format trt`: one scale per tensor, amax / 127 of the method's symmetric
    range, counted on |x| over 2048 bins; the amax never exceeds the tensor's max |x|."""
    model = generated_model_path("cnn")
    out = tmp_path / "cnn.cache"
    assert main(["calibrate", str(model), "--batches", "2", "--method", "entropy-trt", "-o", str(out),
                 "--format", "trt", "-q"]) == 0  # fmt: skip
    ours = onnx_opscope.calibrate(model, FeedSpec(batches=2), method="entropy-trt")
    assert ours.options["mode"] == "absolute" and ours.options["bins"] == 2048
    lines = out.read_text().splitlines()[1:]
    assert len(lines) == len(ours.ranges) > 0
    for line in lines:
        name, hexed = line.split(": ")
        lo, hi = ours.ranges[name]
        assert lo == -hi and 0 < hi <= max(abs(float(v)) for v in ours.minmax[name])
        assert struct.unpack(">f", bytes.fromhex(hexed))[0] == np.float32(float(hi) / 127.0)


def test_cli_calibrate(tmp_path, capsys):
    model = generated_model_path("cnn")
    out, qdq = tmp_path / "r.json", tmp_path / "q.onnx"
    assert (
        main(
            [
                "calibrate",
                str(model),
                "--batches",
                "2",
                "-o",
                str(out),
                "--qdq",
                str(qdq),
                "--op-types",
                "Conv",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"{out}: minmax ranges of" in printed and "2 batches" in printed
    assert set(load_tensors_data(out).keys()) == onnxruntime_selection(tensors_to_calibrate(model, ["Conv"]))
    assert "QuantizeLinear" in {n.op_type for n in onnx.load(qdq).graph.node}
    assert main(["calibrate", str(model), "-o", str(tmp_path), "-q"]) == 2
    assert "it is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", str(model), "--method", "entropi"])
    assert exc.value.code == 2 and "did you mean 'entropy'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    assert "examples:" in capsys.readouterr().out


def test_cli_qdq_options_reach_the_quantizer(tmp_path):
    """--activation-type / --weight-type / --per-channel: the QDQ model's zero points have the asked
    types, and a Conv weight gets one scale per output channel only with --per-channel."""
    from onnx import numpy_helper

    model = generated_model_path("cnn")

    def quantized(*extra: str) -> onnx.ModelProto:
        out = tmp_path / f"q{len(extra)}.onnx"
        args = ["calibrate", str(model), "--batches", "2", "-o", str(tmp_path / "r.json"), "-q"]
        assert main([*args, "--qdq", str(out), "--op-types", "Conv", *extra]) == 0
        return onnx.load(out)

    def zero_point_types(m: onnx.ModelProto) -> tuple[set, set]:
        inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        weights = {
            n.input[0] for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
        }
        acts, wts, scales = set(), set(), []
        for n in m.graph.node:
            if n.op_type == "DequantizeLinear" and len(n.input) > 2 and inits[n.input[2]].dtype != np.int32:
                (wts if n.input[0] in weights else acts).add(inits[n.input[2]].dtype)
                if n.input[0] in weights:
                    scales.append(inits[n.input[1]].size)
        return acts, wts, max(scales)

    assert zero_point_types(quantized()) == ({np.dtype(np.uint8)}, {np.dtype(np.int8)}, 1)
    acts, wts, most = zero_point_types(quantized("--activation-type", "int16", "--per-channel"))
    assert (acts, wts) == ({np.dtype(np.int16)}, {np.dtype(np.int8)}) and most > 1
    bad = ["calibrate", str(model), "-o", str(tmp_path / "r.json"), "--qdq", str(tmp_path / "bad.onnx")]
    assert main([*bad, "--activation-type", "int8", "--weight-type", "uint8", "-q"]) == 2
    assert not (tmp_path / "bad.onnx").exists()
