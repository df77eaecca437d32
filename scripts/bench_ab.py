"""Old against new: a model instrumented by two checkouts of onnx-opscope, timed against plain in one process.

    python scripts/bench_ab.py --old ../before --models ppocrv4_det,bert_like
    python scripts/bench_ab.py --old ../before --new ../after --sketch all --rounds 60

What a change to the instrumented graph buys, measured as finely as a shared machine allows.
`bench.py` runs every row in a fresh process, and between processes one row moves by about ±0.1×
plain (BENCHMARKS.md, "Issue 16, fourteenth session"), which is more than most graph changes.
Here each checkout injects the model in a process of its own, with the sites, feeds, sketch
options and input shapes that `bench.py` uses. One process then times plain, old and new in turn,
`--rounds` times, `--runs` runs each. It uses one intra-op thread, and runs the tapped models in
priority order as `record` does. Each tapped round is divided by the plain round before it.

Each side runs in `--sessions` sessions of its own, alternating with the other side's: one session of
a model can be ~5% slower or faster than another of the same file for its whole life (where its
buffers fell: ppocrv4_rec with every sketch, five sessions of one file in one process, 1.15-1.28×
plain; ppocrv4_det 3.66-3.75×, bert_like 1.275-1.277×), which one session a side would take for the
change. Per model it prints ms a run and × plain of each side as a paired median with quartiles over
every session's rounds, the spread of the sessions' medians, and new ÷ old (session k of new over
session k of old, round by round). The run alone: no decode (`bench_decode.py` times the host side).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - a sibling script: the models, feeds and ops bench.py measures

# Runs in a child with a checkout first on sys.path (an editable install's finder removed, so the
# checkout given is the one imported): inject as `record` would on the CPU provider, save, say where from.
_INJECT = """
import json, sys
checkout, model, out, ops, shapes, sketches = sys.argv[1:7]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, checkout)
import onnx, onnx_opscope
from onnx_opscope.instrument import inject
from onnx_opscope.sites import Selection
from onnx_opscope.sketch import SketchOptions, for_providers
options = for_providers(SketchOptions(), ["CPUExecutionProvider"])
chosen = None if sketches == "default" else sketches.split(",")
inst, _ = inject(model, Selection(op_types=tuple(json.loads(ops))), chosen, options, input_shapes=json.loads(shapes))
onnx.save(inst, out)
print(onnx_opscope.__file__)
"""


def instrument(checkout: Path, case: bench.Case, shapes: dict, sketches: str, out: Path) -> Path:
    """`case`'s model injected by the onnx_opscope of `checkout`, saved at `out`."""
    args = [str(checkout), str(case.model), str(out), json.dumps(case.ops), json.dumps(shapes), sketches]
    proc = subprocess.run([sys.executable, "-c", _INJECT, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"{checkout}: injecting {case.name} failed: {tail}")
    where = Path(proc.stdout.strip().splitlines()[-1]).resolve()
    if not where.is_relative_to(checkout.resolve()):
        raise SystemExit(
            f"{checkout}: the child imported onnx_opscope from {where.parent}, not from the checkout"
        )
    return out


def time_paired(paths: list[Path], feeds: dict, rounds: int, runs: int) -> list[list[float]]:
    """Seconds a run of each model per round, the models in turn within each round (the first one plain)."""
    import onnxruntime as ort

    from onnx_opscope.run.session import RuntimeConfig, for_tapped

    cfg = RuntimeConfig(graph_opt="all", threads=1)
    sessions = []
    for i, p in enumerate(paths):
        so = (for_tapped(cfg) if i else cfg).session_options()
        s = ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
        sessions.append((s, {x.name: feeds[x.name] for x in s.get_inputs()}))
    for s, f in sessions:
        for _ in range(3):
            s.run(None, f)
    times: list[list[float]] = [[] for _ in paths]
    for _ in range(rounds):
        for (s, f), t in zip(sessions, times):
            start = time.perf_counter()
            for _ in range(runs):
                s.run(None, f)
            t.append((time.perf_counter() - start) / runs)
    return times


def load_case(work: Path, name: str, quick: bool) -> tuple[bench.Case, dict, dict]:
    """bench.py's model `name` written into `work`: (its case, its first batch of feeds, their shapes)."""
    cases = bench.prepare_cases(work, quick, 1, {name})
    if not cases or cases[0].model is None:
        raise SystemExit(
            f"{name}: no such benchmark model here (bench.py's names; real ones need fetch_models)"
        )
    case = cases[0]
    with np.load(case.feeds) as z:
        feeds = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("0/")}
    return case, feeds, {k: list(v.shape) for k, v in feeds.items()}


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a round, a run, a session)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return n


def time_sessions(paths: list[Path], feeds: dict, rounds: int, runs: int, sessions: int) -> list[np.ndarray]:
    """`time_paired` with every model but the first (plain) in `sessions` sessions, the sessions of all the
    models in turn within each round: per model but plain, a [sessions, rounds] array of × plain; plain's
    seconds a run first, [1, rounds]."""
    order = [paths[0]] + [p for _ in range(sessions) for p in paths[1:]]
    t = np.array(time_paired(order, feeds, rounds, runs))
    n = len(paths) - 1
    return [t[:1]] + [t[1 + i :: n] / t[0] for i in range(n)]


def spread(v: np.ndarray) -> str:
    """median [quartiles] of every value; with several sessions (rows), the range of their medians too."""
    q = np.percentile(v, [25, 50, 75])
    text = f"{q[1]:.3f} [{q[0]:.3f}–{q[2]:.3f}]"
    if v.ndim == 2 and len(v) > 1:
        per = np.median(v, axis=1)
        text += f", sessions {per.min():.3f}–{per.max():.3f}"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="the checkout before the change (its root folder)")
    p.add_argument("--new", type=Path, default=bench.ROOT, help="the checkout after it (default: this one)")
    p.add_argument(
        "--models", default="ppocrv4_det,bert_like", help="bench.py's model names, comma-separated"
    )
    p.add_argument("--sketch", default="default", help="sketch names, comma-separated, or default")
    p.add_argument("--rounds", type=positive, default=40, help="alternations (default 40)")
    p.add_argument("--runs", type=positive, default=3, help="runs per model and round (default 3)")
    p.add_argument("--sessions", type=positive, default=3, help="sessions per side, alternating (default 3)")
    p.add_argument(
        "--quick", action="store_true", help="bench.py's quick models (a smoke run; never judge by it)"
    )
    a = p.parse_args(argv)
    for side in (a.old, a.new):
        if not (side / "onnx_opscope" / "__init__.py").is_file():
            p.error(f"{side}: not an onnx-opscope checkout (no onnx_opscope/__init__.py)")
    print(
        f"old {a.old}, new {a.new}; sketches {a.sketch}; {a.rounds} rounds × {a.runs} runs × {a.sessions} sessions"
    )
    print("| model | side | ms a run | × plain, paired median [quartiles], sessions' medians |")
    print("|---|---|---:|---:|")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in a.models.split(","):
            case, feeds, shapes = load_case(work, name, a.quick)
            paths = [case.model]
            for side, root in (("old", a.old), ("new", a.new)):
                paths.append(instrument(root, case, shapes, a.sketch, work / f"{name}_{side}.onnx"))
            plain, old, new = time_sessions(paths, feeds, a.rounds, a.runs, a.sessions)
            print(f"| {name} | plain | {np.median(plain) * 1e3:.2f} | 1 |")
            for side, x in (("old", old), ("new", new)):
                print(f"| {name} | {side} | {np.median(x * plain) * 1e3:.2f} | {spread(x)} |")
            ratios.append((name, new / old))
    for name, r in ratios:
        print(f"{name}: new ÷ old {spread(r)} (below 1: new is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
