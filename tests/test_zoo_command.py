"""`opscope zoo` and `analysis.survey`: one row per model of a folder or a list, failures as rows, on Ray too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import generated_model_path

from onnx_opscope import cli
from onnx_opscope.analysis import analyze
from onnx_opscope.analysis.survey import survey
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run import FeedSpec, RuntimeConfig, read_table
from onnx_opscope.run.engine import Engine

VOLATILE = {"seconds", "record_seconds", "record_table"}  # time, and the folder each run was given


@pytest.fixture
def zoo(tmp_path: Path) -> Path:
    """zoo/: bad.onnx (garbage), cnn.onnx, mlp.onnx, sub/if_model.onnx, and zoo.txt listing some of them."""
    folder = tmp_path / "zoo"
    (folder / "sub").mkdir(parents=True)
    for name in ("mlp", "cnn"):
        shutil.copy(generated_model_path(name), folder / f"{name}.onnx")
    shutil.copy(generated_model_path("if_model"), folder / "sub" / "if_model.onnx")
    (folder / "bad.onnx").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "zoo.txt").write_text(
        "# a comment, then a blank line\n\n../zoo/sub/if_model.onnx\n  ../zoo/mlp.onnx  \n../zoo/missing.onnx\n"
    )
    return folder


def _ok_rows(result) -> dict[str, dict]:
    return {r["model"]: r for r in result.table.to_pylist() if r["status"] == "ok"}


def test_folder_rows_in_order_with_analyze_totals(zoo: Path) -> None:
    calls: list[tuple[int, int]] = []
    result = survey(zoo, progress=lambda done, total: calls.append((done, total)))
    models = result.table.column("model").to_pylist()
    assert models == [str(zoo / n) for n in ("bad.onnx", "cnn.onnx", "mlp.onnx", "sub/if_model.onnx")]
    assert result.table.column("status").to_pylist() == ["failed", "ok", "ok", "ok"]
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    bad = result.table.to_pylist()[0]
    assert "not an ONNX model" in bad["error"] and bad["flops_expr"] is None
    assert result.failed == [(str(zoo / "bad.onnx"), bad["error"])] and result.ok == 3
    for model, row in _ok_rows(result).items():
        totals = analyze(model).totals
        assert row["error"] is None
        assert row["flops"] == totals["flops"] and row["flops_expr"] == totals["flops_expr"]
        assert row["nodes"] == totals["nodes"] and row["params"] == totals["params"]
        assert row["weight_bytes"] == totals["weights_unique_bytes"] and row["symbols"] == "batch"
    # the feed's --dim gives the symbol a value: the FLOPs become analyze's numbers
    sized = survey(zoo, feeds=FeedSpec(dims={"batch": 4}))
    for model, row in _ok_rows(sized).items():
        expected = analyze(model, dims={"batch": 4}).totals["flops"]
        assert expected is not None and expected > 0
        assert row["flops"] == expected
    assert len({row["flops"] for row in _ok_rows(sized).values()}) == 3


def test_list_file_paths_relative_to_it(zoo: Path) -> None:
    listing = zoo.parent / "lists" / "zoo.txt"
    rows = survey(listing).table.to_pylist()
    assert [Path(r["model"]).resolve() for r in rows] == [
        (zoo / n).resolve() for n in ("sub/if_model.onnx", "mlp.onnx", "missing.onnx")
    ]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert rows[2]["error"] == "no such file"
    # a list of paths: as given, in that order
    paths = [zoo / "mlp.onnx", zoo / "bad.onnx"]
    table = survey(paths).table
    assert table.column("model").to_pylist() == [str(p) for p in paths]
    assert table.column("status").to_pylist() == ["ok", "failed"]


def test_bad_zoo_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "comments.txt").write_text("# nothing\n\n")
    cases = {
        tmp_path / "empty": "no .onnx file",
        tmp_path / "nope.txt": "no such file or folder",
        tmp_path / "comments.txt": "names no model",
    }
    for given, words in cases.items():
        with pytest.raises(OpscopeError, match=words):
            survey(given)
    with pytest.raises(OpscopeError, match="empty"):
        survey([])
    with pytest.raises(OpscopeError, match="out_dir"):
        survey([generated_model_path("mlp")], record=True)


def test_record_writes_one_table_per_model(zoo: Path, tmp_path: Path) -> None:
    # two models with the same stem in different folders: each gets its own table
    (zoo / "other").mkdir()
    shutil.copy(zoo / "cnn.onnx", zoo / "other" / "mlp.onnx")
    out = tmp_path / "runs"
    result = survey(
        [zoo / "mlp.onnx", zoo / "other" / "mlp.onnx"], record=True, out_dir=out, feeds=FeedSpec(batches=3)
    )
    rows = result.table.to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["error"] for r in rows]
    assert [Path(r["record_table"]).name for r in rows] == ["mlp.parquet", "mlp-2.parquet"]
    for row in rows:
        table = read_table(row["record_table"])
        assert Path(row["record_table"]).parent == out
        assert row["record_batches"] == 3 and sorted(set(table.column("step").to_pylist())) == [0, 1, 2]
        assert table.num_rows == row["record_rows"] > 0 and row["record_sites"] > 0
    assert rows[0]["record_rows"] != rows[1]["record_rows"]  # the mlp's table and the cnn's, not one twice


def test_zoo_wide_dims_apply_where_the_symbol_is(zoo: Path, tmp_path: Path) -> None:
    # moe's input is x[tokens, 32], with no `batch`: to it, --dim batch=4 is not an error but someone else's
    shutil.copy(generated_model_path("moe"), zoo / "moe.onnx")
    paths = [zoo / "mlp.onnx", zoo / "moe.onnx"]
    feeds = FeedSpec(batches=2, dims={"batch": 4, "bacth": 2})
    with pytest.warns(UserWarning, match="--dim bacth: no model has an input dim named 'bacth'"):
        result = survey(paths, record=True, out_dir=tmp_path / "runs", feeds=feeds)
    mlp, moe = result.table.to_pylist()
    assert (mlp["status"], moe["status"]) == ("ok", "ok"), (mlp["error"], moe["error"])
    assert mlp["flops"] == analyze(paths[0], dims={"batch": 4}).totals["flops"] is not None
    assert moe["flops"] is None and moe["flops_expr"] == analyze(paths[1]).totals["flops_expr"]
    assert (mlp["symbols"], moe["symbols"]) == (None, "tokens") and moe["record_rows"] > 0
    assert "_used" not in result.table.column_names
    # a --shape goes to the models with that input, and one it does not fit is that model's failure
    mlp, moe = survey(paths, feeds=FeedSpec(shapes={"x": [3, 64]})).table.to_pylist()
    assert mlp["flops"] == analyze(paths[0], {"x": [3, 64]}).totals["flops"] is not None
    assert moe["status"] == "failed" and "x" in moe["error"]


def _opscope(argv: list[str], monkeypatch) -> int:
    if "zoo" not in cli.COMMANDS:  # until the command is registered with the others
        monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, "zoo"])
    return cli.main(argv)


def test_cli_exit_codes_and_table(zoo: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert _opscope(["zoo", str(zoo)], monkeypatch) == 1
    out = capsys.readouterr().out
    for name in ("bad.onnx", "cnn.onnx", "mlp.onnx", "if_model.onnx"):
        assert name in out
    assert "failed" in out and "not an ONNX model" in out and "4 models, 3 ok, 1 failed" in out
    assert analyze(zoo / "cnn.onnx").totals["flops_expr"] in out

    (zoo / "bad.onnx").unlink()
    target = tmp_path / "zoo.parquet"
    assert _opscope(["zoo", str(zoo), "-o", str(target), "--dim", "batch=2"], monkeypatch) == 0
    assert "3 models, 3 ok, 0 failed" in capsys.readouterr().err
    written = pq.read_table(target)
    assert written.column("status").to_pylist() == ["ok"] * 3
    assert written.column("flops").to_pylist() == [
        analyze(zoo / n, dims={"batch": 2}).totals["flops"]
        for n in ("cnn.onnx", "mlp.onnx", "sub/if_model.onnx")
    ]

    assert _opscope(["zoo", str(zoo / "mlp.onnx"), "--format", "json"], monkeypatch) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["model"] == str(zoo / "mlp.onnx") and row["status"] == "ok"

    (tmp_path / "empty").mkdir()
    for argv in (
        ["zoo", str(tmp_path / "empty")],
        ["zoo", str(tmp_path / "no-such-list.txt")],
        ["zoo", str(zoo), "--format", "parquet"],
        ["zoo", str(zoo), "--workers", "2"],
    ):
        assert _opscope(argv, monkeypatch) == 2, argv
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "Traceback" not in err


@pytest.fixture
def ray_cluster():
    import ray  # in the test extra: missing, it fails here

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_ray_table_equals_local(zoo: Path, tmp_path: Path, ray_cluster, monkeypatch) -> None:
    options = dict(record=True, feeds=FeedSpec(batches=2), runtime=RuntimeConfig(threads=1))
    local = survey(zoo, out_dir=tmp_path / "local", **options)
    calls: list[tuple[int, int]] = []
    on_ray = survey(
        zoo, engine=Engine("ray"), out_dir=tmp_path / "ray", progress=lambda *a: calls.append(a), **options
    )
    assert on_ray.engine == "ray" and calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert on_ray.table.schema == local.table.schema
    keep = [c for c in local.table.column_names if c not in VOLATILE]
    assert on_ray.table.select(keep).to_pylist() == local.table.select(keep).to_pylist()
    assert on_ray.table.column("status").to_pylist() == ["failed", "ok", "ok", "ok"]
    for a, b in zip(local.table.to_pylist(), on_ray.table.to_pylist()):
        if a["status"] != "ok":
            continue
        assert Path(b["record_table"]).parent == tmp_path / "ray"
        ta, tb = read_table(a["record_table"]), read_table(b["record_table"])
        cols = [c for c in ta.column_names if c != "run_id"]
        assert tb.select(cols).to_pylist() == ta.select(cols).to_pylist()

    # tasks that finish out of order (the last one running first, each time) still give rows in listed order
    real_wait = ray_cluster.wait

    def last_first(refs, num_returns=1, **kwargs):
        real_wait(refs, num_returns=len(refs), **kwargs)
        return [refs[-1]], list(refs[:-1])

    monkeypatch.setattr(ray_cluster, "wait", last_first)
    shuffled = survey(zoo, engine=Engine("ray", workers=2))
    cols = [c for c in shuffled.table.column_names if c not in VOLATILE]
    assert shuffled.table.select(cols).to_pylist() == local.table.select(cols).to_pylist()
