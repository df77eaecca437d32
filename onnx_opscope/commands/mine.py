"""`opscope mine`: rules over a sketch table -> ranked findings (printed, optionally saved as JSON).

Thin: parse the options, call `onnx_opscope.mine.mine`, print. Thresholds are changed with
`--set NAME=VALUE` (the fields of `MineConfig`), never by editing code.
"""

from __future__ import annotations

import argparse

from ..mine import (
    collect,
    config_with,
    mine_series,
    print_findings,
    read_sketch_table,
    save_findings,
    unchecked_rules,
)
from ..plan import load_costs


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "mine",
        help="exploitable patterns in a sketch table, ranked",
        description="Signals per (site, role) from a recorded sketch table (density, channel outliers, "
        "histogram shape, row energy and coherence, kurtosis, non-finite share), a cascade of rules (first "
        "match wins) naming the exploit, and, when the table has several steps, stationary / memoize / "
        "delta-compute verdicts across steps. Each finding has a guard, its stability and an estimated "
        "(optionally measured) speed-up.",
    )
    p.add_argument("table", help="sketch table written by `opscope record` (.parquet or .csv)")
    p.add_argument("--json", metavar="FILE", help="also save the findings as JSON")
    p.add_argument("--costs", metavar="FILE",
                   help="site FLOPs for the FLOP share and savings: a .sites.csv sidecar or `opscope analyze` "
                   "output (.json/.csv/.parquet); default: the table's own .sites.csv")  # fmt: skip
    p.add_argument("--top", type=int, metavar="N", help="print only the N best findings")
    p.add_argument("--measure", action="store_true",
                   help="time each exploit against dense at the site's shape (numpy / scipy; seconds)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change a threshold, e.g. density_max=0.4 (repeatable; the README lists them)")  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    config = config_with(overrides=args.set)
    table, path = read_sketch_table(args.table)  # read once: the findings and the unchecked rules
    findings = mine_series(collect(table), load_costs(args.costs, path), config, measure=args.measure)
    print_findings(findings, top=args.top)
    unchecked = unchecked_rules(table)
    if unchecked:
        need = sorted({s for m in unchecked.values() for s in m})
        print(
            f"not checked: {', '.join(unchecked)} (not recorded: {', '.join(need)}); "
            "record with --sketch all (or name them) to check these rules"
        )
    if args.json:
        path = save_findings(findings, args.json, config)
        print(f"wrote {path}")
    return 0
