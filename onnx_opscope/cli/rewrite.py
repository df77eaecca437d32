"""`opscope rewrite skip|fakequant|weights`: write a rewritten model and report its quality against the original.

Two API calls: `onnx_opscope.skip_blocks` / `fake_quant` / `apply_weight_plan`, then
`run.write_rewrite` (save, and compare with the original on the same feeds: max relative error,
cosine, top-1 / top-5 agreement, KL).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from ..errors import OpscopeError
from ..files import check_writable
from ..run import write_rewrite
from ..transform import QUANT_MODES, Rewritten, apply_weight_plan, fake_quant, residual_sites, skip_blocks
from .options import (
    add_feed_arguments,
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    feed_spec_from_args,
    runtime_config_from_args,
)

EPILOG = """examples:
  opscope rewrite skip model.onnx --list                        # the residual Adds, in execution order
  opscope rewrite skip model.onnx --blocks 'block2/*' -o skip2.onnx
  opscope rewrite skip model.onnx --blocks 5,7 -o skip.onnx      # by execution-order index
  opscope rewrite fakequant model.onnx -o fq.onnx --mode channel --weights
  opscope rewrite weights model.onnx --plan plan.json -o small.onnx   # a plan from `opscope weights --plan`
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, help="the .onnx model (external weights are never loaded)")
    add_output_argument(p, "where to write the rewritten model")
    p.add_argument(
        "--no-check", action="store_true", help="write the model without comparing it to the original"
    )
    add_quiet_argument(p)
    add_feed_arguments(p)
    add_runtime_arguments(p)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "rewrite",
        help="skip residual blocks, fake-quantize activations or apply a weight plan, and measure the quality cost",
        description="Rewrite a model and compare the rewrite with the original on the same feeds: max relative "
        "error (max|a-b| / max|a|), cosine, and top-1 agreement when an output looks like logits.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="transform", metavar="TRANSFORM", required=True, parser_class=type(p))
    skip = sub.add_parser(
        "skip",
        help="replace residual Adds x + f(x) by x and remove the dead block",
        description="Each chosen residual Add becomes an Identity of its residual input; the block it closed, now "
        "dead, is removed with its weights.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(skip)
    skip.add_argument(
        "--blocks",
        action="append",
        default=[],
        metavar="SITE[,SITE]",
        help="residual Adds to skip: site ids, node names, globs ('block2/*') or execution-order indices (repeatable)",
    )
    skip.add_argument("--list", action="store_true", help="list the residual Adds and exit")
    fq = sub.add_parser(
        "fakequant",
        help="symmetric int8 round trip on the activations entering every MatMul / Gemm",
        description="a' = clip(round(a*127/amax), -127, 127) * amax/127 before every MatMul / Gemm, amax per token "
        "(over the contraction axis) or per channel (over the token axes).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(fq)
    fq.add_argument(
        "--mode", choices=QUANT_MODES, default="token", help="amax per token (default) or channel"
    )
    fq.add_argument(
        "--weights", action="store_true", help="also quantize constant weights, per output channel"
    )
    wp = sub.add_parser(
        "weights",
        help="store each planned weight as its option (MatMulNBits, DequantizeLinear, two MatMuls, folded)",
        description="Apply a per-layer weight plan (`opscope weights --plan`): int4 on MatMul / Linear-like Gemm "
        "weights as com.microsoft MatMulNBits, int8 / int4 as DequantizeLinear where the opset allows (13 per "
        "axis, 21 int4 and blocks), low rank as two MatMuls / Gemms, anything else folded (the weight replaced "
        "by its approximation, so the quality is measured but no byte is saved).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(wp)
    wp.add_argument("--plan", type=Path, required=True, metavar="PLAN.json", help="the plan to apply")
    return p


def _load_plan(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise OpscopeError(f"{path}: cannot read the plan: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise OpscopeError(f"{path}: not a JSON plan ({exc.msg} at line {exc.lineno})") from None


def _describe(result: Rewritten) -> list[str]:
    if result.transform == "weight_plan":
        applied = result.options["applied"]
        hows = Counter(a["how"] for a in applied["layers"])
        before, after = applied["bytes_before"], applied["bytes_after"]
        return [
            f"weight plan: {len(applied['layers'])} weights ("
            + ", ".join(f"{h} {n}" for h, n in hows.most_common())
            + f"), {before / 2**20:.2f} -> {after / 2**20:.2f} MiB as stored"
        ]
    if result.transform == "skip_blocks":
        lines = [f"skipped {s.site}: keeps {s.kept}, drops {s.dropped}" for s in result.skipped]
        pr = result.pruned
        ops = ", ".join(f"{k} {v}" for k, v in pr.ops_removed.items())
        lines.append(
            f"removed {pr.nodes_removed} nodes ({ops}), {pr.initializers_removed} weights "
            f"({pr.params_removed:,} parameters, {pr.bytes_removed / 2**20:.2f} MiB)"
        )
        return lines
    acts = sum(q.kind == "activation" for q in result.quantized)
    left = f", {len(result.left_alone)} left as they are (not float)" if result.left_alone else ""
    return [
        f"fake-quant ({result.options['mode']}): {acts} activation and {len(result.quantized) - acts} weight "
        f"operands quantized to int8{left}"
    ]


def run(args: argparse.Namespace) -> int:
    if args.transform == "skip" and args.list:
        sites = residual_sites(args.model)
        if not sites:
            print("no residual Add (x + f(x) with weights in f) in this model")
        for k, s in enumerate(sites):
            keep = s.role("residual_a" if not s.attrs.get("skip") else "residual_b").tensor
            print(f"{k:>4}  {s.id}  (keeps {keep})")
        return 0
    if args.output is None:
        raise OpscopeError("-o OUT is required: where to write the rewritten model")
    check_writable(args.output, inputs=[args.model])  # before the rewrite and its quality runs
    if args.transform == "skip":
        blocks = [b for item in args.blocks for b in item.split(",") if b.strip()]
        if not blocks:
            raise OpscopeError(
                "--blocks is required", hint="`opscope rewrite skip MODEL --list` shows the choices"
            )
        result = skip_blocks(args.model, blocks)
    elif args.transform == "weights":
        model, applied = apply_weight_plan(args.model, _load_plan(args.plan))
        result = Rewritten(
            model, "weight_plan", options={"plan": str(args.plan), "applied": applied.to_dict()}
        )
    else:
        result = fake_quant(args.model, args.mode, args.weights)
    written = write_rewrite(args.model, result, args.output, check=not args.no_check,
                            feeds=feed_spec_from_args(args), runtime=runtime_config_from_args(args))  # fmt: skip
    lines = [*_describe(result), f"wrote {written.path}"]
    rep = written.quality
    if rep is not None:
        s = rep.summary()
        top1 = "" if s["top1"] is None else f", top-1 agreement {s['top1']:.2%}"
        top1 += "" if s.get("top5") is None else f", top-5 {s['top5']:.2%}, KL {s['kl']:.3g}"
        lines.append(
            f"quality vs the original on {rep.batches} batches: max rel error {s['max_rel']:.3g}, "
            f"cosine {s['cosine']:.6f}{top1}"
        )
        for name, m in rep.outputs.items():
            t = "" if m["top1"] is None else f", top-1 {m['top1']:.2%}"
            lines.append(
                f"  {name}: max abs {m['max_abs']:.3g}, max rel {m['max_rel']:.3g}, cosine {m['cosine']:.6f}{t}"
            )
    if not args.quiet:
        print("\n".join(lines))
    return 0
