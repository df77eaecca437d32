"""Quantized models: the instrumented model computes what the plain one does at every optimization level.

The quantized models are built here by onnxruntime's own quantizer (`scripts/make_quantized.py`)
from the bundled float models and one real one: static QDQ (uint8 / int8 activations, per
tensor / per channel), static QOperator, and dynamic int8. At `ORT_ENABLE_EXTENDED` and above
onnxruntime fuses each QDQ group into one integer kernel; a tap that gave a float tensor of the
group a second consumer would stop the fusion (the control test shows by how much).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import ROOT, generated_model_path, real_model_path
from onnx import helper
from test_sketches import assert_sketch, dequantize, tensor_values

from onnx_opscope import sites as sites_mod
from onnx_opscope import sketch as sk
from onnx_opscope.instrument import decode_tap, host_values, inject, sites_of, unpacked
from onnx_opscope.run import record
from onnx_opscope.run.feeds import FeedSpec, iter_feeds
from onnx_opscope.run.kernels import KernelChangeWarning, keep_kernels
from onnx_opscope.run.session import RuntimeConfig, make_session, run

_spec = importlib.util.spec_from_file_location("make_quantized", ROOT / "scripts" / "make_quantized.py")
make_quantized = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_quantized)

LEVELS = ("disable", "basic", "extended", "all")
RTOL = 1e-4  # the bar: outputs within 1e-4 of their max


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    dest = tmp_path_factory.mktemp("quantized")

    def build(source: str, variant: str, real: bool = False):
        src = real_model_path(source) if real else generated_model_path(source)
        return make_quantized.quantize(src, variant, dest)

    return build


def worst_moves(
    plain_path, instrumented: onnx.ModelProto, levels=LEVELS, batches: int = 2
) -> dict[str, float]:
    """level -> the largest |plain - instrumented| over every original output, relative to the output's max."""
    plain_model = onnx.load(plain_path)
    names = [o.name for o in plain_model.graph.output]
    feeds = list(iter_feeds(plain_model, FeedSpec(batches=batches)))
    out = {}
    for level in levels:
        cfg = RuntimeConfig(graph_opt=level)
        plain, inst = make_session(plain_path, cfg), make_session(instrumented, cfg)
        worst = 0.0
        for f in feeds:
            for a, b in zip(run(plain, f, names), run(inst, f, names)):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
        out[level] = worst
    return out


@pytest.mark.parametrize("variant", sorted(make_quantized.VARIANTS))
@pytest.mark.parametrize("source", ["cnn", "transformer_block"])
def test_outputs_unchanged_at_every_level(quantized, source, variant):
    path = quantized(source, variant)
    instrumented, manifest = inject(path)
    assert manifest.taps
    moves = worst_moves(path, instrumented)
    assert all(v <= RTOL for v in moves.values()), moves


def test_real_model_int8_per_channel_outputs_unchanged(quantized):
    """A real DenseNet + BiLSTM (captcha_crnn) quantized to int8 per channel: 200+ taps, at every level."""
    path = quantized("captcha_crnn", "qdq_s8_pc", real=True)
    instrumented, manifest = inject(path)
    assert sum(t.dequant is not None for t in manifest.taps) > 100
    moves = worst_moves(path, instrumented, batches=1)
    assert all(v <= RTOL for v in moves.values()), moves


def test_taps_on_dequantized_floats_would_stop_the_fusion(quantized, monkeypatch):
    """The control: tapping the DQ outputs themselves (the old behaviour) moves the outputs at level all,
    not with optimizations off, so the test above can fail."""
    monkeypatch.setattr("onnx_opscope.sites.find.through_qdq", lambda node, taps, view: taps)
    path = quantized("transformer_block", "qdq_s8")
    instrumented, _ = inject(path)
    moves = worst_moves(path, instrumented, levels=("disable", "all"))
    assert moves["disable"] <= RTOL < moves["all"], moves


def test_int8_pairs_become_uint8_only_on_cpu(quantized):
    """On CPU, a tapped int8 Q -> DQ pair is converted as onnxruntime would; for other providers it stays."""
    path = quantized("transformer_block", "qdq_s8")

    def zero_point_types(model):
        inits = {t.name: t.data_type for t in model.graph.initializer}
        return {inits.get(n.input[2]) for n in model.graph.node if n.op_type == "QuantizeLinear"}

    cpu, _ = inject(path)
    other, _ = inject(path, providers=["TensorrtExecutionProvider"])
    assert onnx.TensorProto.UINT8 in zero_point_types(cpu)
    assert zero_point_types(other) == {onnx.TensorProto.INT8}
    # and the TensorRT form is still a drop-in where it runs on CPU with optimizations off
    assert worst_moves(path, other, levels=("disable",))["disable"] <= RTOL


@pytest.mark.parametrize("variant", ["qdq_s8_pc", "qdq_u8", "qop_u8"])
def test_quantized_taps_describe_the_dequantized_values(quantized, variant):
    """Every sketch of a QDQ tap (weights included, per channel) equals its numpy reference on
    DequantizeLinear(quantized tensor), the value the integer kernel reads."""
    path = quantized("cnn", variant)
    model = onnx.load(path)
    feeds = next(iter(iter_feeds(model, FeedSpec(batches=1))))
    # the manifest for another provider keeps the model's own zero points: the reference reads those
    instrumented, manifest = inject(path, sketches=["all"], providers=["CUDAExecutionProvider"])
    taps = [t for t in manifest.taps if t.graph == "" and t.dequant is not None]
    assert taps and any(t.constant for t in taps) and any(not t.constant for t in taps)
    needed = {n for t in taps for n in (t.tensor, t.dequant["scale"], t.dequant["zero_point"]) if n}
    values = tensor_values(model, sorted(needed), feeds)
    sess = make_session(instrumented, RuntimeConfig(graph_opt="disable"))
    outs = unpacked(manifest, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds))))
    host = host_values(manifest, path)
    opts = manifest.sketch_options()
    compared = 0
    for tap in taps:
        dq = tap.dequant
        x = dequantize(values[tap.tensor], values[dq["scale"]], values.get(dq["zero_point"]), dq["attrs"])
        got, shape = host[tap.id] if tap.constant else decode_tap(tap, outs, opts)
        assert shape == list(x.shape)
        for stat in tap.sketches:
            assert_sketch(stat, got[stat], sk.reference(stat, x, tap.info(), opts), x, tap.tensor)
            compared += 1
    assert compared > 50


def test_qdq_roles_read_quantized_tensors():
    """On a hand-built QDQ Conv, lhs/weight read the DQ inputs and out the Q output (sites.qdq)."""
    f, u8, i8 = onnx.TensorProto.FLOAT, onnx.TensorProto.UINT8, onnx.TensorProto.INT8
    init = [
        helper.make_tensor("s", f, [], [0.1]),
        helper.make_tensor("z", u8, [], [128]),
        helper.make_tensor("wq", i8, [4, 3, 1, 1], list(range(-6, 6))),
        helper.make_tensor("ws", f, [4], [0.01, 0.02, 0.03, 0.04]),
        helper.make_tensor("wz", i8, [4], [0, 0, 0, 0]),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd"], ["y"], name="conv"),
        helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", f, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("out", f, [1, 4, 4, 4])],
        init,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    (site,) = sites_mod.find_sites(model)
    taps = {t.role: t for t in site.taps}
    assert (taps["in"].tensor, taps["weight"].tensor, taps["out"].tensor) == ("xq", "wq", "yq")
    assert taps["weight"].dequant == sites_mod.Dequant("ws", "wz", (("axis", 0),), "")
    assert taps["out"].dequant.scale == "s"


def test_tap_that_changes_integer_kernels_is_left_out():
    """zoo `quantized`: a tap on MatMul(x, DQ(w))'s output stops MatMul + Add -> Gemm, and onnxruntime then
    runs an int8 MatMulNBits instead. keep_kernels finds that tap (and only it) and leaves it out."""
    path = generated_model_path("quantized")
    chosen = sites_of(path)
    naive, _ = inject(path, chosen)
    assert worst_moves(path, naive, levels=("all",))["all"] > 1e-3  # the control: the tap moves the output
    kept, left_out = keep_kernels(path, chosen, RuntimeConfig())
    assert [(c.site, c.role) for c in left_out] == [("c/matmul", "out")]
    assert "MatMulNBits" in left_out[0].change
    assert sum(len(s.taps) for s in kept) == sum(len(s.taps) for s in chosen) - 1
    guarded, _ = inject(path, kept)
    moves = worst_moves(path, guarded)
    assert all(v <= RTOL for v in moves.values()), moves


def test_float_models_pay_nothing_for_the_kernel_check(monkeypatch):
    def no_session(*a, **k):
        raise AssertionError("no session should be created for a float model")

    monkeypatch.setattr("onnx_opscope.run.kernels.make_session", no_session)
    path = generated_model_path("cnn")
    chosen = sites_of(path)
    assert keep_kernels(path, chosen, RuntimeConfig()) == (chosen, [])


def test_record_and_inject_report_the_taps_left_out(tmp_path):
    path = generated_model_path("quantized")
    with pytest.warns(KernelChangeWarning, match="c/matmul out: not tapped"):
        result = record(path, out=tmp_path / "t.parquet", feeds=FeedSpec(batches=2))
    meta = json.loads(result.run.read_text())
    assert [(c["site"], c["role"]) for c in meta["left_out"]] == [("c/matmul", "out")]
    assert result.parity is not None and result.parity.max_rel == 0.0  # a true drop-in at level all
    cli = subprocess.run(
        [sys.executable, "-m", "onnx_opscope", "inject", str(path), "-o", str(tmp_path / "i.onnx")],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0, cli.stderr
    assert "warning: c/matmul out: not tapped" in cli.stderr and "MatMulNBits" in cli.stderr
    manifest = json.loads((tmp_path / "i.manifest.json").read_text())
    assert manifest["left_out"][0]["tensor"] == "c/matmul_output_0"
