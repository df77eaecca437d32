"""GuardedMemo: outputs bit-identical to the uncached model on a replay of a real one, hits on repeats, a
miss (never a wrong answer) when the hash matches and the bytes do not, and its capacity respected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import real_model_path

from onnx_opscope.errors import OpscopeError
from onnx_opscope.run import FeedSpec, GuardedMemo, RuntimeConfig, iter_feeds, make_session
from onnx_opscope.run import memo as memo_module


class Doubler:
    """A session-like object: y = 2x, counting its runs."""

    def __init__(self):
        self.calls = 0

    def run(self, output_names, input_feed, run_options=None):
        self.calls += 1
        return [np.asarray(input_feed["x"]) * 2]


def _same_bits(a, b) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_replay_is_bit_identical_to_the_uncached_model():
    det = real_model_path("ppocrv4_det")
    plain = make_session(det, RuntimeConfig(threads=1))
    feeds = list(iter_feeds(det, FeedSpec(batches=4, seed=7)))
    cached = GuardedMemo(det, capacity=8, runtime=RuntimeConfig(threads=1))
    order = [0, 1, 0, 2, 1, 0, 3, 3, 2, 0]
    for i in order:
        got = cached.run(None, feeds[i])
        assert _same_bits(got, plain.run(None, feeds[i]))
    assert (cached.hits, cached.misses, cached.collisions) == (len(order) - 4, 4, 0)
    names = [o.name for o in cached.get_outputs()]  # the session's own methods pass through
    assert _same_bits(cached.run(names[:1], feeds[0]), plain.run(names[:1], feeds[0]))
    assert cached.misses == 5  # other outputs asked for: another key


def test_same_hash_different_bytes_is_a_miss(monkeypatch):
    monkeypatch.setattr(memo_module, "input_key", lambda names, feed: b"same")
    inner = Doubler()
    m = GuardedMemo(inner, capacity=4)
    a, b = np.arange(6, dtype=np.float32), np.arange(6, dtype=np.float32) + 1
    assert np.array_equal(m.run(None, {"x": a})[0], a * 2)
    assert np.array_equal(m.run(None, {"x": b})[0], b * 2)  # the hash says hit, the bytes say no
    assert np.array_equal(m.run(None, {"x": a})[0], a * 2)
    assert (m.hits, m.misses, m.collisions, inner.calls) == (0, 3, 2, 3)
    assert m.run(None, {"x": a.copy()})[0].tobytes() == (a * 2).tobytes()
    assert (m.hits, inner.calls) == (1, 3)
    # dtype and shape are part of the guard, not only the bytes
    assert m.run(None, {"x": a.view(np.int32)})[0].dtype == np.int32
    assert m.run(None, {"x": a.reshape(2, 3)})[0].shape == (2, 3)
    assert inner.calls == 5


def test_bytes_not_values_decide():
    inner = Doubler()
    m = GuardedMemo(inner)
    m.run(None, {"x": np.array([0.0, 1.0])})
    m.run(None, {"x": np.array([-0.0, 1.0])})  # equal values, other bytes: computed
    nan = np.array([np.nan, 1.0])
    m.run(None, {"x": nan})
    m.run(None, {"x": nan.copy()})  # the same NaN bytes: a hit
    assert (m.hits, inner.calls) == (1, 3)


def test_capacity_in_entries_and_bytes():
    inner = Doubler()
    m = GuardedMemo(inner, capacity=2)
    x = [np.full(4, i, np.float32) for i in range(3)]
    for i in (0, 1, 2, 0):  # 0 was the least recently used when 2 came: evicted
        m.run(None, {"x": x[i]})
    assert (len(m), m.evictions, m.hits, inner.calls) == (2, 2, 0, 4)
    m.run(None, {"x": x[2]})
    assert m.hits == 1
    entry = 2 * x[0].nbytes  # the input copy and the output
    m = GuardedMemo(Doubler(), capacity=100, max_bytes=entry + 1)
    m.run(None, {"x": x[0]})
    m.run(None, {"x": x[1]})
    assert (len(m), m.bytes, m.evictions) == (1, entry, 1)
    m.run(None, {"x": np.zeros(100, np.float32)})  # bigger than max_bytes alone: computed, not stored
    assert (len(m), m.bytes) == (1, entry)
    assert m.stats()["entries"] == 1


def test_caller_buffers_and_outputs_do_not_reach_the_cache():
    inner = Doubler()
    m = GuardedMemo(inner)
    x = np.ones(3, np.float32)
    first = m.run(None, {"x": x})[0]
    first[:] = -1  # the caller writes into what it got
    x[:] = 5  # and reuses its input buffer
    assert np.array_equal(m.run(None, {"x": x})[0], np.full(3, 10, np.float32))  # a miss: new bytes
    again = m.run(None, {"x": np.ones(3, np.float32)})[0]
    assert np.array_equal(again, np.full(3, 2, np.float32)) and inner.calls == 2
    view = GuardedMemo(Doubler(), copy=False)
    view.run(None, {"x": x})
    with pytest.raises(ValueError):
        view.run(None, {"x": x})[0][0] = 0


def test_bad_capacity_is_one_line():
    with pytest.raises(OpscopeError, match="capacity 0"):
        GuardedMemo(Doubler(), capacity=0)
    with pytest.raises(OpscopeError, match="max_bytes -1"):
        GuardedMemo(Doubler(), max_bytes=-1)


def test_bench_memo_quick_prints_every_row():
    """scripts/bench_memo.py runs (it checks its outputs bit for bit itself) and prints its rows."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts" / "bench_memo.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hit rate 0.700" in proc.stdout  # 30% distinct: every repeat hits
    for row in (
        "| replay, plain session |",
        "| replay, GuardedMemo |",
        "| one hit",
        "| a miss beyond its run",
    ):
        assert row in proc.stdout, row
