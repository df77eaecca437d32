"""Models of LLM size: memory and start-up of record / calibrate / weights against plain inference.

    python scripts/bench.py --big 2,6          # 2 GiB and 6 GiB of float32 weights (external data)
    python scripts/bench_big.py --gib 2 --rounds 3 --batches 4

The model is `zoo.write_external_weights_model(folder, GiB, 2)`: x [1, d] @ W0 @ W1 with two
d x d float32 weights in one external data file (d = 16384 at 2 GiB), written once to a
temporary folder. Each measurement runs in a fresh Python process that imports the same
libraries first; its peak RSS is the process's VmHWM. Rows:

- plain: an onnxruntime session on the file (its default options) and N runs: the
  session's creation time, the median run, the peak RSS;
- record: `onnx_opscope.record` over the same N batches with an empty weight cache: the
  time from the call to the first batch in the table (after its parity gate, when that runs
  first), the median time between batches, the peak RSS; "record again" the same with the
  cache the first run filled (what a second recording of the model costs);
- calibrate (minmax, N batches) and weights (the probes) for their peak RSS and wall time.

Goals (issue "Models of LLM size"): peak RSS <= plain's peak + 10% (+ the sketch buffer);
time to the first recorded batch <= 1.5x the plain session's creation; per-batch cost
<= 1.5x plain's run. Ratios are per round against the same round's plain row, then the
median (and the spread) over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT = "RESULT "
GOALS = {"rss": 1.10, "first": 1.5, "batch": 1.5}


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def _feeds(d: int, n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((1, d)).astype(np.float32)} for _ in range(n)]


def child(job: dict) -> dict:
    """One measurement in this (fresh) process."""
    import onnxruntime as ort

    import onnx_opscope.run  # noqa: F401 - the same imports in every row, so RSS differences are the work

    model, n, d = job["model"], job["batches"], job["d"]
    feeds = _feeds(d, n)
    kind = job["kind"]
    out: dict = {}
    t0 = time.perf_counter()
    if kind == "plain":
        sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        out["create_s"] = time.perf_counter() - t0
        times = []
        for f in feeds:
            t = time.perf_counter()
            sess.run(None, f)
            times.append(time.perf_counter() - t)
        out["batch_s"] = statistics.median(times[1:] or times)
    elif kind == "record":
        from onnx_opscope import FeedSpec, record

        marks: list[float] = []
        t0 = time.perf_counter()
        record(model, out=Path(job["work"]) / "t.parquet", feeds=FeedSpec(batches=n),
               progress=lambda done, total: marks.append(time.perf_counter()))  # fmt: skip
        out["first_s"] = marks[0] - t0
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        out["batch_s"] = statistics.median(gaps) if gaps else None
        out["total_s"] = time.perf_counter() - t0
    elif kind == "calibrate":
        from onnx_opscope import FeedSpec, calibrate

        calibrate(model, FeedSpec(batches=n))
        out["total_s"] = time.perf_counter() - t0
    elif kind == "weights":
        from onnx_opscope import probe_weights

        probe_weights(model)
        out["total_s"] = time.perf_counter() - t0
    else:
        raise ValueError(kind)
    out["peak_mb"] = _peak_rss_mb()
    return out


def run_child(job: dict, env: dict | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(job)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {proc.returncode}: {tail[:200]}"}


def _median_spread(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.2f} [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else f"{med:.2f}"


def measure(gib: float, rounds: int, batches: int, work: Path, log=print) -> list[str]:
    """The rows for one model size, as Markdown lines."""
    from onnx_opscope import zoo

    folder = work / f"w{gib:g}"
    log(f"writing a model with {gib:g} GiB of float32 weights in external data ...")
    model = zoo.write_external_weights_model(folder, int(gib * 2**30), 2)
    import onnx

    d = int(
        onnx.load(str(model), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[1].dim_value
    )
    base = {"model": str(model), "batches": batches, "d": d, "work": str(work)}
    rows: dict[str, list[dict]] = {k: [] for k in ("plain", "record", "record again", "calibrate", "weights")}
    for r in range(rounds):
        cache = work / f"cache{r}"
        env = {"OPSCOPE_CACHE_DIR": str(cache)}
        for name, kind in (("plain", "plain"), ("record", "record"), ("record again", "record"),
                           ("calibrate", "calibrate"), ("weights", "weights")):  # fmt: skip
            got = run_child({**base, "kind": kind}, env)
            log(f"  {gib:g} GiB round {r + 1} {name}: {got}")
            rows[name].append(got)
    lines = [
        f"### {gib:g} GiB of weights (d = {d}, 2 MatMuls, [1, d] batches, {batches} batches, {rounds} rounds)",
        "",
        "| row | peak RSS MB | vs plain | first batch s | vs plain create | per batch s | vs plain run | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain = rows["plain"]
    for name, results in rows.items():
        ok = [(p, g) for p, g in zip(plain, results) if "error" not in p and "error" not in g]
        if len(ok) < len(results):
            lines.append(f"| {name} | error: {next(g for g in results if 'error' in g)['error']} |||||||")
            continue
        rss = [g["peak_mb"] for _, g in ok]
        rss_ratio = [g["peak_mb"] / p["peak_mb"] for p, g in ok]
        first = [g["first_s"] if "first_s" in g else g.get("create_s") for _, g in ok]
        first_ratio = [f / p["create_s"] for (p, _), f in zip(ok, first) if f is not None]
        first = [f for f in first if f is not None]
        batch = [g["batch_s"] for _, g in ok if g.get("batch_s")]
        batch_ratio = [g["batch_s"] / p["batch_s"] for p, g in ok if g.get("batch_s")]
        wall = [g["total_s"] for _, g in ok if "total_s" in g]
        cells = [rss, rss_ratio, first, first_ratio, batch, batch_ratio, wall]
        lines.append(f"| {name} | " + " | ".join(_median_spread(c) for c in cells) + " |")
    lines += ["", *goal_lines(rows)]
    return lines


def goal_lines(rows: dict[str, list[dict]]) -> list[str]:
    plain = rows["plain"]
    out = []
    for name in ("record", "record again", "calibrate", "weights"):
        pairs = [(p, g) for p, g in zip(plain, rows[name]) if "error" not in p and "error" not in g]
        if not pairs:
            out.append(f"- {name}: no result")
            continue
        rss = statistics.median(g["peak_mb"] / p["peak_mb"] for p, g in pairs)
        line = f"- {name}: peak RSS {rss:.3f}x plain ({'met' if rss <= GOALS['rss'] else 'NOT met'}, goal <= 1.10x)"
        if name.startswith("record"):
            first = statistics.median(g["first_s"] / p["create_s"] for p, g in pairs)
            line += f"; first batch {first:.2f}x plain's session creation ({'met' if first <= GOALS['first'] else 'NOT met'}, goal <= 1.5x)"
            batch = [g["batch_s"] / p["batch_s"] for p, g in pairs if g.get("batch_s")]
            if batch:
                b = statistics.median(batch)
                line += f"; per batch {b:.2f}x plain ({'met' if b <= GOALS['batch'] else 'NOT met'}, goal <= 1.5x)"
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", default="2", help="comma-separated weight sizes in GiB (default 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(RESULT + json.dumps(child(json.loads(args.one))), flush=True)
        return 0
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="opscope-big-") as tmp:
        for gib in (float(g) for g in args.gib.split(",")):
            lines += measure(
                gib, args.rounds, args.batches, Path(tmp), log=lambda m: print(m, file=sys.stderr)
            )
            lines.append("")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
