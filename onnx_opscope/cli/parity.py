"""`opscope parity`: original vs rewritten model, or one model on two execution providers.

Thin: parse, call `onnx_opscope.parity` (with --generate: `run.parity_generate.parity_generation`, two
decoders over one generated sequence), print the report. Exit 0 when every output is within --tol (with
--generate: and B's top-1 is A's token at every step), 1 when not, 2 on a user error (bad file, unknown
provider).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compare import DEFAULT_TOL
from ..errors import OpscopeError
from ..files import check_writable, write_text
from ..run import parity
from ..run.parity_generate import parity_generation, provider_runtimes
from .generate import add_generation_arguments, generation_from_args
from .options import (
    add_feed_arguments,
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    add_site_arguments,
    feed_spec_from_args,
    runtime_config_from_args,
    selection_from_args,
)

EPILOG = """examples:
  opscope parity model.onnx fq.onnx --shape x:1,3,48,320 --tol 0.05   # original vs rewrite
  opscope parity model.onnx --providers cpu,cuda                      # provider vs provider
  opscope parity model.onnx skip.onnx -o parity.json --no-layers
  opscope parity decoder.onnx decoder_int4.onnx --generate --prompt-ids 1,9690,198 --steps 32
  opscope parity decoder.onnx --providers cpu,cuda --generate --tokens 16 --steps 64 -o gen.json
  opscope parity decoder.onnx decoder_int4.onnx --generate --tokens 8 --steps 32 --sample --seed 3

With --generate, A decodes --steps tokens greedily after the prompt and B's KV loop is fed A's tokens
(teacher forcing), so each step compares both next-token distributions on the same prefix: top-1
agreement (B's argmax is A's token), KL(A || B) and max |logit difference|; the layers are compared at
the first step whose top-1 differs (else the largest-KL step). With --sample, A's sequence is a sampled
one (as `opscope generate --sample` draws it with the same --seed), top-1 agreement is B's argmax against
A's, and B also draws with A's Gumbel noise: the same-seed agreement of two sampling servers. The feed
options do not apply, but --seed seeds a --tokens prompt and --sample.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "parity",
        help="compare a model with its rewrite, or one model on two execution providers, layer by layer",
        description="Run both sides on the same feeds; compare the outputs (max abs, max rel = max|a-b| / "
        "max|a|, cosine, top-1 agreement when an output looks like logits) and, through the same in-graph "
        "sketches on both sides (constant memory), name the first site in execution order whose "
        "statistics diverge beyond the layer tolerance.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="the reference .onnx model (A)")
    p.add_argument(
        "other", type=Path, nargs="?", help="the model to compare with A (B), e.g. a rewrite of it"
    )
    p.add_argument(
        "--providers",
        metavar="EP,EP",
        help="instead of B: run A on these two execution providers, the first as the reference",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=DEFAULT_TOL,
        help=f"max relative error allowed on every output (default {DEFAULT_TOL:g})",
    )
    p.add_argument(
        "--layer-tol", type=float, default=None, help="divergence allowed per statistic (default: --tol)"
    )
    p.add_argument("--no-layers", action="store_true", help="compare the outputs only")
    add_output_argument(p, "also write the report as JSON")
    add_quiet_argument(p)
    add_site_arguments(p, "which sites the layer-wise comparison taps")
    add_feed_arguments(p)
    add_runtime_arguments(p)
    add_generation_arguments(p, "compare two decoders token by token over one generated sequence")
    p.add_argument("--sample", action="store_true", help="with --generate: A draws from softmax(logits / T)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="with --sample (default: 1)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.output:
        check_writable(args.output, inputs=[args.model, args.other])
    generation = generation_from_args(args)
    if generation is not None:
        return _run_generation(args, generation)
    if args.sample:
        raise OpscopeError("--sample goes with --generate", hint="add --generate to run a decoder's KV loop")
    report = parity(
        args.model,
        args.other,
        providers=args.providers,
        feeds=feed_spec_from_args(args),
        runtime=runtime_config_from_args(args),
        tol=args.tol,
        layer_tol=args.layer_tol,
        selection=selection_from_args(args),
        layers=not args.no_layers,
    )
    if not args.quiet:
        print(report.format())
    if args.output:
        write_text(args.output, report.to_json())
    return 0 if report.passed else 1


def _run_generation(args: argparse.Namespace, generation: dict) -> int:
    """`--generate`: B (or A on the second of --providers) fed A's tokens (greedy or --sample), step by step."""
    runtime = runtime_config_from_args(args)
    if (args.other is None) == (args.providers is None):
        raise OpscopeError(
            "give either a second decoder to compare with, or providers to compare (not both)",
            hint="opscope parity A.onnx B.onnx --generate ...  |  opscope parity A.onnx --providers cpu,cuda ...",
        )
    runtime_a, runtime_b = (
        provider_runtimes(args.providers, runtime) if args.providers else (runtime, runtime)
    )
    result = parity_generation(
        args.model,
        args.other or args.model,
        **generation,
        sample=args.sample,
        temperature=args.temperature,
        runtime_a=runtime_a,
        runtime_b=runtime_b,
        tol=args.tol,
        layer_tol=args.layer_tol,
        selection=selection_from_args(args),
        layers=not args.no_layers,
    )
    if not args.quiet:
        print(result.format())
    if args.output:
        write_text(args.output, result.to_json())
    return 0 if result.passed else 1
