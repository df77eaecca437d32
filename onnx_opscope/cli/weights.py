"""`opscope weights`: per-weight probes and hints, and with --plan the per-layer plan at byte budgets.

Two API calls: `onnx_opscope.probe_weights` (the table) and `onnx_opscope.plan_weights` (menus,
greedy and DADO per budget, each budget's plan applied and scored against the model).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from ..errors import OpscopeError
from ..files import atomic_path, check_writable, write_table
from ..run.weights import DEFAULT_MIN_COSINE, DEFAULT_MIN_TOP1, WeightPlans, plan_weights
from ..weights import probe_weights, probes_table
from ..weights.plan import DEFAULT_BUDGETS, DEFAULT_SVD_CAP
from .options import (
    add_feed_arguments,
    add_format_argument,
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    csv_items,
    feed_spec_from_args,
    output_format,
    runtime_config_from_args,
)

EPILOG = """what the columns mean:
  stable_rank   ||W||_F^2 / sigma_max^2: much below min(rows, cols) means low rank
  int<b>_<g>    relative L2 error of symmetric int<b> (scale amax / (2^(b-1)-1)) per tensor,
                channel (output channel) or group (g32 / g128 along the input axis)
  best_bits     the first of --bits whose per-channel error is under --budget
  nm_error      2:4 sparsity error (keep the 2 largest |w| of every 4 along the input axis)
  ternary       TWN error (delta = 0.7 mean|w|, alpha = mean|w| over |w| > delta)
  cardinality   distinct round(w * 1000), capped at 100k;  outliers: input columns > 6x the median
  hint          first match: 2:4 sparse, palettize / LUT, factored matmul, mixed int4,
                grouped int4, int4 / int8 per channel, keep fp16/bf16

--plan: each weight's menu (dense, int8/int4 per channel and grouped, ternary, 2:4, low rank at
90/99/99.9% energy, Monarch, Tucker, tensor train: error, bytes, MACs), greedy and DADO at each
--budgets fraction of the dense bytes, and each budget's plan applied and compared with the model
on the feeds (cosine, top-1 / top-5, KL). The plan written is the smallest budget that keeps
cosine >= --min-cosine and top-1 >= --min-top1 (or the largest budget, marked not recommended).

examples:
  opscope weights model.onnx                                  # the probes, largest weights first
  opscope weights model.onnx --format parquet -o probes.parquet
  opscope weights model.onnx --plan plan.json                 # menus, allocators, checked plans
  opscope weights model.onnx --plan plan.json --storable --budgets 0.3,0.25 --report plan.html
  opscope report sketches.parquet --weights plan.json -o report.html   # the section in the main report
  opscope rewrite weights model.onnx --plan plan.json -o model.small.onnx
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "weights",
        help="per-weight probes and hints; with --plan, the cheapest per-layer representation at byte budgets",
        description="Probe every float weight (initializers and Constants, subgraphs included, external data read "
        "one tensor at a time) as a [output channels, inputs] matrix: stable rank, int3/4/6/8 error per tensor, "
        "channel and group, 2:4 and ternary error, cardinality, outlier columns, and a hint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="the .onnx model")
    add_format_argument(p, "the probe table")
    add_output_argument(p, "write the probe table to FILE (csv, json, parquet)")
    p.add_argument("--top", type=int, default=25, metavar="N", help="rows shown in the terminal table")
    p.add_argument("--budget", type=float, default=0.02, help="error budget of best_bits (default 0.02)")
    p.add_argument("--bits", default="3,4,6,8", help="bit widths probed (default 3,4,6,8)")
    plan = p.add_argument_group("plan", "per-layer menus and allocators (--plan)")
    plan.add_argument("--plan", type=Path, metavar="OUT.json", help="write the checked plan here")
    plan.add_argument(
        "--budgets",
        default=",".join(str(b) for b in DEFAULT_BUDGETS),
        help="byte budgets as fractions of the dense weights (default 0.5,0.35,0.2)",
    )
    plan.add_argument(
        "--storable",
        action="store_true",
        help="plan only options this model's opset and readers can store (the file shrinks as planned)",
    )
    plan.add_argument("--svd-cap", type=int, default=DEFAULT_SVD_CAP, metavar="N",
                      help=f"randomized SVD above min(rows, cols) > N (default {DEFAULT_SVD_CAP})")  # fmt: skip
    plan.add_argument("--no-check", action="store_true", help="do not apply and score the plans")
    plan.add_argument("--report", type=Path, metavar="OUT.html",
                      help="also draw the plans: error against bytes per layer, the frontier (.html or .md)")  # fmt: skip
    plan.add_argument("--min-cosine", type=float, default=DEFAULT_MIN_COSINE,
                      help=f"quality gate: worst output cosine (default {DEFAULT_MIN_COSINE})")  # fmt: skip
    plan.add_argument("--min-top1", type=float, default=DEFAULT_MIN_TOP1,
                      help=f"quality gate: top-1 agreement of logits-like outputs (default {DEFAULT_MIN_TOP1})")  # fmt: skip
    add_quiet_argument(p)
    add_feed_arguments(p)
    add_runtime_arguments(p)
    return p


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in csv_items([text])]
    except ValueError:
        raise OpscopeError(f"{flag} {text!r}: expected comma-separated numbers") from None


def run(args: argparse.Namespace) -> int:
    args.format = output_format(args)
    if args.format == "parquet" and not args.output:
        raise OpscopeError("--format parquet needs -o FILE")
    bits = [int(b) for b in _floats(args.bits, "--bits")]
    if any(b < 2 or b > 16 for b in bits):
        raise OpscopeError(f"--bits {args.bits}: widths from 2 to 16")
    budgets = _floats(args.budgets, "--budgets")
    if args.report is not None and args.plan is None:
        raise OpscopeError("--report draws the plans: give --plan OUT.json too")
    for out in (args.output, args.plan, args.report):
        if out is not None:
            check_writable(out, inputs=[args.model])
    probes = probe_weights(args.model, budget=args.budget, bits=bits)
    if not probes:
        raise OpscopeError(f"{args.model}: no float weight to probe")
    _write_probes(args, probes)
    if args.plan is not None:
        plans = plan_weights(args.model, budgets=budgets, storable=args.storable, check=not args.no_check,
                             feeds=feed_spec_from_args(args), runtime=runtime_config_from_args(args),
                             min_cosine=args.min_cosine, min_top1=args.min_top1, svd_cap=args.svd_cap)  # fmt: skip
        plans.write(args.plan)
        if args.report is not None:
            from ..reporting import write_weights_report

            write_weights_report(plans.to_dict(), args.report)
        if not args.quiet:
            print(_frontier_text(plans, args.plan))
            if args.report is not None:
                print(f"wrote {args.report}")
    return 0


def _write_probes(args: argparse.Namespace, probes) -> None:
    if args.format == "table":
        text = _probe_text(probes, args.top)
        if args.output:
            with atomic_path(args.output) as tmp:
                Path(tmp).write_text(text + "\n")
        elif not args.quiet:
            print(text)
        return
    table = probes_table(probes)
    if args.output:
        write_table(table, args.output, args.format)
    elif args.format == "json":
        import json

        sys.stdout.write(json.dumps(table.to_pylist(), indent=1, default=float) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.csv as pacsv

        sink = pa.BufferOutputStream()
        pacsv.write_csv(table, sink)
        sys.stdout.write(sink.getvalue().to_pybytes().decode())


def _probe_text(probes, top: int) -> str:
    rows = sorted(probes, key=lambda p: -p.dense_bytes)
    total = sum(p.dense_bytes for p in probes)
    lines = [
        f"{len(probes)} weights, {total / 2**20:.2f} MiB; largest first (--top {top}):",
        f"  {'weight':<34} {'op':<10} {'rows x cols':>13} {'MiB':>7} {'s.rank':>7} {'int8 ch':>8} "
        f"{'int4 ch':>8} {'int4 g128':>9} {'2:4':>6} {'bits':>4}  hint",
    ]
    for p in rows[:top]:
        q = p.quant
        lines.append(
            f"  {p.name[-34:]:<34} {p.op[:10]:<10} {f'{p.rows}x{p.cols}':>13} {p.dense_bytes / 2**20:>7.2f} "
            f"{p.stable_rank:>7.1f} {q.get('int8_channel', float('nan')):>8.4f} {q.get('int4_channel', float('nan')):>8.4f} "
            f"{q.get('int4_g128', float('nan')):>9.4f} {p.nm_error:>6.3f} {p.best_bits or '-':>4}  {p.hint}"
        )
    counts = Counter(p.hint for p in probes)
    lines.append("hints: " + ", ".join(f"{h} {n}" for h, n in counts.most_common()))
    return "\n".join(lines)


def _frontier_text(plans: WeightPlans, path: Path) -> str:
    dense = plans.dense_bytes
    kind = (
        "as this model stores them"
        if plans.storable
        else "nominal (--storable: as this model can store them)"
    )
    lines = [
        f"plans over {len(plans.menus)} weights, {dense / 2**20:.2f} MiB dense; bytes {kind}:",
        f"  {'budget':>6} {'greedy err':>10} {'dado err':>9} {'kept':>6} {'plan MiB':>9} {'stored MiB':>10} "
        f"{'cosine':>9} {'top-1':>6} {'top-5':>6} {'KL':>8}  gate",
    ]
    for b in plans.budgets:
        q = b.quality or {}

        def fmt(key: str, spec: str, q=q) -> str:
            return "-" if q.get(key) is None else format(q[key], spec)

        stored = "-" if b.stored_bytes is None else f"{b.stored_bytes / 2**20:.2f}"
        gate = "-" if not q else ("pass" if plans.passes(b) else "fail")
        lines.append(
            f"  {b.budget:>6.2f} {b.greedy['error']:>10.4f} {b.dado['error']:>9.4f} {b.method:>6} "
            f"{b.plan['bytes'] / 2**20:>9.2f} {stored:>10} {fmt('cosine', '.5f'):>9} {fmt('top1', '.1%'):>6} "
            f"{fmt('top5', '.1%'):>6} {fmt('kl', '.2e'):>8}  {gate}"
        )
    rec = plans.recommended
    if rec is not None:
        lines.append(f"wrote {path}: the plan at budget {rec.budget:g} (the smallest that passes the gate)")
    else:
        why = (
            "not checked (--no-check)"
            if all(b.quality is None for b in plans.budgets)
            else "none passes the gate"
        )
        lines.append(f"wrote {path}: the plan at the largest budget, NOT recommended ({why})")
    lines.append(f"apply it: opscope rewrite weights MODEL --plan {path} -o OUT.onnx")
    return "\n".join(lines)
