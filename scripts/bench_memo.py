"""What `GuardedMemo` gains on a replay of repeated inputs, and what its guards cost.

    python scripts/bench_memo.py                          # ppocrv4_det, 300 calls, 30% distinct
    python scripts/bench_memo.py --distinct 0.1 --calls 1000
    python scripts/bench_memo.py --quick                  # smoke run: its figures mean nothing

A replay: `--calls` calls drawn uniformly (seeded) from `--distinct` x calls different feeds, every
one of them used at least once. Each round (interleaved, median [min-max]) replays it through the
plain session and through a fresh `GuardedMemo` on the same session, checking that every output
is bit-identical to the plain one. Also timed apart: a hit (hash, byte compare, output copy) and
the overhead of a miss (hash, copies stored) per call, against one plain run.
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

from onnx_opscope.run import FeedSpec, GuardedMemo, RuntimeConfig, iter_feeds, make_session  # noqa: E402


def _fmt(values: list[float], unit: str = "ms", scale: float = 1e3) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.3f} {unit} [{min(v):.3f}-{max(v):.3f}]"


def _replay(run, feeds: list[dict], order: list[int]) -> tuple[float, list]:
    outs = []
    t = time.perf_counter()
    for i in order:
        outs.append(run(None, feeds[i]))
    return time.perf_counter() - t, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "real" / "ppocrv4_det.onnx"))
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--distinct", type=float, default=0.3, help="share of distinct feeds in the replay")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.calls, args.rounds = 40, 2
    k = max(1, round(args.distinct * args.calls))
    feeds = list(iter_feeds(args.model, FeedSpec(batches=k, seed=2)))
    rng = np.random.default_rng(0)
    order = rng.permutation(np.concatenate([np.arange(k), rng.integers(0, k, args.calls - k)])).tolist()
    plain = make_session(args.model, RuntimeConfig(threads=args.threads))
    for f in feeds[:4]:
        plain.run(None, f)

    plain_s, memo_s, stats = [], [], None
    for _ in range(args.rounds):
        t_plain, want = _replay(plain.run, feeds, order)
        memo = GuardedMemo(plain, capacity=max(k, 1))
        t_memo, got = _replay(memo.run, feeds, order)
        for a, b in zip(want, got):
            assert all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b)), (
                "outputs differ"
            )
        plain_s.append(t_plain)
        memo_s.append(t_memo)
        stats = memo.stats()

    # a hit and a miss's overhead, per call, apart from the replay
    memo = GuardedMemo(plain, capacity=max(k, 1))
    memo.run(None, feeds[0])
    n = 200 if not args.quick else 20
    t = time.perf_counter()
    for _ in range(n):
        memo.run(None, feeds[0])
    hit = (time.perf_counter() - t) / n
    run_one = statistics.median(_replay(plain.run, feeds, [0] * 5)[0] / 5 for _ in range(5))
    miss_extra = []
    for f in feeds[: min(k, 20)]:
        m = GuardedMemo(plain)
        t = time.perf_counter()
        m.run(None, f)
        whole = time.perf_counter() - t
        t = time.perf_counter()
        plain.run(None, f)
        miss_extra.append(whole - (time.perf_counter() - t))

    p, m = statistics.median(plain_s), statistics.median(memo_s)
    print(f"## GuardedMemo on {Path(args.model).stem}, {args.threads} thread(s): {args.calls} calls, {k} distinct "
          f"({k / args.calls:.0%}), {args.rounds} rounds")  # fmt: skip
    print(f"hits {stats['hits']}, misses {stats['misses']}, hit rate {stats['hit_rate']:.3f} "
          f"(the replay's repeat share {1 - k / args.calls:.3f}), cache {stats['bytes'] / 1e6:.1f} MB; "
          "every output bit-identical to the plain session's")  # fmt: skip
    print()
    print("| measurement | time | ratio |")
    print("|---|---|---|")
    print(f"| replay, plain session | {_fmt(plain_s, 's', 1)} | 1.00 |")
    print(f"| replay, GuardedMemo | {_fmt(memo_s, 's', 1)} | speed-up {p / m:.2f}x |")
    print(f"| best possible (misses only run) | {p * k / args.calls:.3f} s | {args.calls / k:.2f}x |")
    print(f"| one hit (hash + compare + copy) | {hit * 1e3:.3f} ms | {hit / run_one:.3f} of a run |")
    print(f"| a miss beyond its run (hash + store) | {statistics.median(miss_extra) * 1e3:.3f} ms | "
          f"{statistics.median(miss_extra) / run_one:.3f} of a run |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
