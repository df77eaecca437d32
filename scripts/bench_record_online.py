"""What `record --online` adds to a batch: the online sketches' host work, against the batch's decode and run.

    python scripts/bench_record_online.py                     # captcha_crnn and ppocrv4_det, 50 batches
    python scripts/bench_record_online.py --batches 5         # smoke run: its figures mean nothing

Per model, the default sketch set at every site, one tapped session: each batch is run once, then its
outputs are decoded into a table part with online off and with it on (`BatchDecoder`, the work of the
pipeline's thread per batch; the order of the two alternates batch by batch), and the batch's online
sketches merged as the driver merges them (`OnlineSketches.add`). Rows are medians over the batches:
run, decode off, decode on + merge, their difference (the overhead) and its share of run + decode.
The pipeline's thread overlaps the next batch's run, so the wall time grows by less than that.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx_opscope import sketch as sk  # noqa: E402
from onnx_opscope.instrument import host_values, inject  # noqa: E402
from onnx_opscope.run import FeedSpec, RuntimeConfig, iter_feeds, make_session  # noqa: E402
from onnx_opscope.run.recorder import BatchDecoder, OnlineSketches  # noqa: E402
from onnx_opscope.run.session import run  # noqa: E402

MODELS = ["captcha_crnn", "ppocrv4_det"]


def bench(name: str, batches: int, threads: int) -> dict:
    path = ROOT / "models" / "real" / f"{name}.onnx"
    runtime = RuntimeConfig(threads=threads)
    options = sk.for_providers(sk.SketchOptions(), ["CPUExecutionProvider"])
    model, manifest = inject(str(path), None, None, options, providers=["CPUExecutionProvider"])
    host = host_values(manifest, model, path.parent, cache=False)
    session = make_session(model, runtime, base_dir=path.parent, take_weights=True)
    want = manifest.output_names()
    labels = ("bench", "cpu", "gaussian")
    off = BatchDecoder(manifest, host, labels, "parquet")
    on = BatchDecoder(manifest, host, labels, "parquet", online=True)
    merged = OnlineSketches(manifest)
    feeds = list(iter_feeds(str(path), FeedSpec(batches=min(batches, 8))))
    times: dict[str, list[float]] = {"run": [], "off": [], "on": []}
    for step in range(batches + 1):  # batch 0 builds the decode plan: left out
        t = time.perf_counter()
        outputs = dict(zip(want, run(session, feeds[step % len(feeds)], want)))
        t_run = time.perf_counter() - t
        order = (off, on) if step % 2 else (on, off)
        got = {}
        for decoder in order:
            t = time.perf_counter()
            done = decoder(step + 1, outputs)  # not step 0: no schema or site dims, as a later batch
            for batch in done.online:
                merged.add(batch)
            got[decoder is on] = time.perf_counter() - t
        if step:
            times["run"].append(t_run)
            times["off"].append(got[False])
            times["on"].append(got[True])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    live = sum(1 for t in manifest.taps if not t.constant)
    return {"model": name, "taps": live, **med, "overhead": med["on"] - med["off"],
            "share": (med["on"] - med["off"]) / (med["run"] + med["off"])}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", action="append", default=None, help="a models/real/ name (default: both)")
    args = ap.parse_args()
    print(f"median of {args.batches} batches, {args.threads} thread(s); ms a batch")
    print(f"{'model':<14} {'taps':>5} {'run':>8} {'decode':>8} {'+online':>8} {'overhead':>9} {'share':>7}")
    for name in args.model or MODELS:
        r = bench(name, args.batches, args.threads)
        print(f"{r['model']:<14} {r['taps']:>5} {r['run']:>8.2f} {r['off']:>8.2f} {r['on']:>8.2f} "
              f"{r['overhead']:>9.2f} {r['share']:>6.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
