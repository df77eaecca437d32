"""Benchmark `generate`: the plain KV-cache loop against the recorded one (default sketch set), per token and in memory.

Each mode runs in its own process (peak RSS is per process): a random prompt, then `--steps` tokens.
Prints the prefill time, the median decode step, the decode ratio recorded / plain and the peak RSS.

    python scripts/make_decoder.py && python scripts/bench_generate.py --steps 256
    python scripts/bench_generate.py --model models/real/smollm2_135m_l2/model.onnx --steps 64
    python scripts/bench_generate.py --steps 64 --repeat 5     # interleaved rounds: median [min-max] of each figure
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "real" / "smollm2_135m" / "model.onnx"


def _rss_mb() -> float:
    """Resident memory now (Linux /proc; elsewhere the peak so far)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(model: str, mode: str, prompt: int, steps: int, every: int, threads: int | None) -> dict:
    # onnxruntime.tools imports torch whenever it is installed (the decoder extra): +230 MB and ~4 s in any
    # process that infers shapes. A user recording a decoder needs no torch, so keep it out of the measure.
    sys.modules["torch"] = None
    import numpy as np

    from onnx_opscope import RuntimeConfig, generate

    marks: list[tuple[float, float, float]] = []  # (wall, process CPU seconds, RSS MB) after each step

    def progress(done: int, total: int | None) -> None:
        marks.append((time.perf_counter(), time.process_time(), _rss_mb()))

    with tempfile.TemporaryDirectory() as tmp:
        out = None if mode == "plain" else Path(tmp) / "gen.parquet"
        r = generate(model, tokens=prompt, steps=steps, out=out, every=every, runtime=RuntimeConfig(threads=threads),
                     parity=False, progress=progress)  # fmt: skip
    decode = np.array(r.step_seconds[1:])
    wall = np.array([w for w, _, _ in marks])
    cpu = np.array([c for _, c, _ in marks])
    rss = [m for _, _, m in marks]
    return {
        "mode": mode,
        "prefill_ms": 1e3 * r.step_seconds[0],
        "decode_ms": 1e3 * float(np.median(decode)),
        # a token's whole wall time, step to step: the run, binding, and waiting for the decode thread
        "token_ms": 1e3 * float(np.median(np.diff(wall))),
        # every thread's CPU over the decode steps (the table's decoding on its thread included) per token
        "decode_cpu_ms": 1e3 * float(cpu[-1] - cpu[0]) / (len(cpu) - 1),
        "rss_first_mb": rss[0],
        "rss_max_mb": max(rss),
        "rss_last_mb": rss[-1],
        "rows": r.rows,
        "seconds": r.seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompt", type=int, default=32, help="random prompt tokens (default 32)")
    p.add_argument("--steps", type=int, default=256, help="tokens generated (default 256)")
    p.add_argument("--every", type=int, default=1, help="record one decode step in N (default 1)")
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (default 1: steadier on a shared machine)"
    )
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="N rounds of plain then recorded: each figure as median [min-max], the ratios taken per round "
                   "(default 1; 5 or more on a shared machine)")  # fmt: skip
    p.add_argument("--one", choices=["plain", "recorded"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.model, args.one, args.prompt, args.steps, args.every, args.threads)))
        return 0
    rounds, loads = [], [os.getloadavg()[0]]
    for _ in range(max(1, args.repeat)):
        results = {}
        for mode in ("plain", "recorded"):
            cmd = [sys.executable, __file__, "--one", mode, "--model", args.model, "--prompt", str(args.prompt),
                   "--steps", str(args.steps), "--every", str(args.every), "--threads", str(args.threads)]  # fmt: skip
            results[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        rounds.append(results)
        loads.append(os.getloadavg()[0])
    print(f"{Path(args.model).parent.name}: prompt {args.prompt} tokens, {args.steps} generated, "
          f"recording every {args.every}, {args.threads} thread(s)")  # fmt: skip
    if len(rounds) == 1:
        report(rounds[0])
    else:
        report_rounds(rounds, loads)
    return 0


def report(results: dict) -> None:
    for mode, r in results.items():
        print(f"  {mode:<9} prefill {r['prefill_ms']:6.1f} ms  decode run {r['decode_ms']:6.1f} ms  token {r['token_ms']:6.1f} ms  "
              f"CPU {r['decode_cpu_ms']:6.1f} ms/token  RSS {r['rss_first_mb']:.0f} -> {r['rss_last_mb']:.0f} MB "
              f"(max {r['rss_max_mb']:.0f}, peak incl. setup {r['peak_rss_mb']:.0f})  {r['rows']} rows  "
              f"{r['seconds']:.1f} s")  # fmt: skip
    plain, rec = results["plain"], results["recorded"]
    print(f"  recorded / plain per decode token: CPU {rec['decode_cpu_ms'] / plain['decode_cpu_ms']:.2f}x, "
          f"run {rec['decode_ms'] / plain['decode_ms']:.2f}x, token (wall) {rec['token_ms'] / plain['token_ms']:.2f}x; RSS during the loop "
          f"+{rec['rss_max_mb'] - plain['rss_max_mb']:.0f} MB, growth over it {rec['rss_last_mb'] - rec['rss_first_mb']:+.0f} MB "
          f"(plain {plain['rss_last_mb'] - plain['rss_first_mb']:+.0f})")  # fmt: skip


def report_rounds(rounds: list[dict], loads: list[float]) -> None:
    """Each figure over the rounds as median [min-max]; a ratio is recorded / plain within one round."""

    def spread(values: list[float], unit: str = "") -> str:
        v = sorted(values)
        return f"{v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2:.2f}{unit} [{v[0]:.2f}-{v[-1]:.2f}]"

    for mode in ("plain", "recorded"):
        rs = [r[mode] for r in rounds]
        print(f"  {mode:<9} token {spread([r['token_ms'] for r in rs], ' ms')}  CPU {spread([r['decode_cpu_ms'] for r in rs], ' ms')}"
              f"/token  decode run {spread([r['decode_ms'] for r in rs], ' ms')}  {rs[-1]['rows']} rows")  # fmt: skip
    ratio = {
        k: [r["recorded"][k] / r["plain"][k] for r in rounds]
        for k in ("token_ms", "decode_cpu_ms", "decode_ms")
    }
    print(f"  recorded / plain per decode token over {len(rounds)} interleaved rounds: token (wall) "
          f"{spread(ratio['token_ms'], 'x')}, CPU {spread(ratio['decode_cpu_ms'], 'x')}, run {spread(ratio['decode_ms'], 'x')}; "
          f"1-min load {' '.join(f'{x:.1f}' for x in loads)}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
