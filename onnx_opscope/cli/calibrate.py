"""`opscope calibrate`: quantization ranges for onnxruntime's quantizer and TensorRT, from one pass."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..calibration import EXPORT_FORMATS, METHODS, calibrate, quantize_qdq, write_ranges
from ..calibration.fp16 import check_precision
from ..calibration.generation import calibrate_generation
from ..errors import OpscopeError
from ..files import check_writable, write_text
from .generate import add_generation_arguments, generation_from_args
from .options import (
    add_engine_arguments,
    add_feed_arguments,
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    csv_items,
    engine_from_args,
    feed_spec_from_args,
    runtime_config_from_args,
)

EPILOG = """\
The tensors are exactly those onnxruntime's quantize_static calibrates for --op-types (default:
its own list), found by its own rule, plus the same rule inside If / Loop / Scan bodies.
minmax equals onnxruntime's MinMaxCalibrater bit for bit on the same feeds (its session runs
with graph optimizations off; so does ours unless --opt-level says otherwise).

methods (--method):
  minmax       min and max over all batches (onnxruntime's MinMaxCalibrater)
  percentile   onnxruntime's percentile of an exact histogram (--percentile, --symmetric)
  entropy      onnxruntime's KL threshold on x over [-t, t] (128 bins, as its default)
  entropy-trt  TensorRT's KL amax on |x| over [0, max|x|], cuts from bin 128 of 2048, for
               -o r.cache --format trt (the scale a TensorRT entropy calibrator would write)
  mse          the symmetric int8 range of least squared error (pytorch-quantization's mse)

formats (-o):
  ort     onnxruntime's calibration cache (JSON): quantize_static(model, out,
          calibration_data_reader=None, calibration_cache_path=RANGES) runs no calibration
  trt     TensorRT's calibration cache: TRT-<v>-EntropyCalibration2, <tensor>: <hex float32 scale>
  trt-ep  a folder with calibration.flatbuffers / .json / .cache for the TensorRT execution provider
          (trt_int8_calibration_table_name=calibration.flatbuffers)

exit codes: 0 done, 2 bad input (file, option, feed, provider, unwritable output).

examples:
  opscope calibrate model.onnx --data calib/ -o ranges.json
  opscope calibrate model.onnx --data calib/ -o ranges.json --qdq model.int8.onnx
  opscope calibrate model.onnx -o r.json --qdq m.s8.onnx --activation-type int8 --per-channel
  opscope calibrate cnn.onnx --op-types Conv,MatMul --symmetric -o cnn.trt --format trt
  opscope calibrate rec.onnx --shape x:1,3,48,320 --batches 32 -o rec_ep --format trt-ep
  opscope calibrate model.onnx --data calib/ --method percentile --percentile 99.99 -o p.json
  opscope calibrate model.onnx --data calib/ --method entropy-trt -o model.cache --format trt
  opscope calibrate decoder.onnx --generate --prompt-file prompt.txt --steps 64 -o ranges.json
"""


QUANT_TYPES = ("uint8", "int8", "uint16", "int16")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate",
        help="quantization ranges of every tensor onnxruntime's quantizer calibrates: caches and a QDQ model",
        description="Tap every tensor quantize_static would calibrate with a min/max in the graph, run every "
        "batch once (memory flat in the number of batches, batches of different shapes welcome) and write "
        "the ranges as onnxruntime's calibration cache, TensorRT's, or a quantized QDQ model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="the .onnx model (float)")
    add_output_argument(p, "the ranges to write (see formats below)", default=Path("ranges.json"))
    p.add_argument("--format", choices=EXPORT_FORMATS, default="ort", help="output format (default: ort)")
    p.add_argument(
        "--method", choices=METHODS, default="minmax", help="how a range is chosen (default: minmax)"
    )
    p.add_argument(
        "--op-types",
        action="append",
        default=[],
        metavar="OP[,OP...]",
        help="calibrate the inputs and outputs of these ops only (default: quantize_static's own list)",
    )
    p.add_argument(
        "--symmetric",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ranges (-m, m), m = max(|min|, |max|) (default: onnxruntime's, on for percentile only)",
    )
    p.add_argument(
        "--bins",
        type=int,
        default=None,
        metavar="N",
        help="histogram bins (default: onnxruntime's for the method: 128 for entropy, 2048 otherwise)",
    )
    p.add_argument(
        "--percentile",
        type=float,
        default=99.999,
        metavar="P",
        help="for --method percentile (default 99.999)",
    )
    p.add_argument(
        "--qdq",
        type=Path,
        default=None,
        metavar="OUT.onnx",
        help="also write onnxruntime's QDQ model from our ranges (quantize_static, no calibration of its own)",
    )
    p.add_argument(
        "--activation-type",
        choices=QUANT_TYPES,
        default="uint8",
        help="for --qdq: the activations' integer type (default uint8, quantize_static's)",
    )
    p.add_argument(
        "--weight-type",
        choices=QUANT_TYPES,
        default="int8",
        help="for --qdq: the weights' integer type (default int8, quantize_static's)",
    )
    p.add_argument(
        "--per-channel",
        action="store_true",
        help="for --qdq: one weight scale per output channel (quantize_static's per_channel)",
    )
    p.add_argument(
        "--check",
        choices=("fp16", "bf16"),
        default=None,
        help="instead of ranges: tap every float tensor (any producer, bodies too), list those that overflow "
        "or underflow the type, and write -o as JSON with the node block list onnxconverter-common's "
        "convert_float_to_float16(node_block_list=...) takes and TensorRT's --layerPrecisions",
    )
    add_quiet_argument(p)
    add_feed_arguments(p)
    # off by default: the floats onnxruntime's own calibrator sees (it runs without optimizations)
    add_runtime_arguments(p, opt_level="disable")
    add_engine_arguments(p)
    add_generation_arguments(
        p, "calibrate a decoder over the prefill and every decode step of a greedy KV-cache loop, not --data"
    )
    return p


def run(args: argparse.Namespace) -> int:
    feeds = feed_spec_from_args(args)
    runtime = runtime_config_from_args(args)
    if args.bins is not None and args.bins < 2:
        raise OpscopeError(f"--bins {args.bins}: expected at least 2")
    if not 0 < args.percentile <= 100:
        raise OpscopeError(f"--percentile {args.percentile}: expected a value in (0, 100]")
    for out in (args.output, args.qdq):
        if out is not None:
            check_writable(out, inputs=[args.model, feeds.data])
    generation = generation_from_args(args)
    if args.check:
        if generation is not None:
            raise OpscopeError("--check runs on feeds: it does not take --generate")
        return _check_precision(args, feeds, runtime)
    console = Console(stderr=True, quiet=args.quiet)
    columns = [TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=True, disable=args.quiet) as bar:
        task = bar.add_task("calibrate", total=None)
        result = (calibrate if generation is None else calibrate_generation)(
            args.model,
            **({"feeds": feeds} if generation is None else generation),
            method=args.method,
            op_types=list(csv_items(args.op_types)) or None,
            runtime=runtime,
            symmetric=args.symmetric,
            bins=args.bins,
            percentile=args.percentile,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            engine=engine_from_args(args),
        )
    written = write_ranges(result, args.output, args.format, inputs=(args.model,))
    if args.qdq is not None:
        quantize_qdq(args.model, result, args.qdq, **_qdq_options(args))
    if not args.quiet:
        extra = f"; {len(result.unobserved)} never ran (no range)" if result.unobserved else ""
        print(
            f"{written}: {args.method} ranges of {len(result.ranges)} tensors ({args.format}) over "
            f"{result.batches} {'batches' if generation is None else 'steps'} in {result.seconds:.1f}s{extra}"
        )
        if args.qdq is not None:
            print(f"qdq: {args.qdq}")
    return 0


def _qdq_options(args: argparse.Namespace) -> dict:
    """quantize_static's options from --activation-type / --weight-type / --per-channel."""
    from onnxruntime.quantization import QuantType

    kinds = dict(zip(QUANT_TYPES, (QuantType.QUInt8, QuantType.QInt8, QuantType.QUInt16, QuantType.QInt16)))
    return {
        "activation_type": kinds[args.activation_type],
        "weight_type": kinds[args.weight_type],
        "per_channel": args.per_channel,
    }


def _check_precision(args: argparse.Namespace, feeds, runtime) -> int:
    """`--check fp16|bf16`: the headroom report and the block list, as JSON at -o."""
    report = check_precision(args.model, feeds, target=args.check, runtime=runtime)
    doc = {
        "model": str(args.model),
        "target": args.check,
        "node_block_list": report.block_list(),
        "trtexec_args": report.trtexec_args(),
        "overflowing_inputs": report.overflowing_inputs(),
        "tensors": [r for r in report.to_rows() if r["overflow"] or r["underflow"] or r["nan"] or r["inf"]],
    }
    write_text(args.output, json.dumps(doc, indent=1, default=float))
    if not args.quiet:
        print(report.summary())
        print(f"{args.output}: {len(doc['node_block_list'])} nodes to keep in float32 for {args.check}")
    return 0
