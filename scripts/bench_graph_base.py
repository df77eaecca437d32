"""Which graph base for opscope: raw protobuf, onnx-ir or onnx-graphsurgeon, measured on one edit.

    python scripts/bench_graph_base.py [--nodes 160000] [--weights-gb 2] [--runs 3] [--dir DIR] [--quick]

Two models, built once with the project's own builders into a temporary folder (deleted at
the end): `wide.onnx` = zoo.wide_graph(--nodes) (160k nodes, 40k MatMuls, small inline
weights) and `big.onnx` + `big.onnx.data` = zoo.write_external_weights_model (--weights-gb
of float32 weights in an external data file, 8 MatMuls).

Every candidate does the same edit, starting from the model file on disk:
1. load it without reading external weight data (protobuf: onnx.load(load_external_data=False);
   onnx-ir: onnx_ir.load, whose external tensors stay lazy; graphsurgeon: gs.import_onnx of
   that proto, whose constants keep the TensorProto as LazyValues);
2. index the main graph: the producer and the consumers of every tensor;
3. for every MatMul output, append ReduceMin, ReduceMax and ReduceSumSquare (keepdims=0, no
   axes) and make the three results graph outputs (float32, rank 0) after the original ones;
4. save beside the source (onnx.save_model for protobuf and graphsurgeon, onnx_ir.save for
   onnx-ir), so external data stays referenced by its relative location.
A 4th row runs the project's own pipeline, opscope `inject(path)` + `save_model`: it taps
every MatMul operand and output with the default sketch set, so it does far more work and
its ratio is not like-for-like.

Each (candidate, model, round) runs in a fresh Python subprocess, rounds interleaved (round 1
of every candidate before round 2 of any); the OS page cache is warm for all alike. Times:
wall time of load, edit (index + taps) and save, and their sum. Peak RSS: VmHWM from
/proc/self/status after the save minus VmHWM after importing the candidate's library, before
the load. After each run the parent checks the result outside the timing: the wide model
with onnx.checker.check_model(path), the big one by its number of outputs, the size of the
saved .onnx (no weight inlined), its external locations, and the data file's inode, size and
mtime (not rewritten), and that no other large file appeared (not copied). Prints the median
and min-max of --runs runs, and the ratio of medians to the protobuf row.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = ("_min", "_max", "_sumsq")
TAP_OPS = ("ReduceMin", "ReduceMax", "ReduceSumSquare")
CHILD_TIMEOUT_S = 1800
SMALL_ONNX_BYTES = 16 * 1024**2  # a saved big.onnx above this has inlined weights


def vm_hwm_mb() -> float:
    """The process's peak resident set size so far, MB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


# --------------------------------------------------------------------------------------------
# children: one candidate, one model, one round each; each returns (load, edit, save) seconds


class Clock:
    """Lap times of one edit: `lap(name)` records the seconds since the previous lap."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now


def edit_protobuf(src: str, out: str) -> tuple[Clock, int]:
    import onnx
    from onnx import TensorProto, helper

    clock = Clock()
    model = onnx.load(src, load_external_data=False)
    clock.lap("load")
    graph = model.graph
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            if name:
                consumers.setdefault(name, []).append(i)
        for name in node.output:
            if name:
                producer[name] = i
    tapped = [name for name, i in producer.items() if graph.node[i].op_type == "MatMul"]
    new_nodes, new_outputs = [], []
    for t in tapped:
        for op_type, suffix in zip(TAP_OPS, SUFFIXES):
            res = t + suffix
            new_nodes.append(helper.make_node(op_type, [t], [res], name=f"{t}/tap{suffix}", keepdims=0))
            new_outputs.append(helper.make_tensor_value_info(res, TensorProto.FLOAT, []))
    graph.node.extend(new_nodes)
    graph.output.extend(new_outputs)
    clock.lap("edit")
    onnx.save_model(model, out)
    clock.lap("save")
    return clock, len(tapped)


def edit_onnx_ir(src: str, out: str) -> tuple[Clock, int]:
    import onnx_ir as ir

    clock = Clock()
    model = ir.load(src)
    clock.lap("load")
    graph = model.graph
    producer: dict[str, ir.Node] = {}
    consumers: dict[str, list[ir.Node]] = {}
    outputs_of: dict[str, ir.Value] = {}
    for node in graph:
        for v in node.inputs:
            if v is not None:
                consumers.setdefault(v.name, []).append(node)
        for v in node.outputs:
            producer[v.name] = node
            outputs_of[v.name] = v
    tapped = [name for name, node in producer.items() if node.op_type == "MatMul"]
    for t in tapped:
        value = outputs_of[t]
        for op_type, suffix in zip(TAP_OPS, SUFFIXES):
            res = ir.Value(name=t + suffix, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
            node = ir.node(op_type, [value], {"keepdims": 0}, outputs=[res], name=f"{t}/tap{suffix}")
            graph.append(node)
            graph.outputs.append(res)
    clock.lap("edit")
    ir.save(model, out)  # external_data=None: external tensors are written with their references as is
    clock.lap("save")
    return clock, len(tapped)


def edit_graphsurgeon(src: str, out: str) -> tuple[Clock, int]:
    import numpy as np
    import onnx
    import onnx_graphsurgeon as gs

    clock = Clock()
    graph = gs.import_onnx(onnx.load(src, load_external_data=False))
    clock.lap("load")
    producer: dict[str, gs.Node] = {}
    consumers: dict[str, list[gs.Node]] = {}
    tensor_of: dict[str, gs.Tensor] = {}
    for node in graph.nodes:
        for t in node.inputs:
            consumers.setdefault(t.name, []).append(node)
        for t in node.outputs:
            producer[t.name] = node
            tensor_of[t.name] = t
    tapped = [name for name, node in producer.items() if node.op == "MatMul"]
    for t in tapped:
        tensor = tensor_of[t]
        for op_type, suffix in zip(TAP_OPS, SUFFIXES):
            res = gs.Variable(t + suffix, dtype=np.float32, shape=[])
            graph.nodes.append(
                gs.Node(
                    op_type, name=f"{t}/tap{suffix}", attrs={"keepdims": 0}, inputs=[tensor], outputs=[res]
                )
            )
            graph.outputs.append(res)
    clock.lap("edit")
    model = gs.export_onnx(graph)  # constants still hold their (external) TensorProto, untouched
    onnx.save_model(model, out)
    clock.lap("save")
    return clock, len(tapped)


def opscope_api() -> tuple[Callable, Callable]:
    from onnx_opscope import inject, save_model

    return inject, save_model


def edit_opscope(src: str, out: str) -> tuple[Clock, int]:
    inject, save_model = opscope_api()
    clock = Clock()
    model, manifest = inject(src)
    clock.lap("edit")  # load + sites + taps: not split
    save_model(model, out, base_dir=Path(src).parent)
    clock.lap("save")
    return clock, len(manifest.taps)


Edit = Callable[[str, str], tuple[Clock, int]]
CANDIDATES: dict[str, tuple[str, str | None, Edit]] = {
    # key: (label, module that must be importable, edit)
    "protobuf": ("protobuf (onnx.ModelProto)", "onnx", edit_protobuf),
    "onnx_ir": ("onnx-ir", "onnx_ir", edit_onnx_ir),
    "graphsurgeon": ("onnx-graphsurgeon", "onnx_graphsurgeon", edit_graphsurgeon),
    "opscope": ("opscope inject (full default taps)", "onnx_opscope", edit_opscope),
}
INSTALL = {"onnx_ir": "pip install onnx-ir", "onnx_graphsurgeon": "pip install onnx-graphsurgeon"}
IMPORTS: dict[str, Callable[[], object]] = {  # run before the RSS baseline: it holds the library itself
    "protobuf": lambda: importlib.import_module("onnx"),
    "onnx_ir": lambda: importlib.import_module("onnx_ir"),
    "graphsurgeon": lambda: importlib.import_module("onnx_graphsurgeon"),
    "opscope": opscope_api,
}


def child(candidate: str, src: str, out: str) -> dict[str, Any]:
    IMPORTS[candidate]()
    base = vm_hwm_mb()
    t0 = time.perf_counter()
    clock, taps = CANDIDATES[candidate][2](src, out)
    total = time.perf_counter() - t0
    return {
        "total_s": total,
        **{f"{k}_s": v for k, v in clock.laps.items()},
        "rss_mb": vm_hwm_mb() - base,
        "taps": taps,
    }


def run_child(candidate: str, src: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", candidate, str(src), str(out)]
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    lines = res.stdout.strip().splitlines()
    if res.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    why = err[-1].strip() if err else f"exit status {res.returncode}"
    return {"error": why if res.returncode > 0 else f"killed by signal {-res.returncode}"}


# --------------------------------------------------------------------------------------------
# parent: models, checks, table


def file_id(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def folder_sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}


def check_wide(out: Path, n_outputs: int | None) -> list[str]:
    import onnx

    onnx.checker.check_model(str(out))
    got = len(onnx.load(str(out), load_external_data=False).graph.output)
    if n_outputs is not None and got != n_outputs:
        return [f"{got} outputs, expected {n_outputs}"]
    return ["check_model ok"]


def check_big(
    out: Path, n_outputs: int | None, data: Path, data_id: tuple[int, int, int], before: dict
) -> list[str]:
    """Notes on what the save did with external data and on anything wrong with the saved model."""
    import onnx

    notes = []
    if file_id(data) != data_id:
        notes.append("rewrote external data")
    copies = {n: s for n, s in folder_sizes(out.parent).items() if n not in before and n != out.name}
    if any(s > SMALL_ONNX_BYTES for s in copies.values()):
        notes.append(f"copied external data ({', '.join(copies)})")
    size = out.stat().st_size
    if size > SMALL_ONNX_BYTES:
        notes.append(f"inlined weights ({size / 2**20:.0f} MB .onnx)")
    model = onnx.load(str(out), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    if locations != {data.name}:
        notes.append(f"external locations {sorted(locations)}")
    got = len(model.graph.output)
    if n_outputs is not None and got != n_outputs:
        notes.append(f"{got} outputs, expected {n_outputs}")
    return notes or [
        f"kept the reference to {data.name} (not rewritten, not copied; .onnx {size / 1024:.0f} KB)"
    ]


def measure(
    candidate: str, src: Path, out: Path, expect_outputs: int | None, data: Path | None
) -> dict[str, Any]:
    before = folder_sizes(src.parent)
    data_id = file_id(data) if data else None
    result = run_child(candidate, src, out)
    if "error" not in result:
        try:
            if data is None:
                result["notes"] = check_wide(out, expect_outputs)
            else:
                result["notes"] = check_big(out, expect_outputs, data, data_id, before)
        except Exception as exc:  # an invalid saved model is a result, not a crash
            result["notes"] = [f"invalid: {one_line(exc)}"]
    for p in src.parent.iterdir():  # the saved model (and anything it wrote beside) goes
        if p.name not in before:
            p.unlink()
    return result


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def n_outputs_expected(src: Path) -> tuple[int, int]:
    """(outputs the same-work edit must leave, MatMul count) of the model at `src`."""
    import onnx

    g = onnx.load(str(src), load_external_data=False).graph
    matmuls = sum(1 for n in g.node if n.op_type == "MatMul")
    return len(g.output) + 3 * matmuls, matmuls


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def versions() -> str:
    from importlib import metadata

    import google.protobuf
    from google.protobuf.internal import api_implementation

    parts = [f"python {platform.python_version()}"]
    for dist in ("onnx", "onnx-ir", "onnx-graphsurgeon", "protobuf", "numpy"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    parts.append(f"(protobuf {google.protobuf.__version__}, {api_implementation.Type()} backend)")
    return ", ".join(parts)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def row_text(model: str, candidate: str, results: list[dict], proto_med: float | None) -> list[str]:
    label, module, _ = CANDIDATES[candidate]
    if module is not None and importlib.util.find_spec(module) is None:
        return [
            model,
            label,
            "-",
            "-",
            "-",
            "-",
            f"not installed ({INSTALL.get(module, 'pip install ' + module)})",
        ]
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    if not ok:
        return [model, label, "-", "-", "-", "-", f"failed: {errors[0]}"]
    times = [r["total_s"] for r in ok]
    med = statistics.median(times)
    if proto_med is None or candidate == "protobuf":
        ratio = "1.00x" if candidate == "protobuf" else "-"
    else:
        ratio = f"{med / proto_med:.2f}x" if candidate != "opscope" else f"({med / proto_med:.1f}x)"
    split = "/".join(
        f"{statistics.median(r[k] for r in ok):.3f}" if k in ok[0] else "-"
        for k in ("load_s", "edit_s", "save_s")
    )
    notes = sorted({n for r in ok for n in r.get("notes", [])})
    if candidate == "opscope":
        notes.insert(0, f"{ok[0]['taps']} taps, more work: ratio not like-for-like")
    else:
        notes.insert(0, f"{ok[0]['taps']} MatMuls tapped")
    if errors:
        notes.append(f"{len(errors)} of {len(results)} runs failed: {errors[0]}")
    return [
        model,
        label,
        spread(times, ".3f"),
        ratio,
        split,
        spread([r["rss_mb"] for r in ok], ".0f"),
        "; ".join(notes),
    ]


def print_table(rows: list[list[str]]) -> None:
    head = [
        "model",
        "candidate",
        "median s (min-max)",
        "vs protobuf",
        "load/edit/save s",
        "extra peak RSS MB",
        "notes",
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    for r in [head, ["-" * w for w in widths] + ["-----"], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=160_000, help="nodes of the wide graph")
    ap.add_argument("--weights-gb", type=float, default=2.0, help="GiB of external weights of the big model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to make the scratch folder (default: tmp)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 10k nodes, 64 MiB of weights, 1 run")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        try:
            result = child(*args.child)
        except Exception as exc:
            traceback.print_exc()
            result = {"error": one_line(exc)}
        print(json.dumps(result))
        return 0
    if args.quick:
        args.nodes, args.weights_gb, args.runs = 10_000, 64 / 1024, 1

    from onnx_opscope import zoo

    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"versions: {versions()}")
    print(f"onnx_opscope from: {Path(zoo.__file__).parent}")
    print(f"load average (1/5/15 min) at start: {load_avg()}")
    scratch = Path(tempfile.mkdtemp(prefix="opscope-bench-graph-base-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        wide_dir, big_dir = scratch / "wide", scratch / "big"
        wide_dir.mkdir()
        wide = wide_dir / "wide.onnx"
        with open(wide, "wb") as f:
            f.write(zoo.wide_graph(args.nodes).SerializeToString())
        big = zoo.write_external_weights_model(big_dir, total_bytes=int(args.weights_gb * 1024**3))
        data = big.parent / "big.onnx.data"
        print(
            f"models: wide.onnx {args.nodes} nodes ({wide.stat().st_size / 2**20:.1f} MB), "
            f"big.onnx {big.stat().st_size / 1024:.1f} KB + big.onnx.data {data.stat().st_size / 2**30:.2f} GiB, "
            f"written in {time.perf_counter() - t0:.1f} s"
        )
        models = {
            f"wide_graph({args.nodes})": (wide, None, *n_outputs_expected(wide)),
            f"external {args.weights_gb:g} GiB": (big, data, *n_outputs_expected(big)),
        }
        installed = [
            c for c, (_, mod, _) in CANDIDATES.items() if mod is None or importlib.util.find_spec(mod)
        ]
        results: dict[tuple[str, str], list[dict]] = {(m, c): [] for m in models for c in CANDIDATES}
        for r in range(args.runs):
            for m, (src, data_file, n_out, _) in models.items():
                for c in installed:
                    expect = n_out if c != "opscope" else None
                    res = measure(c, src, src.parent / f"{src.stem}.{c}.r{r}.onnx", expect, data_file)
                    results[(m, c)].append(res)
                    status = res.get("error") or f"{res['total_s']:.2f} s, {res['rss_mb']:.0f} MB"
                    print(f"  round {r + 1}/{args.runs}  {m:<24} {c:<13} {status}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    for m in models:
        proto = [r["total_s"] for r in results[(m, "protobuf")] if "error" not in r]
        proto_med = statistics.median(proto) if proto else None
        rows.extend(row_text(m, c, results[(m, c)], proto_med) for c in CANDIDATES)
    print(f"\nload average (1/5/15 min) at end: {load_avg()}")
    print(
        f"median of {args.runs} runs (min-max), each in a fresh process; extra peak RSS = VmHWM after - after imports"
    )
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
