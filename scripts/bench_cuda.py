"""Recording on a GPU provider: what the taps cost once outputs cross the bus and every node is a launch.

    python scripts/bench_cuda.py                          # CUDA, every model: rounds that fit 400 s
    python scripts/bench_cuda.py --quick                  # CUDA, bert_like (2 layers) + captcha_crnn: 100 s
    python scripts/bench_cuda.py --provider cpu --quick   # the same rows on CPU: the smoke path

On CPU a session's outputs are handed over without a copy; on CUDA each extra output is a
device-to-host copy and each tap node a kernel launch, so the balance between sampled and
exact histograms (counted in the graph) and copying small tensors out whole is measured here
again rather than carried over from bench.py. Rows per model (every MatMul/Gemm tapped, or
the convolutions / LSTMs of the models without): plain `session.run`; plain with IOBinding
(all batches' inputs put on the device once, outputs left there: what a GPU service does); the
opscope rows as `record` builds them for the provider (default set with sampled or exact
histograms, small tensors copied out, `--sketch all`, min+max), each also through IOBinding
(model outputs stay on the device, tap outputs bound to CPU memory); onnxruntime's
MinMaxCalibrater on the same provider.

Measured as bench.py measures (its case preparation and child runner are reused): a fresh
process per (model, row, round), rounds interleaved, a row's figure the median over rounds of
the median per-batch wall time; ratios are taken against the plain rows of the same round
(× plain: `session.run`; × plain IOBinding), shown as median (min–max) over rounds. Extra
memory: peak RSS and the GPU's used memory at the end of the run (nvidia-smi; onnxruntime's
arena does not shrink, so it holds its peak) minus the plain row's. `--budget` starts a round
only when the rounds so far say it will end in time, so a default run fits a GPU lease.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - a sibling script: its cases, child runner and environment helpers
import bench_peers as peers  # noqa: E402 - the measuring helpers every bench child uses

MB = 1024**2
DEFAULT_MODELS = ("bert_like", *bench._REAL)
QUICK_MODELS = ("bert_like", "captcha_crnn")
KNOWN_MODELS = ("bert_like", "bert_like_mixed", "bert_like_add", "resnet_like", "tiny_taps", *bench._REAL)
IOB = ", IOBinding"
CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # plain | opscope | calibrator
    args: dict = field(default_factory=dict)
    iobinding: bool = False


PLAIN = "plain"
PLAIN_IOB = "plain" + IOB
_OPSCOPE = [
    ("opscope default set, sampled hist", {"sketches": None, "hist_mode": "sampled"}),
    ("opscope default set, exact hist (counted in the graph)",
     {"sketches": None, "hist_mode": "exact", "force": {"exact_counts": "graph"}}),
    ("opscope default set, small tensors copied out (copy_out_max 4096)",
     {"sketches": None, "hist_mode": "sampled", "force": {"copy_out_max": 4096}}),
    ("opscope --sketch all, sampled hist", {"sketches": ["all"], "hist_mode": "sampled"}),
    ("opscope min+max", {"sketches": ["min", "max"], "hist_mode": "sampled"}),
]  # fmt: skip
ROWS: list[Row] = [
    Row(PLAIN, "plain"),
    Row(PLAIN_IOB, "plain", iobinding=True),
    *(Row(name + suffix, "opscope", args, iobinding=bool(suffix)) for name, args in _OPSCOPE for suffix in ("", IOB)),
    Row("ORT MinMaxCalibrater", "calibrator", {"method": "MinMax"}),
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the measuring side (one `--one JOB` process per measurement)


def _device(providers: list[str]) -> str:
    """The OrtValue device of the first provider: where IOBinding keeps inputs and model outputs."""
    return "cuda" if providers[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else "cpu"


def _on_device(batches: list[peers.Feeds], device: str) -> list[dict]:
    """Every batch's inputs as OrtValues on `device`, uploaded before timing (they live there)."""
    import onnxruntime as ort

    return [{k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in b.items()} for b in batches]


def bound_runner(
    sess: Any, batches: list[peers.Feeds], device: str, host_outputs: set[str]
) -> tuple[Callable[[dict], list], list[dict], list[str], int]:
    """IOBinding of `sess`: (step, every batch's inputs on `device`, output names, outputs rebound per run).

    Every output is bound once, those in `host_outputs` to CPU memory and the others to `device`,
    and onnxruntime reuses the bound buffers run after run, as a service would. A reused buffer of
    another shape is an error, so the outputs whose shape differs between the batches (one untimed
    pass over them finds those) are bound afresh before each run. `step(inputs)` runs one batch and
    returns its outputs as OrtValues in the order of the names.
    """
    names = [o.name for o in sess.get_outputs()]
    where = {n: "cpu" if n in host_outputs else device for n in names}
    shapes: dict[str, set] = {n: set() for n in names}
    for b in batches:
        for n, v in zip(names, sess.run(None, b)):
            shapes[n].add(np.shape(v))
    varying = [n for n in names if len(shapes[n]) > 1]
    io = sess.io_binding()
    for n in names:
        io.bind_output(n, where[n])

    def step(inputs: dict) -> list:
        for k, v in inputs.items():
            io.bind_ortvalue_input(k, v)
        for n in varying:
            io.bind_output(n, where[n])
        sess.run_with_iobinding(io)  # synchronous: onnxruntime waits for the device stream before returning
        return io.get_outputs()  # in binding order: `names`

    return step, _on_device(batches, device), names, len(varying)


def host_array(value: Any) -> np.ndarray | None:
    """A CPU-bound output as `session.run` gives it: a copy (the bound buffer is reused by the next
    run), or None for an output the run did not produce (a tap in an If branch not taken)."""
    return value.numpy().copy() if value.is_tensor() else None


def gpu_used_mb() -> float | None:
    """Memory in use on the GPU this process sees (nvidia-smi), None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return float(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def run_plain(job: dict) -> dict:
    """The model alone on the provider: `session.run` with outputs to the host, or IOBinding."""
    from onnx_opscope.run.session import RuntimeConfig, make_session

    batches = peers.load_batches(job["feeds"])
    sess = make_session(job["model"], RuntimeConfig(providers=job["providers"], threads=job["threads"]))
    if not job["iobinding"]:
        return {"times": peers.timed(lambda f: sess.run(None, f), batches, job["warmup"]), "tensors": None}
    step, feeds, _, rebound = bound_runner(sess, batches, _device(job["providers"]), set())
    note = f"{rebound} outputs rebound per run (shapes vary)" if rebound else ""
    return {"times": peers.timed(step, feeds, job["warmup"]), "tensors": None, "note": note}


def run_opscope(job: dict) -> dict:
    """What `record` does per batch on the provider: inject as it injects for those providers, run,
    decode the tap outputs into a table part on the pipeline thread (overlapping the next run; batches
    that pile up go as one group, as in `record`).

    With IOBinding the model's own outputs stay on the device and only the tap outputs are fetched
    (bound to CPU memory, copied off the reused buffers before the next run overwrites them).
    """
    from onnx_opscope.instrument import host_values, inject
    from onnx_opscope.run.recorder import BatchDecoder, BatchPipeline, PartMaker
    from onnx_opscope.run.session import RuntimeConfig, for_tapped, make_session
    from onnx_opscope.sites import Selection
    from onnx_opscope.sketch import SketchOptions, for_providers

    providers = job["providers"]
    batches = peers.load_batches(job["feeds"])
    options = for_providers(SketchOptions(hist_mode=job["hist_mode"]), providers)
    options = replace(options, **job.get("force", {}))  # what the row asks for, whatever the provider
    shapes = {k: list(v.shape) for k, v in batches[0].items()}
    model, manifest = inject(
        job["model"],
        Selection(op_types=tuple(job["ops"])),
        job["sketches"],
        options,
        providers=providers,
        input_shapes=shapes,
    )
    host = host_values(manifest, model)
    config = for_tapped(RuntimeConfig(providers=providers, threads=job["threads"]))
    sess = make_session(model, config, base_dir=str(Path(job["model"]).parent), take_weights=True)
    del model
    decoder = BatchDecoder(manifest, host, ("bench", "cpu", "uniform"), "parquet")
    parts = PartMaker(decoder)  # what `record` does with a group of batches, but the write
    original = set(manifest.original_outputs)
    rebound = 0
    if job["iobinding"]:
        taps = {o.name for o in sess.get_outputs()} - original
        run_bound, feeds, names, rebound = bound_runner(sess, batches, _device(providers), taps)

        def step(inputs: dict) -> dict:
            return {n: host_array(v) for n, v in zip(names, run_bound(inputs)) if n in taps}

    else:
        names = [o.name for o in sess.get_outputs()]

        def step(inputs: dict) -> dict:
            return dict(zip(names, sess.run(None, inputs)))

        feeds: list = batches

    def pipeline() -> BatchPipeline:
        return BatchPipeline(lambda group: collections.deque(parts(group), maxlen=0))

    times = peers.timed(step, feeds, job["warmup"], pipeline)
    live = sum(not t.constant for t in manifest.taps)
    copied = sum(t.copied for t in manifest.taps)
    note = f"{len(names) - len(original)} tap outputs; copy_out_max {options.copy_out_max}" + (
        f", {copied} copied out" if copied else ""
    )
    if options.hist_mode == "exact":
        note += f"; exact_counts {options.exact_counts}"
    if rebound:
        note += f"; {rebound} outputs rebound per run (shapes vary)"
    return {"times": times, "tensors": live, "note": note}


def run_calibrator(job: dict) -> dict:
    """onnxruntime's MinMaxCalibrater on the same provider where create_calibrator takes one, timed as
    bench.py times it: collect_data over the N batches (MinMax computes inside it), divided by N."""
    from onnxruntime.quantization.calibrate import (
        CalibrationDataReader,
        CalibrationMethod,
        create_calibrator,
    )

    CalibrationDataReader.register(peers._Reader)
    batches = peers.load_batches(job["feeds"])
    kwargs: dict[str, Any] = {}
    where = "on CPU (this onnxruntime's create_calibrator takes no providers)"
    if "providers" in inspect.signature(create_calibrator).parameters:
        kwargs["providers"], where = job["providers"], f"on {job['providers'][0]}"
    with tempfile.TemporaryDirectory(prefix="opscope-cal-") as tmp:
        cal = create_calibrator(
            Path(job["model"]),
            job["ops"],
            augmented_model_path=str(Path(tmp) / "aug.onnx"),
            calibrate_method=getattr(CalibrationMethod, job["method"]),
            **kwargs,
        )
        n_tensors = len(cal.select_tensors_to_calibrate(cal.model)[0])
        cal.collect_data(peers._Reader(batches[: job["warmup"]]))
        cal.calibrate_tensors_range = None  # forget the warm-up batches
        t0 = time.perf_counter()
        cal.collect_data(peers._Reader(batches))
        seconds = time.perf_counter() - t0
    return {"times": [seconds / len(batches)], "tensors": n_tensors, "note": where}


def run_probe(job: dict) -> dict:
    """A one-node session on the provider: does it start, and on what (before any model is measured)."""
    from onnx import TensorProto, helper

    from onnx_opscope.run.session import RuntimeConfig, make_session

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    sess = make_session(model, RuntimeConfig(providers=job["providers"]))
    sess.run(None, {"x": np.ones(4, np.float32)})
    return {"started": sess.get_providers()}


def one(job: dict) -> None:
    """The `--one` side: the imports every measurement makes, one measurement, one RESULT line."""
    import onnxruntime  # noqa: F401 - the same imports in every process: RSS differences are the work

    import onnx_opscope.instrument  # noqa: F401
    import onnx_opscope.run  # noqa: F401

    with contextlib.suppress(ImportError):
        import onnxruntime.quantization.calibrate  # noqa: F401
    if job.get("threads"):
        peers.pin_threads(job["threads"])
    kinds = {"plain": run_plain, "opscope": run_opscope, "calibrator": run_calibrator, "probe": run_probe}
    try:
        result = kinds[job["kind"]](job)
    except Exception as exc:  # the row shows the error; the run goes on
        result = {"error": peers.one_line(exc)}
    result["peak_rss"] = peers.peak_rss()
    if job.get("device_memory"):
        result["gpu_mb"] = gpu_used_mb()
    peers.emit(result)


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Settings:
    providers: list[str]
    rounds: int
    batches: int
    warmup: int
    budget: float  # seconds; 0: no limit
    timeout: float
    threads: int | None


Results = dict[tuple[str, str], dict[int, dict]]  # (model, row) -> round -> the child's result


def run_rounds(cases: list[bench.Case], rows: list[Row], s: Settings) -> tuple[Results, int]:
    """Every (case, row) once per round, rounds interleaved. A round starts only when the longest one so
    far says it ends within the budget; past the budget, the rest of a round is left out."""
    out: Results = {}
    start = time.perf_counter()
    longest = 0.0
    done = 0
    for r in range(s.rounds):
        elapsed = time.perf_counter() - start
        if r and s.budget and elapsed + longest > s.budget:
            _log(
                f"round {r + 1} left out: {elapsed:.0f} s + {longest:.0f} s would pass --budget {s.budget:.0f} s"
            )
            break
        t_round = time.perf_counter()
        for case in cases:
            if case.missing:
                continue
            for row in rows:
                if s.budget and time.perf_counter() - start > s.budget:
                    out.setdefault((case.name, row.name), {})[r] = {"error": "not run: past --budget"}
                    continue
                job = {
                    "kind": row.kind,
                    **row.args,
                    "iobinding": row.iobinding,
                    "model": str(case.model),
                    "feeds": str(case.feeds),
                    "ops": case.ops,
                    "warmup": s.warmup,
                    "threads": s.threads,
                    "providers": s.providers,
                    "device_memory": s.providers[0] != CPU,
                }
                t0 = time.perf_counter()
                res = bench.run_child(job, s.timeout, script=Path(__file__).resolve())
                out.setdefault((case.name, row.name), {})[r] = res
                shown = res.get("error") or f"{1e3 * statistics.median(res['times']):.3f} ms/batch"
                _log(
                    f"[round {r + 1}/{s.rounds}] {case.name}: {row.name}: {shown} ({time.perf_counter() - t0:.1f} s)"
                )
        longest = max(longest, time.perf_counter() - t_round)
        done = r + 1
    return out, done


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Figure:
    ms: float | None = None
    ratios: dict[str, list[float]] = field(default_factory=dict)  # baseline row -> per-round ratios
    extra_mb: float | None = None
    extra_gpu_mb: float | None = None
    tensors: int | None = None
    note: str = ""
    error: str | None = None


def _median_time(res: dict) -> float:
    return statistics.median(res["times"])


def summarize(results: Results, case: str, row: str) -> Figure:
    """Median ms over rounds; ratios and extra memory against each baseline row of the same round."""
    runs = results.get((case, row), {})
    good = {r: v for r, v in runs.items() if "error" not in v}
    if not good:
        return Figure(error=next((v["error"] for v in runs.values()), "not run"))
    middle = sorted(good.values(), key=_median_time)[(len(good) - 1) // 2]
    fig = Figure(
        ms=1e3 * statistics.median(_median_time(v) for v in good.values()),
        tensors=middle.get("tensors"),
        note=middle.get("note", ""),
    )
    if len(good) < len(runs):
        fig.note += f"; {len(runs) - len(good)} round(s) failed: {next(v['error'] for v in runs.values() if 'error' in v)}"
    for base_row in (PLAIN, PLAIN_IOB):
        base = results.get((case, base_row), {})
        pairs = [(v, base[r]) for r, v in good.items() if r in base and "error" not in base[r]]
        if pairs:
            fig.ratios[base_row] = [_median_time(v) / _median_time(b) for v, b in pairs]
    plain = results.get((case, PLAIN), {})
    pairs = [(v, plain[r]) for r, v in good.items() if r in plain and "error" not in plain[r]]
    if pairs:
        fig.extra_mb = statistics.median(v["peak_rss"] - b["peak_rss"] for v, b in pairs) / MB
        gpu = [
            v["gpu_mb"] - b["gpu_mb"]
            for v, b in pairs
            if v.get("gpu_mb") is not None and b.get("gpu_mb") is not None
        ]
        fig.extra_gpu_mb = statistics.median(gpu) if gpu else None
    return fig


def _ratio_cell(values: list[float] | None) -> str:
    if not values:
        return "–"
    med = f"{statistics.median(values):.2f}"
    return med if len(values) == 1 else f"{med} ({min(values):.2f}–{max(values):.2f})"


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(cases: list[bench.Case], rows: list[Row], results: Results) -> list[str]:
    lines = [
        "| model | measurement | tensors | ms / batch | × plain | × plain IOBinding | extra peak RSS MB | "
        "extra GPU MB | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for case in cases:
        head = f"**{case.name}**"
        if case.missing:
            lines.append(f"| {head} | (all rows) | | | | | | | {case.missing} |")
            continue
        for row in rows:
            f = summarize(results, case.name, row.name)
            if f.error:
                lines.append(f"| {head} | {row.name} | | | | | | | **failed**: {f.error.replace('|', '/')} |")
            else:
                lines.append(
                    f"| {head} | {row.name} | {_fmt(f.tensors, 'd')} | {_fmt(f.ms, '.3f')} | "
                    f"{_ratio_cell(f.ratios.get(PLAIN))} | {_ratio_cell(f.ratios.get(PLAIN_IOB))} | "
                    f"{_fmt(f.extra_mb, '+.0f')} | {_fmt(f.extra_gpu_mb, '+.0f')} | {f.note.replace('|', '/')} |"
                )
            head = ""
    return lines


def gpu_lines() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return ["- GPU: no nvidia-smi on this machine"]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return [f"- GPU: nvidia-smi failed ({peers.one_line(exc)})"]
    return [f"- GPU {line}" for line in out.splitlines()] or ["- GPU: nvidia-smi lists none"]


def environment(s: Settings, argv: list[str], started: list[str], rounds_done: int) -> list[str]:
    import onnxruntime as ort
    from onnxruntime.capi import build_and_package_info as build

    cuda = ", ".join(
        f"{k} {getattr(build, k)}" for k in ("cuda_version", "cudnn_version") if hasattr(build, k)
    )
    dists = ", ".join(
        f"{d} {bench._version(d)}"
        for d in ("onnx-opscope", "onnxruntime", "onnxruntime-gpu", "onnx", "numpy")
    )
    budget = f"--budget {s.budget:.0f} s" if s.budget else "no --budget"
    return [
        f"- command: `python scripts/bench_cuda.py{' ' if argv else ''}{' '.join(argv)}`",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- machine: {platform.platform()}; {bench._cpu_model()}; {os.cpu_count()} logical cores; {bench._mem_total()}",
        *gpu_lines(),
        f"- python {platform.python_version()}; {dists}; onnxruntime build: {cuda or 'no CUDA in its build info'}",
        f"- providers available: {', '.join(ort.get_available_providers())}; requested {', '.join(s.providers)}; "
        f"a session started with {', '.join(started)}",
        f"- threads: {s.threads or 'onnxruntime default'}; IOBinding device: {_device(s.providers)}",
        f"- {rounds_done} of {s.rounds} round(s) run ({budget}), interleaved; per measurement {s.warmup} warm-up + "
        f"{s.batches} timed batches; each (model, row, round) in a fresh process",
    ]


def _fail(message: str) -> int:
    print(f"bench_cuda.py: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", default="cuda", help="execution provider, short or full name (default cuda)")
    p.add_argument(
        "--models",
        help=f"comma-separated (default {','.join(DEFAULT_MODELS)}; quick: "
        f"{','.join(QUICK_MODELS)}); also {', '.join(n for n in KNOWN_MODELS if n not in DEFAULT_MODELS)}",
    )
    p.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    p.add_argument("--batches", type=int, help="timed batches per measurement (default 20, quick 5)")
    p.add_argument("--threads", type=int, help="intra-op threads in every session (default: onnxruntime's)")
    p.add_argument(
        "--budget", type=float, help="seconds the rows may take; 0: no limit (default 400, quick 100)"
    )
    p.add_argument(
        "--quick", action="store_true", help="~2 min on a GPU: 1 round, 5 batches, bert_like 2 layers"
    )
    p.add_argument("--rows", help="only these rows, names separated by ';' (the plain rows are always run)")
    p.add_argument("--out", type=Path, help="also write the Markdown report here")
    p.add_argument("--json", type=Path, help="also write the raw per-round results here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        one(json.loads(args.one))
        return 0
    from onnx_opscope.errors import OpscopeError, did_you_mean
    from onnx_opscope.run.session import resolve_providers

    try:
        providers = resolve_providers(args.provider)
    except OpscopeError as exc:
        return _fail(
            f"{exc} (run it where that provider is installed, e.g. `pip install onnxruntime-gpu` for "
            "cuda, or pass --provider cpu for the smoke run)"
        )
    models = args.models.split(",") if args.models else list(QUICK_MODELS if args.quick else DEFAULT_MODELS)
    for m in models:
        if m not in KNOWN_MODELS:
            return _fail(
                f"unknown model {m!r}{did_you_mean(m, KNOWN_MODELS)}; known: {', '.join(KNOWN_MODELS)}"
            )
    rows = ROWS
    if args.rows:
        wanted = {r.strip() for r in args.rows.split(";") if r.strip()}
        names = [r.name for r in ROWS]
        for w in wanted - set(names):
            return _fail(f"unknown row {w!r}{did_you_mean(w, names)}; rows: {'; '.join(names)}")
        rows = [r for r in ROWS if r.name in wanted | {PLAIN, PLAIN_IOB}]
    s = Settings(
        providers,
        args.rounds or (1 if args.quick else 3),
        args.batches or (5 if args.quick else 20),
        1 if args.quick else 3,
        args.budget if args.budget is not None else (100 if args.quick else 400),
        90,
        args.threads,
    )
    started = providers
    # installed is not started (CUDA/cuDNN libraries missing): one line now, rather than a table of failures
    if providers[0] != CPU:
        probe = bench.run_child(
            {"kind": "probe", "providers": providers}, s.timeout, script=Path(__file__).resolve()
        )
        if "error" in probe:
            return _fail(f"{providers[0]} does not start a session here: {probe['error']}")
        started = probe["started"]
    with tempfile.TemporaryDirectory(prefix="opscope-bench-cuda-") as tmp:
        work = Path(tmp)
        _log(f"preparing models and feeds in {work} ...")
        cases = _cases(work, args.quick, s.batches, models)
        results, done = run_rounds(cases, rows, s)
    env = environment(s, argv, started, done)
    report = [
        "## Environment", "", *env, "",
        "## Models and feeds", "", *bench.case_lines(cases), "",
        f"## Time and memory on {providers[0]}", "", *table(cases, rows, results),
    ]  # fmt: skip
    if args.quick:
        report += ["", "(quick mode: a smoke run; its figures say little about speed)"]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        raw = {f"{k[0]} | {k[1]}": v for k, v in results.items()}
        args.json.write_text(json.dumps({"environment": env, "rounds": done, "rows": raw}, indent=1))
    return 0


def _cases(work: Path, quick: bool, n: int, models: list[str]) -> list[bench.Case]:
    """bench.py's cases, in the order asked; quick makes bert_like its 2-layer variant."""
    cases = bench.prepare_cases(work, True, n, {"bert_like"}) if quick and "bert_like" in models else []
    rest = set(models) - {"bert_like"} if quick else set(models)
    if rest:
        cases += bench.prepare_cases(work, False, n, rest)
    order = {m: i for i, m in enumerate(models)}
    return sorted(cases, key=lambda c: order[c.name])


if __name__ == "__main__":
    sys.exit(main())
