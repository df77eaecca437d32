"""Online sketches (sketch.online, over Apache DataSketches) against exact numpy values on real tensors.

Tolerances are the sketches' own stated ones: KLL's normalized rank error at k = 200 (`rank_error`,
0.0133 for one quantile, 0.0165 for a CDF), HLL's 8% bound at lg_k = 12 from the issue (its
standard error is 1.6%). HLL unions are exact: the registers of a union equal those of one sketch
of all the data, and unions over the same data give the same estimate to the last bit.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import real_model_path
from onnx import numpy_helper

from onnx_opscope.errors import OpscopeError
from onnx_opscope.sketch import online

HLL_REGISTERS = 1 << online.HLL_LG_K  # the compact HLL_8 image ends with one byte per register


@pytest.fixture(scope="module")
def real_tensors() -> list[np.ndarray]:
    """The largest weights of two real models: real value distributions, 100k to 1.6M elements each."""
    out = []
    for name in ("captcha_crnn", "magika_standard_v3_3"):
        model = onnx.load(real_model_path(name))
        arrays = [
            numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT
        ]
        arrays = sorted((a for a in arrays if a.size >= 100_000), key=lambda a: -a.size)[:3]
        out.extend(a.astype(np.float32).ravel() for a in arrays)
    assert len(out) == 5
    return out


def _true_rank_interval(x: np.ndarray, q: float) -> tuple[float, float]:
    """The ranks a value q holds in x: from the share below it to the share at or below it."""
    s = np.sort(x)
    return np.searchsorted(s, q, "left") / s.size, np.searchsorted(s, q, "right") / s.size


def _assert_rank_within(x: np.ndarray, q: float, rank: float, eps: float) -> None:
    lo, hi = _true_rank_interval(x, q)
    assert lo - eps <= rank <= hi + eps, (
        f"value {q} has true rank {lo:.4f}..{hi:.4f}, asked {rank} +/- {eps:.4f}"
    )


def test_kll_quantiles_within_stated_rank_error(real_tensors):
    eps = online.rank_error()
    assert 0.013 < eps < 0.014  # k = 200, as the module says
    for x in real_tensors:
        s = online.quantile_sketch()
        assert online.add_values(s, x) == x.size
        assert s.is_estimation_mode()  # the sketch holds far fewer values than it saw
        for r in (0.01, 0.25, 0.5, 0.75, 0.99):
            _assert_rank_within(x, s.get_quantile(r), r, eps)
        # numpy's median: its rank in the sketch (from the share below it to the share at or below
        # it: real weights have ties) is within the error of 0.5 too
        m = np.float32(np.median(x))
        assert s.get_rank(m, inclusive=False) - eps <= 0.5 <= s.get_rank(m, inclusive=True) + eps


def test_kll_leaves_out_non_finite_values():
    s = online.quantile_sketch()
    x = np.array([1.0, np.nan, -np.inf, 2.0, np.inf, 3.0], np.float32)
    assert online.add_values(s, x) == 3
    assert (s.n, s.get_min_value(), s.get_max_value()) == (3, 1.0, 3.0)


def test_kll_merge_is_the_sketch_of_the_union(real_tensors):
    eps = online.rank_error()
    x, y = real_tensors[0], real_tensors[3]
    a, b = online.quantile_sketch(), online.quantile_sketch()
    online.add_values(a, x)
    online.add_values(b, y)
    merged = online.merge_quantiles([a, b])
    union = np.concatenate([x, y])
    assert merged.n == union.size and (a.n, b.n) == (x.size, y.size)  # the parts are unchanged
    assert merged.get_min_value() == union.min() and merged.get_max_value() == union.max()
    for r in (0.05, 0.5, 0.95):
        _assert_rank_within(union, merged.get_quantile(r), r, eps)


def _hll(ids) -> object:
    h = online.distinct_sketch()
    online.add_fingerprints(h, (online.fingerprint([np.array([i], np.int64)]) for i in ids))
    return h


def test_hll_counts_10k_distinct_within_8_percent():
    h = _hll(range(10_000))
    assert h.lg_config_k == 12
    assert abs(h.get_estimate() - 10_000) <= 800
    repeated = _hll([i % 10_000 for i in range(30_000)])  # each seen 3 times: still 10k distinct
    assert abs(repeated.get_estimate() - 10_000) <= 800


def test_hll_counts_fingerprints_of_real_rows(real_tensors):
    """Rows of a real weight, hashed: the estimate is within 8% of numpy's count of distinct rows."""
    x = real_tensors[0]
    rows = x[: 8 * 20_000].reshape(-1, 8)
    exact = np.unique(rows, axis=0).shape[0]
    h = online.distinct_sketch()
    online.add_fingerprints(h, (online.fingerprint([r]) for r in rows))
    assert exact > 3000
    assert abs(h.get_estimate() - exact) <= 0.08 * exact


def test_hll_union_is_exact():
    whole, a, b = _hll(range(10_000)), _hll(range(6_000)), _hll(range(4_000, 10_000))
    merged = online.merge_distinct([a, b])
    # the union holds exactly the registers of one sketch of all the data
    assert online.to_bytes(merged)[-HLL_REGISTERS:] == online.to_bytes(whole)[-HLL_REGISTERS:]
    # and every union over the same data gives the same estimate, bit for bit
    estimates = {
        online.merge_distinct(parts).get_estimate()
        for parts in (
            [a, b],
            [b, a],
            [whole, a],
            [whole, whole],
            [_hll(range(5_000)), _hll(range(5_000, 10_000))],
        )
    }
    assert len(estimates) == 1
    assert abs(estimates.pop() - 10_000) <= 800


def test_serialize_round_trip(real_tensors, tmp_path):
    q = online.quantile_sketch()
    online.add_values(q, real_tensors[1])
    h = _hll(range(5_000))
    for s in (q, h):
        back = online.from_bytes(online.kind_of(s), online.to_bytes(s))
        assert online.to_bytes(back) == online.to_bytes(s)
        assert online.to_bytes(online.decode(online.encode(s))) == online.to_bytes(s)
    assert online.decode(online.encode(h)).get_estimate() == h.get_estimate()
    back_q = online.decode(online.encode(q))
    assert back_q.n == q.n
    assert back_q.get_quantiles([0.01, 0.5, 0.99]) == q.get_quantiles([0.01, 0.5, 0.99])
    path = online.save_sketches(
        tmp_path / "t.online.json", [{"site": "s", "role": "in", "stat": "kll", "sketch": q}], {"every": 3}
    )
    entries, meta = online.load_sketches(path)
    assert meta == {"every": 3}
    assert entries[0]["site"] == "s" and entries[0]["sketch"].get_quantile(0.5) == q.get_quantile(0.5)
    assert online.online_path(tmp_path / "run.parquet") == tmp_path / "run.online.json"


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(OpscopeError, match="not an encoded online sketch"):
        online.decode("kll:not base64!")
    with pytest.raises(OpscopeError, match="not a serialized kll"):
        online.from_bytes("kll", b"\x00\x01\x02")
    with pytest.raises(OpscopeError, match="unknown online sketch kind"):
        online.from_bytes("theta", b"")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(OpscopeError, match="not an onnx-opscope online sketch file"):
        online.load_sketches(tmp_path / "x.json")


def test_ks_distance_tracks_the_exact_one(real_tensors):
    """The sketch KS distance is within twice the CDF error of the exact two-sample one (numpy)."""
    x = real_tensors[3]
    std = float(x.std())
    for moved in (x, x + 0.25 * std, x * 2.0):
        a, b = online.quantile_sketch(), online.quantile_sketch()
        online.add_values(a, x)
        online.add_values(b, moved)
        grid = np.sort(np.concatenate([x, moved]))
        exact = np.max(np.abs(np.searchsorted(np.sort(x), grid, "right") / x.size
                              - np.searchsorted(np.sort(moved), grid, "right") / moved.size))  # fmt: skip
        assert abs(online.ks_distance(a, b) - exact) <= 2 * online.rank_error(pmf=True) + 0.01


def test_fingerprint_follows_bytes_dtype_and_shape():
    x = np.arange(12, dtype=np.float32)
    f = online.fingerprint
    assert f([x]) == f([x.copy()])
    assert f([x]) != f([x.reshape(3, 4)]) and f([x]) != f([x.astype(np.float64)])
    assert f([np.array([0.0])]) != f([np.array([-0.0])])
    assert f([x[::2]]) == f([np.ascontiguousarray(x[::2])])
    assert -(2**63) <= f([x]) < 2**63
