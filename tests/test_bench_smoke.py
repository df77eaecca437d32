"""Smoke tests of the benchmark scripts: `scripts/bench.py --quick` and `scripts/bench_calibrate.py
--quick` run, print their tables, exit 0.

It never asserts on a time or a memory figure: those belong to BENCHMARKS.md, measured on a
quiet machine, not to CI.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser

from onnx_opscope.sketch import SKETCH_SETS

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench.py"
BENCH_CALIBRATE = ROOT / "scripts" / "bench_calibrate.py"


def _bench_module(path: Path = BENCH, name: str = "opscope_bench"):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_every_row():
    bench = _bench_module()
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "| model | measurement |" in out
    for name in bench.QUICK_ROWS:
        assert f"| {name} |" in out, f"row {name!r} missing from the table"
    assert "inject_file" in out
    assert "costs.analyze" in out  # its row is there even while the analyzer cannot be imported
    assert "## Goals" in out


def test_calibrate_quick_run_prints_every_row():
    """Every row of bench_calibrate.py, ours and onnxruntime's, measured on transformer_block (< 30 s)."""
    bench = _bench_module(BENCH_CALIBRATE, "opscope_bench_calibrate")
    proc = subprocess.run(
        [sys.executable, str(BENCH_CALIBRATE), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "| model | measurement |" in out
    assert "(the same set)" in out  # our selection is onnxruntime's, checked before measuring
    settings = bench.Settings(quick=True, rounds=1, batches=2, many=4, bins=None, timeout=120)
    rows = {line.split(" | ")[1]: line for line in out.splitlines() if line.startswith("| ")}
    for row in bench.rows_for(settings):
        assert row.label in rows, f"row {row.label!r} missing from the table"
        assert "**failed**" not in rows[row.label], rows[row.label]
    assert "ORT EntropyCalibrater, 4 batches" in rows  # the row that says why it is not run
    assert "## Goals" in out


def test_weights_and_counting_quick_runs():
    """scripts/bench_weights.py --quick (probes of a tiled model with external data),
    scripts/bench_counting.py on a small tensor and scripts/bench_ray.py --quick (a local Ray
    instance per row) print their tables; the Ray rows must equal the single-process ones."""
    for script, args, expect in [
        ("bench_weights.py", ["--quick"], ["| probe_weights |", "largest tensor"]),
        ("bench_counting.py", ["--elements", "20000", "--runs", "2", "--bins", "64"], ["np.histogram", "host np.bincount"]),
        ("bench_ray.py", ["--quick"], ["speed-up of 2 Ray workers", "the same rows in the same order: True"]),
    ]:  # fmt: skip
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True,
                              text=True, timeout=300, cwd=ROOT)  # fmt: skip
        assert proc.returncode == 0, (script, proc.stderr[-2000:])
        for text in expect:
            assert text in proc.stdout, (script, text, proc.stdout[-2000:])


def test_outputs_bench_runs_and_its_variants_agree():
    """scripts/bench_outputs.py: every way of returning the values gives the same values (it asserts
    that itself) and prints one row per way and the cost line."""
    script = ROOT / "scripts" / "bench_outputs.py"
    for order in ("default", "priority"):
        proc = subprocess.run(
            [sys.executable, str(script), "--n", "16", "--rounds", "2", "--order", order],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"{order} node order" in proc.stdout
        assert proc.stdout.count("×") == 6 and "an output costs" in proc.stdout  # one row a way


def test_ab_bench_times_two_checkouts_against_plain(tmp_path):
    """scripts/bench_ab.py with this checkout on both sides: each side injects in a child, one table row
    per side, and the new ÷ old line; a folder that is no checkout is one clear error."""
    script = ROOT / "scripts" / "bench_ab.py"
    args = [sys.executable, str(script), "--new", str(ROOT), "--quick", "--models", "bert_like"]
    proc = subprocess.run(
        [*args, "--old", str(ROOT), "--rounds", "2", "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| bert_like |")]
    assert [r.split("|")[2].strip() for r in rows] == ["plain", "old", "new"]
    assert "bert_like: new ÷ old" in proc.stdout
    bad = subprocess.run(
        [*args, "--old", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert bad.returncode == 2 and "not an onnx-opscope checkout" in bad.stderr


def run_model(model, x):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def test_floor_bench_reads_the_tapped_tensors_and_times_each_variant():
    """scripts/bench_floor.py: the readers it appends are the ops it names, one per tapped tensor and op,
    each a graph output; its table has plain, the three readers and the default set (and with
    --sketch-costs, the set and one row per sketch of it left out)."""
    floor = _bench_module(ROOT / "scripts" / "bench_floor.py", "opscope_bench_floor")
    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[2, 3] x) => (float[2, 3] y) '
        "{ a = Relu(x)\n y = Neg(a) }"
    )
    read = floor.with_readers(model, ["a", "y"], floor.FLOOR_READERS["+ 4 reductions"])
    ops = floor.FLOOR_READERS["+ 4 reductions"]
    added = [n for n in read.graph.node if n.name.startswith("floor_n_")]
    assert [(n.op_type, n.input[0]) for n in added] == [(op, t) for op in ops for t in ("a", "y")]
    assert len(read.graph.output) == 1 + 4 and len(model.graph.output) == 1  # one output an op
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    got = dict(zip([o.name for o in read.graph.output], run_model(read, x), strict=True))
    a = np.maximum(x, 0)
    for op, ref in (("ReduceMin", np.min), ("ReduceMax", np.max), ("ReduceSum", np.sum)):
        np.testing.assert_allclose(got[f"floor_{op}"], [ref(a), ref(-a)], rtol=1e-6)
    np.testing.assert_allclose(got["floor_ReduceSumSquare"], [(a * a).sum(), (a * a).sum()], rtol=1e-6)
    script = ROOT / "scripts" / "bench_floor.py"
    for extra, labels in (
        ((), ["plain", "+ Shape", "+ ReduceMax", "+ 4 reductions", "default set"]),
        (("--sketch-costs",), ["plain", "--sketch all"] + [f"without {n}" for n in SKETCH_SETS["all"]]),
        (
            ("--sketch-costs", "default"),
            ["plain", "--sketch default"] + [f"without {n}" for n in SKETCH_SETS["default"]],
        ),
    ):
        proc = subprocess.run(
            [
                sys.executable,
                str(script),
                "--quick",
                "--models",
                "bert_like",
                "--rounds",
                "1",
                "--runs",
                "1",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [
            line.split("|")[2].strip()
            for line in proc.stdout.splitlines()
            if line.startswith("| bert_like |")
        ]
        assert [r.split(" (")[0] for r in rows] == labels
