"""`opscope mine`: the rules over a sketch table -> ranked findings (`onnx_opscope.mine`)."""

from __future__ import annotations

import argparse

from ..files import atomic_path, check_writable
from ..findings import (
    config_with,
    describe,
    findings_source,
    mine,
    mine_decoder,
    print_findings,
    save_findings,
    unchecked_rules,
)
from .options import add_output_argument, add_quiet_argument

EPILOG = """examples:
  opscope mine sketches.parquet --top 10
  opscope mine sketches.parquet -o findings.json --set density_max=0.3 --set pos_cv_min=1.5
  opscope mine sketches.parquet --measure           # time each exploit against dense at the site's shape
  opscope mine sketches.parquet --validate          # skip each candidate block and score it on the recorded feeds
  opscope mine gen.parquet --decoder                 # a `generate` table: only the per-layer decoder findings
"""


def set_epilog() -> str:
    """The --set names with their defaults and reasons, for the help of the commands that take --set."""
    rows = [f"  {name:<18} {default:>7}  {why}" for name, default, why in describe()]
    return "thresholds (--set NAME=VALUE):\n" + "\n".join(rows)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "mine",
        help="exploitable patterns in a sketch table, ranked",
        description="Signals per (site, role) from a recorded sketch table (density, channel outliers, histogram "
        "shape, row energy and coherence, kurtosis, non-finite share; attention peaks, expert load, residual "
        "block influence), the rules of each site kind naming the exploit, and, when the table has several steps, "
        "stationary / memoize / delta-compute verdicts across steps. Each finding has a guard, its stability, an "
        "estimated (optionally measured) speed-up and, where opscope can act on it, the command that does.",
        epilog=EPILOG + "\n" + set_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("table", help="sketch table written by `opscope record` (.parquet or .csv)")
    add_output_argument(p, "also save the findings as JSON (for `opscope report --findings`)")
    p.add_argument("--costs", metavar="FILE",
                   help="site FLOPs for the FLOP share and savings: a .sites.csv sidecar or `opscope analyze` output "
                   "(.json/.csv/.parquet); default: the table's own .sites.csv")  # fmt: skip
    p.add_argument("--top", type=int, metavar="N", help="print only the N best findings")
    p.add_argument("--all", action="store_true", dest="show_all",
                   help="also list the dense, too-small and nothing-to-do rows (hidden by default; the JSON "
                   "always has them)")  # fmt: skip
    p.add_argument("--measure", action="store_true",
                   help="time each exploit against dense at the site's shape (numpy / scipy; seconds)")  # fmt: skip
    p.add_argument("--validate", action="store_true",
                   help="run each skip candidate on the recorded model and feeds (from the table's .run.json) and "
                   "keep its quality numbers")  # fmt: skip
    p.add_argument("--decoder", action="store_true",
                   help="only the decoder findings of a `generate` table (massive activations, attention sinks and "
                   "windows, KV-cache ranges and outlier channels, prefill -> decode drift)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change a threshold, e.g. density_max=0.4 (repeatable; listed below)")  # fmt: skip
    add_quiet_argument(p)
    return p


def run(args: argparse.Namespace) -> int:
    if args.output:
        check_writable(args.output, inputs=[args.table, args.costs])
    config = config_with(overrides=args.set)
    if args.decoder:
        findings = mine_decoder(args.table, config)
    else:
        findings = mine(args.table, args.costs, config, measure=args.measure, validate=args.validate)
    if not args.quiet:
        print_findings(findings, top=args.top, show_all=args.show_all)
        unchecked = {} if args.decoder else unchecked_rules(args.table)  # the gemm cascade's rules
        if unchecked:
            need = sorted({s for m in unchecked.values() for s in m})
            print(
                f"not checked: {', '.join(unchecked)} (not recorded: {', '.join(need)}); "
                "record with --sketch all (or name them) to check these rules"
            )
    if args.output:
        with atomic_path(args.output) as tmp:
            save_findings(findings, tmp, config, findings_source(args.table, findings))
        if not args.quiet:
            print(f"wrote {args.output}")
    return 0
