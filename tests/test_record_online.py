"""`record(online=True)`: KLL quantiles of the sampled values within their stated rank error of numpy's,
HLL counts of the elemsig fingerprints against the table's distinct elemsig rows, a split run merged
against one run, Ray against one process, the sidecar written atomically and only when asked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import generated_model_path

import onnx_opscope
from onnx_opscope.cli import main
from onnx_opscope.run import FeedSpec, iter_feeds, read_table, recorder
from onnx_opscope.run.engine import Engine
from onnx_opscope.sketch import online, sample_positions
from onnx_opscope.sketch.histogram import elemsig_of

MODEL = generated_model_path("transformer_block")
EPS = online.rank_error()


@pytest.fixture(scope="module")
def batches() -> list[dict[str, np.ndarray]]:
    """Six distinct batches of the model's inputs (different shapes among them: seq 8 and 12)."""
    a = list(iter_feeds(MODEL, FeedSpec(batches=3, dist="outlier", seed=1)))
    b = list(iter_feeds(MODEL, FeedSpec(batches=3, dist="gaussian", seed=2, dims={"seq": 12})))
    return a + b


def _data(folder: Path, batches: list[dict[str, np.ndarray]]) -> Path:
    folder.mkdir(parents=True)
    for i, b in enumerate(batches):
        np.savez(folder / f"b{i}.npz", **b)
    return folder


def _record(tmp_path: Path, name: str, batches: list[dict], **kw):
    data = _data(tmp_path / f"{name}_data", batches)
    return onnx_opscope.record(MODEL, out=tmp_path / f"{name}.parquet", feeds=FeedSpec(data=data), run_id="r",
                               online=True, **kw)  # fmt: skip


def _tensors(result, batches: list[dict]) -> dict[str, list[np.ndarray]]:
    """tap id -> the tapped tensor of each batch, from onnxruntime running the plain model with them as outputs."""
    taps = [t for t in result.manifest.taps if not t.constant]
    model = onnx.load(MODEL)
    have = {o.name for o in model.graph.output}
    for t in taps:
        if t.tensor not in have:
            model.graph.output.append(
                onnx.helper.make_tensor_value_info(t.tensor, onnx.TensorProto.FLOAT, None)
            )
            have.add(t.tensor)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [t.tensor for t in taps]
    out: dict[str, list[np.ndarray]] = {t.id: [] for t in taps}
    for b in batches:
        for t, x in zip(taps, sess.run(names, b)):
            out[t.id].append(np.asarray(x, np.float64).ravel())
    return out


def _sample(x: np.ndarray, o) -> np.ndarray:
    return x[sample_positions(x.size, o.sample_size)]


def _rank(values: np.ndarray, q: float) -> tuple[float, float]:
    """The rank interval of q among `values`: below it, and at or below it."""
    return float(np.mean(values < q)), float(np.mean(values <= q))


def _within(values: np.ndarray, q: float, r: float, eps: float) -> bool:
    lo, hi = _rank(values, q)
    return lo - eps <= r <= hi + eps


def test_quantiles_are_within_rank_error_of_numpy_on_the_sampled_values(tmp_path, batches):
    result = _record(tmp_path, "q", batches)
    assert result.online == online.online_path(result.table) and result.online.is_file()
    o = result.manifest.sketch_options()
    assert any(t.copied for t in result.manifest.taps) and any(
        not (t.copied or t.constant) for t in result.manifest.taps
    )  # both kinds of tap are held to numpy here
    tensors = _tensors(result, batches)
    got = online.read_online(result.table, ranks=[0.01, 0.1, 0.5, 0.9, 0.99])
    live = {t.id for t in result.manifest.taps if not t.constant}  # weights do not change between batches
    tap_of = {(s.id, r): tid for s in result.manifest.sites for r, tid in s.roles.items() if tid in live}
    assert got.keys() == tap_of.keys()
    checked = 0
    for key, entry in got.items():
        parts = []
        for x in tensors[tap_of[key]]:
            s = _sample(x, o)
            parts.append(s[:: max(1, s.size // recorder.VALUES_PER_TAP)][: recorder.VALUES_PER_TAP])
        exact = np.concatenate(parts)
        assert entry["values"] == exact.size
        for r, q in zip([0.01, 0.1, 0.5, 0.9, 0.99], entry["quantiles"]):
            assert _within(exact, q, r, EPS), (key, r, q, np.quantile(exact, r))
        kll = entry["kll"]
        assert kll.get_min_value() == np.float32(exact.min()) and kll.get_max_value() == np.float32(
            exact.max()
        )
        checked += 1
    assert checked == len(tap_of)


def test_distinct_fingerprints_match_the_tables_distinct_elemsig_rows(tmp_path, batches):
    repeated = [batches[i] for i in (0, 1, 2, 0, 1, 3, 0)]  # 4 distinct batches among 7
    result = _record(tmp_path, "d", repeated)
    df = read_table(result.table).to_pandas()
    sig = df[df.stat == "elemsig"].sort_values(["site", "role", "step", "idx"])
    got = online.read_online(result.table)
    groups = dict(list(sig.groupby(["site", "role"])))
    assert len(got.keys() & groups.keys()) >= 10  # (residual taps sample for hist, without elemsig rows)
    for (site, role), rows in groups.items():
        if (site, role) not in got:  # a weight's: the same every batch, not sketched online
            assert (
                rows.step.nunique() == len(repeated)
                and rows.groupby("step").value.apply(tuple).nunique() == 1
            )
            continue
        vecs = {tuple(g.value.to_numpy()) for _, g in rows.groupby("step") if np.any(g.value.to_numpy() != 0)}
        seen = sum(np.any(g.value.to_numpy() != 0) for _, g in rows.groupby("step"))
        entry = got[(site, role)]
        assert entry["seen"] == seen
        assert abs(entry["distinct"] - len(vecs)) <= max(0.08 * len(vecs), 0.5), (site, role)
    assert {round(e["distinct"]) for e in got.values()} >= {
        4
    }  # input-dependent tensors repeat as the inputs do
    # the fingerprint is of the elemsig the table holds: recomputed from onnxruntime's tensors
    o = result.manifest.sketch_options()
    tensors = _tensors(result, repeated)
    tid = next(t.id for t in result.manifest.taps if not (t.copied or t.constant))
    prints = {online.fingerprint([elemsig_of(_sample(x, o), o)]) for x in tensors[tid]}
    site, role = next((s.id, r) for s in result.manifest.sites for r, t in s.roles.items() if t == tid)
    direct = online.distinct_sketch()
    online.add_fingerprints(direct, prints)
    assert online.distinct_estimate(got[(site, role)]["hll"]) == online.distinct_estimate(direct)


def test_a_split_run_merged_equals_one_run(tmp_path, batches):
    whole = online.read_online(_record(tmp_path, "all", batches).table)
    first = online.read_online(_record(tmp_path, "a", batches[:3]).table)
    second = online.read_online(_record(tmp_path, "b", batches[3:]).table)
    assert whole.keys() == first.keys() == second.keys()
    for key, w in whole.items():
        hll = online.merge_distinct([first[key]["hll"], second[key]["hll"]])
        assert online.distinct_estimate(hll) == w["distinct"]  # exact, to the last bit
        kll = online.merge_quantiles([first[key]["kll"], second[key]["kll"]])
        _same_within_error(kll, w["kll"])


def _same_within_error(a, b) -> None:
    """Two KLL sketches of the same values: same count, min and max; quantiles within twice the rank error."""
    assert a.n == b.n and a.get_min_value() == b.get_min_value() and a.get_max_value() == b.get_max_value()
    for r in (0.05, 0.25, 0.5, 0.75, 0.95):
        assert abs(b.get_rank(a.get_quantile(r)) - r) <= 2 * EPS + 1.0 / b.n


def test_ray_sketches_equal_the_local_runs(tmp_path, batches):
    import ray

    local = online.read_online(_record(tmp_path, "local", batches).table)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        spread = _record(tmp_path, "ray", batches, engine=Engine("ray", workers=2))
    finally:
        ray.shutdown()
    got = online.read_online(spread.table)
    assert got.keys() == local.keys()
    for key, entry in got.items():
        assert entry["distinct"] == local[key]["distinct"] and entry["seen"] == local[key]["seen"]
        _same_within_error(entry["kll"], local[key]["kll"])


def test_the_sidecar_is_atomic_kept_by_a_failed_run_and_absent_without_online(tmp_path, batches, monkeypatch,
                                                                              capsys):  # fmt: skip
    data = _data(tmp_path / "data", batches)
    out = tmp_path / "t.parquet"
    sidecar = online.online_path(out)
    assert main(["record", str(MODEL), "-o", str(out), "--data", str(data), "--online"]) == 0
    assert f"online: {sidecar}" in capsys.readouterr().out
    _, meta = online.load_sketches(sidecar)
    assert meta["batches"] == 6 and meta["interrupted"] is False and meta["values_per_tap"] == 256

    def stop(done, total):  # a run that fails after its third batch
        if done == 3:
            raise RuntimeError("stopped")

    with pytest.raises(RuntimeError):
        onnx_opscope.record(MODEL, out=out, feeds=FeedSpec(data=data), online=True, progress=stop)
    entries, meta = online.load_sketches(sidecar)
    # the third batch may have been written in one part with the next ones: they are all kept
    kept = len(set(read_table(out, ["step"]).column("step").to_pylist()))
    assert meta["interrupted"] is True and meta["batches"] == kept and 3 <= kept <= 6
    assert {e["sketch"].n for e in entries if e["stat"] == "kll"} <= {kept * n for n in (256, 16, 64, 128)}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # written under a temporary name
    assert json.loads(sidecar.read_text())["format"] == online.FORMAT

    # off by default: no online code runs, and an earlier run's sidecar does not outlive its table
    def boom(*a, **k):
        raise AssertionError("online sketches computed without online=True")

    monkeypatch.setattr(recorder, "batch_online", boom)
    monkeypatch.setattr(recorder.OnlineSketches, "__init__", boom)
    result = onnx_opscope.record(MODEL, out=out, feeds=FeedSpec(data=data))
    assert result.online is None and not sidecar.exists()
    assert result.batches == 6


def test_many_distinct_fingerprints_merge_exactly_across_a_split(tmp_path):
    """Where HLL leaves its exact small-count modes (thousands of distinct fingerprints), a run's count
    and the union of any split of it still agree to the last bit, and stay within 8%."""
    _, manifest = onnx_opscope.inject(MODEL)
    tid = next(t.id for t in manifest.taps if not t.constant)
    empty = online.to_bytes(online.quantile_sketch())
    prints = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64).tolist()
    whole, first, second = (recorder.OnlineSketches(manifest) for _ in range(3))
    for i, f in enumerate(prints):
        batch = recorder.BatchOnline((tid,), (empty,), (f,))
        whole.add(batch)
        (first if i < 700 else second).add(batch)

    def hll(acc):
        return next(e["sketch"] for e in acc.entries() if e["stat"] == "hll")

    merged = online.merge_distinct([hll(first), hll(second)])
    assert online.distinct_estimate(merged) == online.distinct_estimate(hll(whole))
    assert abs(online.distinct_estimate(hll(whole)) - 3000) <= 0.08 * 3000
    assert online.distinct_estimate(hll(first)) == pytest.approx(700, rel=0.08)
