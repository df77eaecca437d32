"""What `LiveRecorder` costs a serving session: its unsampled calls, its sampled ones, and on average.

    python scripts/bench_live.py                       # ppocrv4_det, 1 thread, every=100
    python scripts/bench_live.py --model models/real/captcha_crnn.onnx --every 50
    python scripts/bench_live.py --quick               # smoke run: its figures mean nothing

Rows (median [min-max] over rounds of per-call medians; in each round plain and recorder calls
alternate on the same feed, timed one by one with perf_counter_ns, on the same session):
- plain: the onnxruntime session's own `run`;
- unsampled: `LiveRecorder(session, every=N).run` on the calls it does not sample (the counter and
  the branch in front of the same session); the ratio to plain is the overhead the issue asks to be
  close to zero;
- the wrapper alone: the same two on a session whose `run` returns at once, in ns a call: what the
  counter and the branch cost with no model to hide them;
- sampled: the calls it samples (the tapped session, the plain one too when the tapped outputs are
  not bit-identical, the sketch updates), and the amortized cost of one call in N.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx_opscope.run import FeedSpec, LiveRecorder, RuntimeConfig, iter_feeds, make_session  # noqa: E402


class Instant:
    """A session whose run returns at once: the wrapper's cost with nothing to hide it."""

    def __init__(self):
        self.out = [np.zeros(1, np.float32)]

    def run(self, output_names, input_feed, run_options=None):
        return self.out


def _fmt(values: list[float], unit: str = "ms", scale: float = 1e-6) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.3f} {unit} [{min(v):.3f}-{max(v):.3f}]"


def _per_call(run, feeds: list[dict], calls: int) -> list[int]:
    times = []
    for i in range(calls):
        feed = feeds[i % len(feeds)]
        t = time.perf_counter_ns()
        run(None, feed)
        times.append(time.perf_counter_ns() - t)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "real" / "ppocrv4_det.onnx"))
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--calls", type=int, default=300, help="calls of each kind a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.calls, args.rounds, args.every = 20, 2, 5
    runtime = RuntimeConfig(threads=args.threads)
    feeds = list(iter_feeds(args.model, FeedSpec(batches=8, seed=1)))
    shapes = {k: list(v.shape) for k, v in feeds[0].items()}
    plain = make_session(args.model, runtime)
    t = time.perf_counter()
    rec = LiveRecorder(plain, every=args.every, model=args.model, runtime=runtime, input_shapes=shapes)
    built = time.perf_counter() - t
    for f in feeds:  # warm both sessions
        plain.run(None, f)
        rec.tapped.run(None, f)

    # plain and recorder calls alternate (ABAB) on the same feed, so a load change on the machine
    # falls on both; a sampled call is set apart (its neighbour plain call too)
    plain_med, unsampled_med = [], []
    for _ in range(args.rounds):
        plain_t, rec_t = [], []
        for i in range(args.calls):
            feed = feeds[i % len(feeds)]
            t = time.perf_counter_ns()
            plain.run(None, feed)
            dp = time.perf_counter_ns() - t
            n0 = rec.sampled
            t = time.perf_counter_ns()
            rec.run(None, feed)
            dr = time.perf_counter_ns() - t
            if rec.sampled == n0:
                plain_t.append(dp)
                rec_t.append(dr)
        plain_med.append(statistics.median(plain_t))
        unsampled_med.append(statistics.median(rec_t))
    # sampled calls: every call sampled, on a second recorder over the same session, ABAB again
    every1 = LiveRecorder(plain, every=1, model=args.model, runtime=runtime, input_shapes=shapes)
    sampled_med, plain_s_med = [], []
    for _ in range(args.rounds):
        plain_t, rec_t = [], []
        for i in range(max(8, args.calls // 10)):
            feed = feeds[i % len(feeds)]
            plain_t.append(_per_call(plain.run, [feed], 1)[0])
            rec_t.append(_per_call(every1.run, [feed], 1)[0])
        plain_s_med.append(statistics.median(plain_t))
        sampled_med.append(statistics.median(rec_t))

    instant = Instant()
    rec_instant = LiveRecorder(instant, every=1 << 62, model=args.model, runtime=runtime, input_shapes=shapes)
    wrapped_ns, bare_ns = [], []
    n = 200_000 if not args.quick else 20_000
    for _ in range(args.rounds):
        t = time.perf_counter_ns()
        for _ in range(n):
            instant.run(None, None)
        bare_ns.append((time.perf_counter_ns() - t) / n)
        t = time.perf_counter_ns()
        for _ in range(n):
            rec_instant.run(None, None)
        wrapped_ns.append((time.perf_counter_ns() - t) / n)

    p = statistics.median(plain_med)
    u = statistics.median(unsampled_med)
    s = statistics.median(sampled_med) * p / statistics.median(plain_s_med)  # at the first rows' plain speed
    amortized = ((args.every - 1) * u + s) / args.every
    print(f"## LiveRecorder on {Path(args.model).stem}, {args.threads} thread(s), every={args.every}, "
          f"{args.rounds} rounds x {args.calls} calls")  # fmt: skip
    print(f"tapped sites {len(rec.manifest.sites)}, tensors sampled {len(rec._taps)}, built in {built:.2f} s, "
          f"tapped outputs bit-identical: {every1.outputs_match}, sketch memory {rec.memory_bytes() / 1e3:.0f} KB "
          f"(bound {rec.max_memory_bytes() / 1e3:.0f} KB)")  # fmt: skip
    print()
    print("| measurement | per call | ratio to plain |")
    print("|---|---|---|")
    print(f"| plain session | {_fmt(plain_med)} | 1.000 |")
    print(f"| LiveRecorder, unsampled call | {_fmt(unsampled_med)} | {u / p:.3f} |")
    print(f"| LiveRecorder, sampled call (every=1) | {_fmt(sampled_med)} | {s / p:.2f} |")
    print(
        f"| LiveRecorder, amortized (1 in {args.every} sampled) | {amortized * 1e-6:.3f} ms | {amortized / p:.3f} |"
    )
    print(f"| instant session, bare | {_fmt(bare_ns, 'ns', 1)} | |")
    print(f"| instant session, through LiveRecorder | {_fmt(wrapped_ns, 'ns', 1)} | "
          f"+{statistics.median(wrapped_ns) - statistics.median(bare_ns):.0f} ns a call |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
