"""LiveRecorder on a real model (ppocrv4_det, ~3 ms a call): outputs bit-for-bit the plain session's on
every call, exactly every N-th call sampled, memory that does not grow, quantiles and repeat shares
against numpy values of the very tensors it sampled, drift found where the inputs move."""

from __future__ import annotations

import math
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import real_model_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.errors import OpscopeError
from onnx_opscope.run import FeedSpec, LiveRecorder, RuntimeConfig, iter_feeds, make_session
from onnx_opscope.sketch import SketchOptions, online, sample_positions
from onnx_opscope.sketch.histogram import elemsig_of

SHAPES = {"x": [1, 3, 64, 64]}
FIRST_CONV = "p2o.Conv.0"  # its `in` role is the model input x itself: its sample is known here


class Spy:
    """A session-like object that counts the calls it runs (and that cannot say which model it runs)."""

    def __init__(self, session):
        self.session, self.calls = session, 0

    def run(self, output_names, input_feed, run_options=None):
        self.calls += 1
        return self.session.run(output_names, input_feed, run_options)

    def get_inputs(self):
        return self.session.get_inputs()


@pytest.fixture(scope="module")
def det():
    return real_model_path("ppocrv4_det")


@pytest.fixture(scope="module")
def feeds(det):
    return list(iter_feeds(det, FeedSpec(batches=6, seed=3)))


def _same_bits(a, b) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


@pytest.mark.parametrize("graph_opt", ["all", "disable"])
def test_outputs_bit_identical_and_every_nth_call_sampled(det, feeds, graph_opt):
    plain = make_session(det, RuntimeConfig(graph_opt=graph_opt, threads=1))
    spy = Spy(plain)
    every = 3
    rec = LiveRecorder(spy, every=every, model=det, runtime=RuntimeConfig(graph_opt=graph_opt, threads=1),
                       input_shapes=SHAPES)  # fmt: skip
    for call in range(1, 13):
        feed = feeds[call % len(feeds)]
        before = spy.calls
        got = rec.run(None, feed)
        assert _same_bits(got, plain.run(None, feed)), f"call {call}: outputs differ from the plain session's"
        assert rec.sampled == call // every
        if call % every:
            assert spy.calls == before + 1  # an unsampled call is the plain session's, once
        # first word on a sampled call: the plain session also ran, to compare (and for the outputs
        # from then on only when the tapped ones differed)
        elif call == every or not rec.outputs_match:
            assert spy.calls == before + 1
        else:
            assert spy.calls == before
    names = [o.name for o in plain.get_outputs()]
    assert _same_bits(rec.run(names[:1], feeds[0]), plain.run(names[:1], feeds[0]))  # a subset of outputs
    if graph_opt == "disable":
        assert rec.outputs_match is True  # no fusion to block: the tapped session runs instead
    assert rec.get_inputs()[0].name == "x"  # the session's own methods pass through


def test_quantiles_and_repeat_share_match_numpy(det, feeds):
    rec = LiveRecorder(det, every=1, window=4, runtime=RuntimeConfig(threads=1), input_shapes=SHAPES)
    opts = SketchOptions()
    values, order = [], [0, 1, 2, 0, 1, 3, 0, 2, 1, 0, 4, 2]  # 5 distinct inputs in 12 calls
    for i in order:
        rec.run(None, feeds[i])
        flat = feeds[i]["x"].ravel()
        sample = flat[sample_positions(flat.size, opts.sample_size)]
        values.append(sample[:: sample.size // rec.values_per_tap][: rec.values_per_tap])
    s = rec.summary()
    row = next(r for r in s["sites"] if r["site"] == FIRST_CONV and r["role"] == "in")
    exact = np.concatenate(values)
    assert row["values"] == exact.size
    eps = online.rank_error()
    for r, key in ((0.01, "p01"), (0.5, "p50"), (0.99, "p99")):
        sorted_ = np.sort(exact)
        lo, hi = (
            np.searchsorted(sorted_, row[key], "left") / exact.size,
            np.searchsorted(sorted_, row[key], "right") / exact.size,
        )
        assert lo - eps <= r <= hi + eps, (key, row[key])
    want = 1 - len(set(order)) / len(order)
    assert s["inputs_repeat_share"] == pytest.approx(want, abs=0.01)
    assert row["repeat_share"] == pytest.approx(want, abs=0.01) and row["seen"] == len(order)
    # step change: the mean relative L2 distance of elemsig between consecutive calls, as the miner defines it
    sigs = [
        elemsig_of(v.astype(np.float64), opts)
        for v in (feeds[i]["x"].ravel()[sample_positions(12288, 4096)] for i in order)
    ]
    steps = [
        np.linalg.norm(a - b) / max(np.linalg.norm(a), np.linalg.norm(b)) for a, b in zip(sigs[1:], sigs)
    ]
    assert row["step_change"] == pytest.approx(np.mean(steps), rel=1e-9)
    found = rec.findings(min_seen=8)
    assert any(f.rule == "memoize" and f.site == "<inputs>" for f in found)
    # the whole input repeats, so every site does: the model-level memo says it, once
    assert not any(f.rule == "memoize" and f.site != "<inputs>" for f in found)


def _two_branches() -> onnx.ModelProto:
    """y = a @ Wa + b @ Wb: a site per input, so one can repeat while the model's inputs do not."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), n) for n in ("Wa", "Wb")
    ]
    nodes = [
        helper.make_node("MatMul", ["a", "Wa"], ["ya"], name="mm_a"),
        helper.make_node("MatMul", ["b", "Wb"], ["yb"], name="mm_b"),
        helper.make_node("Add", ["ya", "yb"], ["y"], name="add"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 64]) for n in ("a", "b", "y")]
    graph = helper.make_graph(nodes, "two", io[:2], io[2:], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_site_that_repeats_more_than_the_inputs_is_found():
    rec = LiveRecorder(_two_branches(), every=2, runtime=RuntimeConfig(threads=1))
    rng = np.random.default_rng(1)
    fixed = [rng.standard_normal((1, 64)).astype(np.float32) for _ in range(2)]
    for call in range(40):
        rec.run(None, {"a": fixed[call % 4 // 2], "b": rng.standard_normal((1, 64)).astype(np.float32)})
    s = rec.summary()
    share = {r["site"]: r["repeat_share"] for r in s["sites"]}
    assert s["inputs_repeat_share"] == 0.0  # b never repeats
    assert share[next(k for k in share if "mm_a" in k)] == pytest.approx(1 - 2 / 20, abs=0.01)
    assert share[next(k for k in share if "mm_b" in k)] == 0.0
    memo = [f.site for f in rec.findings() if f.rule == "memoize"]
    assert len(memo) == 1 and "mm_a" in memo[0]


def test_memory_bounded_and_drift_found(det, feeds, tmp_path):
    rec = LiveRecorder(det, every=1, window=4, runtime=RuntimeConfig(threads=1), input_shapes=SHAPES)
    for i in range(16):  # 4,096 values a tensor: every KLL sketch is past its exact mode
        rec.run(None, feeds[i % 6])
    first = rec.memory_bytes()
    count = len(rec.sketches())
    tracemalloc.start()
    held = tracemalloc.get_traced_memory()[0]
    for i in range(16, 64):
        rec.run(None, feeds[i % 6])
    grown = tracemalloc.get_traced_memory()[0] - held
    tracemalloc.stop()
    assert grown < 100_000, f"Python memory grew by {grown} bytes over 48 calls"  # one call's samples: 2 MB
    assert len(rec.sketches()) == count
    # 4x the calls: no sketch added, none past its bound, the total within the compactions' wobble
    bound = rec.max_memory_bytes()
    assert rec.memory_bytes() <= bound and first <= bound
    assert all(
        len(e["sketch"].serialize()) <= online.KLL_MAX_BYTES for e in rec.sketches() if e["stat"] == "kll"
    )
    assert rec.memory_bytes() <= 1.3 * first, (first, rec.memory_bytes())
    before = next(r for r in rec.summary()["sites"] if r["site"] == FIRST_CONV and r["role"] == "in")
    assert before["shift"] < 0.15  # the same distribution: KS noise only
    for i in range(8):  # the inputs move: 4x larger and shifted
        rec.run(None, {"x": feeds[i % 6]["x"] * 4 + 2})
    after = next(r for r in rec.summary()["sites"] if r["site"] == FIRST_CONV and r["role"] == "in")
    assert after["shift"] > 0.5
    assert any(f.rule == "drift" and f.site == FIRST_CONV for f in rec.findings())
    entries, meta = online.load_sketches(rec.save(tmp_path / "live.online.json"))
    assert meta["sampled"] == 72 and len(entries) == count
    kll = next(e for e in entries if e["site"] == FIRST_CONV and e["role"] == "in")
    assert kll["sketch"].n == after["values"]
    assert math.isclose(kll["sketch"].get_quantile(0.5), after["p50"])


def test_user_errors_are_one_line(det):
    with pytest.raises(OpscopeError, match="every 0"):
        LiveRecorder(det, every=0)
    with pytest.raises(OpscopeError, match="cannot tell which model"):
        LiveRecorder(Spy(None), every=2)
    with pytest.raises(OpscopeError, match="check 'never'"):
        LiveRecorder(det, check="never")


def test_bench_live_quick_prints_every_row():
    """scripts/bench_live.py runs and prints its rows (no time is asserted: BENCHMARKS figures are not CI's)."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts" / "bench_live.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    for row in ("| plain session |", "| LiveRecorder, unsampled call |", "| LiveRecorder, sampled call",
                "| LiveRecorder, amortized", "| instant session, through LiveRecorder |"):  # fmt: skip
        assert row in proc.stdout, row
