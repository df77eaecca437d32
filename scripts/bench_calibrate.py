"""Calibration against onnxruntime's calibrators: time, extra memory and time to a quantized model.

    python scripts/bench_calibrate.py --threads 1          # transformer_block, 3 rounds (minutes)
    python scripts/bench_calibrate.py --threads 1 --models ppocrv4_rec,captcha_crnn --op-types Conv,MatMul
    python scripts/bench_calibrate.py --quick              # CI smoke run: its figures mean nothing

Side by side in one run, per model, on the same tensors and the same feeds:
- `onnx_opscope.calibrate(method="minmax")` vs onnxruntime's `MinMaxCalibrater`, and
  `"entropy"` / `"percentile"` vs `EntropyCalibrater` / `PercentileCalibrater`
  (`create_calibrator(..., calibrate_method=...)`, `collect_data` + `compute_data`), both tools at
  the same bin count: `--bins`, else `create_calibrator`'s default for the method (128 for
  entropy, 2048 for percentile; `calibrate`'s too), and onnxruntime's other defaults (percentile
  99.999, symmetric for percentile only, which are ours too);
- ours again at `--many` batches (default 1,000: the N batches cycled), to show that its memory
  does not grow with the batch count; onnxruntime's histogram calibrators are not run there: they
  keep every batch's outputs until `compute_data`;
- time to a QDQ model: `calibrate(method="minmax")` + `calibration.export.quantize_qdq` vs
  `quantize_static(..., calibrate_method=MinMax)` calibrating on its own.

The tensors are onnxruntime's own selection for `--op-types` (default: quantize_static's own
list), which `calibration.tensors` reproduces; the script checks that the two sets are equal before
it measures. Feeds are `run.feeds` synthetic feeds (the real models: those of scripts/bench.py),
every batch the same shape: onnxruntime's histogram calibrators crash on batches of different
shapes (see BENCHMARKS.md, "Peers' failures").

How it is measured, with scripts/bench.py's helpers: every (model, row, round) runs in a fresh
process (`--one`), so its peak RSS (VmHWM) is that row's alone; rounds are interleaved; each
process imports the same libraries first. **ms / batch** is end to end, from the model file and
the batches in memory to the ranges, divided by the batch count: for ours one `calibrate` call
(taps, sessions, every pass, ranges) after an untimed warm-up call on one batch; for onnxruntime's
`create_calibrator` + `collect_data` + `compute_data`, after an untimed warm-up `collect_data`
(`bench_peers.run_calibrator`). **Extra peak MB**: the row's peak RSS minus that of a plain
session of the model (graph optimizations off, as both calibrators run it) over the same batches
in the same round. Ratios are taken per round (theirs / ours), then the median over rounds; the
spread is [min–max] over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - sibling scripts, not a package
import bench_peers as peers  # noqa: E402

ROOT = bench.ROOT
SCRIPT = Path(__file__).resolve()
MB = bench.MB
FLAT_MB = 10.0  # "flat": our extra memory at --many batches within this of that at --batches
PEER = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}
ORT_BINS = {"entropy": 128, "percentile": 2048}  # create_calibrator's num_bins defaults
CHOICES = ("minmax", "entropy", "percentile", "qdq")
MIXED_NOTE = (
    "Every batch has the same shape: onnxruntime's EntropyCalibrater and PercentileCalibrater "
    "crash on batches of different shapes (`ValueError: ... inhomogeneous shape`, they np.asarray "
    "the per-batch tensors; bert_like_mixed in BENCHMARKS.md); calibrate() takes them."
)


# ---------------------------------------------------------------------------------------------
# the measuring side: one row in this process, one RESULT line


class _Cycle:
    """`batches` repeated up to `count` batches; iterable again and again (the histogram pass rereads it)."""

    def __init__(self, batches: list[dict], count: int):
        self.batches, self.count = batches, count

    def __iter__(self) -> Iterator[dict]:
        return (self.batches[i % len(self.batches)] for i in range(self.count))


def run_ours(job: dict) -> dict:
    """One `onnx_opscope.calibrate` call over `count` batches, after an untimed minmax call on one."""
    import onnx_opscope
    from onnx_opscope.calibration import onnxruntime_selection

    batches = peers.load_batches(job["feeds"])
    count = job.get("count") or len(batches)
    feeds = batches if count == len(batches) else _Cycle(batches, count)
    options = {"method": job["method"], "op_types": job["ops"], "bins": job["bins"] or None}
    # warm-up: sessions, kernels, lazy imports (a min/max pass is enough, and cheap on every model)
    onnx_opscope.calibrate(job["model"], batches[:1], op_types=job["ops"])
    stamps: list[float] = []
    t0 = time.perf_counter()
    result = onnx_opscope.calibrate(
        job["model"], feeds, progress=lambda done, total: stamps.append(time.perf_counter()), **options
    )
    seconds = time.perf_counter() - t0
    pass1 = statistics.median(np.diff(stamps)) if len(stamps) > 1 else float("nan")
    rest = t0 + seconds - stamps[-1]
    note = f"min/max pass {1e3 * pass1:.2f} ms/batch; after it {rest:.2f} s"
    if job["method"] != "minmax":
        note += " (histogram pass, ranges)"
    return {
        "times": [seconds / count],
        "seconds": seconds,
        "tensors": len(onnxruntime_selection(result.tensors)),
        "note": note,
    }


def run_ort(job: dict) -> dict:
    """onnxruntime's calibrator, end to end: create_calibrator's time added to bench_peers' figure."""
    extra = {"num_bins": job["bins"]} if job["method"] != "MinMax" else {}
    res = peers.run_calibrator(job, job["method"], extra)
    n = job["batches"]
    res["seconds"] = res["times"][0] * n + res["setup_s"]
    res["times"] = [res["seconds"] / n]
    res["note"] = f"create {res['setup_s']:.2f} s; {res['note']}"
    return res


def _qdq_nodes(path: Path) -> int:
    import onnx

    return sum(n.op_type == "QuantizeLinear" for n in onnx.load(str(path)).graph.node)


def run_qdq(job: dict) -> dict:
    """Model file + batches to a QDQ model file: ours (calibrate + quantize_qdq) or quantize_static's own."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static
    from onnxruntime.quantization.calibrate import CalibrationDataReader

    import onnx_opscope
    from onnx_opscope.calibration import quantize_qdq

    CalibrationDataReader.register(peers._Reader)
    batches = peers.load_batches(job["feeds"])

    def ours(feeds: list[dict], out: Path) -> None:
        ranges = onnx_opscope.calibrate(job["model"], feeds, method="minmax", op_types=job["ops"])
        quantize_qdq(job["model"], ranges, out, op_types=job["ops"])

    def theirs(feeds: list[dict], out: Path) -> None:
        quantize_static(
            onnx.load(job["model"]), str(out), peers._Reader(feeds), quant_format=QuantFormat.QDQ,
            op_types_to_quantize=job["ops"], calibrate_method=CalibrationMethod.MinMax,
        )  # fmt: skip

    build = ours if job["tool"] == "ours" else theirs
    with tempfile.TemporaryDirectory(prefix="opscope-qdq-") as tmp:
        build(batches[:1], Path(tmp) / "warm.onnx")
        t0 = time.perf_counter()
        build(batches, Path(tmp) / "q.onnx")
        seconds = time.perf_counter() - t0
        nodes = _qdq_nodes(Path(tmp) / "q.onnx")
    return {"times": [seconds / len(batches)], "seconds": seconds, "note": f"{nodes} QuantizeLinear nodes"}


def one(job: dict) -> None:
    """The `--one` side: the same imports in every process, measure, print one RESULT line."""
    import logging

    import onnxruntime  # noqa: F401 - same imports everywhere, so RSS differences are the work
    import onnxruntime.quantization  # noqa: F401 - quantize_static and the calibrators

    import onnx_opscope.calibration.histograms  # noqa: F401
    import onnx_opscope.calibration.methods  # noqa: F401
    import onnx_opscope.run  # noqa: F401

    logging.getLogger().setLevel(logging.ERROR)  # quantize_static's "consider pre-processing" warning
    if job.get("threads"):
        peers.pin_threads(job["threads"])
    kind = job["kind"]
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the calibrators print progress lines
            if kind == "plain":
                result = peers.run_plain(job, "disable")
            elif kind == "ours":
                result = run_ours(job)
            elif kind == "ort":
                result = run_ort(job)
            elif kind == "qdq":
                result = run_qdq(job)
            else:
                raise ValueError(f"unknown kind {kind!r}")
    except Exception as exc:  # the row shows the error; the run goes on
        result = {"error": peers.one_line(exc)}
    result["peak_rss"] = peers.peak_rss()
    peers.emit(result)


# ---------------------------------------------------------------------------------------------
# what is run


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    kind: str
    args: dict


def rows_for(s: Settings) -> list[Row]:
    rows = [Row("plain", "plain session, graph opt off (baseline)", "plain", {})]
    for m in ("minmax", "entropy", "percentile"):
        if m not in s.methods:
            continue
        ours, theirs = f'calibrate(method="{m}")', f"ORT {PEER[m]}Calibrater"
        if m != "minmax":
            ours, theirs = f"{ours[:-1]}, bins={s.bins_for(m)})", f"{theirs}, num_bins={s.bins_for(m)}"
        rows.append(Row(f"ours {m}", ours, "ours", {"method": m, "bins": s.bins_for(m)}))
        rows.append(Row(f"ort {m}", theirs, "ort", {"method": PEER[m], "bins": s.bins_for(m)}))
    for m in ("entropy", "percentile"):
        if m in s.methods:
            label = f'calibrate(method="{m}", bins={s.bins_for(m)}), {s.many} batches'
            rows.append(
                Row(f"ours {m} many", label, "ours", {"method": m, "bins": s.bins_for(m), "count": s.many})
            )
    if "qdq" in s.methods:
        rows.append(Row("qdq ours", "calibrate + quantize_qdq", "qdq", {"tool": "ours"}))
        rows.append(Row("qdq ort", "quantize_static, own MinMax", "qdq", {"tool": "ort"}))
    return rows


@dataclass
class Case:
    name: str
    describe: str
    model: Path
    feeds: Path | None = None
    ops: list[str] | None = None
    ours: int = 0  # tensors ours selects in the main graph
    theirs: int = 0  # tensors onnxruntime's calibrator selects
    same: bool = False
    missing: str | None = None


def _ort_selection(path: Path, ops: list[str]) -> set[str]:
    """onnxruntime's own rule (CalibraterBase.select_tensors_to_calibrate) on the shape-inferred model."""
    import onnx
    from onnxruntime.quantization.calibrate import CalibraterBase

    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    return CalibraterBase.select_tensors_to_calibrate(SimpleNamespace(op_types_to_calibrate=ops), model)[0]


def prepare(work: Path, names: list[str], s: Settings) -> list[Case]:
    from onnx_opscope.calibration import default_op_types, onnxruntime_selection, tensors_to_calibrate
    from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds

    ops = s.op_types or list(default_op_types())
    cases = []
    for name in names:
        if name == "transformer_block":
            path, spec, post, describe = ROOT / "models" / f"{name}.onnx", {}, dict, None
        elif name in bench._REAL:
            spec, post, _, describe = bench._REAL[name]
            path = bench.REAL / f"{name}.onnx"
        else:
            raise SystemExit(f"unknown model {name!r}: transformer_block or one of {', '.join(bench._REAL)}")
        if not path.is_file():
            cases.append(Case(name, describe or "", path, missing="not fetched: run scripts/fetch_models.py"))
            continue
        batches = [post(synthetic_feeds(path, FeedSpec(**spec), i)) for i in range(s.batches)]
        if describe is None:
            describe = ", ".join(f"{k} {list(v.shape)} N(0,1)" for k, v in batches[0].items())
        ours = onnxruntime_selection(tensors_to_calibrate(path, ops))
        theirs = _ort_selection(path, ops)
        feeds = bench._save_batches(work / f"{name}.npz", batches)
        cases.append(Case(name, describe, path, feeds, ops, len(ours), len(theirs), ours == theirs))
    return cases


def run_all(cases: list[Case], rows: list[Row], s: Settings) -> dict[tuple[str, str], list[dict]]:
    """Every (case, row) once per round, rounds interleaved."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in range(s.rounds):
        for case in cases:
            if case.missing:
                continue
            for row in rows:
                job = {
                    "kind": row.kind, "bins": 0, **row.args, "model": str(case.model), "feeds": str(case.feeds),
                    "ops": case.ops, "warmup": 1, "threads": s.threads, "batches": s.batches,
                }  # fmt: skip
                t0 = time.perf_counter()
                res = bench.run_child(job, s.timeout, script=SCRIPT)
                out.setdefault((case.name, row.key), []).append(res)
                shown = res.get("error") or f"{1e3 * res['times'][0]:.2f} ms/batch"
                bench._log(
                    f"[round {r + 1}/{s.rounds}] {case.name}: {row.label}: {shown} ({time.perf_counter() - t0:.1f} s)"
                )
    return out


# ---------------------------------------------------------------------------------------------
# figures


@dataclass
class Spread:
    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def fmt(self, spec: str, unit: str = "") -> str:
        if not self.values:
            return "–"
        med = format(self.median, spec) + unit
        if len(self.values) == 1:
            return med
        return f"{med} [{format(min(self.values), spec)}–{format(max(self.values), spec)}]"


def _ok(runs: list[dict] | None) -> bool:
    return bool(runs) and not any("error" in r for r in runs)


def figures(results: dict, case: str, key: str) -> tuple[Spread, Spread] | str:
    """(ms / batch, extra peak MB) over rounds, each round's memory against that round's plain row."""
    runs, base = results.get((case, key)), results.get((case, "plain"))
    if not runs:
        return "not run"
    if not _ok(runs):
        return next(r["error"] for r in runs if "error" in r)
    ms = Spread([1e3 * r["times"][0] for r in runs])
    if not _ok(base) or len(base) != len(runs):
        return ms, Spread([])
    return ms, Spread([(r["peak_rss"] - b["peak_rss"]) / MB for r, b in zip(runs, base)])


def ratios(results: dict, case: str, ours: str, theirs: str) -> tuple[Spread, Spread] | None:
    """Per round: their time / ours, and their extra memory / ours (ours counted as at least 1 MB)."""
    a, b, base = (results.get((case, k)) for k in (ours, theirs, "plain"))
    if not (_ok(a) and _ok(b)) or len(a) != len(b):
        return None
    time_ratio = Spread([t["times"][0] / o["times"][0] for o, t in zip(a, b)])
    if not _ok(base) or len(base) != len(a):
        return time_ratio, Spread([])
    mem = [
        (t["peak_rss"] - p["peak_rss"]) / max(o["peak_rss"] - p["peak_rss"], MB)
        for o, t, p in zip(a, b, base)
    ]
    return time_ratio, Spread(mem)


# ---------------------------------------------------------------------------------------------
# the report


def environment(s: Settings, argv: list[str], load: tuple[float, ...]) -> list[str]:
    bins = ", ".join(f"{m} {s.bins_for(m)}" for m in ORT_BINS if m in s.methods) or "–"
    versions = ", ".join(f"{d} {bench._version(d)}" for d in ("onnx-opscope", "onnxruntime", "onnx", "numpy"))
    threads = (
        f"{s.threads} intra-op thread(s) in every session, the calibrators' too (bench_peers.pin_threads)"
        if s.threads
        else "onnxruntime's default intra-op pool in every session"
    )
    return [
        f"- command: `python scripts/bench_calibrate.py{' ' if argv else ''}{' '.join(argv)}`",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- machine: {platform.platform()}; {bench._cpu_model()}; {os.cpu_count()} logical cores; {bench._mem_total()}",
        f"- python {platform.python_version()}; {versions}",
        f"- threads: {threads}; CPU provider",
        f"- load average (1 min) at start / end: {load[0]:.1f} / {os.getloadavg()[0]:.1f}",
        f"- {s.rounds} round(s), interleaved; {s.batches} batches per row ({s.many} for the `many` rows: the "
        f"{s.batches} cycled); histogram bins, both tools: {bins}; each (model, row, round) in a fresh process",
    ]


def case_lines(cases: list[Case]) -> list[str]:
    out = []
    for c in cases:
        if c.missing:
            out.append(f"- **{c.name}**: {c.missing}")
            continue
        same = "the same set" if c.same else "**the sets differ**"
        ops = "quantize_static's default op types" if len(c.ops) > 8 else "/".join(c.ops)
        out.append(
            f"- **{c.name}**: {c.describe}; {ops}: {c.ours} tensors ours, {c.theirs} onnxruntime's ({same})"
        )
    return out


def table(cases: list[Case], rows: list[Row], results: dict, s: Settings) -> list[str]:
    lines = [
        "| model | measurement | tensors | ms / batch, median [min–max] | extra peak MB, median [min–max] | note |",
        "|---|---|---:|---:|---:|---|",
    ]
    for case in cases:
        head = f"**{case.name}**"
        if case.missing:
            lines.append(f"| {head} | (all rows) | | | | {case.missing} |")
            continue
        for row in rows:
            fig = figures(results, case.name, row.key)
            if isinstance(fig, str):
                lines.append(f"| {head} | {row.label} | | | | **failed**: {fig.replace('|', '/')} |")
            else:
                ms, mb = fig
                mid = sorted(results[(case.name, row.key)], key=lambda r: r["times"][0])
                r = mid[(len(mid) - 1) // 2]
                # onnxruntime's count: its selection before create_calibrator adds its Reshape / Reduce
                # nodes, which a selection by op type (Reshape is one) would count again afterwards
                tensors = case.theirs if row.kind == "ort" else r.get("tensors")
                note = r.get("note", "")
                if row.kind == "qdq":
                    note = f"{Spread([x['seconds'] for x in mid]).fmt('.2f', ' s')} in all; {note}"
                lines.append(
                    f"| {head} | {row.label} | {'' if tensors is None else tensors} | {ms.fmt('.2f')} | "
                    f"{mb.fmt('+.0f')} | {note} |"
                )
            head = ""
            if row.key.startswith("ours") and row.key.endswith("many"):
                peer = PEER[row.key.split()[1]]
                lines.append(
                    f"|  | ORT {peer}Calibrater, {s.many} batches | | | | {not_run(results, case, peer, s)} |"
                )
    return lines


def not_run(results: dict, case: Case, peer: str, s: Settings) -> str:
    fig = figures(results, case.name, f"ort {peer.lower()}")
    grow = ""
    if not isinstance(fig, str) and fig[1].values:
        per = fig[1].median / s.batches
        at_many = per * s.many
        size = f"{at_many / 1024:.1f} GB" if at_many >= 1024 else f"{at_many:.0f} MB"
        grow = (
            f" (+{fig[1].median:.0f} MB at {s.batches}: ~{per:.1f} MB a batch, ~{size} at {s.many} "
            "if linear, not measured)"
        )
    return f"not run: keeps every batch's outputs until compute_data{grow}"


def _histogram_goals(c: Case, m: str, results: dict, s: Settings, mark) -> list[str]:
    r = ratios(results, c.name, f"ours {m}", f"ort {m}")
    if r is None:
        err = figures(results, c.name, f"ort {m}")
        why = err if isinstance(err, str) else "ours failed"
        return [f"| {c.name} | {m}: ≥ 4× faster, ≥ 20× less memory | n/a ({why}) | n/a |"]
    speed, mem = r
    lines = [
        f"| {c.name} | {m} ≥ 4× faster than {PEER[m]}Calibrater | {speed.fmt('.2f', '×')} | "
        f"{mark(speed.median >= 4)} |",
        f"| {c.name} | {m} ≥ 20× less extra memory at {s.batches} batches | {mem.fmt('.1f', '×')} | "
        f"{mark(bool(mem.values) and mem.median >= 20)} |",
    ]
    few, many = figures(results, c.name, f"ours {m}"), figures(results, c.name, f"ours {m} many")
    if isinstance(few, str) or isinstance(many, str) or not few[1].values:
        return [*lines, f"| {c.name} | {m}: extra memory flat over batches | n/a | n/a |"]
    grow = many[1].median - few[1].median
    return [
        *lines,
        f"| {c.name} | {m}: extra memory flat, {s.batches} → {s.many} batches (within {FLAT_MB:.0f} MB) | "
        f"{few[1].fmt('+.0f')} → {many[1].fmt('+.0f')} MB ({grow:+.0f}) | {mark(grow <= FLAT_MB)} |",
    ]


def goals(cases: list[Case], results: dict, s: Settings) -> list[str]:
    def mark(ok: bool | None) -> str:
        if s.quick:
            return "n/a (quick run)"
        return "n/a" if ok is None else ("**met**" if ok else "**missed**")

    lines = ["| model | goal | measured, median [min–max] over rounds | status |", "|---|---|---|---|"]
    for c in (c for c in cases if not c.missing):
        if "minmax" in s.methods:
            r = ratios(results, c.name, "ours minmax", "ort minmax")
            speed = r[0] if r else None
            lines.append(
                f"| {c.name} | minmax no slower than MinMaxCalibrater | "
                f"{speed.fmt('.2f', '×') + ' faster' if speed else 'n/a'} | {mark(speed and speed.median >= 1)} |"
            )
        for m in (m for m in ("entropy", "percentile") if m in s.methods):
            lines += _histogram_goals(c, m, results, s, mark)
        if "qdq" in s.methods:
            q = ratios(results, c.name, "qdq ours", "qdq ort")
            lines.append(
                f"| {c.name} | time to a QDQ model vs quantize_static (no number set) | "
                f"{q[0].fmt('.2f', '×') + ' faster' if q else 'n/a'} | {'n/a (quick run)' if s.quick else 'reported'} |"
            )
    return lines


def failures(cases: list[Case], rows: list[Row], results: dict) -> list[str]:
    out = []
    for c in cases:
        for row in rows:
            fig = figures(results, c.name, row.key)
            if isinstance(fig, str) and fig != "not run":
                out.append(f"- {row.label} on {c.name}: {fig}")
    return out or ["- none"]


# ---------------------------------------------------------------------------------------------


@dataclass
class Settings:
    quick: bool
    rounds: int
    batches: int
    many: int
    bins: int | None  # None: ORT_BINS per method
    timeout: float
    threads: int | None = None
    op_types: list[str] | None = None
    methods: tuple[str, ...] = CHOICES

    def bins_for(self, method: str) -> int:
        return self.bins or ORT_BINS.get(method, 0)  # 0: not a histogram method


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI smoke run: 1 round, 2 batches, 4 for 'many'")
    p.add_argument(
        "--models", help="comma-separated: transformer_block (default), ppocrv4_rec, captcha_crnn, ..."
    )
    p.add_argument("--op-types", help="comma-separated op types to calibrate (default: quantize_static's)")
    p.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    p.add_argument("--batches", type=int, help="batches per row (default 20, quick 2)")
    p.add_argument("--many", type=int, help="batches of the 'many' rows, ours only (default 1000, quick 4)")
    p.add_argument(
        "--bins", type=int, help="histogram bins, both tools (default: entropy 128, percentile 2048)"
    )
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(CHOICES)} (default: all)")
    p.add_argument("--threads", type=int, help="intra-op threads in every session (default: onnxruntime's)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per measuring process (default 1800)")
    p.add_argument("--out", type=Path, help="also write the Markdown report here")
    p.add_argument("--json", type=Path, help="also write the raw per-round results here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        one(json.loads(args.one))
        return 0
    load = os.getloadavg()
    q = args.quick
    s = Settings(
        quick=q,
        rounds=args.rounds or (1 if q else 3),
        batches=args.batches or (2 if q else 20),
        many=args.many or (4 if q else 1000),
        bins=args.bins,
        timeout=args.timeout or (120 if q else 1800),
        threads=args.threads,
        op_types=args.op_types.split(",") if args.op_types else None,
        methods=tuple(args.methods.split(",")) if args.methods else CHOICES,
    )
    unknown = set(s.methods) - set(CHOICES)
    if unknown:
        p.error(f"unknown --methods {', '.join(sorted(unknown))}: choose from {', '.join(CHOICES)}")
    names = args.models.split(",") if args.models else ["transformer_block"]
    rows = rows_for(s)
    with tempfile.TemporaryDirectory(prefix="opscope-bench-cal-") as tmp:
        bench._log(f"preparing feeds in {tmp} ...")
        cases = prepare(Path(tmp), names, s)
        for c in cases:
            if not c.missing and not c.same:
                bench._log(
                    f"{c.name}: ours selects {c.ours} tensors, onnxruntime {c.theirs}: not the same set"
                )
        results = run_all(cases, rows, s)
    report = [
        "## Environment",
        "",
        *environment(s, argv, load),
        "",
        "## Models, tensors and feeds",
        "",
        *case_lines(cases),
        "",
        MIXED_NOTE,
        "",
        "## Time and memory",
        "",
        *table(cases, rows, results, s),
        "",
        "## Goals",
        "",
        *goals(cases, results, s),
        "",
        "## Failures in this run",
        "",
        *failures(cases, rows, results),
    ]
    if s.quick:
        report += ["", "(quick mode: a smoke run; its figures say nothing about speed)"]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({f"{k[0]} | {k[1]}": v for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
