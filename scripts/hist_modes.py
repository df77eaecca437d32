"""Histogram modes compared: accuracy of the sampled histogram, and the cost of each mode.

    python scripts/hist_modes.py [--runs 20] [--skip-accuracy] [--skip-timing]

1. Accuracy. On every tensor tapped in the real models (models/real, fetched by
   scripts/fetch_models.py) and in zoo.bert_like(), the sampled histogram (hist_mode="sampled",
   sample_size 4096: 256 evenly spaced blocks of 16 contiguous elements) against the exact one (every finite
   value), both computed by the instrumented model: total-variation distance
   TV = 1/2 * sum |p - q| between the two normalised histograms; median, p95 and max over the
   tensors larger than the sample (smaller ones are sampled whole: TV = 0).
2. Cost. bert_like (hidden 256, 4 layers, seq 128, batch 4), ORT_ENABLE_ALL, CPU: the time of
   one instrumented run (and of the run plus decoding on the host, where `host` mode bins the
   copied-out tensors) as a ratio to the plain model's run, for each mode with sketches=["hist"]
   alone and with the default set: exact counted in the graph, and exact/cpu (bin indices in
   the graph, np.bincount on the host: what `record` picks on the CPU provider). Sessions as
   `record` makes them (runtime.for_tapped); onnxruntime's default threads. Median of --runs
   runs after a warm-up.
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

from onnx_opscope import sketch as sk  # noqa: E402
from onnx_opscope import zoo  # noqa: E402
from onnx_opscope.graph import load_model  # noqa: E402
from onnx_opscope.instrument import (  # noqa: E402
    decode,
    decode_taps,
    host_values,  # noqa: E402
    inject,  # noqa: E402
)
from onnx_opscope.run.session import RuntimeConfig, for_tapped, make_session  # noqa: E402
from onnx_opscope.sites import Selection  # noqa: E402

REAL = ROOT / "models" / "real"
MODES = ("sampled", "exact", "host")


def real_feeds(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Feeds per real_models.md (moderate sizes)."""
    if name == "ppocrv4_rec":
        return {"x": rng.uniform(-1, 1, (1, 3, 48, 320)).astype(np.float32)}
    if name == "ppocrv4_det":
        return {"x": rng.uniform(-1, 1, (1, 3, 320, 320)).astype(np.float32)}
    if name == "silero_vad_v6":
        return {
            "input": rng.uniform(-0.5, 0.5, (1, 512)).astype(np.float32),
            "state": np.zeros((2, 1, 128), np.float32),
            "sr": np.array(16000, np.int64),
        }
    if name == "captcha_crnn":
        return {"image": rng.uniform(0, 255, (1, 3, 60, 160)).astype(np.float32)}
    if name == "magika_standard_v3_3":
        return {"bytes": rng.integers(0, 257, (1, 2048)).astype(np.int32)}
    raise KeyError(name)


def bert_feeds(batch: int, seq: int, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    mask = np.ones((batch, seq), np.int64)
    mask[1:, seq * 3 // 4 :] = 0  # some padding: the -3.4e38 mask bias is live
    return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64), "attention_mask": mask}


def hists(model, feeds, mode: str) -> dict[str, tuple[np.ndarray, int]]:
    """tensor -> (histogram, numel) from the instrumented model, every GEMM tap that ran."""
    opts = sk.SketchOptions(hist_mode=mode)
    inst, manifest = inject(model, Selection(kinds=("gemm",)), ["hist"], opts)
    sess = make_session(inst, RuntimeConfig(graph_opt="disable"))
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    got = {}
    decoded = decode_taps(manifest, outs, host_values(manifest, inst))  # weights: on the host
    for tap in manifest.taps:
        values, shape = decoded[tap.id]
        if shape is not None and "hist" in values:
            got[f"{tap.graph}:{tap.tensor}"] = (values["hist"], int(np.prod(shape)) if shape else 1)
    return got


def tv(p: np.ndarray, q: np.ndarray) -> float:
    sp, sq = p.sum(), q.sum()
    if sp == 0 or sq == 0:
        return 0.0 if sp == sq else 1.0
    return 0.5 * float(np.abs(p / sp - q / sq).sum())


def accuracy() -> None:
    rng = np.random.default_rng(0)
    cases = [
        (n, load_model(REAL / f"{n}.onnx"), real_feeds(n, rng))
        for n in sorted(p.stem for p in REAL.glob("*.onnx"))
    ]
    cases.append(("bert_like", zoo.bert_like(), bert_feeds(4, 128, 1000, rng)))
    print("sampled (4096) vs exact histogram, 32 bins: total-variation distance over tensors > 4096 elements")
    print(f"{'model':<22} {'tensors':>7} {'sampled':>7} {'median':>8} {'p95':>8} {'max':>8}")
    everything = []
    for name, model, feeds in cases:
        sampled, exact = hists(model, feeds, "sampled"), hists(model, feeds, "exact")
        assert sampled.keys() == exact.keys()
        big = [tv(sampled[k][0], exact[k][0]) for k in exact if exact[k][1] > 4096]
        small = [tv(sampled[k][0], exact[k][0]) for k in exact if exact[k][1] <= 4096]
        assert all(d == 0 for d in small), f"{name}: a tensor sampled whole differs from the exact histogram"
        everything += big
        if big:
            print(
                f"{name:<22} {len(exact):>7} {len(big):>7} {np.median(big):>8.4f} "
                f"{np.percentile(big, 95):>8.4f} {max(big):>8.4f}"
            )
        else:
            print(f"{name:<22} {len(exact):>7} {0:>7} {'-':>8} {'-':>8} {'-':>8}")
    print(
        f"{'all':<22} {'':>7} {len(everything):>7} {np.median(everything):>8.4f} "
        f"{np.percentile(everything, 95):>8.4f} {max(everything):>8.4f}\n"
    )


def timed(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timing(runs: int) -> None:
    model = zoo.bert_like(hidden=256, layers=4, heads=4, vocab=1000, max_seq=128)
    feeds = bert_feeds(4, 128, 1000, np.random.default_rng(0))
    cfg = RuntimeConfig(graph_opt="all")
    plain = make_session(model, cfg)
    base = timed(lambda: plain.run(None, feeds), runs)
    print(f"bert_like hidden 256, 4 layers, seq 128, batch 4, ORT_ENABLE_ALL: plain run {base * 1e3:.1f} ms")
    print(f"{'sketches':<10} {'mode':<10} {'taps':>5} {'run ms':>8} {'run/plain':>10} {'+decode/plain':>14}")
    variants = [(m, sk.SketchOptions(hist_mode=m)) for m in MODES]
    variants.insert(2, ("exact/cpu", sk.SketchOptions(hist_mode="exact", exact_counts="host")))
    for label, names in (("hist", ["hist"]), ("default", None)):
        for mode, opts in variants:
            inst, manifest = inject(model, Selection(kinds=("gemm",)), names, opts)
            sess = make_session(inst, for_tapped(cfg))  # as `record` runs it
            t_run = timed(lambda s=sess: s.run(None, feeds), runs)
            out_names = [o.name for o in sess.get_outputs()]

            host = host_values(manifest, inst)

            def run_decode(s=sess, m=manifest, o=out_names, h=host) -> None:
                decode(m, dict(zip(o, s.run(None, feeds))), h)

            t_all = timed(run_decode, runs)
            print(
                f"{label:<10} {mode:<10} {len(manifest.taps):>5} {t_run * 1e3:>8.1f} "
                f"{t_run / base:>10.2f} {t_all / base:>14.2f}"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    if not args.skip_accuracy:
        accuracy()
    if not args.skip_timing:
        timing(args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
