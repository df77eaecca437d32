"""Smoke test of the benchmark script: `scripts/bench.py --quick` runs, prints its table, exits 0.

It never asserts on a time or a memory figure: those belong to BENCHMARKS.md, measured on a
quiet machine, not to CI.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("opscope_bench", BENCH)
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
