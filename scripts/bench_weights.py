"""Weight probes on a ~100M-parameter model: time, and peak memory against the largest tensor.

    python scripts/bench_weights.py                  # 100M parameters, 3 rounds (a few minutes on 2 cores)
    python scripts/bench_weights.py --params 20e6 --source ppocrv4_rec
    python scripts/bench_weights.py --quick          # smoke run: its figures mean nothing

The model is built from repeated real weights: every float weight of `--source` (a fetched real
model, default captcha_crnn) flattened into one pool, tiled into an embedding [32000, 1024] read
by a Gather and MatMul pairs [1024, 4096] / [4096, 1024] (a transformer MLP's shapes) up to
`--params`, each entry scaled by a random factor in [0.5, 1.5) so that no two tensors are copies.
It is saved with every tensor in one external data file, in a temporary folder.

Rows, each in a fresh process per round, rounds interleaved:
- `probe_weights`: onnx_opscope.weights.probe_weights(path): external data read one tensor at a
  time (weights.matrix);
- `naive`: onnx.load with its external data (every weight in memory), then the same probes on
  each weight taken out with numpy_helper.to_array: what the memory bound saves.

**seconds**: the call, median over rounds [min–max]. **extra peak MB**: the process's peak RSS
at the end minus that before the call (after the imports), median over rounds. Peak RSS is
VmHWM (`bench_peers.peak_rss`), not getrusage's ru_maxrss: Linux carries ru_maxrss across exec,
so every child reported the peak of the parent that had just built the model (extra 0 MB).
The largest tensor's size is printed beside it: the probes hold that tensor as read, its float32
[rows, cols] copy (none when the out axis is already first) and a few 1 MiB blocks, so ours should
stay within about twice it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - sibling scripts, not a package
import bench_peers as peers  # noqa: E402

SCRIPT = Path(__file__).resolve()
MB = bench.MB
GOAL_S = 60.0
ROWS = ("probe_weights", "naive")
EMBEDDING = (32000, 1024)
MLP = ((1024, 4096), (4096, 1024))


# ---------------------------------------------------------------------------------------------
# the model


def weight_pool(source: Path) -> np.ndarray:
    """Every float weight of `source`, flattened and concatenated (float32)."""
    from onnx_opscope.weights import iter_weights

    return np.concatenate([m.ravel() for _, m in iter_weights(source, min_elements=1)])


def shapes_for(params: int, quick: bool) -> list[tuple[int, int]]:
    """An embedding, then MLP pairs until `params` (quick: a tenth of each side)."""
    div = 10 if quick else 1
    emb = (EMBEDDING[0] // div, EMBEDDING[1] // div)
    pair = [(r // div, c // div) for r, c in MLP]
    shapes, total = [emb], emb[0] * emb[1]
    while total < params:
        shape = pair[(len(shapes) - 1) % 2]
        shapes.append(shape)
        total += shape[0] * shape[1]
    return shapes


def build_model(folder: Path, pool: np.ndarray, shapes: list[tuple[int, int]]) -> Path:
    """A Gather on the first shape, MatMuls on the rest, every tensor in weights.bin beside model.onnx."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["W0", "ids"], ["h0"], name="embed")]
    inits = []
    offset = 0
    for k, shape in enumerate(shapes):
        size = shape[0] * shape[1]
        idx = (np.arange(size) + offset) % pool.size
        offset = (offset + size) % pool.size
        values = pool[idx] * rng.uniform(0.5, 1.5, size).astype(np.float32)
        inits.append(numpy_helper.from_array(values.reshape(shape), f"W{k}"))
        if k:
            nodes.append(helper.make_node("MatMul", [f"h{k - 1}", f"W{k}"], [f"h{k}"], name=f"mm{k}"))
    graph = helper.make_graph(
        nodes,
        "bench_weights",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info(f"h{len(shapes) - 1}", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=1024)
    return path


# ---------------------------------------------------------------------------------------------
# one measurement in its own process


def one(job: dict) -> None:
    """The `--one` side: import everything either row needs, measure one call, print one RESULT line."""
    import onnx
    from onnx import numpy_helper

    from onnx_opscope.weights.matrix import as_matrix, find_weights
    from onnx_opscope.weights.probes import probe, probe_weights

    before = peers.peak_rss()
    t0 = time.perf_counter()
    if job["row"] == "probe_weights":
        probes = probe_weights(job["model"])
    else:
        model = onnx.load(job["model"])  # every weight in memory
        views = [view for view, _ in find_weights(model)]
        tensors = {t.name: t for t in model.graph.initializer}
        probes = [probe(v, as_matrix(v, numpy_helper.to_array(tensors[v.name]))) for v in views]
    seconds = time.perf_counter() - t0
    peers.emit({"seconds": seconds, "extra": peers.peak_rss() - before, "weights": len(probes)})


# ---------------------------------------------------------------------------------------------
# the run


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: ~1M parameters, 1 round")
    p.add_argument("--params", type=float, help="parameters of the built model (default 100e6)")
    p.add_argument("--source", default="captcha_crnn", help="real model whose weights are tiled")
    p.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    p.add_argument("--rows", help=f"comma-separated subset of {','.join(ROWS)} (default: both)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per measuring process")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        one(json.loads(args.one))
        return 0
    load = os.getloadavg()
    rounds = args.rounds or (1 if args.quick else 3)
    params = int(args.params or (1e6 if args.quick else 100e6))
    rows = tuple(args.rows.split(",")) if args.rows else ROWS
    if set(rows) - set(ROWS):
        p.error(f"unknown --rows: choose from {', '.join(ROWS)}")
    source = bench.ROOT / "models" / "real" / f"{args.source}.onnx"
    if not source.is_file():
        p.error(f"{source.name} is missing: run `python scripts/fetch_models.py` first")
    shapes = shapes_for(params, args.quick)
    with tempfile.TemporaryDirectory(prefix="opscope-bench-weights-") as tmp:
        bench._log(f"building {sum(r * c for r, c in shapes) / 1e6:.1f}M parameters in {tmp} ...")
        path = build_model(Path(tmp), weight_pool(source), shapes)
        results: dict[str, list[dict]] = {r: [] for r in rows}
        for k in range(rounds):
            for row in rows:
                bench._log(f"round {k + 1}/{rounds}: {row}")
                results[row].append(bench.run_child({"row": row, "model": str(path)}, args.timeout, SCRIPT))
        data_mb = (Path(tmp) / "weights.bin").stat().st_size / MB
    largest = max(r * c for r, c in shapes) * 4 / MB
    lines = report(argv, load, rounds, shapes, data_mb, largest, args.source, results)
    print("\n".join(lines))
    return 0


def report(argv, load, rounds, shapes, data_mb, largest, source, results) -> list[str]:
    total = sum(r * c for r, c in shapes)
    out = [
        "## Environment",
        "",
        f"- command: `python scripts/bench_weights.py{' ' if argv else ''}{' '.join(argv)}`",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- machine: {platform.platform()}; {bench._cpu_model()}; {os.cpu_count()} logical cores; {bench._mem_total()}",
        f"- python {platform.python_version()}; numpy {np.__version__}",
        f"- load average (1 min) at start / end: {load[0]:.1f} / {os.getloadavg()[0]:.1f}",
        f"- {rounds} round(s), interleaved; each (row, round) in a fresh process",
        "",
        "## Model",
        "",
        f"- {total / 1e6:.1f}M float32 parameters in {len(shapes)} tensors ({data_mb:.0f} MB of external "
        f"data), tiled from {source}'s weights: an embedding {shapes[0][0]}x{shapes[0][1]} (Gather)"
        + "".join(f", {n} MatMul weights {r}x{c}" for (r, c), n in Counter(shapes[1:]).items()),
        f"- largest tensor: {largest:.0f} MB",
        "",
        "## Time and memory",
        "",
        "| row | seconds | extra peak MB | x largest tensor | M params / s |",
        "|---|---|---|---|---|",
    ]
    for row, runs in results.items():
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            out.append(f"| {row} | {errors[0]} | | | |")
            continue
        secs = [r["seconds"] for r in runs]
        extra = statistics.median(r["extra"] for r in runs) / MB
        med = statistics.median(secs)
        out.append(
            f"| {row} | {med:.1f} [{min(secs):.1f}–{max(secs):.1f}] | {extra:.0f} | {extra / largest:.1f} "
            f"| {total / 1e6 / med:.1f} |"
        )
    ours = [r["seconds"] for r in results.get("probe_weights", []) if "error" not in r]
    if ours:
        verdict = "met" if statistics.median(ours) < GOAL_S else "NOT met"
        if total < 100e6:
            verdict = "not judged (the model is under 100M parameters)"
        out += [
            "",
            f"Goal (issue 14): the probes of a 100M-parameter model in under {GOAL_S:.0f} s: {verdict}.",
        ]
    return out


if __name__ == "__main__":
    sys.exit(main())
