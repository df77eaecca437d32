"""The measuring side of scripts/bench.py: one measurement per process, printed as one JSON line.

Every function here runs inside a fresh `bench.py --one` process, so its peak RSS belongs to
that measurement alone. Each loads the same feeds (an .npz the parent wrote), builds what it
measures (a session, an instrumented model, a calibrator), warms it up, then times N batches.
Peer tools (onnxruntime.quantization, polygraphy, onnx-tool) are imported only inside the
function that measures them: none of them is needed by onnx-opscope or its tests.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

Feeds = dict[str, np.ndarray]
RESULT_TAG = "RESULT "


# ---------------------------------------------------------------------------------------------
# process-level helpers


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """Peak resident set size of this process in bytes (VmHWM; getrusage where /proc is missing)."""
    kb = _status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb * 1024


def current_rss() -> int:
    kb = _status_kb("VmRSS")
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak() -> bool:
    """Restart the VmHWM count from the current RSS (Linux clear_refs "5"), so setup is not counted."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def pin_threads(n: int) -> None:
    """Give every onnxruntime session of this process `n` intra-op threads, the peers' too.

    The calibrators and polygraphy build their own SessionOptions with no thread knob, so the
    class itself is replaced by a subclass whose instances start with `n` threads.
    """
    import onnxruntime as ort

    base = ort.SessionOptions

    class Pinned(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.intra_op_num_threads = n

    ort.SessionOptions = Pinned


def one_line(exc: BaseException, limit: int = 150) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def emit(result: dict[str, Any]) -> None:
    """The one line the parent reads; everything else a peer prints is ignored."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def load_batches(path: str | os.PathLike) -> list[Feeds]:
    """Batches stored as `<index>/<input name>` arrays in one .npz."""
    batches: dict[int, Feeds] = {}
    with np.load(path) as z:
        for key in z.files:
            i, name = key.split("/", 1)
            batches.setdefault(int(i), {})[name] = z[key]
    return [batches[i] for i in sorted(batches)]


def timed(
    step: Callable[[Feeds], Any], batches: list[Feeds], warmup: int, pipeline: Callable[[], Any] | None = None
) -> list[float]:
    """Seconds per batch of `step` over `batches`, after `warmup` untimed calls: the timed batches' wall
    time divided by their number (every row alike: the calibrators' time is theirs over N too). With a
    `pipeline()`, each step's outputs go to a fresh one, as `record` hands them on, and the clock runs
    until it has taken every batch in: work it holds back (batches it groups) is counted, where a
    per-batch median would leave it out. The warm-up goes through a pipeline of its own."""
    steps = itertools.count()

    def through(feeds_list: list[Feeds]) -> None:
        pipe = pipeline() if pipeline else None
        for feeds in feeds_list:
            outputs = step(feeds)
            if pipe is not None:
                pipe.submit(next(steps), outputs)
        if pipe is not None:
            pipe.close()

    through([batches[i % len(batches)] for i in range(warmup)])
    t0 = time.perf_counter()
    through(batches)
    return [(time.perf_counter() - t0) / len(batches)] * len(batches)


def main_graph_tensors(model_path: str, ops: list[str]) -> list[str]:
    """Float tensors read or written by `ops` nodes of the main graph, initializers excluded.

    The same rule as onnxruntime's CalibraterBase.select_tensors_to_calibrate (which needs the
    type from shape inference too), so the copy-out rows and the calibrators see the same tensors.
    """
    model = onnx.shape_inference.infer_shapes(onnx.load(model_path, load_external_data=False))
    g = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.output, *g.value_info]}
    consts = {i.name for i in g.initializer} | {n.output[0] for n in g.node if n.op_type == "Constant"}
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
    out: dict[str, None] = {}
    for node in g.node:
        if node.op_type in ops:
            for name in [*node.input, *node.output]:
                if name and name not in consts and types.get(name) in floats:
                    out[name] = None
    return list(out)


def host_stats(x: np.ndarray, bins: int = 32) -> tuple:
    """What a copy-out tool computes per tensor on the host: min, max, mean, std, 32-bin histogram."""
    v = np.asarray(x, np.float32).ravel()
    if not v.size:
        return ()
    lo, hi = float(v.min()), float(v.max())
    if not (np.isfinite(lo) and np.isfinite(hi)):
        v = v[np.isfinite(v)]
        if not v.size:
            return ()
        lo, hi = float(v.min()), float(v.max())
    m = max(abs(lo), abs(hi)) or 1.0
    counts, _ = np.histogram(v, bins=bins, range=(-m, m))
    return lo, hi, float(v.mean()), float(v.std()), counts


# ---------------------------------------------------------------------------------------------
# rows


def _session(model: str | onnx.ModelProto, graph_opt: str, base_dir: str | None = None):
    from onnx_opscope.run.session import RuntimeConfig, make_session

    return make_session(model, RuntimeConfig(graph_opt=graph_opt), base_dir=base_dir)


def run_plain(job: dict, graph_opt: str) -> dict:
    """The model alone: every output fetched, nothing else."""
    batches = load_batches(job["feeds"])
    sess = _session(job["model"], graph_opt)
    times = timed(lambda f: sess.run(None, f), batches, job["warmup"])
    return {"times": times, "tensors": None}


def instrumented(
    model: str, ops: list[str], shapes: dict, sketches: list[str] | None, options: Any = None
) -> tuple[onnx.ModelProto, Any]:
    """`model` instrumented as `record` would on the CPU provider, its taps sized at `shapes` (the first
    batch's): (model, manifest). `options`: a `SketchOptions` (default: the defaults)."""
    from onnx_opscope.instrument import inject
    from onnx_opscope.sites import Selection
    from onnx_opscope.sketch import SketchOptions, for_providers

    options = for_providers(options or SketchOptions(), ["CPUExecutionProvider"])
    return inject(model, Selection(op_types=tuple(ops)), sketches, options, input_shapes=shapes)


def run_opscope(
    job: dict, sketches: list[str] | None, hist_mode: str, decode_rows: bool | str = True
) -> dict:
    """What `record` does per batch, on the session it makes: run (all outputs), then decode the
    sketches into a table part (Parquet bytes, as `record` writes them) on its pipeline thread,
    overlapping the next run; batches that pile up meanwhile go as one group, as in `record`
    (`decode_rows=False` leaves the decoding out, "rows" the Parquet encoding, to show what each costs)."""
    from onnx_opscope.instrument import host_values
    from onnx_opscope.run.recorder import BatchDecoder, BatchPipeline, PartMaker
    from onnx_opscope.run.session import RuntimeConfig, for_tapped, make_session
    from onnx_opscope.sketch import SketchOptions

    batches = load_batches(job["feeds"])
    options = SketchOptions(hist_mode=hist_mode, copy_out_max=job.get("copy_out_max"))
    shapes = {k: list(v.shape) for k, v in batches[0].items()}  # taps sized at the first batch, as `record`
    model, manifest = instrumented(job["model"], job["ops"], shapes, sketches, options)
    host = host_values(
        manifest, model
    )  # weight taps: once, on the host, from the model in memory, as `record`
    sess = make_session(
        model, for_tapped(RuntimeConfig()), base_dir=str(Path(job["model"]).parent), take_weights=True
    )  # as `record` does
    del model
    names = [o.name for o in sess.get_outputs()]
    decoder = BatchDecoder(manifest, host, ("bench", "cpu", "uniform"), "parquet")
    parts = PartMaker(decoder)  # what `record` does with a group of batches, but the write

    def step(feeds: Feeds) -> dict:
        return dict(zip(names, sess.run(None, feeds)))

    def pipeline() -> BatchPipeline:
        if decode_rows == "rows":
            return BatchPipeline(decoder.table)
        return BatchPipeline(lambda group: collections.deque(parts(group), maxlen=0))

    times = timed(step, batches, job["warmup"], pipeline if decode_rows else None)
    live = sum(not t.constant for t in manifest.taps)
    copied = sum(t.copied for t in manifest.taps)
    note = f"+{len(manifest.taps) - live} weight taps (host, once)" + (
        f"; {copied} copied out" if copied else ""
    )
    return {"times": times, "tensors": live, "copied": copied, "note": note}


FLOOR_READERS = {
    "+ Shape": ("Shape",),
    "+ ReduceMax": ("ReduceMax",),
    "+ 4 reductions": ("ReduceMin", "ReduceMax", "ReduceSum", "ReduceSumSquare"),
}
"""Bare readers of the tensors a set taps (`with_readers`): reading them at all, one whole-tensor pass, and
the default set's four passes (its min, max, sum and finite check Σx²) with none of its structure."""


def with_readers(model: onnx.ModelProto, tensors: list[str], ops: tuple[str, ...]) -> onnx.ModelProto:
    """`model` with each of `tensors` read by each of `ops` (reductions keepdims 0), the results leaving as
    one output per op (each graph output costs ~2 µs a run: the default set packs its scalars too)."""
    from onnx import TensorProto, helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    one = "floor_one"
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), one))
    for op in ops:
        parts = []
        for k, t in enumerate(tensors):
            out = f"floor_{op}_{k}"
            attrs = {} if op == "Shape" else {"keepdims": 0}
            m.graph.node.append(helper.make_node(op, [t], [out], name=f"floor_n_{op}_{k}", **attrs))
            if op != "Shape":  # a scalar, made [1] for the Concat
                m.graph.node.append(
                    helper.make_node("Reshape", [out, one], [f"{out}_1"], name=f"floor_r_{op}_{k}")
                )
                out = f"{out}_1"
            parts.append(out)
        if parts:
            m.graph.node.append(
                helper.make_node("Concat", parts, [f"floor_{op}"], name=f"floor_c_{op}", axis=0)
            )
            elem = TensorProto.INT64 if op == "Shape" else TensorProto.FLOAT
            m.graph.output.append(helper.make_tensor_value_info(f"floor_{op}", elem, [None]))
    return m


def in_graph_tensors(manifest: Any) -> list[str]:
    """The main-graph tensors a manifest's taps reduce in the graph (not copied out, not weights)."""
    return sorted({t.tensor for t in manifest.taps if not (t.constant or t.copied or t.graph)})


def run_floor(job: dict) -> dict:
    """The default set's floor: the tensors its in-graph main-graph taps read, each reduced by its four
    whole-tensor passes and nothing else (`with_readers`), run as `record` runs a tapped model."""
    from onnx_opscope.run.session import RuntimeConfig, for_tapped, make_session

    batches = load_batches(job["feeds"])
    shapes = {k: list(v.shape) for k, v in batches[0].items()}
    _, manifest = instrumented(job["model"], job["ops"], shapes, None)
    tensors = in_graph_tensors(manifest)
    read = with_readers(onnx.load(job["model"]), tensors, FLOOR_READERS["+ 4 reductions"])
    sess = make_session(read, for_tapped(RuntimeConfig()), base_dir=str(Path(job["model"]).parent))
    times = timed(lambda f: sess.run(None, f), batches, job["warmup"])
    return {
        "times": times,
        "tensors": len(tensors),
        "note": "" if tensors else "no tap in the main graph's own nodes",
    }


class _Reader:
    """A CalibrationDataReader over a list of feeds (the protocol: get_next() until None)."""

    def __init__(self, batches: list[Feeds]):
        self._it = iter(batches)

    def get_next(self) -> Feeds | None:
        return next(self._it, None)


def run_calibrator(job: dict, method: str, extra_options: dict | None = None) -> dict:
    """onnxruntime.quantization.calibrate.create_calibrator(model, op types, method), as installed.

    Timed: collect_data over all N batches plus compute_data, divided by N (MinMax calls
    compute_data inside collect_data). Untimed: create_calibrator (augment, save, session) and
    one warm-up collect_data, whose state is dropped before the timed pass; create_calibrator's
    seconds are returned as `setup_s`. `extra_options` go to create_calibrator (e.g. num_bins).
    """
    from onnxruntime.quantization.calibrate import CalibrationDataReader, CalibrationMethod, create_calibrator

    CalibrationDataReader.register(_Reader)
    batches = load_batches(job["feeds"])
    with tempfile.TemporaryDirectory(prefix="opscope-cal-") as tmp:
        t_setup = time.perf_counter()
        cal = create_calibrator(
            Path(job["model"]),
            job["ops"],
            augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=getattr(CalibrationMethod, method),
            extra_options=extra_options or {},
        )
        setup_s = time.perf_counter() - t_setup
        n_tensors = len(cal.select_tensors_to_calibrate(cal.model)[0])
        cal.collect_data(_Reader(batches[: job["warmup"]]))
        for attr in ("collector", "calibrate_tensors_range"):  # forget the warm-up batches
            if hasattr(cal, attr):
                setattr(cal, attr, None)
        t0 = time.perf_counter()
        cal.collect_data(_Reader(batches))
        t1 = time.perf_counter()
        if method != "MinMax":
            cal.compute_data()
        t2 = time.perf_counter()
    n = len(batches)
    note = f"collect {1e3 * (t1 - t0) / n:.1f} ms/batch + compute {1e3 * (t2 - t1):.0f} ms"
    return {"times": [(t2 - t0) / n], "tensors": n_tensors, "note": note, "setup_s": setup_s}


def run_copy_out(job: dict, via: str) -> dict:
    """Mark the tensors as outputs, fetch them every batch and compute `host_stats` with numpy.

    `via="onnx"` edits the graph outputs with onnx and runs a plain session (optimizations on);
    `via="polygraphy"` does it the way `polygraphy run --onnx-outputs` does (ModifyOutputs,
    SessionFromOnnx, OnnxrtRunner).
    """
    batches = load_batches(job["feeds"])
    tensors = main_graph_tensors(job["model"], job["ops"])
    if via == "polygraphy":
        from polygraphy.backend.onnx import BytesFromOnnx, ModifyOutputs, OnnxFromPath
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
        from polygraphy.logger import G_LOGGER

        G_LOGGER.module_severity = G_LOGGER.ERROR
        originals = [o.name for o in onnx.load(job["model"], load_external_data=False).graph.output]
        marked = ModifyOutputs(OnnxFromPath(job["model"]), originals + tensors)
        runner = OnnxrtRunner(SessionFromOnnx(BytesFromOnnx(marked)))
        runner.activate()

        def step(feeds: Feeds) -> None:
            out = runner.infer(feeds)
            for name in tensors:
                host_stats(out[name])

        times = timed(step, batches, job["warmup"])
        runner.deactivate()
        return {"times": times, "tensors": len(tensors)}
    model = onnx.shape_inference.infer_shapes(onnx.load(job["model"]))
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*model.graph.input, *model.graph.value_info]}
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(
        onnx.helper.make_tensor_value_info(t, types.get(t, onnx.TensorProto.FLOAT), None)
        for t in tensors
        if t not in have
    )
    sess = _session(model, "all")
    del model
    names = [o.name for o in sess.get_outputs()]
    wanted = set(tensors)

    def step_onnx(feeds: Feeds) -> None:
        for name, value in zip(names, sess.run(None, feeds)):
            if name in wanted:
                host_stats(value)

    return {"times": timed(step_onnx, batches, job["warmup"]), "tensors": len(tensors)}


# ---------------------------------------------------------------------------------------------
# injection, analysis, FLOP totals


def run_inject(job: dict) -> dict:
    """inject_file on a model whose weights are external: time and extra peak RSS of that call."""
    from onnx_opscope.instrument import inject_file
    from onnx_opscope.sites import Selection

    src = Path(job["model"])
    clean = reset_peak()
    base = current_rss()
    t0 = time.perf_counter()
    inject_file(src, src.with_name("big.opscope.onnx"), sites=Selection(op_types=("MatMul",)))
    seconds = time.perf_counter() - t0
    extra = peak_rss() - base
    data = sum(f.stat().st_size for f in src.parent.glob("*.data"))
    return {"seconds": seconds, "extra_rss": extra, "weights": data, "peak_reset": clean}


def run_analyze(job: dict) -> dict:
    """onnx_opscope.analyze on zoo.wide_graph(n): time and extra peak RSS of the call."""
    try:
        from onnx_opscope import analysis as costs
    except ImportError as exc:
        return {"skipped": f"onnx_opscope.analysis not importable yet ({one_line(exc)})"}
    from onnx_opscope import zoo

    model = zoo.wide_graph(job["nodes"])
    clean = reset_peak()
    base = current_rss()
    t0 = time.perf_counter()
    report = costs.analyze(model, dims={"batch": 1})
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "extra_rss": peak_rss() - base,
        "nodes": len(model.graph.node),
        "flops": report.totals.get("flops"),
        "peak_reset": clean,
    }


def run_flops(job: dict) -> dict:
    """FLOP totals at the feed shapes: onnx_opscope.analyze beside onnx-tool (2 x its MACs)."""
    shapes = {k: list(v.shape) for k, v in load_batches(job["feeds"])[0].items()}
    out: dict[str, Any] = {}
    try:
        from onnx_opscope import analysis as costs

        t0 = time.perf_counter()
        report = costs.analyze(job["model"], shapes=shapes)
        out["ours"] = report.totals.get("flops")
        out["ours_s"] = time.perf_counter() - t0
        out["ours_unknown"] = report.totals.get("flops_unknown_nodes")
    except ImportError as exc:
        out["ours_error"] = f"onnx_opscope.analysis not importable yet ({one_line(exc)})"
    except Exception as exc:  # a benchmark reports a failure in its row and goes on
        out["ours_error"] = one_line(exc)
    try:
        import onnx_tool
    except ImportError:
        out["tool_error"] = "onnx-tool not installed"
        return out
    try:
        t0 = time.perf_counter()
        m = onnx_tool.Model(job["model"], {"verbose": False})
        feeds = load_batches(job["feeds"])[0]
        m.graph.shape_infer({k: np.zeros(v.shape, v.dtype) for k, v in feeds.items()})
        m.graph.profile()
        out["tool"] = 2.0 * float(m.graph.macs[0])
        out["tool_s"] = time.perf_counter() - t0
    except BaseException as exc:  # onnx-tool may call exit() on models it cannot read
        out["tool_error"] = one_line(exc)
    return out


# ---------------------------------------------------------------------------------------------
# profiling (for BENCHMARKS.md: where the time of an instrumented model goes)


def profile_ops(
    model_path: str, batches: list[Feeds], ops: list[str], sketches: list[str] | None, hist_mode: str
) -> dict[str, dict[tuple[str, bool], list[float]]]:
    """onnxruntime's per-node profile by (op type, node is ours): [ms, node runs] per batch, plain vs tapped.

    Node names of tap subgraphs start with "opscope_". The first run is a warm-up and left
    out. Container nodes (If, Loop, Scan) are left out too: their time is the sum of the nodes
    inside them, which the profile lists on their own.
    """
    import onnxruntime as ort

    from onnx_opscope.instrument import inject
    from onnx_opscope.run.session import RuntimeConfig, for_tapped
    from onnx_opscope.sites import Selection
    from onnx_opscope.sketch import SketchOptions

    result = {}
    instrumented, _ = inject(
        model_path, Selection(op_types=tuple(ops)), sketches, SketchOptions(hist_mode=hist_mode)
    )
    with tempfile.TemporaryDirectory(prefix="opscope-prof-") as tmp:
        for label, model in (("plain", model_path), ("opscope", instrumented)):
            cfg = RuntimeConfig(graph_opt="all")
            so = (for_tapped(cfg) if label == "opscope" else cfg).session_options()
            so.enable_profiling = True
            so.profile_file_prefix = str(Path(tmp) / label)
            src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
            sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
            for feeds in [batches[0], *batches]:
                sess.run(None, feeds)
            events = json.loads(Path(sess.end_profiling()).read_text())
            result[label] = _aggregate(events, len(batches))
    return result


def _aggregate(events: list[dict], runs: int) -> dict[tuple[str, bool], list[float]]:
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    lo = spans[1][0] if len(spans) > 1 else 0
    out: dict[tuple[str, bool], list[float]] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < lo:
            continue
        op = e.get("args", {}).get("op_name", "?")
        if op in ("If", "Loop", "Scan"):
            continue
        key = (op, e["name"].startswith("opscope_"))
        acc = out.setdefault(key, [0.0, 0.0])
        acc[0] += e["dur"] / 1e3 / runs
        acc[1] += 1 / runs
    return out
