"""The host side of a recorded batch, alone: decode -> batch table -> encoded part, per batch and per tap.

    python scripts/bench_decode.py                          # tiny_taps, silero_vad_v6, captcha_crnn, ppocrv4_det
    python scripts/bench_decode.py --models tiny_taps --iters 400
    python scripts/bench_decode.py --models silero_vad_v6 --group 64  # as record groups a fast model's batches
    python scripts/bench_decode.py --save SNAP              # also keep raw outputs, manifests and tables
    python scripts/bench_decode.py --check SNAP             # decode SNAP's raw outputs, compare bit for bit

What `record` does on its pipeline thread for every batch (`run.recorder.BatchDecoder`): the tap
outputs of one session.run are decoded into rows (`instrument.decode`), laid out as the sketch
table's columns (`run.table.batch_table`) and encoded as a Parquet part (`run.table.encode_part`).
Each model is injected as `scripts/bench.py` does (the same ops, feeds and sketch options on the CPU
provider), run on `--batches` distinct feeds, and those outputs are decoded `--iters` times in turn;
each stage is timed per batch. Printed: median [p10-p90] µs per batch and µs per live tap, the
ratio to the figures in `--against` (default: bench_decode_baseline.json beside this script, the
code before the fast decode, measured on the shared 2-core machine of BENCHMARKS.md), and the host
path a batch when 8 batches (`--group`) are decoded and encoded together (`run.recorder.decode_group`:
what `record` does with the batches that pile up while its worker decodes, up to 64 for a model much
faster than its decode, as silero_vad_v6).

`--save` writes, per model and sketch set, the raw outputs, the manifest, the weight taps' host values
and each batch's table; `--check` decodes those same raw outputs with the code as it is now and says
whether every table is identical (schema, and every column's bits: NaN payloads included), decoded
one batch at a time and all together (`instrument.decode_many`), so a change to the decoding can be
held to the tables of the code before it.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - a sibling script: the models, feeds and ops bench.py measures

BASELINE = Path(__file__).with_name("bench_decode_baseline.json")  # the code before the fast decode
MODELS = ("tiny_taps", "silero_vad_v6", "captcha_crnn", "ppocrv4_det")
GROUP = 8  # batches decoded together in the grouped column
SETS = {"default": None, "all": ["all"], "exact": None}  # sketch names; "exact": the default set, exact hist


def case(name: str, n: int) -> tuple[object, list[dict], tuple[str, ...]]:
    """(model path or proto, n feeds, ops to tap) as bench.py builds them."""
    from onnx_opscope.run.feeds import FeedSpec, synthetic_feeds

    if name == "tiny_taps":
        model = bench.tiny_model()
        return model, [synthetic_feeds(model, FeedSpec(), i) for i in range(n)], ("MatMul",)
    spec, post, wanted, _ = bench._REAL[name]
    path = bench.REAL / f"{name}.onnx"
    ops, _ = bench._present_ops(path, wanted)
    return path, [post(synthetic_feeds(path, FeedSpec(**spec), i)) for i in range(n)], tuple(ops)


def recorded(name: str, sketch_set: str, n: int) -> tuple[object, dict, list[dict]]:
    """(manifest, host values, n batches of tap outputs) of one model, injected and run as `record` does."""
    from onnx_opscope.instrument import host_values, inject
    from onnx_opscope.run.session import RuntimeConfig, for_tapped, make_session
    from onnx_opscope.sites import Selection
    from onnx_opscope.sketch import SketchOptions, for_providers

    model, feeds, ops = case(name, n)
    options = SketchOptions(hist_mode="exact" if sketch_set == "exact" else "sampled")
    options = for_providers(options, ["CPUExecutionProvider"])
    shapes = {k: list(v.shape) for k, v in feeds[0].items()}
    tapped, manifest = inject(model, Selection(op_types=ops), SETS[sketch_set], options, input_shapes=shapes)
    host = host_values(manifest, tapped)
    base = str(Path(model).parent) if isinstance(model, Path) else None
    sess = make_session(tapped, for_tapped(RuntimeConfig()), base_dir=base, take_weights=True)
    names = [o.name for o in sess.get_outputs()]
    keep = set(manifest.output_names())
    outputs = [{k: v for k, v in zip(names, sess.run(None, f)) if k in keep} for f in feeds]
    return manifest, host, outputs


def host_path(manifest, host, outputs: dict, step: int) -> tuple[object, list[float]]:
    """One batch through the host path (what BatchDecoder does); (its table, seconds per stage)."""
    from onnx_opscope.instrument import decode
    from onnx_opscope.run.table import batch_table, encode_part

    c0, t0 = time.thread_time(), time.perf_counter()
    rows = decode(manifest, outputs, host)
    t1 = time.perf_counter()
    table = batch_table(rows, "run", step, "CPUExecutionProvider", "uniform")
    t2 = time.perf_counter()
    encode_part(table, "parquet", first=step == 0)
    t3 = time.perf_counter()
    return table, [t1 - t0, t2 - t1, t3 - t2, time.thread_time() - c0]


def measure(manifest, host, outputs: list[dict], iters: int) -> dict:
    for i in range(min(5, iters)):  # warm-up: first-batch caches
        host_path(manifest, host, outputs[i % len(outputs)], i)
    stages = [host_path(manifest, host, outputs[i % len(outputs)], i + 1)[1] for i in range(iters)]
    live = sum(not t.constant for t in manifest.taps)
    total = [sum(s[:3]) * 1e6 for s in stages]
    out = {"taps": live, "copied": sum(t.copied for t in manifest.taps), "total": _spread(total)}
    for j, stage in enumerate(("decode", "table", "encode", "cpu")):
        out[stage] = _spread([s[j] * 1e6 for s in stages])
    out["per_tap"] = out["total"][0] / max(live, 1)
    return out


def measure_grouped(
    manifest, host, outputs: list[dict], iters: int, k: int = GROUP
) -> tuple[float, float, float]:
    """µs a batch of the host path when `k` batches are decoded and encoded together (`decode_group`: what
    `record` does with the batches that pile up while its worker decodes)."""
    from onnx_opscope.run.recorder import BatchDecoder, decode_group

    decoder = BatchDecoder(manifest, host, ("run", "CPUExecutionProvider", "uniform"), "parquet")
    groups = [
        [(g * k + j + 1, outputs[(g * k + j) % len(outputs)]) for j in range(k)]
        for g in range(iters // k + 2)
    ]
    decode_group(decoder, groups[0])  # warm-up
    us = []
    for group in groups[1:]:
        t = time.perf_counter()
        decode_group(decoder, group)
        us.append((time.perf_counter() - t) * 1e6 / k)
    return _spread(us)


def _spread(us: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(us, n=10)
    return statistics.median(us), q[0], q[-1]


def table_bits(table) -> dict:
    """Every column of a batch table as bytes that differ when any value, NaN payloads included, does."""
    import pyarrow as pa

    out = {"schema": table.schema.to_string()}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_string(col.type):  # strings: their values and nulls
            out[name] = pickle.dumps(col.to_pylist())
        else:
            nulls = np.asarray(col.is_null()).tobytes() if col.null_count else b""
            out[name] = col.to_numpy(zero_copy_only=False).tobytes() + nulls
    return out


def save(folder: Path, key: str, manifest, host, outputs: list[dict]) -> None:
    d = folder / key
    d.mkdir(parents=True, exist_ok=True)
    (d / "manifest.json").write_text(manifest.to_json())
    (d / "host.pkl").write_bytes(pickle.dumps(host))
    np.savez(d / "outputs.npz", **{f"{i}/{k}": v for i, b in enumerate(outputs) for k, v in b.items()})
    tables = [table_bits(host_path(manifest, host, o, i)[0]) for i, o in enumerate(outputs)]
    (d / "tables.pkl").write_bytes(pickle.dumps(tables))


def load(d: Path) -> tuple[object, dict, list[dict]]:
    from onnx_opscope.instrument import load_manifest

    manifest = load_manifest(d / "manifest.json")
    host = pickle.loads((d / "host.pkl").read_bytes())
    batches: dict[int, dict] = {}
    with np.load(d / "outputs.npz", allow_pickle=True) as z:  # an output onnxruntime gave as None
        for k in z.files:
            i, name = k.split("/", 1)
            batches.setdefault(int(i), {})[name] = z[k]
    return manifest, host, [batches[i] for i in sorted(batches)]


def _read_back(table, step: int):
    """The table as a reader sees the Parquet part `encode_part` makes of it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from onnx_opscope.run.table import encode_part

    return pq.read_table(pa.BufferReader(encode_part(table, "parquet", first=step == 0)))


def _together(manifest, host, outputs: list[dict]) -> list:
    """Each batch's table when all of them are decoded in one call (`decode_many`), where this code has it."""
    from onnx_opscope import instrument
    from onnx_opscope.run.table import batch_table

    if not hasattr(instrument, "decode_many"):
        return [None] * len(outputs)
    many = instrument.decode_many(manifest, outputs, host)
    return [batch_table(rows, "run", i, "CPUExecutionProvider", "uniform") for i, rows in enumerate(many)]


def check(folder: Path) -> bool:
    """Decode every saved model's raw outputs and compare each batch's table, and its Parquet part as
    read back, with the saved table."""
    ok = True
    for d in sorted(p for p in folder.iterdir() if (p / "tables.pkl").is_file()):
        manifest, host, outputs = load(d)
        before = pickle.loads((d / "tables.pkl").read_bytes())
        bad = []
        together = _together(manifest, host, outputs)
        for i, o in enumerate(outputs):
            table = host_path(manifest, host, o, i)[0]
            for what, t in (
                ("table", table),
                ("part read back", _read_back(table, i)),
                ("decoded together", together[i]),
            ):
                if t is None:
                    continue
                now = table_bits(t)
                bad += [f"batch {i} {what} {c}" for c in before[i] if now.get(c) != before[i][c]]
                bad += [f"batch {i} {what} {c} (new)" for c in now if c not in before[i]]
        ok &= not bad
        print(
            f"{d.name}: {len(outputs)} batches, "
            + ("identical" if not bad else "DIFFER: " + ", ".join(bad[:6]))
        )
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--sets", default="default", help=f"sketch sets, comma-separated, of {', '.join(SETS)}")
    p.add_argument("--batches", type=int, default=20, help="distinct recorded batches per model")
    p.add_argument("--iters", type=int, default=200, help="timed decodes per model (batches in turn)")
    p.add_argument(
        "--group",
        type=int,
        default=GROUP,
        help=f"batches decoded together in the last column (default {GROUP}; record groups up to 64)",
    )
    p.add_argument("--save", type=Path, help="also save raw outputs, manifests and tables in this folder")
    p.add_argument("--check", type=Path, help="only compare the tables of a --save folder with this code's")
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    p.add_argument(
        "--against",
        type=Path,
        default=BASELINE,
        help="figures of earlier code (JSON) to print ratios against",
    )
    a = p.parse_args()
    if a.check:
        return 0 if check(a.check) else 1
    import onnx_opscope

    print(f"onnx_opscope from {Path(onnx_opscope.__file__).parent}; load average {os.getloadavg()[0]:.2f}")
    print(f"{os.cpu_count()} cores; µs per batch, median [p10-p90]; CPU time: this thread's (thread_time)")
    before = json.loads(a.against.read_text())["figures"] if a.against and a.against.is_file() else {}
    print(
        "| model | set | taps (copied) | decode | table | encode | host path | its CPU time | µs / tap | before / now"
        f" | host path, {a.group} batches together |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    figures = {}
    for name in a.models.split(","):
        for sketch_set in a.sets.split(","):
            manifest, host, outputs = recorded(name, sketch_set, a.batches)
            if a.save:
                save(a.save, f"{name}-{sketch_set}", manifest, host, outputs)
            f = measure(manifest, host, outputs, a.iters)
            f["grouped"] = measure_grouped(manifest, host, outputs, max(a.iters, 4 * a.group), a.group)
            figures[f"{name}-{sketch_set}"] = f
            cells = [
                f"{f[s][0]:.0f} [{f[s][1]:.0f}-{f[s][2]:.0f}]"
                for s in ("decode", "table", "encode", "total", "cpu")
            ]
            old = before.get(f"{name}-{sketch_set}")
            ratio = (
                f"{old['cpu'] / f['cpu'][0]:.2f}x CPU, {old['total'] / f['total'][0]:.2f}x wall"
                if old
                else "-"
            )
            taps = f"{f['taps']} ({f['copied']})"
            grouped = "{:.0f} [{:.0f}-{:.0f}]".format(*f["grouped"])
            print(
                f"| {name} | {sketch_set} | {taps} | {' | '.join(cells)} | {f['per_tap']:.1f} | {ratio} | {grouped} |"
            )
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
