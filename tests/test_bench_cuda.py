"""scripts/bench_cuda.py: refuses a missing GPU provider in one line, runs every row on CPU, and its
IOBinding path fetches the same tap values as `session.run`.

No figure of time or memory is asserted (those belong to a GPU run, written down in BENCHMARKS.md).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from conftest import real_model_path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_cuda.py"


def _script():
    spec = importlib.util.spec_from_file_location("opscope_bench_cuda", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_missing_gpu_provider_is_one_line_exit_2():
    """`--provider cuda` where this onnxruntime has no CUDA (another GPU provider where it has)."""
    from onnx_opscope.run.session import known_providers

    available = set(ort.get_available_providers())
    short = next(p for p in ("cuda", "coreml", "dml", "qnn") if known_providers()[p] not in available)
    proc = _run("--provider", short, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert known_providers()[short] in lines[0] and "--provider cpu" in lines[0]
    assert "Traceback" not in proc.stderr and not proc.stdout


def test_cpu_smoke_run_prints_its_rows(tmp_path):
    """The smoke path: one row of each kind measured on CPU (a process each: the whole set is 13, ~35 s
    on 2 idle cores), with its ratio to the plain rows of the same round."""
    bench = _script()
    raw_path = tmp_path / "raw.json"
    chosen = [r for r in bench.ROWS if r.name in (bench.PLAIN, bench.PLAIN_IOB, "ORT MinMaxCalibrater")
              or r.name.startswith("opscope default set, sampled hist")]  # fmt: skip
    assert {r.kind for r in chosen} == {r.kind for r in bench.ROWS} and any(r.iobinding for r in chosen[2:])
    proc = _run(
        "--provider", "cpu", "--quick", "--models", "bert_like", "--rounds", "1", "--batches", "2",
        "--rows", ";".join(r.name for r in chosen), "--json", str(raw_path), timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = "| model | measurement | tensors | ms / batch | × plain | × plain IOBinding |"
    assert header in proc.stdout
    cells = {
        line.split(" | ")[1]: [c.strip() for c in line.split("|")[1:-1]]
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and " | " in line and "---" not in line
    }
    raw = json.loads(raw_path.read_text())["rows"]
    plain = raw[f"bert_like | {bench.PLAIN}"]["0"]
    for row in chosen:
        assert row.name in cells, f"row {row.name!r} missing from the table"
        _, _, tensors, ms, ratio, _, _, _, note = cells[row.name]
        assert "failed" not in note, cells[row.name]
        got = raw[f"bert_like | {row.name}"]["0"]
        expected = np.median(got["times"]) / np.median(plain["times"])  # the same round's plain row
        assert float(ratio) == round(expected, 2), (row.name, ratio, expected)
        assert float(ms) > 0
        if row.kind != "calibrator":
            assert len(got["times"]) == 2  # --batches 2
        if row.kind == "opscope":
            assert int(tensors) == 32  # every MatMul input and output of the 2-layer bert_like
    assert "providers available:" in proc.stdout and "1 of 1 round(s) run" in proc.stdout


def _check_bound(model, batches: list[dict], ops: tuple[str, ...], sketches: list[str] | None) -> set[str]:
    """Every output of `bound_runner`'s steps equals `session.run`'s, over the batches twice (the bound
    buffers are reused); returns the outputs the run did not produce (None from both)."""
    from onnx_opscope.instrument import inject
    from onnx_opscope.run.session import RuntimeConfig, make_session
    from onnx_opscope.sites import Selection

    bench = _script()
    tapped, manifest = inject(model, Selection(op_types=ops), sketches)
    sess = make_session(tapped, RuntimeConfig())
    names = [o.name for o in sess.get_outputs()]
    taps = set(names) - set(manifest.original_outputs)
    step, feeds, bound_names, _ = bench.bound_runner(sess, batches, "cpu", taps)
    assert bound_names == names and taps
    missing = set()
    for _ in range(2):
        for plain, inputs in zip(batches, feeds):
            expected = dict(zip(names, sess.run(None, plain)))
            got = dict(zip(bound_names, step(inputs)))
            for name in names:
                value = bench.host_array(got[name])
                if expected[name] is None:
                    assert value is None, name
                    missing.add(name)
                else:
                    np.testing.assert_array_equal(value, expected[name], err_msg=name)
    return missing


def test_iobinding_fetches_what_session_run_gives_when_shapes_change():
    """Batches of two sequence lengths: the outputs whose shape changes are rebound before each run."""
    from onnx_opscope import zoo
    from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds

    model = zoo.bert_like(hidden=32, layers=1, heads=2, vocab=50, max_seq=16)
    dims = [{"batch": 2, "seq": seq} for seq in (16, 8, 16)]
    _check_bound(
        model, [synthetic_feeds(model, FeedSpec(dims=d), i) for i, d in enumerate(dims)], ("MatMul",), None
    )


def test_iobinding_in_nested_if_branches():
    """silero_vad, adj_sumsq: taps inside nested If branches, taken or not, come back through the bound
    outputs as `session.run` gives them. onnxruntime gave None for exactly two of them, adj_sumsq of the
    LSTM weights sliced from initializers inside the branches; those are weight taps now
    (`instrument.folded`), so every output is produced (`host_array` keeps its None for one that is not)."""
    bench = _script()
    spec, post, ops, _ = bench.bench._REAL["silero_vad_v6"]
    from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds

    path = real_model_path("silero_vad_v6")
    batches = [post(synthetic_feeds(path, FeedSpec(**spec), i)) for i in range(2)]
    assert _check_bound(path, batches, ops, ["adj_sumsq"]) == set()
