"""The README's first command: `opscope demo` runs the whole loop with no arguments, and says what it
found from its own run, never what it hoped to find."""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter

import pytest

from onnx_opscope.cli import build_parser, main
from onnx_opscope.findings import load_findings
from onnx_opscope.run import read_table


def _counts(text: str) -> dict[str, int]:
    """'5 heavy_tail, 1 concentrated' -> {'heavy_tail': 5, 'concentrated': 1}."""
    return {rule: int(n) for n, rule in re.findall(r"(\d+) (\w+)", text)}


def test_demo_runs_the_whole_loop_and_says_what_it_found(tmp_path, capsys):
    assert main(["demo", "-o", str(tmp_path), "--batches", "3"]) == 0
    out = capsys.readouterr().out
    for stage in ("analyze", "record", "mine", "report"):
        assert stage in out
    table = read_table(tmp_path / "sketches.parquet")
    assert set(table.column("step").to_pylist()) == {0, 1, 2}
    saved = json.loads((tmp_path / "findings.json").read_text())["findings"]
    # The demo feeds inputs with outlier channels; after the block's LayerNorm they show as heavy
    # tails (or outlier channels) on the q/k/v projections' input.
    q_lhs = [f for f in saved if f["site"].endswith("q_proj/matmul") and f["role"] == "lhs"]
    assert q_lhs and q_lhs[0]["rule"] in ("outlier", "heavy_tail"), q_lhs

    # the mine line counts what findings.json holds, rule by rule, from the saved dicts themselves
    line = re.search(r"^mine: found: (.*)$", out, re.M).group(1)
    want = Counter(
        f["rule"]
        for f in saved
        if f["rule"] not in ("dense", "small") and not f["exploit"].startswith("none")
    )
    temporal = Counter(f["temporal"]["rule"] for f in saved if f["temporal"]
                       and f["temporal"]["rule"] in ("stationary", "memoize", "delta"))  # fmt: skip
    head, *middle, idle = line.split("; ")
    assert _counts(head) == dict(want), line
    assert _counts(" ".join(middle).removeprefix("across steps: ")) == dict(temporal), line
    actionable = sum(f.actionable for f in load_findings(tmp_path / "findings.json"))
    assert idle.startswith(f"{len(saved) - actionable} of {len(saved)} tensors with nothing to act on"), line
    # no promise the run did not keep: 'outlier channels' only if the outlier rule fired
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    helptext = capsys.readouterr().out
    said = (out + helptext).replace("\n", " ")
    assert ("outlier channels" in said) == ("outlier" in want), said
    # its next step is a real command
    nxt = re.search(r"^next: \w+ .*?\): (opscope .*)$", out, re.M)
    assert nxt, out
    args, extra = build_parser().parse_known_args(shlex.split(nxt.group(1))[1:])
    assert not extra and args.command in ("rewrite", "mine", "calibrate", "record")

    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3 and "Summary: what to do next" in html
    assert json.loads((tmp_path / "costs.json").read_text())["records"]
