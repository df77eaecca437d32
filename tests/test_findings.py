"""The miner against ground truth: the seven synthetic distributions recorded through a real MatMul,
temporal patterns fed as data, and hand-built tables at every rule's boundary."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.findings import (
    RULES,
    MineConfig,
    collect,
    config_with,
    hist_gaps,
    load_findings,
    mine,
    print_findings,
    rel_dist,
    save_findings,
    step_signals,
)
from onnx_opscope.findings.rules import DENSE_NOTE
from onnx_opscope.run import read_table, record
from onnx_opscope.run.feeds import DISTRIBUTIONS, FeedSpec
from onnx_opscope.sites import Selection

B, T, C = 2, 64, 64  # x[B, T, C] @ W[C, C]: M = 128, K = N = 64


def matmul_model(b: int = B, t: int = T, c: int = C):
    """x @ W with a fixed random weight: the lhs is the graph input, so it carries the distribution."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((c, c)).astype(np.float32), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, t, c])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, t, c])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [x], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def record_dist(path, dist: str, batches: int = 3, seed: int = 0):
    return record(matmul_model(), out=path, feeds=FeedSpec(dist=dist, batches=batches, seed=seed), sketches=["all"],
                  sites=Selection(op_types=("MatMul",)), run_id="t").table  # fmt: skip


def record_arrays(folder, arrays: list[np.ndarray], out):
    """Record the model over the given inputs, one .npz batch each."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, a in enumerate(arrays):
        np.savez(folder / f"b{i}.npz", x=a.astype(np.float32))
    return record(matmul_model(), out=out, feeds=FeedSpec(data=folder), sites=Selection(op_types=("MatMul",)), sketches=["all"],
                  run_id="t").table  # fmt: skip


def pick(findings, role: str = "lhs", dist: str | None = None):
    found = [f for f in findings if f.role == role and (dist is None or f.dist == dist)]
    assert len(found) == 1, [(f.site, f.role, f.dist) for f in findings]
    return found[0]


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    """All seven distributions, 3 batches each, recorded into separate tables; their union as one table."""
    root = tmp_path_factory.mktemp("seven")
    paths = {d: record_dist(root / f"{d}.parquet", d) for d in DISTRIBUTIONS}
    return paths, pa.concat_tables([read_table(p) for p in paths.values()])


# --------------------------------------------------------------------------------------------
# the seven distributions through a real MatMul


EXPECTED = {
    "sparse90": "sparse",
    "coherent": "coherent",
    "outlier": "outlier",
    "quantized": "levels",
    "gaussian": "dense",
    "uniform": "dense",
    "lowrank": "dense",
}


@pytest.mark.parametrize("dist", list(EXPECTED))
def test_each_distribution_fires_its_rule_on_lhs(seven, dist):
    paths, _ = seven
    f = pick(mine(paths[dist]), "lhs")
    assert f.rule == EXPECTED[dist], (dist, f.signals)
    assert (f.site, f.op_type, f.dist, f.steps) == ("mm", "MatMul", dist, 3)
    assert (f.M, f.K, f.N, f.numel) == (B * T, C, C, B * T * C)
    if dist == "sparse90":
        assert f.signals["density"] == pytest.approx(0.1, abs=0.01)
        assert f.guard == "nnz/numel < 0.5" and f.stability == "stable"
        assert f.est_speedup == pytest.approx(1 / f.signals["density"])
    if f.rule == "dense":
        assert f.note == DENSE_NOTE and f.score == 0.0


def test_one_table_with_all_runs_gives_one_finding_per_run_site_role(seven):
    _, table = seven
    findings = mine(table)
    assert len(findings) == 7 * 3  # lhs, rhs, out per distribution
    assert {pick(findings, "lhs", d).rule for d in EXPECTED} == set(EXPECTED.values())
    scores = [f.rank_score for f in findings]
    assert scores == sorted(scores, reverse=True)


def test_out_of_a_random_weight_does_not_carry_the_distribution(seven):
    """The weight mixes channels: outlier channels and zeros of the lhs are gone in the out."""
    paths, _ = seven
    out = pick(mine(paths["outlier"]), "out")
    assert out.signals["outlier"] < 6 and out.rule != "outlier"
    sparse_out = pick(mine(paths["sparse90"]), "out")
    assert sparse_out.signals["density"] > 0.99 and sparse_out.rule != "sparse"


def test_reference_histtop_rule_misses_quantized_data(seven):
    """round(2x)/2 puts ~17 levels over 32 bins: the largest bin is the zero level, P(|x| < 0.25) ~ 0.197,
    below the reference 0.25, so the reference cascade calls quantized data dense. The levels show as a
    comb of empty bins instead: hist_gaps ~ 0.45 on quantized, 0 on every continuous distribution."""
    paths, _ = seven
    q = pick(mine(paths["quantized"]), "lhs")
    assert 0.17 < q.signals["histtop"] < 0.22 < 0.25
    reference = config_with(overrides={"gaps_min": "inf", "pos_cv_min": "0.75", "kurtosis_min": "inf"})
    assert pick(mine(paths["quantized"], config=reference), "lhs").rule == "dense"
    assert q.signals["hist_gaps"] > 0.4 and q.rule == "levels"
    assert q.est_speedup == 8.0  # ~15 occupied bins -> 4-bit LUT index
    for d in ("gaussian", "uniform", "lowrank", "coherent", "outlier", "sparse90"):
        assert pick(mine(paths[d]), "lhs").signals["hist_gaps"] < 0.1, d


def test_reference_pos_cv_threshold_fires_by_chance_on_lowrank(tmp_path):
    """Rank-4 rows have chi-square(4) energies: pos_cv ~ sqrt(2/4) = 0.71, right at the reference 0.75, so
    a one-batch recording of low-rank data is called "positional" on some batches and not on others.
    1.0 keeps lowrank dense on every batch."""
    path = record_dist(tmp_path / "lowrank.parquet", "lowrank", batches=12)
    (series,) = [s for s in collect(path) if s.role == "lhs"]
    cvs = np.array([step_signals(series.steps[k], series.numel[k])["pos_cv"] for k in sorted(series.steps)])
    assert cvs.mean() == pytest.approx(math.sqrt(0.5), abs=0.08)
    assert (cvs > 0.75).any() and (cvs < 0.75).any() and cvs.max() < 1.0
    worst = read_table(path).filter(pc.equal(pc.field("step"), int(np.argmax(cvs))))
    assert pick(mine(worst, config=MineConfig(pos_cv_min=0.75)), "lhs").rule == "positional"  # false positive
    assert pick(mine(worst), "lhs").rule == "dense"
    assert pick(mine(path), "lhs").rule == "dense"


def test_kurtosis_rule_on_heavy_tails_without_channel_structure(tmp_path):
    """A 2% contamination by 8x-wider values: kurtosis ~ 49, spread over every channel (no outlier channel)."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((B, T, C)) * np.where(rng.random((B, T, C)) < 0.02, 8.0, 1.0) for _ in range(3)]
    f = pick(mine(record_arrays(tmp_path / "heavy", xs, tmp_path / "heavy.parquet")), "lhs")
    assert f.signals["kurtosis"] > 20 and f.signals["outlier"] < 6 and f.signals["density"] > 0.99
    assert f.rule == "heavy_tail" and f.guard == "kurtosis > 10" and f.dist == "data"


def test_cascade_order_earlier_rules_win(seven):
    """sparse90 and outlier also have heavy tails (kurtosis > 10), but their own rules come first."""
    paths, _ = seven
    for dist, rule in (("sparse90", "sparse"), ("outlier", "outlier")):
        f = pick(mine(paths[dist]), "lhs")
        assert f.signals["kurtosis"] > 10 and f.rule == rule
    assert [r.name for r in RULES] == [
        "nonfinite", "sparse", "outlier", "levels", "heavy_tail", "concentrated", "coherent", "positional"
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# temporal


def test_fixed_weight_over_16_steps_is_stationary(tmp_path):
    findings = mine(record_dist(tmp_path / "g.parquet", "gaussian", batches=16))
    w, x = pick(findings, "rhs"), pick(findings, "lhs")
    assert w.temporal.steps == 16 and w.temporal.stationary and w.temporal.rule == "stationary"
    assert w.temporal.exploit == "precompute / prepack" and w.temporal.l1_cv < 1e-4
    assert w.temporal.savings is None  # prepacking a weight saves layout work, not FLOPs
    assert not x.temporal.stationary and x.temporal.rule == "drifting" and x.temporal.repeat_share == 0


def test_pool_of_four_inputs_replayed_is_memoized(tmp_path):
    rng = np.random.default_rng(2)
    pool = [rng.standard_normal((B, T, C)) for _ in range(4)]
    path = record_arrays(tmp_path / "pool", [pool[t % 4] for t in range(20)], tmp_path / "pool.parquet")
    f = pick(mine(path), "lhs")
    t = f.temporal
    assert t.rule == "memoize" and not t.stationary and t.repeat_share == pytest.approx(0.8)
    assert f.flop_share == 1.0 and t.savings == pytest.approx(0.8)  # the sidecar has the one site
    assert t.est_speedup == pytest.approx(5.0) and f.rank_score == pytest.approx(0.8)
    assert pick(mine(path), "out").temporal.rule == "memoize"


def test_slow_random_walk_is_delta_compute(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B, T, C))
    walk = []
    for _ in range(12):
        walk.append(x.copy())
        x = x + 0.05 * rng.standard_normal(x.shape)
    f = pick(mine(record_arrays(tmp_path / "walk", walk, tmp_path / "walk.parquet")), "lhs")
    t = f.temporal
    assert t.rule == "delta" and not t.stationary and t.repeat_share == 0
    assert 0.02 < t.drift < 0.1 and t.l1_cv > 1e-4
    assert t.guard == "reldist(elemsig_t, elemsig_t-1) < 0.3" and t.est_speedup > 5


# --------------------------------------------------------------------------------------------
# hand-built tables: every rule's boundary

NEUTRAL = {
    "nnz": [100.0], "nan_count": [0.0], "inf_count": [0.0], "kurtosis": [3.0], "l1": [80.0],
    "hist": [0.0] * 8 + [10.0] * 16 + [0.0] * 8, "chan_maxabs": [1.0] * 8, "pos_sumsq": [1.0] * 8,
    "adj_sumsq": [2.0] * 7, "elemsig": [0.5, -1.0, 2.0, 0.25],
}  # fmt: skip


def table_of(
    steps: list[dict], numel: int = 100, site: str = "s", role: str = "lhs", dims=(8, 8, 8)
) -> pa.Table:
    """A tidy table from per-step {stat: values}: NEUTRAL filled in, then overridden."""
    cols: dict[str, list] = {k: [] for k in ("run_id", "step", "provider", "dist", "M", "K", "N", "numel",
                                             "site", "op_type", "role", "stat", "idx", "value")}  # fmt: skip
    for step, over in enumerate(steps):
        for stat, vals in {**NEUTRAL, **over}.items():
            for i, v in enumerate(vals):
                for k, x in zip(
                    cols, ("r", step, "cpu", "test", *dims, numel, site, "MatMul", role, stat, i, v)
                ):
                    cols[k].append(x)
    return pa.table(cols)


def one(steps: list[dict], cfg: MineConfig | None = None, **kw):
    """The one finding of a hand-built table. These tables hold 100 elements, under the default
    `numel_min`: the size guard is lowered here and tested on its own (`test_size_guards`)."""
    (f,) = mine(table_of(steps, **kw), config=small_ok(cfg))
    return f


def small_ok(cfg: MineConfig | None = None) -> MineConfig:
    return replace(cfg or MineConfig(), numel_min=min((cfg or MineConfig()).numel_min, 64))


def test_size_guards():
    """Below numel_min only NaN/Inf fire; too few channels, rows or counted elements per bin block their rule."""
    strict = MineConfig()  # numel_min 256 > the tables' 100 elements
    (small,) = mine(table_of([{"nnz": [10.0]}]), config=strict)
    assert small.rule == "small" and small.temporal is None and not small.actionable
    (nan,) = mine(table_of([{"nan_count": [1.0]}]), config=strict)
    assert nan.rule == "nonfinite" and nan.actionable
    few = one([{"chan_maxabs": ratio_vector(6.5, n=7)}])  # 7 channels < channels_min 8
    assert few.rule != "outlier" and "outlier (channels 7 < 8)" in few.note
    assert one([{"chan_maxabs": ratio_vector(6.5, n=8)}]).rule == "outlier"
    thin = one([{"hist": [3.0] + [0.0] * 31}])  # 3 counted elements over 32 bins
    assert thin.rule == "dense" and "concentrated (hist_per_bin" in thin.note
    rows = one([{"pos_sumsq": [1.0, 9.0, 1.0, 9.0], "adj_sumsq": [0.1] * 3}])  # 4 rows < rows_min 8
    assert rows.rule == "dense" and "coherent (rows 4 < 8)" in rows.note


def ratio_vector(r: float, n: int = 8) -> list[float]:
    """n channel maxima whose max/mean is exactly r: one channel at a, the others at 1."""
    a = r * (n - 1) / (n - r)
    return [a] + [1.0] * (n - 1)


def cv_vector(c: float) -> list[float]:
    """Ten row energies whose std/|mean| is exactly c (all positive for c < 3)."""
    base = np.array([0.0] * 9 + [1.0])
    z = (base - base.mean()) / base.std()
    return list(1.0 + c * z)


BOUNDARIES = [
    ("nonfinite", lambda e: {"nan_count": [1.0 if e > 0 else 0.0]}, "nonfinite", 1.0),
    ("density", lambda e: {"nnz": [100 * (0.5 + e)]}, "sparse", -0.01),
    ("outlier", lambda e: {"chan_maxabs": ratio_vector(6 + 10 * e)}, "outlier", 0.01),
    ("hist_gaps", lambda e: {"hist": ([10.0, 0.0] * 16) if e > 0 else [10.0] * 32}, "levels", 1.0),
    ("kurtosis", lambda e: {"kurtosis": [10 + 10 * e]}, "heavy_tail", 0.01),
    ("histtop", lambda e: {"hist": [1e3 * (0.25 + e)] + [1e3 * (0.75 - e) / 31] * 31}, "concentrated", 0.01),
    ("adj", lambda e: {"adj_sumsq": [0.5 + e] * 7}, "coherent", -0.01),
    ("pos_cv", lambda e: {"pos_sumsq": cv_vector(1.0 + e)}, "positional", 0.01),
]


@pytest.mark.parametrize("signal,make,rule,eps", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_rule_boundary(signal, make, rule, eps):
    """Just past the threshold the rule fires; just short of it, it does not."""
    fired = one([make(eps)])
    assert fired.rule == rule, fired.signals
    assert fired.signals[signal] == pytest.approx(fired.signals[signal])  # a number, not None
    assert 0.0 <= fired.score <= 1.0 and fired.guard
    missed = one([make(-eps)])
    assert missed.rule != rule, missed.signals


def test_neutral_table_is_dense_and_thresholds_are_configuration():
    f = one([{}])
    assert f.rule == "dense" and f.stability == "n/a" and f.guard == ""
    assert f.signals["density"] == 1.0 and f.signals["adj"] == 2.0 and f.signals["pos_cv"] == 0.0
    assert one([{"nnz": [60.0]}], MineConfig(density_max=0.7)).rule == "sparse"
    assert one([{"nnz": [60.0]}], config_with(overrides=["density_max=0.7"])).guard == "nnz/numel < 0.7"


def test_scores_of_the_reference_rules():
    assert one([{"nnz": [10.0]}]).score == pytest.approx(0.9)
    assert one([{"chan_maxabs": ratio_vector(7.5)}]).score == pytest.approx(0.25)
    assert one([{"adj_sumsq": [0.2] * 7}]).score == pytest.approx(0.8)
    assert one([{"pos_sumsq": cv_vector(1.5)}]).score == pytest.approx(0.5)
    assert one([{"hist": [600.0] + [400 / 31] * 31}]).score == pytest.approx(0.6)


def test_stability_across_steps():
    stable = one([{"nnz": [10.0]}, {"nnz": [11.0]}, {"nnz": [10.5]}])
    assert stable.stability == "stable" and stable.guard_held == 1.0 and stable.stability_sigma < 0.02
    drifting = one([{"nnz": [10.0]}, {"nnz": [45.0]}, {"nnz": [60.0]}])
    assert drifting.rule == "sparse" and drifting.stability == "watch drift"
    assert drifting.guard_held == pytest.approx(2 / 3)
    assert one([{"nnz": [10.0]}]).stability == "single step"
    assert drifting.sigma["density"] == pytest.approx(np.std([0.1, 0.45, 0.6]))


def steps_with(l1: list[float] | None = None, sigs: list[list[float]] | None = None) -> list[dict]:
    n = len(l1 or sigs)
    return [{**({"l1": [l1[i]]} if l1 else {}), **({"elemsig": sigs[i]} if sigs else {})} for i in range(n)]


def test_temporal_boundaries():
    base = np.array([0.5, -1.0, 2.0, 0.25])
    calm = [list(base)] * 4
    # the same values at every step: a weight's place is stationary (prepack), an activation's repeats (memoize)
    assert one(steps_with([80.0] * 4, calm), role="rhs").temporal.rule == "stationary"
    assert one(steps_with([80.0] * 4, calm)).temporal.rule == "memoize"
    # l1 cv just under / over 1e-4 (the elemsig series is different every step: no repeats)
    walk = [list(base * (1 + 0.5 * i)) for i in range(4)]
    for eps, stationary in ((0.9e-4, True), (1.1e-4, False)):
        l1 = list(80.0 * (1 + eps * np.array([1, -1, 1, -1])))
        assert one(steps_with(l1, walk)).temporal.stationary is stationary
    # repeats: 1 of 5 steps repeats (share 0.2, not > 0.2), 2 of 5 do (0.4)
    moving = list(80.0 * np.arange(1, 6))
    scale = [1.0, 2.0, 3.0, 4.0, 5.0]
    one_repeat = [list(base * s) for s in scale[:4]] + [list(base * (1 + 0.9e-3))]
    t = one(steps_with(moving, one_repeat)).temporal
    assert t.repeat_share == pytest.approx(0.2) and t.rule != "memoize"
    two = [list(base * s) for s in scale[:3]] + [list(base), list(base * 2 * (1 + 1e-4))]
    assert one(steps_with(moving, two)).temporal.rule == "memoize"
    near = [list(base * (1 + 1.1e-3))] + [list(base)]
    assert rel_dist(np.array(near[0]), base) > 1e-3
    # drift just under / over 0.3 (relative L2 step to step, no repeats)
    for d, rule in ((0.29, "delta"), (0.31, "drifting")):
        sigs = [list(base * (1 - d) ** i) for i in range(4)]  # ||a - b|| / max(||a||, ||b||) = d
        t = one(steps_with(moving[:4], sigs)).temporal
        assert t.drift == pytest.approx(d) and t.rule == rule


def test_temporal_needs_min_steps():
    assert one([{}, {}]).temporal is None
    assert one([{}, {}, {}]).temporal is not None


def test_signal_helpers():
    assert hist_gaps(np.array([0, 0, 5, 0, 5, 0, 5, 0, 0.0])) == pytest.approx(2 / 5)
    assert hist_gaps(np.array([1.0] * 10)) == 0.0
    assert math.isnan(hist_gaps(np.zeros(8)))
    assert rel_dist(np.zeros(3), np.zeros(3)) == 0.0
    assert rel_dist(np.array([1.0, np.nan]), np.array([1.0, 0.0])) == 0.0
    s = step_signals({"nnz": np.array([5.0])}, None)
    assert math.isnan(s["density"]) and math.isnan(s["outlier"])


# --------------------------------------------------------------------------------------------
# costs, measurement, JSON, printing, CLI


def test_costs_give_flop_share_and_savings():
    t = pa.concat_tables([table_of([{"nnz": [20.0]}], site="a"), table_of([{}], site="b")])
    by_site = {f.site: f for f in mine(t, costs={"a": 3e6, "b": 1e6}, config=small_ok())}
    assert by_site["a"].flop_share == pytest.approx(0.75)
    assert by_site["a"].savings == pytest.approx(0.75 * (1 - 0.2))
    assert by_site["b"].savings is None
    assert mine(t)[0].flop_share is None


def test_rank_follows_impact_and_hides_the_rest(capsys):
    """Impact = score x FLOP share orders the findings: a likely pattern on the big op beats a sure one on
    a small op; NaN/Inf first whatever their share; dense rows are hidden from the terminal with a count."""
    t = pa.concat_tables([
        table_of([{"nnz": [40.0]}], site="big"),  # sparse, score 0.6, share 0.7
        table_of([{"nnz": [5.0]}], site="tiny"),  # sparse, score 0.95, share 0.1
        table_of([{"nan_count": [1.0]}], site="nan"),  # share 0.1
        table_of([{}], site="plain"),  # dense, share 0.1
    ])  # fmt: skip
    costs = {"big": 7e6, "tiny": 1e6, "nan": 1e6, "plain": 1e6}
    found = mine(t, costs=costs, config=small_ok())
    assert [f.site for f in found] == ["nan", "big", "tiny", "plain"]
    big, tiny = found[1], found[2]
    assert big.impact == pytest.approx(0.6 * 0.7) and tiny.impact == pytest.approx(0.95 * 0.1)
    assert big.saves == pytest.approx(0.7 * 0.6) and found[3].saves is None
    print_findings(found)
    out = capsys.readouterr().out
    assert "ranked by impact (score x FLOP share)" in out and "1 finding(s) hidden" in out
    assert "plain" not in out
    print_findings(found, show_all=True)
    assert "plain" in capsys.readouterr().out


def test_measured_speedup_times_real_kernels(tmp_path):
    """The one test that measures: scipy CSR at the site's shape and density against numpy dense."""
    path = record_dist(tmp_path / "s.parquet", "sparse90")
    f = pick(mine(path, measure=True), "lhs")
    assert f.rule == "sparse" and f.measured_speedup > 0 and "scipy CSR" in f.measure_note
    assert "128x64x64" in f.measure_note
    cfg = MineConfig(measure_cap=32, measure_repeats=1)
    g = pick(mine(path, config=cfg, measure=True), "lhs")
    assert "32x32x32 (capped)" in g.measure_note
    dense = pick(mine(path, measure=True), "rhs")
    assert dense.measured_speedup is None and dense.measure_note.startswith("not measured")


def test_findings_json_round_trip(tmp_path, seven):
    paths, _ = seven
    findings = mine(paths["coherent"])
    out = save_findings(findings, tmp_path / "f.json")
    data = json.loads(out.read_text())
    assert data["format"] == "onnx-opscope/findings" and data["config"]["density_max"] == 0.5
    back = load_findings(out)
    assert back == findings
    assert "NaN" not in out.read_text()


def test_load_findings_errors(tmp_path):
    with pytest.raises(OpscopeError, match="no such findings file"):
        load_findings(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(OpscopeError, match="not an onnx-opscope findings file"):
        load_findings(tmp_path / "x.json")


def test_table_errors(tmp_path):
    with pytest.raises(OpscopeError, match="no such table"):
        mine(tmp_path / "none.parquet")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(OpscopeError, match="missing column"):
        mine(bad)
    with pytest.raises(OpscopeError, match="no such threshold"):
        config_with(overrides=["densty_max=1"])
    with pytest.raises(OpscopeError, match="NAME=VALUE"):
        config_with(overrides=["density_max"])
    assert mine(table_of([{}]).slice(0, 0)) == []


def test_pandas_dataframe_input():
    pd = pytest.importorskip("pandas", reason="pandas is the test extra")
    f = mine(pd.DataFrame(table_of([{"nnz": [10.0]}]).to_pylist()), config=small_ok())
    assert f[0].rule == "sparse"


def test_print_findings(seven, capsys):
    _, table = seven
    print_findings(mine(table), top=5)
    out = capsys.readouterr().out
    assert "5 of 21" in out and "sparse GEMM" in out and "delta-compute" in out


def test_cli_mine(seven, tmp_path, capsys):
    paths, _ = seven
    rc = main(["mine", str(paths["sparse90"]), "-o", str(tmp_path / "f.json"), "--top", "2",
               "--set", "density_max=0.2"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "sparse GEMM" in out and "nnz/numel < 0.2" in out
    assert load_findings(tmp_path / "f.json")[0].rule == "sparse"
    assert main(["mine", str(tmp_path / "missing.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no such table" in err and "Traceback" not in err


def test_load_costs_accepts_every_form(tmp_path):
    from onnx_opscope.analysis import analyze
    from onnx_opscope.findings.plan import load_costs

    report = analyze(matmul_model())
    from_report = load_costs(report)
    assert from_report.site_flops == {"mm": 2.0 * B * T * C * C} and from_report.ridge == report.ridge
    assert from_report.ops and from_report.share("mm") == 1.0
    json_path = report.write(tmp_path / "costs.json")
    from_json = load_costs(json_path)
    assert from_json.site_flops == from_report.site_flops and from_json.ridge == report.ridge
    assert load_costs(report.write(tmp_path / "costs.csv")).ops
    (tmp_path / "t.sites.csv").write_text("site,op_type,flops\na,MatMul,30\nb,Conv,\n")
    sidecar = load_costs(None, tmp_path / "t.parquet")
    assert sidecar.site_flops == {"a": 30.0} and sidecar.share("a") == 1.0 and sidecar.share("b") is None
    assert load_costs({"a": 1.0, "b": float("nan")}).site_flops == {"a": 1.0}
    with pytest.raises(OpscopeError, match="no such file"):
        load_costs(tmp_path / "none.json")


def test_measure_without_scipy_says_why_under_the_table(seven, monkeypatch, capsys):
    """`mine --measure` without scipy: the table's meas column is '-', and one line under it says why."""
    from onnx_opscope.findings import plan

    monkeypatch.setattr(plan, "_have_scipy", lambda: False)
    paths, _ = seven
    assert main(["mine", str(paths["sparse90"]), "--measure"]) == 0
    out = capsys.readouterr().out
    assert "meas: not measured: scipy is not installed (pip install 'onnx-opscope[measure]')" in out
