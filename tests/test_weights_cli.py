"""`opscope weights` and `opscope rewrite weights`, and `plan_weights` behind them: probes in every
table format, plans per budget applied and scored end to end, and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import generated_model_path, real_model_path

import onnx_opscope
from onnx_opscope.cli import main
from onnx_opscope.run import FeedSpec


@pytest.mark.parametrize("storable", [False, True])
def test_plan_weights_each_budget_checked_and_the_smallest_passing_recommended(storable):
    path = generated_model_path("transformer_tiny_lm")
    plans = onnx_opscope.plan_weights(
        path, budgets=(0.6, 0.35, 0.2), storable=storable, feeds=FeedSpec(batches=2)
    )
    assert [b.budget for b in plans.budgets] == [0.6, 0.35, 0.2]
    for b in plans.budgets:
        assert b.plan["bytes"] <= b.budget * plans.dense_bytes
        assert b.dado["error"] <= b.greedy["error"] + 1e-6
        assert b.plan["error"] == pytest.approx(min(b.dado["error"], b.greedy["error"]))
        if storable:  # the file shrinks as planned
            assert b.stored_bytes == b.plan["bytes"]
        assert 0 < b.quality["cosine"] <= 1 + 1e-9 and b.quality["top5"] is not None
    passing = [b.budget for b in plans.budgets if plans.passes(b)]
    rec = plans.recommended
    assert (rec is None) == (not passing) and (rec is None or rec.budget == min(passing))
    doc = plans.to_dict()
    assert doc["recommended_budget"] == (rec.budget if rec else None)
    assert len(doc["menus"]) == len(doc["layers"]) and doc["frontier"][0]["passes"] == plans.passes(
        plans.budgets[0]
    )


def test_cli_weights_tables_read_by_pandas_polars_duckdb(tmp_path, capsys):
    import duckdb  # the test extra's readers: a missing one is a failure, not a skip
    import pandas as pd
    import polars as pl

    model = real_model_path("captcha_crnn")
    out = tmp_path / "probes.parquet"
    assert main(["weights", str(model), "--format", "parquet", "-o", str(out), "-q"]) == 0
    frames = [
        pd.read_parquet(out),
        pl.read_parquet(out).to_pandas(),
        duckdb.sql(f"select * from '{out}'").df(),
    ]
    expect = {p.name: p for p in onnx_opscope.probe_weights(model)}
    for df in frames:
        assert set(df["name"]) == set(expect) and len(df) == len(expect)
        row = df.set_index("name").loc["lstm_fwd.cell.weight_ih"]
        assert row["stable_rank"] == pytest.approx(expect["lstm_fwd.cell.weight_ih"].stable_rank)
    assert main(["weights", str(model), "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(expect) + 1 and "stable_rank" in lines[0]
    assert main(["weights", str(model), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "largest first" in text and "hints:" in text and "lstm_fwd.cell.weight_ih" in text


def test_cli_plan_then_rewrite_weights(tmp_path, capsys):
    model = generated_model_path("transformer_tiny_lm")
    plan, small = tmp_path / "plan.json", tmp_path / "small.onnx"
    args = [
        "weights",
        str(model),
        "--plan",
        str(plan),
        "--budgets",
        "0.5,0.3",
        "--batches",
        "2",
        "--storable",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "greedy err" in printed and "opscope rewrite weights" in printed
    doc = json.loads(plan.read_text())
    assert [f["budget"] for f in doc["frontier"]] == [0.5, 0.3] and doc["storable"] is True
    assert (
        main(["rewrite", "weights", str(model), "--plan", str(plan), "-o", str(small), "--batches", "2"]) == 0
    )
    printed = capsys.readouterr().out
    assert "weight plan:" in printed and "top-5" in printed
    dense = sum(t.ByteSize() for t in onnx.load(model).graph.initializer)
    stored = sum(t.ByteSize() for t in onnx.load(small).graph.initializer)
    assert stored < dense  # storable: the file really shrinks
    ref = onnx_opscope.apply_weight_plan(model, doc)[0]
    got = onnx.load(small)
    assert [t.name for t in ref.graph.initializer] == [t.name for t in got.graph.initializer]
    np.testing.assert_array_equal(
        onnx.numpy_helper.to_array(ref.graph.initializer[0]),
        onnx.numpy_helper.to_array(got.graph.initializer[0]),
    )


def test_cli_weights_bad_input_is_one_line(tmp_path, capsys):
    model = generated_model_path("mlp")
    for args, message in [
        (["weights", str(model), "--budgets", "0.5,x"], "expected comma-separated numbers"),
        (["weights", str(model), "--format", "parquet"], "needs -o FILE"),
        (["weights", str(tmp_path / "missing.onnx")], "missing.onnx"),
        (["weights", str(model), "--plan", str(tmp_path / "p.json"), "--budgets", "1.5"], "in (0, 1]"),
        (["rewrite", "weights", str(model), "--plan", str(tmp_path / "none.json"), "-o", str(tmp_path / "o.onnx")],
         "cannot read the plan"),
    ]:  # fmt: skip
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": [{"weight": "nope", "option": {"kind": "int8_channel"}}]}))
    assert main(["rewrite", "weights", str(model), "--plan", str(bad), "-o", str(tmp_path / "o.onnx")]) == 2
    assert "not a float weight" in capsys.readouterr().err and not (tmp_path / "o.onnx").exists()
    with pytest.raises(SystemExit):
        main(["weights", "--help"])
    assert "examples:" in capsys.readouterr().out
