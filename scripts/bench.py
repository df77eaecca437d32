"""Benchmarks against the peers: the same models, the same feeds, the same tensors, one table.

    python scripts/bench.py                 # full run (tens of minutes on 2 cores)
    python scripts/bench.py --quick         # CI smoke run, under a minute: never judge speed by it
    python scripts/bench.py --profile       # where an instrumented bert_like spends its time
    python scripts/bench.py --sketches-alone --models bert_like --skip-extras   # each sketch alone
    python scripts/bench.py --big 2,6       # models of LLM size: memory and start-up (bench_big.py)

Rows, per model (the tapped ops are every MatMul/Gemm, or the convolutions / LSTMs of the
models that have none): plain inference with graph optimizations on and off; onnx-opscope
with the default sketch set (sampled and exact histogram) and two cut-down sets; onnxruntime's
MinMax / Entropy / Percentile calibrators (`onnxruntime.quantization.calibrate`, their
default settings, `op_types_to_calibrate` = the same ops); marking the same tensors as outputs
and histogramming them on the host with numpy, by hand and through polygraphy's loaders
(what `polygraphy run --onnx-outputs` does) when polygraphy is installed.

How it is measured: every (model, row) runs in a fresh process (`--one`), rounds are
interleaved (round 1 of every row before round 2 of any), and a row's figure is the median
over rounds of the median per-batch wall time over N batches after W warm-up batches. A
batch is everything a user needs for the statistics: session.run (all outputs) plus the
host-side work (opscope: decode into table rows, also shown without; copy-out: numpy min/max/mean/std/32-bin histogram); for the
calibrators, (collect_data over the N batches + compute_data) / N. Extra peak memory is the
process's peak RSS (VmHWM) minus that of the plain-inference process on the same model; ratios and
extra memory are taken against the plain row of the same round, then the median over rounds.
Every process imports the same libraries first, so the difference is the work, not imports.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers as peers  # noqa: E402 - a sibling module of this script, not a package

ROOT = Path(__file__).resolve().parent.parent
REAL = Path(os.environ.get("OPSCOPE_MODELS", ROOT / "models" / "real"))
MB = 1024**2
LOAD = os.getloadavg()

# ---------------------------------------------------------------------------------------------
# what is measured


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # plain | opscope | calibrator | copyout
    args: dict = field(default_factory=dict)
    quick: bool = False
    requires: str | None = None  # a module that must be importable, else the row says so


PLAIN = "plain, graph opt all"
DEFAULT = "opscope default set, sampled hist"
DEFAULT_RUN = "opscope default set, sampled hist, run only (no decode)"
DEFAULT_ROWS = "opscope default set, sampled hist, decoded to rows (no Parquet)"
EXACT = "opscope default set, exact hist"
ALL = "opscope all sketches (--sketch all), sampled hist"
FLOOR = "the default set's four passes alone (its floor)"
IN_GRAPH = "opscope default set, every tap in the graph (--copy-out-max 0)"
IN_GRAPH_RUN = "opscope default set, every tap in the graph, run only"
COPY_OUT = "copy-out + numpy hist"
POLYGRAPHY = "polygraphy --onnx-outputs + numpy hist"

ROWS: list[Row] = [
    Row(PLAIN, "plain", {"graph_opt": "all"}, quick=True),
    Row("plain, graph opt off", "plain", {"graph_opt": "disable"}),
    Row("opscope taps only (elemsig)", "opscope", {"sketches": ["elemsig"], "hist_mode": "sampled"}),
    Row("opscope min+max", "opscope", {"sketches": ["min", "max"], "hist_mode": "sampled"}),
    Row(DEFAULT, "opscope", {"sketches": None, "hist_mode": "sampled"}, quick=True),
    Row(DEFAULT_RUN, "opscope", {"sketches": None, "hist_mode": "sampled", "decode": False}),
    Row(FLOOR, "floor", quick=True),
    Row(DEFAULT_ROWS, "opscope", {"sketches": None, "hist_mode": "sampled", "decode": "rows"}),
    Row(IN_GRAPH, "opscope", {"sketches": None, "hist_mode": "sampled", "copy_out_max": 0}),
    Row(
        IN_GRAPH_RUN,
        "opscope",
        {"sketches": None, "hist_mode": "sampled", "copy_out_max": 0, "decode": False},
    ),
    Row(EXACT, "opscope", {"sketches": None, "hist_mode": "exact"}, quick=True),
    Row(ALL, "opscope", {"sketches": ["all"], "hist_mode": "sampled"}),
    Row("ORT MinMaxCalibrater", "calibrator", {"method": "MinMax"}, quick=True),
    Row("ORT EntropyCalibrater", "calibrator", {"method": "Entropy"}, quick=True),
    Row("ORT PercentileCalibrater", "calibrator", {"method": "Percentile"}),
    Row(COPY_OUT, "copyout", {"via": "onnx"}, quick=True),
    Row(POLYGRAPHY, "copyout", {"via": "polygraphy"}, quick=True, requires="polygraphy"),
]
QUICK_ROWS: list[str] = [r.name for r in ROWS if r.quick]


@dataclass
class Case:
    """One model with its feeds, as files the measuring processes read."""

    name: str
    describe: str
    model: Path | None
    feeds: Path | None
    ops: list[str]
    sites: int = 0
    missing: str | None = None
    rows: tuple[str, ...] | None = None  # only these rows (None: all)


def _save_batches(path: Path, batches: list[dict[str, np.ndarray]]) -> Path:
    np.savez(path, **{f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()})
    return path


def _present_ops(model: Any, wanted: tuple[str, ...]) -> tuple[list[str], int]:
    from onnx_opscope.graph import load_model
    from onnx_opscope.sites import find_sites

    sites = [s for s in find_sites(load_model(model)) if s.op_type in wanted]
    return [o for o in wanted if any(s.op_type == o for s in sites)], len(sites)


def _zoo_case(
    work: Path,
    name: str,
    describe: str,
    model: Any,
    wanted: tuple[str, ...],
    feed: Callable[[int], dict],
    n: int,
) -> Case:
    import onnx

    from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds

    path = work / f"{name.split()[0]}.onnx"
    if not path.exists():
        onnx.save(model, path)
    batches = [synthetic_feeds(model, FeedSpec(**feed(i)), i) for i in range(n)]
    ops, sites = _present_ops(model, wanted)
    slug = "".join(c if c.isalnum() else "_" for c in name)
    return Case(name, describe, path, _save_batches(work / f"{slug}.npz", batches), ops, sites)


# real models: FeedSpec arguments, a post-processing of the drawn values, the ops to tap
_REAL: dict[str, tuple[dict, Callable[[dict], dict], tuple[str, ...], str]] = {
    "ppocrv4_rec": ({"dist": "uniform", "shapes": {"x": [1, 3, 48, 320]}}, dict, ("MatMul", "Gemm"), "x [1,3,48,320] U(-1,1)"),
    "ppocrv4_det": ({"dist": "uniform", "shapes": {"x": [1, 3, 224, 224]}}, dict, ("Conv", "ConvTranspose"), "x [1,3,224,224] U(-1,1)"),
    "silero_vad_v6": (
        {"dist": "uniform", "shapes": {"input": [1, 512], "state": [2, 1, 128]}, "values": {"sr": 16000, "state": 0.0}},
        lambda f: {**f, "input": f["input"] * np.float32(0.5)},
        ("Conv", "LSTM"),
        "input [1,512] U(-.5,.5), state 0 [2,1,128], sr 16000",
    ),
    "captcha_crnn": (
        {"dist": "uniform", "shapes": {"image": [1, 3, 60, 160]}},
        lambda f: {"image": ((f["image"] + 1) * np.float32(127.5)).astype(np.float32)},
        ("MatMul", "Gemm"),
        "image [1,3,60,160] U(0,255)",
    ),
    "magika_standard_v3_3": ({"shapes": {"bytes": [1, 2048]}, "ranges": {"bytes": (0, 257)}}, dict, ("MatMul", "Gemm"), "bytes int32 [1,2048] in 0..256"),
}  # fmt: skip


TINY_LAYERS = 128


def tiny_model() -> Any:
    """TINY_LAYERS MatMuls of a [1, 16] activation, each followed by a Relu: every tapped tensor has 16
    elements, so a tap's cost there is its fixed cost."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(TINY_LAYERS):
        w = numpy_helper.from_array((rng.standard_normal((16, 16)) / 4).astype(np.float32), f"w{i}")
        inits.append(w)
        nodes += [helper.make_node("MatMul", [x, w.name], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu{i}")]  # fmt: skip
        x = f"r{i}"
    g = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 16])], inits,
    )  # fmt: skip
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def prepare_cases(work: Path, quick: bool, n: int, only: set[str] | None) -> list[Case]:
    """Write every model and its N batches of feeds into `work`; real models are read in place."""
    from onnx_opscope import zoo
    from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds

    cases: list[Case] = []

    def want(name: str) -> bool:
        return only is None or name in only

    if quick:
        if want("bert_like"):
            m = zoo.bert_like(hidden=256, layers=2, heads=4)
            cases.append(
                _zoo_case(
                    work, "bert_like", "2 layers (quick), batch 4, seq 128", m, ("MatMul", "Gemm"),
                    lambda i: {"dims": {"batch": 4, "seq": 128}}, n,
                )
            )  # fmt: skip
        return cases
    bert = zoo.bert_like(hidden=256, layers=4, heads=4, vocab=1000, max_seq=128)
    if want("bert_like"):
        cases.append(
            _zoo_case(
                work, "bert_like", "hidden 256, 4 layers, 4 heads; batch 4, seq 128", bert, ("MatMul", "Gemm"),
                lambda i: {"dims": {"batch": 4, "seq": 128}}, n,
            )
        )  # fmt: skip
    if want("bert_like_mixed"):
        mixed = _zoo_case(
            work, "bert_like_mixed", "the same model; batch 4, seq 128 and 96 alternating (peers' failure case)",
            bert, ("MatMul", "Gemm"), lambda i: {"dims": {"batch": 4, "seq": 128 if i % 2 == 0 else 96}}, n,
        )  # fmt: skip
        mixed.rows = (PLAIN, DEFAULT, *(r.name for r in ROWS if r.kind in ("calibrator", "copyout")))
        cases.append(mixed)
    if want("bert_like_add"):
        with_add = _zoo_case(
            work, "bert_like_add", "the same model and feeds as bert_like; ops MatMul and Add (the calibrators "
            "then see the mask Add, −3.4e38; opscope's Add sites are the residual adds)",
            bert, ("MatMul", "Add"), lambda i: {"dims": {"batch": 4, "seq": 128}}, n,
        )  # fmt: skip
        with_add.rows = (PLAIN, DEFAULT, *(r.name for r in ROWS if r.kind == "calibrator"))
        cases.append(with_add)
    if want("resnet_like"):
        cases.append(
            _zoo_case(
                work, "resnet_like", "4 basic blocks, width 64; batch 8, 3x64x64", zoo.resnet_like(),
                ("Conv", "Gemm"), lambda i: {"dims": {"batch": 8}}, n,
            )
        )  # fmt: skip
    if want("tiny_taps"):
        tiny = _zoo_case(
            work, "tiny_taps", f"{TINY_LAYERS} chained MatMul [1,16] x [16,16] + Relu: the fixed cost of a tap",
            tiny_model(), ("MatMul",), lambda i: {}, n,
        )  # fmt: skip
        tiny.rows = (PLAIN, DEFAULT, DEFAULT_ROWS, DEFAULT_RUN, IN_GRAPH, IN_GRAPH_RUN)
        cases.append(tiny)
    for name, (spec, post, wanted, describe) in _REAL.items():
        if not want(name):
            continue
        path = REAL / f"{name}.onnx"
        if not path.is_file():
            cases.append(
                Case(name, describe, None, None, [], missing="not fetched: run scripts/fetch_models.py")
            )
            continue
        batches = [post(synthetic_feeds(path, FeedSpec(**spec), i)) for i in range(n)]
        ops, sites = _present_ops(path, wanted)
        cases.append(Case(name, describe, path, _save_batches(work / f"{name}.npz", batches), ops, sites))
    return cases


# ---------------------------------------------------------------------------------------------
# running one measurement in its own process


def run_child(job: dict, timeout: float, script: Path | None = None) -> dict:
    """Run `bench.py --one JOB` (or `script --one JOB`) and return the JSON it printed, or an error
    naming how it died."""
    cmd = [sys.executable, str(script or Path(__file__).resolve()), "--one", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(peers.RESULT_TAG):
            return json.loads(line[len(peers.RESULT_TAG) :])
    if proc.returncode < 0:
        return {"error": f"killed by signal {-proc.returncode} (out of memory?)"}
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"process failed (exit {proc.returncode}): {tail[:150]}"}


def one(job: dict) -> None:
    """The `--one` side: import what every measurement imports, measure, print one RESULT line."""
    import onnxruntime  # noqa: F401 - same imports in every process, so RSS differences are the work

    import onnx_opscope.instrument  # noqa: F401 - inject, decode, host values
    import onnx_opscope.run  # noqa: F401 - sessions and the opscope rows' pipeline (pyarrow.parquet)

    with contextlib.suppress(ImportError):
        import onnxruntime.quantization.calibrate  # noqa: F401
    if job.get("threads"):
        peers.pin_threads(job["threads"])
    kind = job["kind"]
    try:
        if kind == "plain":
            result = peers.run_plain(job, job["graph_opt"])
        elif kind == "opscope":
            result = peers.run_opscope(job, job["sketches"], job["hist_mode"], job.get("decode", True))
        elif kind == "floor":
            result = peers.run_floor(job)
        elif kind == "calibrator":
            result = peers.run_calibrator(job, job["method"])
        elif kind == "copyout":
            result = peers.run_copy_out(job, job["via"])
        elif kind == "inject":
            result = peers.run_inject(job)
        elif kind == "analyze":
            result = peers.run_analyze(job)
        elif kind == "flops":
            result = peers.run_flops(job)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except Exception as exc:  # the row shows the error; the run goes on
        result = {"error": peers.one_line(exc)}
    result["peak_rss"] = peers.peak_rss()
    peers.emit(result)


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Settings:
    quick: bool
    rounds: int
    batches: int
    warmup: int
    inject_bytes: int
    analyze_nodes: int
    timeout: float
    threads: int | None = None
    contention: bool = False


def settings_for(args: argparse.Namespace) -> Settings:
    if args.quick:
        s = Settings(True, 1, 3, 1, 8 * MB, 16_000, 120)
    else:
        s = Settings(False, 3, 20, 3, 2 * 1024**3, 160_000, 1200)
    s.rounds = args.rounds or s.rounds
    s.batches = args.batches or s.batches
    s.threads = args.threads
    s.contention = getattr(args, "contention", False)
    return s


@contextlib.contextmanager
def background_load(on: bool):
    """One process spinning on a core while the rows run (`--contention`): how the ordering holds when
    another job shares the machine, measured rather than guessed."""
    if not on:
        yield
        return
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_rows(cases: list[Case], rows: list[Row], s: Settings) -> dict[tuple[str, str], list[dict]]:
    """Every (case, row) once per round, rounds interleaved; returns the per-round results."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in range(s.rounds):
        for case in cases:
            if case.missing:
                continue
            for row in rows:
                if (row.requires and not _available(row.requires)) or (
                    case.rows and row.name not in case.rows
                ):
                    continue
                job = {
                    "kind": row.kind, **row.args, "model": str(case.model), "feeds": str(case.feeds),
                    "ops": case.ops, "warmup": s.warmup, "threads": s.threads,
                }  # fmt: skip
                t0 = time.perf_counter()
                res = run_child(job, s.timeout)
                out.setdefault((case.name, row.name), []).append(res)
                shown = res.get("error") or f"{1e3 * statistics.median(res['times']):.2f} ms/batch"
                _log(
                    f"[round {r + 1}/{s.rounds}] {case.name}: {row.name}: {shown} ({time.perf_counter() - t0:.1f} s)"
                )
    return out


@dataclass
class Figure:
    ms: float | None = None
    ratio: float | None = None
    extra_mb: float | None = None
    tensors: int | None = None
    note: str = ""
    error: str | None = None


def summarize(results: dict[tuple[str, str], list[dict]], case: str, row: str) -> Figure:
    """A row's figures: median ms over rounds; × plain and extra MB as medians over rounds of the
    row against the plain row *of the same round*, which ran minutes apart at most, so that a
    slow round (another job on the machine) shifts both."""
    runs = results.get((case, row))
    if not runs:
        return Figure(error="not run")
    bad = [r for r in runs if "error" in r]
    if bad:
        return Figure(error=bad[0]["error"], tensors=None)
    per_round = sorted(runs, key=lambda r: statistics.median(r["times"]))
    middle = per_round[(len(per_round) - 1) // 2]  # the round whose time is reported (its note too)
    ms = statistics.median(statistics.median(r["times"]) for r in runs) * 1e3
    fig = Figure(ms=ms, tensors=middle.get("tensors"), note=middle.get("note", ""))
    base = results.get((case, PLAIN))
    if base and len(base) == len(runs) and not any("error" in b for b in base):
        fig.ratio = statistics.median(
            statistics.median(r["times"]) / statistics.median(b["times"]) for r, b in zip(runs, base)
        )
        fig.extra_mb = statistics.median(r["peak_rss"] - b["peak_rss"] for r, b in zip(runs, base)) / MB
    return fig


# ---------------------------------------------------------------------------------------------
# printing


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024**2:.1f} GiB RAM"
    except OSError:
        pass
    return "RAM unknown"


def environment(s: Settings, argv: list[str]) -> list[str]:
    import onnxruntime as ort

    versions = ", ".join(
        f"{d} {_version(d)}"
        for d in ("onnx-opscope", "onnxruntime", "onnx", "numpy", "polygraphy", "onnx-tool")
    )
    return [
        f"- command: `python scripts/bench.py{' ' if argv else ''}{' '.join(argv)}`",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- machine: {platform.platform()}; {_cpu_model()}; {os.cpu_count()} logical cores; {_mem_total()}",
        f"- python {platform.python_version()}; {versions}",
        (
            f"- threads: {s.threads} intra-op thread(s) in every session (the peers' too: "
            "onnxruntime.SessionOptions is subclassed in the measuring process)"
            if s.threads
            else "- threads: onnxruntime's default intra-op pool (one thread per physical core) in every "
            "session, the peers' included"
        ),
        f"- providers available: {', '.join(ort.get_available_providers())}; CPU used",
        f"- load average (1 min) at start / end: {LOAD[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
        "(other jobs shared this machine)",
        f"- {s.rounds} round(s), interleaved; per measurement {s.warmup} warm-up + {s.batches} timed batches; "
        f"each (model, row, round) in a fresh process",
        *(
            ["- contention: one busy process spinning on a core during every row (--contention)"]
            if s.contention
            else []
        ),
    ]


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(cases: list[Case], rows: list[Row], results: dict[tuple[str, str], list[dict]]) -> list[str]:
    lines = [
        "| model | measurement | tensors | ms / batch | × plain | extra peak MB | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for case in cases:
        head = f"**{case.name}**"
        if case.missing:
            lines.append(f"| {head} | (all rows) | | | | | {case.missing} |")
            continue
        for row in rows:
            if case.rows and row.name not in case.rows:
                continue
            if row.requires and not _available(row.requires):
                lines.append(f"| {head} | {row.name} | | | | | {row.requires} not installed |")
                head = ""
                continue
            f = summarize(results, case.name, row.name)
            if f.error:
                lines.append(f"| {head} | {row.name} | | | | | **failed**: {f.error.replace('|', '/')} |")
            else:
                lines.append(
                    f"| {head} | {row.name} | {_fmt(f.tensors, 'd')} | {_fmt(f.ms, '.2f')} | "
                    f"{_fmt(f.ratio, '.2f')} | {_fmt(f.extra_mb, '+.0f')} | {f.note} |"
                )
            head = ""
    return lines


def case_lines(cases: list[Case]) -> list[str]:
    out = []
    for c in cases:
        taps = f"taps {'/'.join(c.ops) or '—'} ({c.sites} sites)" if not c.missing else c.missing
        out.append(f"- **{c.name}**: {c.describe}; {taps}")
    return out


def extras_table(inj: dict, ana: dict, s: Settings) -> list[str]:
    lines = ["| measurement | seconds | extra peak MB | note |", "|---|---:|---:|---|"]
    size = f"{inj.get('weights', s.inject_bytes) / MB:,.0f} MB"
    if "error" in inj:
        lines.append(f"| inject_file, {size} external weights | | | **failed**: {inj['error']} |")
    else:
        lines.append(
            f"| inject_file, {size} external weights | {inj['seconds']:.3f} | {inj['extra_rss'] / MB:.0f} | "
            "every MatMul tapped, default set; weights stay on disk |"
        )
    label = f"costs.analyze, wide_graph({s.analyze_nodes:,})"
    if "skipped" in ana or "error" in ana:
        lines.append(f"| {label} | | | {ana.get('skipped') or 'failed: ' + ana['error']} |")
    else:
        lines.append(
            f"| {label} | {ana['seconds']:.2f} | {ana['extra_rss'] / MB:.0f} | {ana['nodes']:,} nodes, "
            f"{ana['flops']:.4g} FLOPs |"
        )
    return lines


def flops_table(cases: list[Case], flops: dict[str, dict]) -> list[str]:
    lines = [
        "| model | opscope FLOPs | onnx-tool FLOPs (2 × MACs) | ratio | seconds (opscope / onnx-tool) |",
        "|---|---:|---:|---:|---|",
    ]
    for c in cases:
        f = flops.get(c.name)
        if f is None:
            continue
        ours = f.get("ours")
        tool = f.get("tool")
        ours_s = f"{ours:.4g}" if ours is not None else f"failed: {f.get('ours_error', f.get('error'))}"
        tool_s = f"{tool:.4g}" if tool is not None else f.get("tool_error", f.get("error", "–"))
        ratio = f"{ours / tool:.3f}" if ours and tool else "–"
        secs = f"{_fmt(f.get('ours_s'), '.2f')} / {_fmt(f.get('tool_s'), '.2f')}"
        lines.append(f"| {c.name} | {ours_s} | {tool_s} | {ratio} | {secs} |")
    return lines


def goals(results: dict, inj: dict, ana: dict, s: Settings) -> list[str]:
    """Each goal of BENCHMARKS.md, judged on bert_like (and the side measurements), met or missed."""
    out: list[str] = []

    def mark(ok: bool | None) -> str:
        if s.quick:
            return "n/a (quick run)"
        return "n/a" if ok is None else ("**met**" if ok else "**missed**")

    d = summarize(results, "bert_like", DEFAULT)
    ok = None if d.ratio is None else d.ratio <= 1.5 and d.extra_mb is not None and d.extra_mb < 100
    out.append(
        f"- default set ≤ 1.5× plain and < 100 MB extra (bert_like): {_fmt(d.ratio, '.2f')}×, "
        f"{_fmt(d.extra_mb, '+.0f')} MB: {mark(ok)}"
    )
    e = summarize(results, "bert_like", EXACT)
    for peer in (COPY_OUT, POLYGRAPHY):
        c = summarize(results, "bert_like", peer)
        ok = None if e.ratio is None or c.ratio is None else e.ratio <= c.ratio
        out.append(
            f"- exact-histogram mode no slower than {peer} (bert_like): {_fmt(e.ratio, '.2f')}× vs "
            f"{_fmt(c.ratio, '.2f')}× plain: {mark(ok)}"
        )
    for peer in ("ORT EntropyCalibrater", "ORT PercentileCalibrater"):
        p = summarize(results, "bert_like", peer)
        if d.ratio is None or p.ratio is None:
            out.append(f"- ≥ 4× faster, ≥ 20× less extra memory than {peer}: n/a ({p.error or d.error})")
            continue
        speed = p.ratio / d.ratio
        mem = (p.extra_mb or 0) / max(d.extra_mb or 0, 1.0)
        out.append(
            f"- ≥ 4× faster and ≥ 20× less extra memory than {peer} (bert_like): {speed:.2f}× faster, "
            f"{mem:.1f}× less memory ({_fmt(p.extra_mb, '+.0f')} vs {_fmt(d.extra_mb, '+.0f')} MB, "
            f"ours counted as ≥ 1 MB): {mark(speed >= 4 and mem >= 20)}"
        )
    tiny_plain = summarize(results, "tiny_taps", PLAIN)
    for label, row in (("copied out, run only", DEFAULT_RUN), ("copied out, decoded to rows", DEFAULT_ROWS),
                       ("copied out, with decode and the Parquet part (what record does)", DEFAULT),
                       ("in the graph, run only", IN_GRAPH_RUN)):  # fmt: skip
        f = summarize(results, "tiny_taps", row)
        if f.ms is None or tiny_plain.ms is None or not f.tensors:
            continue
        per_tap = (f.ms - tiny_plain.ms) * 1e3 / f.tensors
        ok = per_tap <= 5 if row != IN_GRAPH_RUN else None
        out.append(f"- fixed cost of one tap (tiny_taps, {f.tensors} tensors of 16 elements), {label}: "
                   f"{per_tap:.1f} µs (goal ≤ 5 µs): {mark(ok) if row != IN_GRAPH_RUN else 'for comparison'}")  # fmt: skip
    every = {
        c: summarize(results, c, DEFAULT).ratio for c in sorted({k[0] for k in results}) if c != "tiny_taps"
    }
    if every:
        worst = max((r for r in every.values() if r is not None), default=None)
        listed = ", ".join(f"{c} {_fmt(r, '.2f')}×" for c, r in every.items())
        out.append(f"- default set ≤ 1.5× plain on every model: {listed}: "
                   f"{mark(None if worst is None else worst <= 1.5)}")  # fmt: skip
        out += issue16_lines(results, sorted(every), mark)
    if "seconds" in inj:
        ok = inj["seconds"] < 1 and inj["extra_rss"] < 200 * MB if not s.quick else None
        out.append(
            f"- 2 GB injection < 1 s and < 200 MB: {inj['seconds']:.3f} s, {inj['extra_rss'] / MB:.0f} MB "
            f"on {inj['weights'] / MB:,.0f} MB of weights: {mark(ok)}"
        )
    if "seconds" in ana:
        ok = ana["seconds"] < 10 if ana["nodes"] >= 160_000 else None
        out.append(
            f"- 160k-node analysis < 10 s: {ana['seconds']:.2f} s on {ana['nodes']:,} nodes: {mark(ok)}"
        )
    else:
        out.append(f"- 160k-node analysis < 10 s: n/a ({ana.get('skipped') or ana.get('error')})")
    return out


def issue16_lines(results: dict, models: list[str], mark: Callable[[bool | None], str]) -> list[str]:
    """Issue 16's lines per model: the default set against its floor (its four passes alone: a line under
    the floor cannot be met by arranging its nodes), `--sketch all`, and min+max against MinMax."""
    out = []
    for c in models:
        d, f = summarize(results, c, DEFAULT), summarize(results, c, FLOOR)
        line = 1.25 if c == "bert_like" else 1.5
        floor = f"floor {_fmt(f.ratio, '.2f')}×" if f.tensors else "no tap in the main graph's own nodes"
        ok = None if d.ratio is None else d.ratio <= line
        out.append(f"- {c}: default set ≤ {line}×: {_fmt(d.ratio, '.2f')}× ({floor}): {mark(ok)}")
        a = summarize(results, c, ALL)
        if a.ratio is not None:
            line = 2.0 if c == "bert_like" else 3.0
            out.append(f"- {c}: --sketch all ≤ {line:.0f}×: {a.ratio:.2f}×: {mark(a.ratio <= line)}")
        m, peer = summarize(results, c, "opscope min+max"), summarize(results, c, "ORT MinMaxCalibrater")
        if m.ratio is not None and peer.ratio is not None and not peer.tensors:
            out.append(
                f"- {c}: min+max {m.ratio:.2f}×; MinMaxCalibrater sees no tensor here ({peer.ratio:.2f}×)"
            )
        elif m.ratio is not None and peer.ratio is not None:
            out.append(f"- {c}: min+max ({m.ratio:.2f}×) no slower than MinMaxCalibrater ({peer.ratio:.2f}×): "
                       f"{mark(m.ratio <= peer.ratio)}")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# profile mode


def profile(
    case: Case, batches: int, sketches: list[str] | None = None, hist_mode: str = "sampled"
) -> list[str]:
    """Per op kind: kernel ms and node runs per batch in the plain model, and in the instrumented
    one split into the model's own nodes and the opscope_ tap nodes."""
    feeds = peers.load_batches(case.feeds)[:batches]
    prof = peers.profile_ops(str(case.model), feeds, case.ops, sketches, hist_mode)

    def get(label: str, op: str, ours: bool) -> list[float]:
        return prof[label].get((op, ours), [0.0, 0.0])

    cols = [("plain", False), ("opscope", False), ("opscope", True)]
    ops = sorted(
        {k[0] for p in prof.values() for k in p}, key=lambda o: -sum(get(c[0], o, c[1])[0] for c in cols)
    )
    what = ",".join(sketches) if sketches else "default set"
    lines = [
        f"profile of {case.name}, {what}, {hist_mode} hist ({len(feeds)} batches; onnxruntime profiler, "
        "kernel ms / node runs per batch; If containers left out)",
        "",
        "| op type | plain ms | plain nodes | tapped: model's ms | model's nodes | tapped: opscope_ ms | opscope_ nodes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    tot = [[0.0, 0.0] for _ in cols]
    for op in ops:
        v = [get(label, op, ours) for label, ours in cols]
        tot = [[a[0] + b[0], a[1] + b[1]] for a, b in zip(tot, v)]
        if max(x[0] for x in v) >= 0.005:
            lines.append(f"| {op} | " + " | ".join(f"{ms:.3f} | {n:.0f}" for ms, n in v) + " |")
    lines.append("| **total** | " + " | ".join(f"{ms:.3f} | {n:.0f}" for ms, n in tot) + " |")
    return lines


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="CI smoke run: bert_like 2 layers, 3 batches, 1 round"
    )
    p.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    p.add_argument("--batches", type=int, help="timed batches per measurement (default 20, quick 3)")
    p.add_argument("--threads", type=int, help="intra-op threads in every session (default: onnxruntime's)")
    p.add_argument("--models", help="comma-separated case names to run (default: all)")
    p.add_argument(
        "--rows",
        help="row names to run, separated by ';' (default: all of the mode; with --sketches-alone, 'opscope only <sketch>' too)",
    )
    p.add_argument("--sketches-alone", action="store_true", help="add one row per registered sketch")
    p.add_argument("--skip-extras", action="store_true", help="leave out injection, analysis and FLOP totals")
    p.add_argument("--profile", nargs="?", const="default", metavar="SKETCHES",
                   help="onnxruntime profile per op kind of the first model, then exit; SKETCHES: the set to tap "
                   "with ('default', 'all' or comma-separated names; default: the default set)")  # fmt: skip
    p.add_argument("--contention", action="store_true",
                   help="run a fixed background load (one busy process) while measuring: a shared machine")  # fmt: skip
    p.add_argument("--big", metavar="GIB[,GIB]",
                   help="instead: models with this many GiB of external weights, peak RSS and start-up of "
                   "record / calibrate / weights against plain inference (scripts/bench_big.py)")  # fmt: skip
    p.add_argument("--out", type=Path, help="also write the Markdown report here")
    p.add_argument("--json", type=Path, help="also write the raw per-round results here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        one(json.loads(args.one))
        return 0
    if args.big:
        import bench_big

        return bench_big.main(
            ["--gib", args.big, "--rounds", str(args.rounds or 3), "--batches", str(args.batches or 4)]
        )
    s = settings_for(args)
    only = set(args.models.split(",")) if args.models else None
    rows = [r for r in ROWS if r.quick or not s.quick]
    if args.sketches_alone:  # every sketch of the registry, opt-in ones included
        from onnx_opscope.sketch import ALL_SKETCHES

        rows += [
            Row(f"opscope only {n}", "opscope", {"sketches": [n], "hist_mode": "sampled"})
            for n in ALL_SKETCHES
        ]
    if args.rows:  # "opscope only <sketch>" rows too, with --sketches-alone
        keep = {r.strip() for r in args.rows.split(";")} | {PLAIN}
        rows = [r for r in rows if r.name in keep]
    with tempfile.TemporaryDirectory(prefix="opscope-bench-") as tmp:
        work = Path(tmp)
        _log(f"preparing models and feeds in {work} ...")
        cases = prepare_cases(work, s.quick, s.batches, only)
        if args.profile:
            case = next((c for c in cases if not c.missing), None)
            if case is None:
                _log("no model to profile")
                return 1
            print("\n".join(profile(case, s.batches, args.profile.split(","))))
            return 0
        with background_load(args.contention):
            results = run_rows(cases, rows, s)
        inj: dict = {}
        ana: dict = {}
        flops: dict[str, dict] = {}
        if not args.skip_extras:
            big = work / "big"
            _log(f"writing a model with {s.inject_bytes / MB:,.0f} MB of external weights ...")
            from onnx_opscope import zoo

            model = zoo.write_external_weights_model(big, s.inject_bytes)
            inj = run_child({"kind": "inject", "model": str(model)}, s.timeout)
            for f in big.iterdir():
                f.unlink()
            _log(f"inject: {inj}")
            ana = run_child({"kind": "analyze", "nodes": s.analyze_nodes}, s.timeout)
            _log(f"analyze: {ana}")
            for c in cases:
                if not c.missing and not c.name.endswith(("_mixed", "_add")):
                    flops[c.name] = run_child(
                        {"kind": "flops", "model": str(c.model), "feeds": str(c.feeds)}, s.timeout
                    )
    report = [
        "## Environment",
        "",
        *environment(s, argv),
        "",
        "## Models and feeds",
        "",
        *case_lines(cases),
        "",
        "## Time and memory against plain inference",
        "",
        *table(cases, rows, results),
    ]
    if not args.skip_extras:
        report += ["", "## Injection and static analysis", "", *extras_table(inj, ana, s)]
        report += ["", "## FLOP totals, opscope vs onnx-tool", "", *flops_table(cases, flops)]
    report += ["", "## Goals", "", *goals(results, inj, ana, s)]
    if s.quick:
        report += ["", "(quick mode: a smoke run; its figures say nothing about speed)"]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        raw = {f"{k[0]} | {k[1]}": v for k, v in results.items()}
        args.json.write_text(
            json.dumps({"rows": raw, "inject": inj, "analyze": ana, "flops": flops}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
