"""The README's first command: `opscope demo` runs the whole loop with no arguments."""

from __future__ import annotations

import json

from onnx_opscope.cli import main
from onnx_opscope.run import read_table


def test_demo_runs_the_whole_loop(tmp_path, capsys):
    assert main(["demo", "-o", str(tmp_path), "--batches", "3"]) == 0
    out = capsys.readouterr().out
    for stage in ("analyze", "record", "mine", "report"):
        assert stage in out
    table = read_table(tmp_path / "sketches.parquet")
    assert set(table.column("step").to_pylist()) == {0, 1, 2}
    findings = json.loads((tmp_path / "findings.json").read_text())
    # The demo feeds inputs with outlier channels; after the block's LayerNorm they show as heavy
    # tails (or outlier channels) on the q/k/v projections' input.
    q_lhs = [f for f in findings["findings"] if f["site"].endswith("q_proj/matmul") and f["role"] == "lhs"]
    assert q_lhs and q_lhs[0]["rule"] in ("outlier", "heavy_tail"), q_lhs
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3
    assert json.loads((tmp_path / "costs.json").read_text())["records"]
