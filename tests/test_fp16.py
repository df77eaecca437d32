"""fp16 / bf16 headroom (`calibration.fp16`): the graph reduction against numpy on a real model's tensors,
subgraph coverage, and a block-list conversion that stays finite where a plain one does not."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import generated_model_path, real_model_path
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnx_opscope.calibration.fp16 import TARGETS, check_precision, convert_fp16, host_stats, name_nodes
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run.session import RuntimeConfig

EXACT = RuntimeConfig(graph_opt="disable")  # the same kernels as the plain session below: equal bits


def _all_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    known = {o.name for o in m.graph.output}
    m.graph.output.extend(
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n not in known
    )
    return m


def _numpy_stats(x: np.ndarray, lim) -> tuple[float, int, int]:
    a = np.abs(x[np.isfinite(x)])
    return (
        (float(a.max()) if a.size else 0.0),
        int((a > lim.max).sum()),
        int(((a > 0) & (a < lim.tiny)).sum()),
    )


def test_every_tensor_of_a_real_model_matches_numpy_and_overflow_counts_are_exact():
    path = real_model_path("magika_standard_v3_3")
    rng = np.random.default_rng(0)
    batches = [{"bytes": rng.integers(0, 256, (4, 2048)).astype(np.int32)} for _ in range(2)]
    report = check_precision(path, batches, runtime=EXACT)
    acts = [t for t in report.tensors if t.kind == "activation"]
    assert len(acts) > 75 and {"ReduceSum", "Mul", "Add", "Tanh", "Sqrt", "Exp"} <= {t.op_type for t in acts}
    model = onnx.load(str(path))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(_all_outputs(model, [t.tensor for t in acts]).SerializeToString(), so)
    names = [o.name for o in plain.get_outputs()]
    values = [dict(zip(names, plain.run(None, b))) for b in batches]
    lim = TARGETS["fp16"]
    for t in acts:
        per = [_numpy_stats(v[t.tensor], lim) for v in values]
        assert t.max_abs == max(p[0] for p in per), t.tensor
        assert (t.overflow, t.underflow) == (sum(p[1] for p in per), sum(p[2] for p in per)), t.tensor
        assert t.numel == sum(v[t.tensor].size for v in values) and t.runs == 2
    over = report.overflowing()
    assert over and over[0].op_type == "ReduceSum" and over[0].max_abs > 65504 and over[0].overflow > 0
    assert over[0].producer in report.blocked_ids()


def _ln_model(scale: float = 1000.0) -> onnx.ModelProto:
    """x * scale -> LayerNormalization -> MatMul: activations past 65504 feeding an op that has a
    native fp16 kernel on CPU, so a plain fp16 conversion really stores them in fp16."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(np.array(scale, np.float32), "scale"),
        numpy_helper.from_array(np.ones(16, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(16, np.float32), "beta"),
        numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["big"], name="scale_up"),
        helper.make_node("LayerNormalization", ["big", "gamma", "beta"], ["normed"], name="ln", axis=-1),
        helper.make_node("MatMul", ["normed", "w"], ["y"], name="proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_block_list_conversion_stays_finite_and_close_where_plain_conversion_does_not():
    pytest.importorskip("onnxconverter_common")
    model = _ln_model()
    x = np.random.default_rng(4).uniform(-100, 100, (32, 16)).astype(np.float32)
    report = check_precision(model, {"x": x})
    assert report["big"].overflow == int((np.abs(x * 1000) > 65504).sum()) > 0
    # the producer, and its reader: the cast after a blocked producer is where the inf would be made
    assert report.block_list() == ["scale_up", "ln"]
    assert report.trtexec_args() == [
        "--fp16",
        "--precisionConstraints=obey",
        "--layerPrecisions=scale_up:fp32,ln:fp32",
        "--layerOutputTypes=scale_up:fp32,ln:fp32",
    ]
    ref = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    # onnxruntime's CPU provider runs these fp16 ops in fp32 (its InsertCastTransformer), which hides
    # the overflow; onnx's reference evaluator computes in fp16, as a GPU provider does
    plain = ReferenceEvaluator(convert_fp16(model, None)).run(None, {"x": x})[0]
    blocked = convert_fp16(model, report)
    kept = ReferenceEvaluator(blocked).run(None, {"x": x})[0]
    assert not np.isfinite(plain).all()
    assert np.isfinite(kept).all()
    assert np.abs(kept - ref).max() / np.abs(ref).max() < 1e-2
    on_cpu = ort.InferenceSession(blocked.SerializeToString()).run(None, {"x": x})[0]
    assert np.abs(on_cpu - ref).max() / np.abs(ref).max() < 1e-2


def test_if_and_loop_bodies_are_tapped():
    loop = check_precision(generated_model_path("loop"), [{"x": np.ones((4, 16), np.float32)}])
    body = {t.tensor: t for t in loop.tensors if t.graph}
    assert {"body_mm", "state_out"} <= set(body) and body["body_mm"].runs == 3  # once per iteration
    assert body["body_mm"].max_abs == loop["scan_out"].max_abs  # the scan output stacks body_mm
    assert body["body_mm"].numel == loop["scan_out"].numel
    path = generated_model_path("if_model")
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    taken = check_precision(path, [{"x": x, "flag": np.array(True)}])
    not_taken = check_precision(path, [{"x": x, "flag": np.array(False)}])
    then_tensors = [t.tensor for t in taken.tensors if "then_branch" in t.graph and t.kind == "activation"]
    assert len(then_tensors) >= 3  # the nested If's branches too
    assert {taken[n].graph.count("/") for n in then_tensors} == {
        1,
        4,
    }  # the nested If's branch (path if/then_branch/<if>/then_branch) too
    assert all(taken[n].runs == 1 for n in then_tensors if taken[n].graph.count("/") == 1)
    assert all(not_taken[n].runs == 0 for n in then_tensors)
    assert taken["y"].max_abs == taken["then_y"].max_abs


def test_bf16_target_counts_past_its_max_and_below_its_smallest_subnormal():
    x = np.array([[3.09e38, 1.0, 1e5, 5e-41, 1e-39, 0.0] * 2 + [0.0] * 4], np.float32).repeat(2, 0)
    x[0, 1] = 3.0e38  # x 1.1: below bf16's max 3.3895e38; 3.09e38 x 1.1 is above it
    x[1, 2] = 1e-42
    r = check_precision(_ln_model(1.1), {"x": x}, target="bf16")
    big = x * np.float32(1.1)
    lim = TARGETS["bf16"]
    assert r["big"].overflow == int((np.abs(big) > np.float32(lim.max)).sum()) == 4
    assert (
        r["big"].underflow
        == host_stats(big, "bf16")[2][4]
        == int(((big != 0) & (np.abs(big) < lim.tiny)).sum())
    )
    fp16 = check_precision(_ln_model(1.1), {"x": x})
    assert fp16["big"].overflow == int((np.abs(big) > 65504).sum()) > r["big"].overflow


def test_unnamed_nodes_are_named_by_their_ids_and_bad_targets_are_one_line():
    m = _ln_model()
    for n in m.graph.node:
        n.name = ""
    assert [n.name for n in name_nodes(m).graph.node] == ["Mul_0", "LayerNormalization_0", "MatMul_0"]
    report = check_precision(m, {"x": np.full((2, 16), 100.0, np.float32)})
    assert report.block_list() == ["Mul_0", "LayerNormalization_0"]
    with pytest.raises(OpscopeError, match="did you mean 'bf16'"):
        check_precision(m, {"x": np.ones((2, 16), np.float32)}, target="bf61")


def test_cli_check_fp16_writes_the_block_list(tmp_path):
    """`opscope calibrate --check fp16` on magika: the LayerNorm sum of squares overflows and is blocked."""
    import json

    from conftest import real_model_path

    from onnx_opscope.cli import main

    out = tmp_path / "fp16.json"
    model = real_model_path("magika_standard_v3_3")
    assert main(["calibrate", str(model), "--check", "fp16", "-o", str(out), "--batches", "2", "-q"]) == 0
    doc = json.loads(out.read_text())
    assert doc["target"] == "fp16"
    assert any(n.endswith("LayerNorm_1/Sum_1") for n in doc["node_block_list"])
    assert all(t["overflow"] or t["underflow"] or t["nan"] or t["inf"] for t in doc["tensors"])
    assert any(t["max_abs"] > 65504 for t in doc["tensors"])
