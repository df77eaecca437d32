"""`report` and `mine` refuse findings of another table and costs of another model, naming both
identities in one line; files written before the identities existed still work, with a warning."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pyarrow.parquet as pq
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.analysis import analyze
from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.findings import SourceWarning, load_findings, mine, read_findings
from onnx_opscope.findings.plan import load_costs
from onnx_opscope.reporting import report
from onnx_opscope.run import record
from onnx_opscope.run.feeds import FeedSpec


def matmul_model(seed: int) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(seed).standard_normal((32, 32)).astype(np.float32), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 32])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [x], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Models a and b (same graph, other weights), a table of each, findings and costs of each."""
    root = tmp_path_factory.mktemp("identity")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = root / f"{name}.onnx"
        onnx.save(matmul_model(seed), model)
        table = root / f"t{name}.parquet"
        record(model, out=table, feeds=FeedSpec(dist="outlier", batches=2), run_id=f"run-{name}")
        assert main(["mine", str(table), "-o", str(root / f"f{name}.json"), "-q"]) == 0
        for fmt in ("json", "csv", "parquet"):
            assert (
                main(["analyze", str(model), "--format", fmt, "-o", str(root / f"c{name}.{fmt}"), "-q"]) == 0
            )
        sha = json.loads((root / f"t{name}.run.json").read_text())["model_sha256"]
        out[name] = {"model": model, "table": table, "findings": root / f"f{name}.json", "sha": sha}
    out["root"] = root
    return out


def err_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_saved_findings_and_costs_carry_their_source(two):
    a = two["a"]
    findings, source = read_findings(a["findings"])
    assert findings and source["run_ids"] == ["run-a"] and source["model_sha256"] == a["sha"]
    assert source["table"] == "ta.parquet" and source["model"] == str(a["model"])
    root = two["root"]
    assert json.loads((root / "ca.json").read_text())["model_sha256"] == a["sha"]
    assert set(pq.read_table(root / "ca.parquet").column("model_sha256").to_pylist()) == {a["sha"]}
    for fmt in ("json", "csv", "parquet"):
        assert load_costs(root / f"ca.{fmt}").model_sha256 == a["sha"]
    # in memory it is the serialised proto's sha256, the same as its file's when onnx.save wrote the file
    assert analyze(matmul_model(0)).model_sha256 == a["sha"] != two["b"]["sha"]


def test_report_with_findings_of_another_table_is_one_error(two, capsys):
    a, b = two["a"], two["b"]
    out = two["root"] / "wrong.html"
    assert main(["report", str(b["table"]), "--findings", str(a["findings"]), "-o", str(out)]) == 2
    lines = err_lines(capsys)
    assert lines[0].startswith("error: --findings ") and len(lines) == 2 and lines[1].startswith("hint: ")
    for part in ("'run-a'", "'run-b'", a["sha"][:12], b["sha"][:12], "tb.parquet"):
        assert part in lines[0]
    assert not out.exists()
    # the right pairing still works, silently
    good = two["root"] / "good.html"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceWarning)
        assert main(["report", str(a["table"]), "--findings", str(a["findings"]), "-o", str(good), "-q"]) == 0
    assert good.is_file()
    with pytest.raises(OpscopeError, match="another table"):  # the Python API, findings in memory
        report(b["table"], two["root"] / "api.html", findings=mine(a["table"]))


def test_same_run_id_other_model_is_caught_by_the_sha(two, tmp_path, capsys):
    table = tmp_path / "t.parquet"
    record(two["b"]["model"], out=table, feeds=FeedSpec(batches=2), run_id="run-a")  # a's run id, b's model
    out = tmp_path / "r.html"
    assert main(["report", str(table), "--findings", str(two["a"]["findings"]), "-o", str(out)]) == 2
    line = err_lines(capsys)[0]
    assert "'run-a'" in line and two["a"]["sha"][:12] in line and two["b"]["sha"][:12] in line
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_report_and_mine_with_costs_of_another_model_are_one_error(two, capsys, fmt):
    a, b = two["a"], two["b"]
    costs_b = two["root"] / f"cb.{fmt}"
    out = two["root"] / f"wrong_{fmt}.md"
    assert main(["report", str(a["table"]), "--costs", str(costs_b), "-o", str(out)]) == 2
    lines = err_lines(capsys)
    assert lines[0].startswith(f"error: --costs {costs_b} prices another model") and len(lines) == 2
    assert a["sha"][:12] in lines[0] and b["sha"][:12] in lines[0] and str(a["model"]) in lines[0]
    assert (str(b["model"]) in lines[0]) == (fmt == "json")  # CSV / Parquet name the model by its sha256 only
    assert not out.exists() and not (two["root"] / f"wrong_{fmt}_files").exists()
    assert main(["mine", str(a["table"]), "--costs", str(costs_b), "-q"]) == 2
    assert "prices another model" in err_lines(capsys)[0]
    good = two["root"] / f"good_{fmt}.html"
    assert (
        main(["report", str(a["table"]), "--costs", str(two["root"] / f"ca.{fmt}"), "-o", str(good), "-q"])
        == 0
    )
    assert not capsys.readouterr().err


def test_costs_from_another_tables_sidecar(two, capsys):
    sites_b = two["b"]["table"].with_name("tb.sites.csv")
    out = two["root"] / "side.html"
    assert main(["report", str(two["a"]["table"]), "--costs", str(sites_b), "-o", str(out)]) == 2
    assert "prices another model" in err_lines(capsys)[0]
    with pytest.raises(OpscopeError, match="prices another model"):
        report(two["a"]["table"], out, costs=analyze(two["b"]["model"]))  # an analyzer Report in memory


def test_old_files_without_identity_warn_and_still_work(two, tmp_path, capsys):
    a = two["a"]
    old = json.loads(a["findings"].read_text())
    del old["source"]
    old_findings = tmp_path / "old.json"
    old_findings.write_text(json.dumps(old))
    assert len(load_findings(old_findings)) == len(load_findings(a["findings"]))
    costs = json.loads((two["root"] / "cb.json").read_text())  # another model's, but it cannot tell
    del costs["model_sha256"]
    old_costs = tmp_path / "old_costs.json"
    old_costs.write_text(json.dumps(costs))
    out = tmp_path / "r.html"
    args = [
        "report",
        str(a["table"]),
        "--findings",
        str(old_findings),
        "--costs",
        str(old_costs),
        "-o",
        str(out),
    ]
    with pytest.warns(SourceWarning) as caught:  # the CLI prints each as one "warning: ..." line
        assert main(args) == 0 and out.is_file()
    lines = [str(w.message) for w in caught]
    assert len(lines) == 2 and not err_lines(capsys)
    assert any("old_costs.json" in line and "not checked" in line for line in lines)
    assert any("old.json" in line and "run id only" in line for line in lines)
    # an old findings file of another table is still caught by its run ids
    b_run = old | {"findings": [f | {"run_id": "run-b"} for f in old["findings"]]}
    old_findings.write_text(json.dumps(b_run))
    assert (
        main(["report", str(a["table"]), "--findings", str(old_findings), "-o", str(tmp_path / "x.html")])
        == 2
    )
    assert "'run-b'" in err_lines(capsys)[0]
