"""The default sketch set, the 'all' set, per-provider histogram counting, and what the miner
says when a rule's sketches were not recorded."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import real_model_path
from test_findings import matmul_model

from onnx_opscope import sketch as sk
from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.findings import RULE_SKETCHES, RULES, unchecked_rules
from onnx_opscope.run import read_table, record
from onnx_opscope.run.feeds import FeedSpec


def test_sets_resolve_in_registry_order():
    assert sk.resolve(None) == list(sk.DEFAULT_SKETCHES)
    assert sk.resolve(["all"]) == list(sk.ALL_SKETCHES)
    assert set(sk.DEFAULT_SKETCHES) < set(sk.ALL_SKETCHES)
    mixed = sk.resolve(["nnz", "default"])
    assert set(mixed) == set(sk.DEFAULT_SKETCHES) | {"nnz"}
    assert mixed == [n for n in sk.REGISTRY if n in mixed]
    with pytest.raises(OpscopeError, match="unknown sketch 'al'.*did you mean 'all'"):
        sk.resolve(["al"])


def test_every_rule_names_the_sketches_it_reads():
    assert set(RULE_SKETCHES) == {r.name for r in RULES}
    assert all(set(need) <= set(sk.ALL_SKETCHES) for need in RULE_SKETCHES.values())


def test_exact_histograms_are_counted_on_the_host_on_cpu_only():
    exact = sk.SketchOptions(hist_mode="exact")
    assert sk.for_providers(exact, ["CPUExecutionProvider"]).exact_counts == "host"
    gpu = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert sk.for_providers(exact, gpu).exact_counts == "graph"
    sampled = sk.SketchOptions()
    cpu = sk.for_providers(sampled, ["CPUExecutionProvider"])
    assert cpu == replace(sampled, copy_out_max=sampled.sample_size)  # small tensors copied out on CPU only
    assert sk.for_providers(sampled, gpu).copy_out_max == 0
    assert sk.for_providers(replace(sampled, copy_out_max=100), gpu).copy_out_max == 100  # a choice stays
    with pytest.raises(ValueError, match="exact_counts"):
        sk.SketchOptions(exact_counts="device")


def test_record_default_set_and_exact_on_cpu(tmp_path, capsys):
    res = record(
        matmul_model(),
        out=tmp_path / "t.parquet",
        feeds=FeedSpec(dist="gaussian", batches=2),
        options=sk.SketchOptions(hist_mode="exact"),
    )
    assert res.manifest.options["exact_counts"] == "host"
    table = read_table(res.table)
    stats = set(table.column("stat").to_pylist())
    assert stats == set(sk.DEFAULT_SKETCHES)
    hist = [r for r in table.to_pylist() if r["stat"] == "hist" and r["step"] == 0]
    numel = {(r["site"], r["role"]): r["numel"] for r in hist}
    counted = {}
    for r in hist:
        counted[(r["site"], r["role"])] = counted.get((r["site"], r["role"]), 0) + r["value"]
    assert counted == {k: float(v) for k, v in numel.items()}  # every element: gaussian data has no NaN
    # the rules whose sketches are opt-in are named, not silently passed over
    missing = unchecked_rules(res.table)
    assert missing == {"sparse": ["nnz"], "outlier": ["chan_maxabs"], "heavy_tail": ["kurtosis"],
                       "coherent": ["adj_sumsq", "pos_sumsq"], "positional": ["pos_sumsq"]}  # fmt: skip
    assert main(["mine", str(res.table)]) == 0
    out = capsys.readouterr().out
    assert "not checked: sparse, outlier, heavy_tail, coherent, positional" in out and "--sketch all" in out


def test_exact_host_counts_come_out_of_nested_ifs(tmp_path):
    """silero's taps sit in nested If branches: the uint8 bin indices cross them (the branch not
    taken returns an empty uint8 tensor) and every element of the branch that ran is counted."""
    res = record(
        real_model_path("silero_vad_v6"),
        out=tmp_path / "vad.parquet",
        feeds=FeedSpec(batches=1, shapes={"input": [1, 512], "state": [2, 1, 128]}, values={"sr": 16000}),
        options=sk.SketchOptions(hist_mode="exact"),
    )
    assert res.manifest.options["exact_counts"] == "host"
    counted: dict = {}
    numel = {}
    for r in read_table(res.table).to_pylist():
        if r["stat"] == "hist":
            key = (r["site"], r["role"])
            counted[key] = counted.get(key, 0.0) + r["value"]
            numel[key] = r["numel"]
    assert len(counted) >= 10 and all(k[0].startswith("If_0/") for k in counted)
    assert counted == {k: float(v) for k, v in numel.items()}


def test_sample_positions_spread_over_every_channel():
    """The sampled histogram's blocks cover the tensor without lining up with its rows: on a
    [512, 256] tensor every channel is sampled, the blocks reach both ends, none repeats."""
    pos = sk.sample_positions(512 * 256, 4096)
    assert pos.size == 4096 and np.unique(pos).size == 4096
    assert set(np.unique(pos % 256)) == set(range(256))
    assert pos.min() < 512 and pos.max() > 512 * 256 - 512
    assert np.array_equal(sk.sample_positions(1000, 4096), np.arange(1000))  # small: every element
    odd = sk.sample_positions(4099 * 3, 4096)  # 16 does not divide n: single elements
    assert odd.size == 4096 and np.unique(odd).size == 4096 and odd.max() < 4099 * 3


def test_references_share_the_finite_view_and_agree_with_each_reference():
    """weights.host_values takes every sketch of a weight at once; the values are each
    sketch's own reference exactly, non-finite values included."""
    x = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    x[3, 5], x[7, 1], x[9, 9] = np.nan, np.inf, -np.inf
    info, o = sk.TapInfo(2), sk.SketchOptions()
    together = sk.references(list(sk.ALL_SKETCHES), x, info, o)
    assert list(together) == list(sk.ALL_SKETCHES)
    for name, got in together.items():
        np.testing.assert_array_equal(got, sk.reference(name, x, info, o), err_msg=name)
    assert together["nan_count"][0] == 1 and together["inf_count"][0] == 2
