"""`opscope demo`: the whole loop on a bundled model, with no arguments: analyze -> record -> mine -> report.

What it says it found comes from its own run: the line after mining counts the findings it saved
per rule (`findings.findings_line`), so the demo never promises a pattern its run did not show.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from ..analysis import analyze
from ..analysis.table import print_report
from ..files import atomic_path, check_writable, writing
from ..findings import (
    feed_flags,
    findings_line,
    findings_source,
    mine,
    next_steps,
    print_findings,
    save_findings,
    top_actions,
)
from ..graph.io import save_model
from ..reporting import report
from ..run import FeedSpec, RuntimeConfig, record
from ..run.table import is_table_folder
from .options import add_output_argument, add_quiet_argument

DEMO_MODEL = "transformer_block"
DEMO_DIST = (
    "outlier"  # the feeds' distribution (`run.feeds`); what the block makes of it is for the miner to say
)
REPO_MODELS = Path(__file__).resolve().parents[2] / "models"
EPILOG = """examples:
  opscope demo                          # writes opscope-demo/
  opscope demo -o demo-out --batches 8
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        help="run the whole loop on a bundled transformer block and show what it finds",
        description=f"Analyze the bundled `{DEMO_MODEL}` model's static cost, record every sketch of every site "
        f"on synthetic `{DEMO_DIST}` inputs (1% of the channels scaled 30x), mine the sketches and "
        "print what the rules found, counted per rule, then write the HTML report (summary, findings, roofline). "
        "Writes everything into one folder.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_output_argument(p, "the folder to write into", default=Path("opscope-demo"))
    p.add_argument("--batches", type=int, default=4, help="batches to record (default 4)")
    add_quiet_argument(p)
    return p


def demo_model(out_dir: Path) -> Path:
    """The bundled model from a checkout's models/, else built from onnx_opscope.zoo into out_dir."""
    path = REPO_MODELS / f"{DEMO_MODEL}.onnx"
    if path.is_file():
        return path
    from ..zoo import build

    return save_model(build(DEMO_MODEL), out_dir / f"{DEMO_MODEL}.onnx")


def run(args: argparse.Namespace) -> int:
    console = Console(quiet=args.quiet)
    out_dir = args.output
    for name in ("costs.json", "sketches.parquet", "findings.json", "report.html"):  # before any work
        check_writable(out_dir / name, replaces=is_table_folder)
    with writing(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    model = demo_model(out_dir)
    console.rule(f"[bold]onnx-opscope demo[/] on {model.name}")
    dims = {"batch": 2, "seq": 32}
    costs = analyze(model, dims=dims)
    costs.write(out_dir / "costs.json")
    console.print(
        f"[bold]analyze[/]: {costs.totals['flops'] / 1e6:.1f} MFLOP, {costs.totals['bytes'] / 1e6:.2f} MB moved "
        f"per batch of {dims['batch']}×{dims['seq']} tokens; top op kinds:"
    )
    if not args.quiet:
        print_report(costs, top=5)
    feeds = FeedSpec(dist=DEMO_DIST, batches=args.batches, dims=dims)
    # every sketch, opt-in ones included: the demo shows what each miner rule can find
    result = record(
        model, out=out_dir / "sketches.parquet", feeds=feeds, sketches=["all"], runtime=RuntimeConfig()
    )
    console.print(
        f"[bold]record[/]: {result.rows} rows from {len(result.manifest.sites)} sites over {result.batches} "
        f"batches in {result.seconds:.1f}s on synthetic --dist {DEMO_DIST} inputs, parity ok",
        soft_wrap=True,
    )
    findings = mine(result.table, costs=costs)
    with atomic_path(out_dir / "findings.json") as tmp:
        save_findings(findings, tmp, source=findings_source(result.table, findings))
    console.print(f"[bold]mine[/]: {findings_line(findings)}", highlight=False, soft_wrap=True)
    if not args.quiet:
        print_findings(findings, top=10)
    for f in top_actions(findings, 1):
        for step in next_steps(f, str(model), str(result.table), feed_flags(asdict(feeds)))[:1]:
            line = f"next: {step.what} {f.site} ({f.role}, {f.rule}): {step.command}"
            console.print(line, highlight=False, soft_wrap=True, markup=False)  # a command, not rich markup
    page = report(result.table, out_dir / "report.html", findings=findings, costs=costs)
    console.print(f"\n[bold]report[/]: {page}\ntable:  {result.table}\nsites:  {result.sites}")
    return 0
