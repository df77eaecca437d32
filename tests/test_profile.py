"""Measured time per node: fused kernels mapped back, shares, the measured roofline, regions, the CLI.

References are taken outside the code under test: onnxruntime's own trace (at opt level
"disable" every kernel is one node of the model), the model's graph (a BatchNormalization
fused into a Conv must share its kernel with that Conv), the names the generated transformer
was built with (block1/attn/..., block1/mlp/...), and numpy for the bandwidth's scale.
"""

from __future__ import annotations

import json
import math
import time
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
from conftest import generated_model_path, real_model_path

from onnx_opscope import profile_nodes
from onnx_opscope.analysis.bandwidth import measure, measure_bandwidth, measure_peak
from onnx_opscope.analysis.events import profile_session
from onnx_opscope.analysis.regions import find_blocks, region_times
from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds
from onnx_opscope.run.session import CPU, RuntimeConfig

DET_SHAPE = {
    "x": [1, 3, 96, 96]
}  # ppocrv4_det: Conv + BatchNorm + activations, NCHWc reorders at level "all"


@pytest.fixture(scope="module")
def measured():
    return measure(RuntimeConfig(), nbytes=16 << 20, n=256)


@pytest.fixture(scope="module")
def det_all(measured):
    return profile_nodes(real_model_path("ppocrv4_det"), DET_SHAPE, runs=2, measured=measured)


def test_fused_kernels_map_back_at_level_all(det_all):
    prof = det_all
    assert prof.opt_level == "all" and prof.kernels
    assert all(k.nodes for k in prof.kernels), [k.name for k in prof.kernels if not k.nodes]
    assert sum(n.time_s for n in prof.nodes) == pytest.approx(prof.kernel_s, rel=1e-9)
    assert prof.unmapped_s == 0
    # the optimizer did fuse and insert here, so the mapping was exercised
    assert any(k.how == "fused" for k in prof.kernels) and any(k.inserted for k in prof.kernels)
    model = onnx.load(str(real_model_path("ppocrv4_det")), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    kernel_nodes = {k.name: set(k.nodes) for k in prof.kernels}
    checked = 0
    for n in model.graph.node:
        if n.op_type != "BatchNormalization" or producer.get(n.input[0]) is None:
            continue
        conv = producer[n.input[0]]
        if conv.op_type != "Conv":
            continue
        holding = [name for name, members in kernel_nodes.items() if n.name in members]
        assert holding and all(conv.name in kernel_nodes[name] for name in holding), n.name
        checked += 1
    assert checked >= 1


def test_shares_sum_to_one(det_all):
    for rows in (det_all.by_op(), det_all.by_region()):
        for key in ("time_share", "flops_share", "bytes_share"):
            assert sum(r[key] for r in rows) == pytest.approx(1.0, abs=1e-9), key
    assert det_all.seconds_by_op()["Conv"] == pytest.approx(
        sum(n.time_s for n in det_all.nodes if n.op_type == "Conv")
    )


def test_every_node_timed_at_level_disable(measured):
    """With optimizations off each kernel is one node: node time == onnxruntime's own kernel time."""
    path = real_model_path("ppocrv4_det")
    config = RuntimeConfig(graph_opt="disable")
    prof = profile_nodes(path, DET_SHAPE, config=config, runs=1, measured=measured)
    model = onnx.load(str(path), load_external_data=False)
    ran = {n.name for n in model.graph.node if n.op_type != "Constant"}
    by_node = {n.node: n for n in prof.nodes}
    assert {k.name for k in prof.kernels} == ran
    for k in prof.kernels:
        assert k.nodes == (k.name,) and k.how == "same" and not k.inserted
        assert by_node[k.name].time_s == pytest.approx(k.time_s, rel=1e-12)
    assert all(by_node[name].time_s > 0 for name in ran)
    feeds = synthetic_feeds(path, FeedSpec(dist="uniform", shapes=DET_SHAPE))
    trace = profile_session(path, feeds, config, runs=1)  # an independent trace: the same kernels ran
    assert set(trace.mean()) == ran


def test_verdicts_follow_the_measured_roofline(det_all):
    m = det_all.measured
    for n in det_all.nodes:
        if not n.time_s:
            assert n.verdict == "not run"
        elif n.bytes_per_s is None:
            assert n.verdict == "unknown"
        elif n.bytes / n.time_s >= 0.5 * m.bandwidth:
            assert n.verdict == "bandwidth"
        elif n.flops and n.bytes and n.flops / n.bytes > m.ridge:
            assert n.verdict == "compute"
        else:
            assert n.verdict == "latency"


def test_bandwidth_and_peak_probes_are_positive_and_plausible():
    bw = measure_bandwidth(RuntimeConfig(), nbytes=16 << 20)
    peak = measure_peak(RuntimeConfig(), n=256)
    assert math.isfinite(bw) and bw > 0 and math.isfinite(peak) and peak > 0
    src = np.ones(4 << 20, np.float32)  # numpy's copy on the same machine: the same order of magnitude
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    assert 0.05 < bw / (2 * src.nbytes / best) < 50


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_regions_with_the_skip_rewrite():
    path = generated_model_path("transformer_tiny_lm")
    blocks = find_blocks(path)
    assert blocks.attention == ["block1/attn_residual", "block2/attn_residual"]
    assert blocks.mlp == ["block1/mlp_residual", "block2/mlp_residual"]
    model = onnx.load(str(path))
    for n in model.graph.node:
        expect = "attention" if "/attn/" in n.name else "mlp" if "/mlp/" in n.name else None
        if expect:
            assert blocks.region(n.name) == expect, n.name
    assert blocks.region("ln_f") == blocks.region("lm_head/matmul") == "other"
    feeds = synthetic_feeds(path, FeedSpec(dims={"batch": 4, "seq": 64}))
    r = region_times(path, feeds, blocks=blocks, repeats=5)
    assert min(r.full_s, r.no_attention_s, r.no_mlp_s, r.neither_s) > 0
    assert r.neither_s < r.full_s  # without all four blocks only the embedding, norms and head are left
    assert r.slack_s == pytest.approx(r.full_s - r.attention_s - r.mlp_s - r.other_s, abs=1e-15)
    assert r.to_dict()["slack_s"] == r.slack_s
    with pytest.raises(OpscopeError, match="no"):  # convolution blocks only: no attention / MLP region
        region_times(real_model_path("ppocrv4_det"), {})


def test_region_rollup_of_the_node_profile(measured):
    prof = profile_nodes(generated_model_path("transformer_tiny_lm"), dims={"batch": 1, "seq": 32}, runs=1,
                         measured=measured, regions=True)  # fmt: skip
    rows = {r["name"]: r for r in prof.by_region()}
    assert set(rows) == {"attention", "mlp", "other"}
    assert sum(r["time_share"] for r in rows.values()) == pytest.approx(1.0)
    assert prof.regions is not None and prof.regions.attention_blocks == 2


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["analyze", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_unknown_or_missing_provider_is_one_line(capsys):
    mlp = str(generated_model_path("mlp"))
    rc, _, err = _cli(capsys, mlp, "--profile", "--provider", "cdua")
    assert rc == 2 and err.startswith("error: unknown execution provider 'cdua'") and "Traceback" not in err
    assert len(err.splitlines()) <= 2  # the error, and its hint
    rc, _, err = _cli(capsys, mlp, "--profile", "--provider", "cuda")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert rc == 2 and "is not available" in err and "hint:" in err
    rc, _, err = _cli(capsys, mlp, "--regions")
    assert rc == 2 and "add --profile" in err
    rc, _, err = _cli(capsys, mlp, "--opt-level", "basic")
    assert rc == 2 and "--opt-level only apply" in err


def test_provider_fallback_runs_on_cpu(measured):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = RuntimeConfig(providers="cuda,cpu", fallback=True)
        prof = profile_nodes(generated_model_path("mlp"), runs=1, config=config, measured=measured)
    assert CPU in prof.providers and prof.kernels


def test_cli_writes_plot_and_json(tmp_path, capsys):
    png, out = tmp_path / "roof.png", tmp_path / "costs.json"
    mlp = str(generated_model_path("mlp"))
    rc, _, _ = _cli(capsys, mlp, "--profile", "--runs", "1", "--roofline-plot", str(png), "--format", "json",
                    "-o", str(out))  # fmt: skip
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(out.read_text())
    prof = doc["profile"]
    assert prof["opt_level"] == "all" and prof["measured"]["bandwidth"] > 0
    assert sum(r["time_share"] for r in prof["by_op"]) == pytest.approx(1.0)
    rc, text, _ = _cli(capsys, mlp, "--profile", "--runs", "1", "--opt-level", "basic")
    assert rc == 0 and "measured time by op kind" in text and "opt level basic" in text
    with pytest.raises(OpscopeError):
        profile_nodes(mlp, config=RuntimeConfig(graph_opt="fastest"))
