"""`record --engine ray` against one process, on the same model, batches and taps.

    python scripts/bench_ray.py                 # bert_like, 2 workers vs 1 process, 1 thread each
    python scripts/bench_ray.py --quick         # smoke run: its figures mean nothing

Rows, each in a fresh process, 3 rounds interleaved (median [min-max]):
- one process, 1 intra-op thread: `record(...)` as the CLI runs it, N batches;
- Ray, `--workers` actors of 1 thread each on a local cluster started in that process, N batches.
  Ray's own start-up (`ray.init`) is timed apart. The steady-state cost of a batch, b, is the time
  between the 10th written batch and the last over the batches between (from `record`'s progress
  calls); what is left of a recording beyond N·b (actors started, each building its session
  from the model bytes; Ray worker processes started when its pool has none idle) is the fixed
  cost. The speed-up is the ratio of the two engines' b;
- the driver's peak memory with many small batches (`--many`, default 400, of a tiny model) and
  with a tenth of them: flat when the driver holds a bounded number of results;
- the machine's own ceiling: the instrumented model in the session `record` makes (1 thread, no
  decoding, no table) alone, and as `--workers` such processes at once. Their per-batch ratio is
  the most any engine of that many workers can gain on this machine (shared caches, memory
  bandwidth, the other jobs on it), printed beside Ray's speed-up.

The tables of both engines are compared row for row (they must be equal). Beside the speed-up goes
the CPU a batch costs (steady batches, the last ten left out): in one process (its session's run, and
decoding and encoding the part, which overlap on the second core), and on Ray in the workers'
processes and in the driver's (feeds, Ray's client threads, writing the parts); the bare rows give
the run alone and the decoding and encoding alone. On 2 cores, Ray's per-batch time is at best
(workers + driver) / 2, and one process's at best its run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker_cpu() -> dict[str, float]:
    """CPU seconds so far of each of this machine's Ray actor processes (none where /proc is not there)."""
    cpu = {}
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::_Worker"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu


def _model(job: dict) -> Path:
    import onnx

    from onnx_opscope import zoo

    model = Path(job["dir"]) / f"{job['model']}.onnx"
    if not model.exists():
        m = (
            zoo.bert_like(hidden=256, layers=job["layers"], heads=4)
            if job["model"] == "bert_like"
            else zoo.mlp()
        )
        onnx.save(m, model)
    return model


def bare(job: dict) -> None:
    """The instrumented model in a plain onnxruntime session, batch after batch; prints a JSON line."""
    from onnx_opscope import inject
    from onnx_opscope.instrument import host_values
    from onnx_opscope.run import FeedSpec, RuntimeConfig, iter_feeds, make_session
    from onnx_opscope.run.recorder import BatchDecoder
    from onnx_opscope.run.session import for_tapped

    feeds = FeedSpec(batches=job["batches"], dims=job.get("dims") or {})
    model, manifest = inject(_model(job))
    decoder = BatchDecoder(
        manifest, host_values(manifest, model, None), ("bench", "cpu", "gaussian"), "parquet"
    )
    batches = list(iter_feeds(model, feeds))
    # the session `record` makes (priority-based node order), without the decoding and the table
    session = make_session(model, for_tapped(RuntimeConfig(threads=1)), take_weights=True)
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, batches[0])))  # warm up
    times, cpu, post = [], [], []
    for step, feed in enumerate(batches, 1):
        t, c = time.perf_counter(), time.thread_time()
        session.run(None, feed)
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        c = time.thread_time()
        decoder(step, outputs)  # what a Ray worker does after each run, on the warm-up's outputs
        post.append(time.thread_time() - c)
    print(json.dumps({"steady": statistics.median(times), "seconds": sum(times),
                      "run_cpu": statistics.median(cpu), "post_cpu": statistics.median(post)}))  # fmt: skip


def one(job: dict) -> None:
    """One measurement in this process; prints a JSON line."""
    import onnx_opscope
    from onnx_opscope.run import FeedSpec, RuntimeConfig
    from onnx_opscope.run.engine import Engine

    if job["engine"] == "bare":
        bare(job)
        return
    folder = Path(job["dir"])
    model = _model(job)
    runtime = RuntimeConfig(threads=1)
    feeds = FeedSpec(batches=job["batches"], dims=job.get("dims") or {})
    engine = Engine("ray", workers=job["workers"]) if job["engine"] == "ray" else Engine()
    setup = 0.0
    if engine.kind == "ray":
        import ray

        t = time.perf_counter()
        ray.init(
            num_cpus=job["workers"], include_dashboard=False, log_to_driver=False, configure_logging=False
        )
        onnx_opscope.record(model, out=folder / f"warm_{job['engine']}.parquet", feeds=FeedSpec(batches=1),
                            runtime=runtime, engine=engine, parity=False)  # fmt: skip
        setup = time.perf_counter() - t
    before = _peak_mb()
    done: list[float] = []
    skip = min(10, job["batches"] - 2)
    # CPU from batch `skip` to as many before the end: after the last batch the actors may be gone already
    marks = (skip, job["batches"] - skip)
    cpu: list[tuple[float, dict[str, float]]] = []  # (this process, each actor) at the marks

    def progress(k: int, total: int | None) -> None:
        done.append(time.perf_counter())
        if k in marks:  # not every batch: reading /proc costs the driver ~1 ms
            cpu.append((time.process_time(), _worker_cpu() if engine.kind == "ray" else {}))

    t = time.perf_counter()
    res = onnx_opscope.record(model, out=folder / f"{job['tag']}.parquet", feeds=feeds, runtime=runtime,
                              engine=engine, parity=False, run_id="bench", progress=progress)  # fmt: skip
    seconds = time.perf_counter() - t
    n = len(done) - skip
    steady = (done[-1] - done[skip - 1]) / n if skip > 0 else float("nan")
    own = workers = float("nan")
    if len(cpu) == 2 and marks[1] > marks[0]:
        own = (cpu[1][0] - cpu[0][0]) / (marks[1] - marks[0])
        # per process: the warm-up's actors may still be exiting at the first mark
        workers = sum(c - cpu[0][1].get(pid, 0.0) for pid, c in cpu[1][1].items()) / (marks[1] - marks[0])
    print(json.dumps({"seconds": seconds, "setup": setup, "steady": steady, "rows": res.rows,
                      "own_cpu": own, "workers_cpu": workers,
                      "peak_mb": _peak_mb(), "before_mb": before, "table": str(res.table)}))  # fmt: skip


def _run(job: dict) -> dict:
    """The job in a fresh process; with "at_once" k, k copies at the same time (their median result)."""
    procs = [subprocess.Popen([sys.executable, __file__, "--one", json.dumps(job)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(job.get("at_once", 1))]  # fmt: skip
    got = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"{job['tag']} failed: {err.strip().splitlines()[-1:]}")
        got.append(json.loads(out.strip().splitlines()[-1]))
    if len(got) == 1:
        return got[0]
    return {"steady": statistics.median(g["steady"] for g in got), "seconds": max(g["seconds"] for g in got),
            "run_cpu": statistics.median(g["run_cpu"] for g in got),
            "post_cpu": statistics.median(g["post_cpu"] for g in got)}  # fmt: skip


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}–{max(xs):.2f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 round")
    p.add_argument("--workers", type=int, default=2, help="Ray workers (default 2)")
    p.add_argument("--batches", type=int, help="batches of the speed rows (default 80, quick 14)")
    p.add_argument("--many", type=int, help="batches of the memory rows (default 400, quick 20)")
    p.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    p.add_argument("--batch", type=int, default=16,
                   help="bert_like's batch size (default 16: compute-bound; the rows a batch does not grow with it)")  # fmt: skip
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        one(json.loads(args.one))
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    batches = args.batches or (14 if args.quick else 80)
    many = args.many or (20 if args.quick else 400)
    layers = 1 if args.quick else 4
    dims = {"batch": args.batch, "seq": 128}
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="opscope-bench-ray-") as tmp:
        jobs = [
            ("one process", {"engine": "local", "model": "bert_like", "batches": batches, "dims": dims}),
            ("ray", {"engine": "ray", "model": "bert_like", "batches": batches, "dims": dims}),
            (f"ray, mlp, {many // 10} batches", {"engine": "ray", "model": "mlp", "batches": many // 10}),
            (f"ray, mlp, {many} batches", {"engine": "ray", "model": "mlp", "batches": many}),
            ("bare session, alone", {"engine": "bare", "model": "bert_like", "batches": batches // 2, "dims": dims}),
            (f"bare session, {args.workers} at once",
             {"engine": "bare", "model": "bert_like", "batches": batches // 2, "dims": dims, "at_once": args.workers}),
        ]  # fmt: skip
        for r in range(rounds):
            for label, job in jobs:
                tag = f"{label}-{r}".replace(" ", "_").replace(",", "")
                job = {**job, "dir": tmp, "layers": layers, "workers": args.workers, "tag": tag}
                results.setdefault(label, []).append(_run(job))
                print(
                    f"[round {r + 1}/{rounds}] {label}: {results[label][-1]['seconds']:.2f} s",
                    file=sys.stderr,
                )
        import pyarrow.parquet as pq

        same = pq.read_table(results["one process"][0]["table"]).equals(
            pq.read_table(results["ray"][0]["table"])
        )
    load = os.getloadavg()
    print(f"- bert_like ({layers} layers, hidden 256, batch {args.batch}, seq 128), N = {batches} batches; {args.workers} "
          f"workers; 1 intra-op thread per session; {rounds} round(s); load {load[0]:.1f} at the end")  # fmt: skip
    print("| row | seconds, median [min–max] | steady ms / batch | ray.init s | driver peak MB | rows |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, rs in results.items():
        if label.startswith("bare"):
            print(f"| {label} | | {_median([x['steady'] * 1e3 for x in rs])} | | | |")
            continue
        print(f"| {label} | {_median([x['seconds'] for x in rs])} | {_median([x['steady'] * 1e3 for x in rs])} | "
              f"{_median([x['setup'] for x in rs])} | {_median([x['peak_mb'] for x in rs])} | {rs[0]['rows']} |")  # fmt: skip

    one_b = [x["steady"] for x in results["one process"]]
    ray_b = [x["steady"] for x in results["ray"]]
    fixed = [a["seconds"] - batches * b for a, b in zip(results["ray"], ray_b)]
    print(
        f"\nsteady state, ms a batch: one process {_median([x * 1e3 for x in one_b])}, "
        f"ray {_median([x * 1e3 for x in ray_b])}"
    )
    print(f"speed-up of {args.workers} Ray workers over one process: {_median([a / b for a, b in zip(one_b, ray_b)])}x "
          f"(goal >= 1.8x on 2 cores)")  # fmt: skip
    alone = [x["steady"] for x in results["bare session, alone"]]
    at_once = [x["steady"] for x in results[f"bare session, {args.workers} at once"]]
    ceiling = [args.workers * a / b for a, b in zip(alone, at_once)]
    print(f"the machine's ceiling for {args.workers} workers ({args.workers} bare tapped sessions at once against one "
          f"alone): {_median(ceiling)}x")  # fmt: skip
    gain = statistics.median(one_b) - statistics.median(ray_b)
    pays = (
        f"from about {statistics.median(fixed) / gain:.0f} batches of this model"
        if gain > 0
        else "never here"
    )
    print(f"Ray's fixed cost per recording (actors, sessions, results), beyond ray.init: {_median(fixed)} s; "
          f"Ray pays {pays} (per batch it is {'faster' if gain > 0 else 'slower'})")  # fmt: skip
    print(f"the same rows in the same order: {same}")

    def ms(label: str, key: str) -> str:
        return _median([x[key] * 1e3 for x in results[label]])

    print(f"CPU ms a batch (steady batches): one process {ms('one process', 'own_cpu')} (run + decoding and "
          f"encoding, overlapped); Ray workers {ms('ray', 'workers_cpu')} + driver {ms('ray', 'own_cpu')}; a bare "
          f"session's run {ms('bare session, alone', 'run_cpu')} alone, {ms(f'bare session, {args.workers} at once', 'run_cpu')} "
          f"{args.workers} at once; decoding and encoding a batch {ms('bare session, alone', 'post_cpu')}")  # fmt: skip
    small, large = (statistics.median(x["peak_mb"] for x in results[k])
                    for k in (f"ray, mlp, {many // 10} batches", f"ray, mlp, {many} batches"))  # fmt: skip
    print(
        f"driver peak MB, {many // 10} -> {many} batches: {small:.0f} -> {large:.0f} ({large - small:+.0f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
