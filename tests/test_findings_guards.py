"""The miner's guards: minimum sample sizes per rule, norms fixed by construction, what repeats.

Hand-built series check each guard at its boundary; recorded tables of zoo and real models check
the cases issue 17 names (a softmax output feeding the attention MatMul, an 8-element router output,
the tiny tensors of a real VAD model).
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from conftest import real_model_path

from onnx_opscope import FeedSpec, MineConfig, mine, record, zoo
from onnx_opscope.findings.miner import fixed_norm
from onnx_opscope.findings.signals import hist_peak, persistent_outlier
from onnx_opscope.sites import Selection

COLUMNS = ("run_id", "step", "provider", "dist", "M", "K", "N", "numel", "site", "op_type", "role", "stat", "idx",
           "value")  # fmt: skip
GAUSS_HIST = [1, 2, 5, 12, 25, 47, 80, 124, 177, 233, 285, 324, 343, 338, 310, 264, 210, 155, 106, 67, 39, 21,
              10, 5, 2, 1, 1, 0, 0, 0, 0, 0]  # fmt: skip


def table(steps: list[dict], numel: int = 4096, role: str = "lhs", dims=(64, 64, 64)) -> pa.Table:
    """A tidy table of one (site, role): one {stat: values} per step, numel elements each."""
    cols: dict[str, list] = {k: [] for k in COLUMNS}
    for step, stats in enumerate(steps):
        for stat, values in stats.items():
            for i, v in enumerate(values):
                row = ("r", step, "cpu", "test", *dims, numel, "s", "MatMul", role, stat, i, float(v))
                for k, x in zip(COLUMNS, row):
                    cols[k].append(x)
    return pa.table(cols)


def one(steps: list[dict], cfg: MineConfig | None = None, **kw):
    (f,) = mine(table(steps, **kw), config=cfg)
    return f


def test_below_numel_min_only_nan_and_inf_fire():
    loud = {"nnz": [5.0], "hist": [9.0, 0.0] * 16, "kurtosis": [80.0], "nan_count": [0.0], "inf_count": [0.0]}
    f = one([loud] * 4, numel=100)
    assert f.rule == "small" and f.exploit.startswith("none") and f.temporal is None and not f.actionable
    assert f.signals["density"] == pytest.approx(0.05)  # the evidence is kept, the verdict is not given
    assert one([loud] * 4, numel=256).rule == "sparse"  # numel_min itself is enough
    assert one([{**loud, "nan_count": [1.0]}], numel=8).rule == "nonfinite"


def test_histogram_rules_need_counted_elements_per_bin():
    thin = one([{"hist": [2.0, 0.0] * 16}])  # 32 counted elements over 32 bins: 1 per bin < 4
    assert thin.rule == "dense" and "levels (hist_per_bin 1 < 4)" in thin.note
    assert one([{"hist": [8.0, 0.0] * 16}]).rule == "levels"  # 4 per bin
    spike = [0.0] * 31 + [3.0]
    assert "concentrated (hist_per_bin" in one([{"hist": spike}]).note


def test_outlier_needs_channels_and_values_per_channel():
    loud = [75.0] + [1.0] * 15  # max/mean 13.3 over 16 channels
    assert one([{"chan_maxabs": loud}]).rule == "outlier"
    few = one([{"chan_maxabs": [100.0] + [1.0] * 6}])  # max/mean 6.6 over 7 channels (at most 7 there)
    assert few.signals["outlier"] > 6 and few.rule == "dense" and "outlier (channels 7 < 8)" in few.note
    shallow = one([{"chan_maxabs": loud}], numel=64)  # 16 channels of 4 values each
    assert shallow.signals["rows"] == 4 and shallow.rule == "small"
    shallow = one([{"chan_maxabs": loud}], numel=64, cfg=MineConfig(numel_min=16))
    assert shallow.rule == "dense" and "outlier (rows 4 < 8)" in shallow.note


def test_outlier_channels_must_stay_the_same_across_steps():
    """A heavy tail puts its largest value in another channel each batch; outlier channels stay."""
    moving = [{"chan_maxabs": np.roll([40.0] + [3.0] * 15, k)} for k in range(3)]
    f = one(moving)
    assert f.rule != "outlier" and f.signals["outlier"] == pytest.approx(1.0)
    fixed = one([{"chan_maxabs": [40.0] + [3.0] * 15}] * 3)
    assert fixed.rule == "outlier" and fixed.signals["outlier"] == pytest.approx(40 / (85 / 16))
    assert math.isnan(persistent_outlier([np.ones(4)]))  # one step: no verdict of its own


def test_row_rules_need_rows_and_channels():
    few_rows = one([{"pos_sumsq": [1.0, 1.1, 1.2, 1.3], "adj_sumsq": [0.01] * 3}])
    assert few_rows.rule == "dense" and "coherent (rows 4 < 8)" in few_rows.note
    assert one([{"pos_sumsq": [1.0] * 16, "adj_sumsq": [0.01] * 15}]).rule == "coherent"
    loud = [1.0] * 14 + [30.0, 30.0]  # pos_cv 2.3
    assert one([{"pos_sumsq": loud, "chan_maxabs": [1.0] * 16}]).rule == "positional"
    thin = one([{"pos_sumsq": loud, "chan_maxabs": [1.0] * 3}])  # a row energy over 3 channels is noise
    assert thin.rule == "dense" and "positional (channels 3 < 8)" in thin.note


def test_concentrated_needs_a_pile_on_one_value():
    """Rows of two scales pile half their values in the two middle bins: peaked, not one value."""
    peaked = [0.0] * 13 + [40.0, 300.0, 900.0, 900.0, 300.0, 40.0] + [0.0] * 13
    f = one([{"hist": peaked}])
    assert f.signals["histtop"] > 0.25 and f.signals["hist_peak"] == pytest.approx(1.0)
    assert f.rule == "dense" and "concentrated (hist_peak 1 < 2)" in f.note
    piled = list(GAUSS_HIST)
    piled[17] += 1500  # a saturation level
    g = one([{"hist": piled}])
    assert g.rule == "concentrated" and g.signals["hist_peak"] > 3
    assert g.guard == "max(hist)/sum(hist) > 0.25 and max(hist) >= 2 x the fuller bin beside it"
    assert hist_peak(np.array(GAUSS_HIST, float)) == pytest.approx(343 / 338)
    assert hist_peak(np.array([0.0, 5.0, 0.0])) == pytest.approx(1e6)  # empty neighbours: a millionth


def test_fixed_norm_is_no_stationarity_verdict():
    """Rows that sum to 1 have l1 = numel / row length at every step, whatever the input."""
    numel, d = 4096, 64
    sigs = [[0.1, 0.3, 0.2, 0.4], [0.3, 0.1, 0.4, 0.2], [0.2, 0.2, 0.1, 0.5], [0.4, 0.1, 0.3, 0.2]]
    f = one([{"l1": [numel / d], "elemsig": s} for s in sigs])
    assert f.temporal.rule != "stationary" and not f.temporal.stationary and f.temporal.l1_cv < 1e-12
    assert "l1 = numel/64: fixed by construction" in f.note
    assert fixed_norm(numel / d * (1 + 5e-5), numel, (64, 64, 64), 1e-4) == 64
    assert fixed_norm(numel / d * (1 + 5e-4), numel, (64, 64, 64), 1e-4) is None
    w = one([{"l1": [123.4], "elemsig": sigs[0]}] * 4, role="rhs")  # a weight: constant, not normalised
    assert w.temporal.rule == "stationary" and w.temporal.stationary


def test_a_norm_that_stands_still_by_chance_is_no_stationarity_verdict():
    """The l1 of 1e8 fresh Gaussian values moves by sqrt(Var|x| / n) / E|x| = 7.6e-5 per batch: below
    stationary_cv 1e-4, and no sign that the values stand still."""
    n = 10**8
    sigs = [[0.1, -0.3, 0.2], [0.3, 0.1, -0.4], [-0.2, 0.2, 0.1], [0.4, -0.1, 0.3]]
    wobble = (6e-5, -4e-5, 3e-5, -5e-5)
    steps = [{"l1": [0.798 * n * (1 + e)], "sumsq": [float(n)], "elemsig": s} for e, s in zip(wobble, sigs)]
    f = one(steps, numel=n)
    assert f.temporal.l1_cv < 1e-4 and f.temporal.rule != "stationary"
    assert "as much as 100000000 fresh values do by chance (7.6e-05)" in f.note
    weight = one([{"l1": [0.798 * n], "sumsq": [float(n)], "elemsig": sigs[0]}] * 4, numel=n, role="rhs")
    assert weight.temporal.rule == "stationary"  # a constant stands exactly still


def test_the_same_values_at_every_step_are_memoize_for_an_activation():
    same = [{"l1": [123.4], "elemsig": [0.5, -1.0, 2.0, 0.25]}] * 5
    act = one(same)
    assert act.temporal.rule == "memoize" and act.temporal.repeat_share == pytest.approx(0.8)
    assert not act.temporal.stationary and act.actionable
    assert one(same, role="rhs").temporal.rule == "stationary"  # the operand a kernel prepacks


def test_all_zero_fingerprints_neither_repeat_nor_stand_still():
    """16 positions that all fall on zeros of a sparse tensor say nothing about the steps."""
    steps = [{"l1": [100.0 + 7 * k], "elemsig": [0.0] * 16} for k in range(5)]
    t = one(steps).temporal
    assert t.repeat_share == 0 and t.drift is None and t.rule == "drifting"


# --------------------------------------------------------------------------------------------
# recorded tables


def _record(model, tmp_path, name: str, feeds: FeedSpec, sites: Selection | None = None):
    out = record(
        model, out=tmp_path / f"{name}.parquet", feeds=feeds, sketches=["all"], sites=sites, run_id=name
    )
    return mine(out.table)


def test_softmax_output_feeding_attention_gets_no_stationary_verdict(tmp_path):
    findings = _record(
        zoo.transformer_block(), tmp_path, "block", FeedSpec(dims={"batch": 2, "seq": 16}, batches=4)
    )
    probs = next(f for f in findings if f.site == "block/attn/av_matmul" and f.role == "lhs")
    assert probs.numel == 2 * 4 * 16 * 16 and probs.temporal.l1_cv < 1e-4  # rows sum to 1 at every step
    assert probs.temporal.rule != "stationary" and "fixed by construction" in probs.note
    weight = next(f for f in findings if f.site == "block/attn/q_proj/matmul" and f.role == "rhs")
    assert weight.temporal.rule == "stationary"


def test_eight_element_router_output_is_small(tmp_path):
    findings = _record(zoo.moe(), tmp_path, "moe", FeedSpec(dims={"tokens": 1}, batches=4))
    router = next(f for f in findings if f.site == "router/matmul" and f.role == "out")
    assert router.numel == 8 and router.rule == "small" and router.temporal is None
    assert not router.actionable and router.exploit.startswith("none")
    weight = next(f for f in findings if f.site == "router/matmul" and f.role == "rhs")  # 32 x 8
    assert weight.rule != "small"


def test_real_models_tiny_tensors_get_no_verdict(tmp_path):
    """silero_vad's decoder works on a few dozen elements: none of them gets a rule or a step verdict."""
    feeds = FeedSpec(shapes={"input": [1, 512], "state": [2, 1, 128]}, values={"sr": 16000}, batches=4)
    findings = [
        f for f in _record(real_model_path("silero_vad_v6"), tmp_path, "vad", feeds) if f.kind == "gemm"
    ]
    tiny = [f for f in findings if f.numel is not None and f.numel < MineConfig().numel_min]
    assert len(tiny) >= 4 and {f.rule for f in tiny} == {"small"} and all(f.temporal is None for f in tiny)
    assert any(f.rule != "small" for f in findings if f.numel >= MineConfig().numel_min)


def test_real_softmax_output_gets_no_stationary_verdict(tmp_path):
    feeds = FeedSpec(shapes={"x": [1, 3, 48, 320]}, batches=4)
    findings = _record(
        real_model_path("ppocrv4_rec"), tmp_path, "rec", feeds, Selection(names=("p2o.MatMul.4",))
    )
    probs = next(f for f in findings if f.role == "lhs")  # softmax_9.tmp_0, the attention probabilities
    assert probs.temporal.l1_cv < 1e-4 and probs.temporal.rule != "stationary"
    assert "fixed by construction" in probs.note
