"""Time and memory of injection on big models: 2 GB of external weights, and a 40k-node graph.

    python scripts/bench_inject.py [--weights-gb 2] [--nodes 40000] [--runs 3] [--dir DIR]

1. inject + save into a model whose weights (default 2 GB) live in an external data file
   (zoo.write_external_weights_model, written once to a temporary folder). The instrumented
   model is saved once beside the source (the data file is reused) and once into another
   folder (the data file is hard-linked). Goal: < 1 s and < 200 MB peak RSS, i.e. the weights
   are never read.
2. inject into zoo.wide_graph(40000) (20k tapped tensors), in memory. Goal: < 5 s.

Every measurement runs in a fresh Python subprocess, so caches and allocator state of one run
cannot help the next. Peak RSS is the process's VmHWM (from /proc/self/status) after the step
minus VmHWM after the imports and model set-up; the tracemalloc peak (Python allocations only)
is measured in a second pass of the same step, since tracing slows the step down. Prints the
median of --runs runs and whether each goal is met.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"external": (1.0, 200.0), "wide": (5.0, None)}  # seconds, MB peak RSS


def vm_hwm_mb() -> float:
    """The process's peak resident set size so far, MB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


# --------------------------------------------------------------------------------------------
# children: one measurement each


def child_external(src: str, out_dir: str) -> dict:
    from onnx_opscope.instrument import inject_file

    base = vm_hwm_mb()
    out = Path(out_dir)
    t0 = time.perf_counter()
    inject_file(src, Path(src).parent / f"{out.name}_beside.onnx")
    t1 = time.perf_counter()
    inject_file(src, out / "tapped.onnx")
    t2 = time.perf_counter()
    rss = vm_hwm_mb() - base
    tracemalloc.start()
    inject_file(src, out / "again" / "tapped.onnx")
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return {"beside_s": t1 - t0, "other_s": t2 - t1, "rss_mb": rss, "tracemalloc_mb": peak}


def child_wide(n_nodes: int) -> dict:
    from onnx_opscope import zoo
    from onnx_opscope.instrument import inject

    model = zoo.wide_graph(n_nodes)
    base = vm_hwm_mb()
    t0 = time.perf_counter()
    inst, manifest = inject(model)
    t1 = time.perf_counter()
    return {
        "inject_s": t1 - t0,
        "rss_mb": vm_hwm_mb() - base,
        "taps": len(manifest.taps),
        "nodes_out": len(inst.graph.node),
    }


def run_child(*args: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if res.returncode:
        raise SystemExit(f"child {args[0]} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# parent


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def verdict(value: float, goal: float | None) -> str:
    return "-" if goal is None else ("met" if value < goal else "MISSED")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights-gb", type=float, default=2.0)
    ap.add_argument("--nodes", type=int, default=40_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        kind, *rest = args.child
        result = child_external(*rest) if kind == "external" else child_wide(int(rest[0]))
        print(json.dumps(result))
        return 0

    from onnx_opscope import zoo

    scratch = Path(tempfile.mkdtemp(prefix="opscope-bench-inject-", dir=args.dir))
    try:
        total = int(args.weights_gb * 1024**3)
        t0 = time.perf_counter()
        src = zoo.write_external_weights_model(scratch / "src", total)
        print(f"wrote {total / 1024**3:.2f} GB of external weights in {time.perf_counter() - t0:.1f} s")
        ext = [run_child("external", str(src), str(scratch / f"out{i}")) for i in range(args.runs)]
        wide = [run_child("wide", str(args.nodes)) for _ in range(args.runs)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    t_goal, rss_goal = GOALS["external"]
    w_goal = GOALS["wide"][0]
    rows = [
        ("external: inject+save beside source", median(ext, "beside_s"), "s", t_goal),
        ("external: inject+save other folder (hard link)", median(ext, "other_s"), "s", t_goal),
        ("external: peak RSS over baseline", median(ext, "rss_mb"), "MB", rss_goal),
        ("external: tracemalloc peak", median(ext, "tracemalloc_mb"), "MB", None),
        (f"wide_graph({args.nodes}): inject", median(wide, "inject_s"), "s", w_goal),
        (f"wide_graph({args.nodes}): peak RSS over baseline", median(wide, "rss_mb"), "MB", None),
    ]
    print(f"\nmedian of {args.runs} runs, each in a fresh process ({wide[0]['taps']} taps on the wide graph)")
    print(f"{'measure':<52} {'value':>10}  {'goal':>8}  verdict")
    for name, value, unit, goal in rows:
        goal_s = f"< {goal:g} {unit}" if goal is not None else ""
        print(f"{name:<52} {value:>8.3f} {unit:<2} {goal_s:>8}  {verdict(value, goal)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
