"""What an exact histogram costs per element on onnxruntime's CPU provider, against numpy's.

The calibration goal "entropy / percentile 4x faster than onnxruntime's calibrators" meets a
floor here: those calibrators copy each tensor out and call np.histogram, and no onnxruntime
CPU kernel counts faster than that. This script measures, on one float32 tensor, per element:

- one elementwise op (Mul), the unit every tap op costs;
- Gather from a small table and ScatterElements(add), the two kernels counting could use;
- Unique with counts (the sort opsets 11-15 offer);
- the histogram pass's own subgraphs (`calibration.histograms.add_histogram_taps` on an
  Identity model), counted on the host (np.bincount of the narrow indices) and in the graph;
- np.histogram on the same values, and the model's output copy that precedes it in the peers.

    python scripts/bench_counting.py                 # 4M elements, 2048 bins, 1 thread, 7 runs
    python scripts/bench_counting.py --bins 128 --elements 1000000

Medians over the runs, [min-max]; ratios against np.histogram. The figures are per element and
so independent of the model; what a model adds is its own run (twice: the min/max pass and this
one) and how many elements its calibrated tensors hold.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnx_opscope.calibration.histograms import _accumulate, add_histogram_taps, bin_edges


def _model(nodes, inits, outputs) -> ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        [helper.ValueInfoProto(name=o) for o in outputs],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _session(model: ModelProto, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time(fn: Callable[[], object], runs: int) -> list[float]:
    fn()
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _kernels(x: np.ndarray, bins: int, threads: int) -> dict[str, Callable[[], object]]:
    """Each measured kernel alone, on ready-made inputs (indices precomputed where it takes them)."""
    idx = np.clip((x - x.min()) / (x.max() - x.min()) * bins, 0, bins - 1).astype(np.int64)
    table = numpy_helper.from_array(np.linspace(0, 1, bins + 1).astype(np.float32), "table")
    mul = _session(
        _model(
            [helper.make_node("Mul", ["x", "s"], ["y"])], [numpy_helper.from_array(np.float32(2), "s")], ["y"]
        ),
        threads,
    )
    ints = helper.make_tensor_value_info("i", TensorProto.INT64, [None])

    def int_model(node, inits, out):
        m = _model([node], inits, [out])
        m.graph.input[0].CopyFrom(ints)
        return _session(m, threads)

    gather = int_model(helper.make_node("Gather", ["table", "i"], ["y"]), [table], "y")
    zeros = numpy_helper.from_array(np.zeros(bins, np.int64), "z")
    ones = numpy_helper.from_array(np.ones(x.size, np.int64), "one")
    scatter = int_model(
        helper.make_node("ScatterElements", ["z", "i", "one"], ["y"], reduction="add"), [zeros, ones], "y"
    )
    unique = int_model(helper.make_node("Unique", ["i"], ["u", "a", "b", "c"], sorted=1), [], "c")
    return {
        "Mul (one elementwise op)": lambda: mul.run(None, {"x": x}),
        "Gather from a [bins+1] table": lambda: gather.run(None, {"i": idx}),
        "ScatterElements(add), int64": lambda: scatter.run(None, {"i": idx}),
        "Unique with counts (sort)": lambda: unique.run(None, {"i": idx}),
    }


def _passes(x: np.ndarray, bins: int, threads: int) -> dict[str, Callable[[], object]]:
    """The histogram pass's own subgraph per element, both ways of counting, and numpy's histogram."""
    lo, hi = float(-np.abs(x).max()), float(np.abs(x).max())
    out: dict[str, Callable[[], object]] = {}
    for host in (True, False):
        model = _model([helper.make_node("Identity", ["x"], ["y"])], [], ["y"])
        tap = add_histogram_taps(model, {"y": (lo, hi)}, bins, "minmax", host_counts=host)[0]
        session = _session(model, threads)

        def count(session=session, tap=tap):
            acc = np.zeros(bins + 2, np.int64)
            _accumulate(acc, session.run([tap.counts], {"x": x})[0], tap)
            return acc

        out[f"opscope pass, {'host np.bincount' if host else 'ScatterElements'}"] = count
    copy = _session(_model([helper.make_node("Identity", ["x"], ["y"])], [], ["y"]), threads)
    edges = bin_edges(lo, hi, bins)
    out["copy-out (an Identity output)"] = lambda: copy.run(None, {"x": x})
    out["np.histogram (the peers' count)"] = lambda: np.histogram(x, bins, range=(edges[0], edges[-1]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=1 << 22, help="tensor size (default 4M)")
    p.add_argument("--bins", type=int, default=2048, help="histogram bins (default 2048)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--runs", type=int, default=7, help="timed runs per row (default 7)")
    args = p.parse_args(argv)
    x = np.random.default_rng(0).standard_normal(args.elements).astype(np.float32)
    rows = {**_kernels(x, args.bins, args.threads), **_passes(x, args.bins, args.threads)}
    times = {name: _time(fn, args.runs) for name, fn in rows.items()}
    ref = statistics.median(times["np.histogram (the peers' count)"])
    print(f"{args.elements} float32 elements, {args.bins} bins, {args.threads} thread(s), {args.runs} runs")
    print(f"| {'measurement':40s} | ns / element, median [min-max] | × np.histogram |")
    print(f"|{'-' * 42}|{'-' * 32}:|{'-' * 15}:|")
    for name, ts in times.items():
        ns = [t / args.elements * 1e9 for t in ts]
        med = statistics.median(ns)
        print(
            f"| {name:40s} | {med:7.2f} [{min(ns):.2f}-{max(ns):.2f}] | {statistics.median(ts) / ref:13.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
