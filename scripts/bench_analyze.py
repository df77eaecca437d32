"""Time `opscope analyze` on a 160k-node graph and on the real models; compare with onnx-tool.

    python scripts/bench_analyze.py [--nodes 160000] [--runs 3] [--skip-real] [--no-peer]

The big graph is one chain of MatMul -> Add -> Mul blocks with tiny per-block weights
(x [4, 8], W [8, 8]), built directly with onnx.helper. Goal: analyze() well under 10 s.
When onnx_tool is importable (it is not a dependency: `pip install onnx-tool` to compare),
the same models are profiled with it too and both FLOP totals are printed side by side.
Prints the median of --runs runs for each timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx_opscope.analysis import analyze  # noqa: E402

REAL = ["ppocrv4_rec", "ppocrv4_det", "silero_vad_v6", "captcha_crnn", "magika_standard_v3_3"]
REAL_SHAPES = {
    "ppocrv4_rec": {"x": [1, 3, 48, 320]},
    "ppocrv4_det": {"x": [1, 3, 640, 640]},
    "silero_vad_v6": {"input": [1, 512], "state": [2, 1, 128], "sr": []},
    "captcha_crnn": {"image": [1, 3, 60, 160]},
    "magika_standard_v3_3": {"bytes": [1, 2048]},
}


def chain_model(n_nodes: int, rows: int = 4, width: int = 8) -> onnx.ModelProto:
    """MatMul/Add/Mul blocks, each with its own tiny weights: 3 nodes and 3 initializers per block."""
    rng = np.random.default_rng(0)
    blocks = n_nodes // 3
    nodes, inits = [], []
    w = (rng.standard_normal((width, width)) * 0.1).astype(np.float32)
    b = (rng.standard_normal(width) * 0.1).astype(np.float32)
    prev = "x"
    for i in range(blocks):
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"))
        nodes.append(helper.make_node("Mul", [f"a{i}", f"s{i}"], [f"y{i}"], name=f"mul{i}"))
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        inits.append(numpy_helper.from_array(b, f"b{i}"))
        inits.append(numpy_helper.from_array(b, f"s{i}"))
        prev = f"y{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [rows, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def median_time(fn, runs: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def median_wall_cpu(fn, runs: int) -> tuple[float, float, object]:
    """Median wall and CPU seconds: on a shared machine the CPU figure is the steadier one."""
    walls, cpus, out = [], [], None
    for _ in range(runs):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), out


def onnx_tool_flops(path: Path, shapes: dict | None) -> tuple[float | None, str]:
    """(total MACs x 2, status) from onnx-tool's profiler, or (None, why) when it fails.

    onnx-tool reports MACs and counts an elementwise op as 1 MAC per element, so its x2
    figure runs above ours on elementwise-heavy graphs; GEMM/conv-heavy ones compare directly.
    """
    try:
        import onnx_tool
    except ImportError:
        return None, "onnx_tool not installed"
    try:
        m = onnx_tool.Model(str(path))
        g = m.graph
        feeds = {k: np.zeros(v, dtype=np.float32) for k, v in (shapes or {}).items() if v}
        g.shape_infer(feeds or None)
        g.profile()
        return float(g.macs[0]) * 2, "ok"
    except Exception as exc:  # noqa: BLE001 - the peer's failure is the finding
        return None, f"failed: {type(exc).__name__}: {str(exc)[:60]}"


def peer_in_child(
    path: Path, shapes: dict | None, runs: int, timeout: float
) -> tuple[float | None, str, str]:
    """Median seconds, FLOPs and status of onnx-tool in a child process killed after `timeout` s."""
    cmd = [
        sys.executable,
        "-W",
        "ignore",
        __file__,
        "--peer-one",
        str(path),
        json.dumps(shapes or {}),
        "--runs",
        str(runs),
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, None, f"not done in {timeout:.0f} s"
    try:
        secs, flops, status = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, None, f"crashed: {out.stderr.strip()[-80:]}"
    return secs, flops, status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=160_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--no-peer", action="store_true", help="do not time onnx-tool even if installed")
    ap.add_argument("--peer-timeout", type=float, default=180, help="seconds before a peer run is abandoned")
    ap.add_argument("--peer-one", nargs=2, metavar=("MODEL", "SHAPES_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_one:  # child process: time onnx-tool on one model, print one JSON line
        path, shapes = Path(args.peer_one[0]), json.loads(args.peer_one[1])
        secs, (flops, status) = median_time(lambda: onnx_tool_flops(path, shapes), args.runs)
        print(json.dumps([secs, flops, status]))
        return 0

    try:
        from importlib.metadata import version

        peer = None if args.no_peer else f"onnx-tool {version('onnx-tool')}"
    except Exception:  # noqa: BLE001 - not installed
        peer = None
    print(f"python {sys.version.split()[0]}, onnx {onnx.__version__}; peer: {peer or 'none'}")

    t0 = time.perf_counter()
    big = chain_model(args.nodes)
    print(f"built {len(big.graph.node)}-node chain in {time.perf_counter() - t0:.1f} s")
    secs, cpu, rep = median_wall_cpu(lambda: analyze(big), args.runs)
    print(
        f"analyze, {len(big.graph.node)} nodes: median {secs:.2f} s wall, {cpu:.2f} s CPU over {args.runs} "
        f"runs ({1e6 * secs / len(big.graph.node):.1f} us/node), FLOPs {rep.totals['flops']:.6g}, "
        f"goal < 10 s: {'met' if secs < 10 else 'MISSED'}"
    )
    print(f"  shape sources: {rep.shape_sources}")

    with tempfile.TemporaryDirectory() as tmp:
        models: list[tuple[str, Path, dict | None]] = []
        if peer:
            for n in (10_000, 40_000, args.nodes):
                p = Path(tmp) / f"chain{n}.onnx"
                onnx.save(big if n == args.nodes else chain_model(n), str(p))
                models.append((f"chain {n // 1000}k", p, None))
        if not args.skip_real:
            for name in REAL:
                p = ROOT / "models" / "real" / f"{name}.onnx"
                if p.is_file():
                    models.append((name, p, REAL_SHAPES[name]))
                else:
                    print(f"{name}: not fetched (scripts/fetch_models.py)")
        rows = []
        for name, path, shapes in models:
            given = {k: v for k, v in (shapes or {}).items() if v}
            secs, rep = median_time(lambda p=path, s=given: analyze(p, shapes=s), args.runs)
            ours = rep.totals["flops"]
            row = [name, f"{secs:.3f}", f"{ours:.4g}" if ours is not None else rep.totals["flops_expr"][:20]]
            if peer:
                psecs, pflops, status = peer_in_child(path, shapes, args.runs, args.peer_timeout)
                ratio = f"{pflops / ours:.3f}" if pflops and ours else "-"
                row += [
                    f"{psecs:.3f}" if psecs is not None else "-",
                    f"{pflops:.4g}" if pflops else status,
                    ratio,
                ]
            rows.append(row)
    head = ["model", "opscope s", "opscope FLOPs"]
    if peer:
        head += ["onnx-tool s", "onnx-tool FLOPs (2 x MACs)", "theirs/ours"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
