"""Recording end to end: the CLI on generated and real models, the table against numpy, interruptions."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, generated_model_path, real_model_path

from onnx_opscope import sketch as sk
from onnx_opscope.cli import main
from onnx_opscope.compare import check_drop_in
from onnx_opscope.instrument import Manifest
from onnx_opscope.run import read_table, record, sidecar_paths
from onnx_opscope.run.feeds import FeedSpec, iter_feeds
from onnx_opscope.run.session import ProviderFallbackWarning, RuntimeConfig, make_session, run

REAL_FEEDS = {
    "ppocrv4_rec": ["--shape", "x:1,3,48,320"],
    "ppocrv4_det": ["--shape", "x:1,3,64,96"],
    "silero_vad_v6": ["--shape", "input:1,512", "--shape", "state:2,1,128", "--value", "sr:16000"],
    "captcha_crnn": ["--shape", "image:1,3,60,160"],
    "magika_standard_v3_3": ["--shape", "bytes:1,2048"],
}


def check_table_against_manifest(table, manifest: Manifest, steps: int) -> None:
    """Every step has every main-graph (site, role) of the manifest, each with exactly its sketches, with the
    row counts the sketch and the run-time numel imply; subgraph sites appear whole or not at all."""
    opts = manifest.sketch_options()
    taps = {t.id: t for t in manifest.taps}
    cols = [table.column(c).to_pylist() for c in ("step", "site", "role", "stat", "numel")]
    counts: dict[tuple, int] = {}
    numel: dict[tuple, int] = {}
    for step, site, role, stat, n in zip(*cols):
        counts[(step, site, role, stat)] = counts.get((step, site, role, stat), 0) + 1
        numel[(step, site, role)] = n
    assert {k[0] for k in counts} == set(range(steps))
    for step in range(steps):
        ran = {(k[1], k[2]) for k in counts if k[0] == step}
        for site in manifest.sites:
            for role, tid in site.roles.items():
                tap = taps[tid]
                if (site.id, role) not in ran:
                    assert site.graph, f"step {step}: main-graph {site.id} {role} has no rows"
                    continue
                stats = {k[3] for k in counts if k[:3] == (step, site.id, role)}
                expected_stats = set(tap.sketches)
                assert stats <= expected_stats and expected_stats - stats <= {"adj_sumsq", "pos_sumsq"}, (
                    site.id,
                    role,
                    stats ^ expected_stats,
                )
                n = numel[(step, site.id, role)]
                for stat in tap.sketches:
                    got = counts.get((step, site.id, role, stat), 0)
                    if stat == "hist":
                        assert got == opts.hist_bins
                    elif stat == "elemsig" and tap.stacked == 0:
                        assert got == min(n, opts.elemsig_k)
                    elif not sk.REGISTRY[stat].vector:
                        assert got == 1, (site.id, role, stat, got)


def test_record_cli_generated_models(tmp_path):
    dims = {"transformer_block": ["--dim", "batch=2,seq=8"], "cnn": ["--dim", "batch=2"]}
    for name in [
        "transformer_block",
        "cnn",
        "gru",
        "quantized",
        "if_model",
        "loop",
        "scan",
        "opset11_mlp",
        "opset21_mlp",
        "moe",
        "bool_int_inputs",
        "attention_contrib",
    ]:
        out = tmp_path / f"{name}.parquet"
        assert (
            main(
                [
                    "record",
                    str(generated_model_path(name)),
                    "-o",
                    str(out),
                    "--batches",
                    "3",
                    "-q",
                    *dims.get(name, []),
                ]
            )
            == 0
        ), name
        table = pq.read_table(out)
        run_meta = json.loads(sidecar_paths(out)[1].read_text())
        assert run_meta["batches"] == 3 and run_meta["parity"]["ok"]
        assert table.num_rows == run_meta["rows"]
        from onnx_opscope.instrument import inject

        _, manifest = inject(generated_model_path(name))
        # the one tap that would change onnxruntime's integer kernels is left out (run.kernels)
        left_out = {(c["site"], c["role"]) for c in run_meta["left_out"]}
        assert left_out == ({("c/matmul", "out")} if name == "quantized" else set()), name
        for site in manifest.sites:
            site.roles = {r: t for r, t in site.roles.items() if (site.id, r) not in left_out}
        check_table_against_manifest(table, manifest, 3)


@pytest.mark.parametrize("name", list(REAL_FEEDS))
def test_record_cli_real_models(tmp_path, name):
    path = real_model_path(name)
    out = tmp_path / "t.parquet"
    assert main(["record", str(path), "-o", str(out), "--batches", "3", "-q", *REAL_FEEDS[name]]) == 0
    table = pq.read_table(out)
    from onnx_opscope.instrument import inject

    _, manifest = inject(path)
    check_table_against_manifest(table, manifest, 3)
    sites_csv = sidecar_paths(out)[0].read_text().splitlines()
    assert sites_csv[0] == '"site","op_type","order","M","K","N","flops"'
    assert len(sites_csv) == len(manifest.sites) + 1


def test_table_values_match_numpy(tmp_path):
    """Values in the written table equal numpy on the real tensors of the same feeds."""
    path = real_model_path("ppocrv4_rec")
    feeds = FeedSpec(batches=2, shapes={"x": [1, 3, 48, 320]}, dist="uniform")
    runtime = RuntimeConfig(graph_opt="disable")
    res = record(path, out=tmp_path / "t.parquet", feeds=feeds, sketches=["all"], runtime=runtime)
    table = read_table(res.table).to_pylist()
    m = res.manifest
    chosen = [s for s in m.sites if s.op_type == "MatMul"][:3] + [s for s in m.sites if s.op_type == "Conv"][
        :2
    ]
    plain = onnx.load(path)
    taps = {t.id: t for t in m.taps}
    tensors = sorted({taps[tid].tensor for s in chosen for tid in s.roles.values()})
    for name in tensors:
        plain.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = make_session(plain, runtime)
    opts = m.sketch_options()
    for step, batch in enumerate(iter_feeds(path, feeds)):
        values = dict(zip(tensors, run(session, batch, tensors)))
        for site in chosen:
            for role, tid in site.roles.items():
                tap = taps[tid]
                wanted = (
                    "min",
                    "max",
                    "nnz",
                    "sumsq",
                    "chan_maxabs",
                    "pos_sumsq",
                    "elemsig",
                    "hist",
                    "kurtosis",
                )
                assert set(wanted) <= set(tap.sketches), (site.id, role, tap.sketches)
                for stat in wanted:
                    got = np.array(
                        [
                            r["value"]
                            for r in table
                            if r["step"] == step
                            and r["site"] == site.id
                            and r["role"] == role
                            and r["stat"] == stat
                        ]
                    )
                    ref = sk.reference(stat, values[tap.tensor], tap.info(), opts)
                    rtol = max(sk.REGISTRY[stat].tol[0], 1e-6)
                    np.testing.assert_allclose(
                        got,
                        ref,
                        rtol=rtol,
                        atol=1e-6 * np.abs(ref).max(),
                        err_msg=f"{site.id} {role} {stat} step {step}",
                    )


def test_csv_and_parquet_hold_the_same_rows(tmp_path):
    args = ["record", str(generated_model_path("mlp")), "--batches", "2", "-q", "--sketch", "min,max,hist"]
    assert main([*args, "-o", str(tmp_path / "a.parquet")]) == 0
    assert main([*args, "-o", str(tmp_path / "a.csv")]) == 0
    a, b = read_table(tmp_path / "a.parquet"), read_table(tmp_path / "a.csv")
    assert a.num_rows == b.num_rows > 0
    assert a.column("value").to_pylist() == pytest.approx(b.column("value").to_pylist())
    pd = pytest.importorskip("pandas")  # the test extra: pandas reads both directly
    assert len(pd.read_parquet(tmp_path / "a.parquet")) == len(pd.read_csv(tmp_path / "a.csv"))


def _start_long_recording(out: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "onnx_opscope",
        "record",
        str(generated_model_path("transformer_block")),
        "-o",
        str(out),
        "--batches",
        "100000",
        "-q",
        "--dim",
        "batch=4,seq=64",
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_parts(out: Path, proc: subprocess.Popen, n: int = 3) -> None:
    """Until the long recording has written `n` batches at `out` (an earlier run's do not count)."""
    run_json = sidecar_paths(out)[1]
    deadline = time.time() + 60
    while time.time() < deadline:
        with contextlib.suppress(OSError, ValueError):
            mine = json.loads(run_json.read_text())["run_id"].startswith("transformer_block")
            if mine and len(list(out.glob("part-*.parquet"))) >= n:
                return
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    raise AssertionError("recording wrote no batches in 60 s")


def _steps_by_every_reader(out: Path) -> list[int]:
    """The table's steps, checked to be whole batches 0..k-1, read by pandas, pyarrow, polars and DuckDB."""
    pd = pytest.importorskip("pandas")
    pl = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    steps = pq.read_table(out).column("step").to_pylist()
    assert len(pd.read_parquet(out)) == len(steps)
    assert pl.read_parquet(out).height == pl.scan_parquet(f"{out}/*.parquet").collect().height == len(steps)
    assert duckdb.sql(f"select count(*) from read_parquet('{out}/*.parquet')").fetchall() == [(len(steps),)]
    assert read_table(out).num_rows == len(steps)
    kept = sorted(set(steps))
    assert kept == list(range(len(kept))), kept
    per_step = {steps.count(s) for s in kept}
    assert len(per_step) <= 1, f"a partial batch leaked into the table: rows per step {per_step}"
    assert all(p.name.startswith("part-") or p.name == "_SUCCESS" for p in out.iterdir())
    return kept


def test_killed_recording_leaves_whole_batches_for_every_reader(tmp_path):
    """SIGKILL at random moments: the path always holds a table of whole batches, readable by pandas,
    pyarrow, polars and DuckDB, with the sidecars of the same run: the earlier run's when the kill came
    before the new run's first batch, else the new run's, marked interrupted."""
    rng = random.Random()
    out = tmp_path / "run.parquet"
    assert main(["record", str(generated_model_path("mlp")), "-o", str(out), "--batches", "2", "-q"]) == 0
    for attempt in range(3):
        proc = _start_long_recording(out)
        if attempt:  # the first kill may come before the new run's first batch, the others after it
            _wait_for_parts(out, proc, n=1)
        delay = rng.uniform(0.0, 3.0 if attempt == 0 else 1.0)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kept = _steps_by_every_reader(out)
        (run_id,) = set(read_table(out, ["run_id"]).column("run_id").to_pylist())
        meta = json.loads(sidecar_paths(out)[1].read_text())
        assert meta["run_id"] == run_id, (attempt, delay)
        if run_id.startswith("mlp"):  # killed before its first batch: the earlier table, as it was
            assert attempt == 0 and kept == [0, 1] and (out / "_SUCCESS").exists(), delay
            assert meta["batches"] == 2 and not meta["interrupted"]
        else:
            assert kept and not (out / "_SUCCESS").exists(), (attempt, delay)
            assert meta["interrupted"] and meta["batches"] <= len(kept), (attempt, delay)


def test_interrupted_recording_says_what_it_kept(tmp_path):
    out = tmp_path / "run.parquet"
    proc = _start_long_recording(out)
    _wait_for_parts(out, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    line = proc.stderr.read().decode().strip()
    kept = _steps_by_every_reader(out)
    assert line == f"interrupted: kept {len(kept)} of 100000 batches in {out}", line
    meta = json.loads(sidecar_paths(out)[1].read_text())
    assert meta["interrupted"] is True and meta["batches"] == len(kept) and not (out / "_SUCCESS").exists()


def test_terminated_recording_ends_like_ctrl_c(tmp_path):
    out = tmp_path / "run.parquet"
    proc = _start_long_recording(out)
    _wait_for_parts(out, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    assert len(_steps_by_every_reader(out)) >= 3
    assert "interrupted: kept" in proc.stderr.read().decode()


def test_parity_gate_reports_the_worst_output():
    a = [np.array([1.0, 2.0]), np.array([10.0, 20.0])]
    same = check_drop_in(["p", "q"], a, [x.copy() for x in a], 0.0, 0.0)
    assert same.ok and same.max_abs == 0
    moved = check_drop_in(["p", "q"], a, [a[0], np.array([10.0, 21.0])], 1e-3, 0.0)
    assert not moved.ok and moved.worst_output == "q" and moved.max_abs == pytest.approx(1.0)
    assert check_drop_in(["p", "q"], a, [a[0], np.array([10.0, 20.001])], 1e-3, 0.0).ok


def test_record_runs_two_shapes_of_one_model(tmp_path):
    """Symbolic batch and sequence: numel and M in the table follow the feeds."""
    path = generated_model_path("transformer_block")
    for batch, seq in [(1, 8), (3, 20)]:
        res = record(
            path,
            out=tmp_path / f"{batch}.parquet",
            feeds=FeedSpec(batches=1, dims={"batch": batch, "seq": seq}),
        )
        rows = [r for r in read_table(res.table).to_pylist() if r["site"] == "block/attn/q_proj/matmul"]
        assert {r["numel"] for r in rows if r["role"] == "lhs"} == {batch * seq * 64}
        assert {r["M"] for r in rows} == {batch * seq}


def cli_error(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[0] if err else ""


def test_cli_errors_are_one_line(capsys, tmp_path):
    mlp = str(generated_model_path("mlp"))
    out = str(tmp_path / "t.parquet")
    cases = [
        (["record", mlp, "--provider", "cdua", "-o", out], "unknown execution provider"),
        (["record", mlp, "--provider", "cuda", "-o", out], "CUDAExecutionProvider is not available"),
        (["record", mlp, "--provider", "coreml", "-o", out], "CoreMLExecutionProvider is not available"),
        (["record", mlp, "--shape", "y:1,64", "-o", out], "'y'"),
        (["record", mlp, "--shape", "x:1,2,64", "-o", out], "rank"),
        (["record", mlp, "--dist", "gausian", "-o", out], "did you mean 'gaussian'"),
        (["record", str(tmp_path / "missing.onnx"), "-o", out], "no such file"),
        (["inject", mlp, "-o", str(tmp_path / "x.onnx"), "--op", "Conv"], "matches no node"),
        (["inject", mlp, "-o", str(tmp_path / "x.onnx"), "--sketch", "hsit"], "did you mean 'hist'"),
    ]
    for argv, needle in cases:
        code, line = cli_error(capsys, argv)
        assert code == 2, argv
        assert line.startswith("error: ") and needle in line, (argv, line)


def test_cli_wrong_dtype_in_data(capsys, tmp_path):
    np.savez(tmp_path / "b.npz", x=np.zeros((2, 64), np.int32))
    code, line = cli_error(
        capsys,
        [
            "record",
            str(generated_model_path("mlp")),
            "--data",
            str(tmp_path / "b.npz"),
            "-o",
            str(tmp_path / "t.parquet"),
        ],
    )
    assert code == 2 and "int32" in line and "float" in line


def test_cli_fallback_runs_on_cpu(capsys, tmp_path):
    """Without CUDA, `--fallback` warns once and records on CPU; with it, CUDA is used."""
    import onnxruntime as ort

    out = tmp_path / "t.parquet"
    args = ["record", str(generated_model_path("mlp")), "--provider", "cuda,cpu", "--fallback", "-q"]
    args += ["--batches", "1", "-o", str(out)]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert main(args) == 0
        assert set(read_table(out).column("provider").to_pylist()) == {"cuda"}
        return
    with pytest.warns(ProviderFallbackWarning, match="CUDAExecutionProvider not available"):
        assert main(args) == 0
    assert set(read_table(out).column("provider").to_pylist()) == {"cpu"}


def test_cli_model_failure_is_one_line(capsys, tmp_path):
    code, line = cli_error(
        capsys,
        [
            "record",
            str(real_model_path("ppocrv4_det")),
            "--shape",
            "x:1,3,100,100",
            "-o",
            str(tmp_path / "t.parquet"),
        ],
    )
    assert code == 2 and "the model itself failed" in line and "Traceback" not in line


def test_help_teaches():
    out = subprocess.run(
        [sys.executable, "-m", "onnx_opscope", "record", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert out.returncode == 0
    for needle in (
        "--dist",
        "--shape",
        "--provider",
        "--sketch",
        "exit codes",
        "examples",
        "pandas.read_parquet",
    ):
        assert needle in out.stdout


def test_arrow_columns_from_buffers():
    """The table's columns are built from numpy buffers (no pandas import): nulls, UTF-8 and order kept."""
    from onnx_opscope.instrument.rows import arrow_float64, arrow_int64, arrow_strings

    assert arrow_int64(np.array([1, 2, 3]), np.array([False, True, False])).to_pylist() == [1, None, 3]
    assert arrow_int64(np.arange(9), np.zeros(9, bool)).null_count == 0
    assert arrow_strings(["a", "bé", ""], np.array([1, 0, 2, 1])).to_pylist() == ["bé", "a", "", "bé"]
    assert arrow_strings(["x"], np.zeros(0, np.int64)).to_pylist() == []
    assert arrow_float64(np.array([0.5, np.nan])).to_pylist()[0] == 0.5
