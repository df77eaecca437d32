"""`opscope inject`: write the instrumented model and its manifest (`onnx_opscope.inject_file`)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from ..files import check_writable
from ..instrument import inject, inject_file
from ..instrument.manifest import manifest_path_for
from ..run.kernels import checked_sites
from ..run.session import resolve_providers
from .options import (
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    add_tap_arguments,
    runtime_config_from_args,
    selection_from_args,
    sketch_epilog,
    sketch_options_from_args,
    sketches_from_args,
)

EPILOG = """examples:
  opscope inject model.onnx -o tapped.onnx
  opscope inject model.onnx -o tapped.onnx --op MatMul --role lhs,out --sketch min,max,hist
  opscope inject bert.onnx -o t.onnx --name 'encoder/layer.0/*' --min-numel 4096 --sketch all
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "inject",
        help="write an instrumented model whose extra outputs are sketches of the tapped tensors",
        description="Append small reduction/histogram/gather subgraphs on each tapped tensor and expose them as "
        "extra outputs after the model's own (names and order unchanged). Writes OUT.onnx and OUT.manifest.json, "
        "which says what every extra output means. Taps on weights (initializers, Constants) add nothing to the "
        "graph: their sketches are computed on the host when decoding (onnx_opscope.host_values). External "
        "weights are not loaded: the new model refers to the original data file (hard-linked beside OUT when it "
        "is in another folder, or copied with --copy-external-data).",
        epilog=EPILOG + "\n" + sketch_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="the .onnx model")
    add_output_argument(
        p, "where to write the instrumented .onnx (the manifest goes beside it)", required=True
    )
    p.add_argument(
        "--copy-external-data",
        action="store_true",
        help="copy external weight files next to OUT instead of hard-linking them",
    )
    add_quiet_argument(p)
    add_tap_arguments(p)
    add_runtime_arguments(p, "the onnxruntime the model will run on: on quantized models, taps that would "
                          "change its integer kernels at this level are left out and named (--opt-level "
                          "disable skips the check)")  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    runtime = runtime_config_from_args(args)
    providers = resolve_providers(runtime.providers, fallback=runtime.fallback)
    sketches, options = sketches_from_args(args), sketch_options_from_args(args)
    for path in (args.output, manifest_path_for(args.output)):
        check_writable(path, inputs=[args.model])

    def build(chosen):
        return inject(args.model, chosen, sketches, options, args.placement, providers).model

    sites, left_out = checked_sites(args.model, selection_from_args(args), runtime, args.model.parent, build)
    path, mpath, manifest = inject_file(
        args.model,
        args.output,
        sites=sites,
        sketches=sketches,
        options=options,
        placement=args.placement,
        copy_external=args.copy_external_data,
        providers=providers,
        left_out=[asdict(c) for c in left_out],
    )
    if args.quiet:
        return 0
    raws = sum(len(t.outputs) for t in manifest.taps)
    print(
        f"{path}: {len(manifest.sites)} sites, {len(manifest.taps)} tapped tensors, {raws} raw tensors "
        f"in {len(manifest.output_names())} extra outputs"
    )
    print(f"manifest: {mpath}")
    weights = sum(t.constant for t in manifest.taps)
    if weights:
        print(
            f"{weights} weight taps have no outputs: decode(..., host=host_values(manifest, {path.name!r})) "
            "computes them once from the model (onnx_opscope.instrument)"
        )
    return 0
