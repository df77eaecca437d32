"""`opscope demo`: the whole loop on a bundled model, with no arguments: analyze -> record -> mine -> report."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..analysis import analyze
from ..analysis.table import print_report
from ..files import atomic_path, check_writable, writing
from ..findings import findings_source, mine, print_findings, save_findings
from ..graph.io import save_model
from ..reporting import report
from ..run import FeedSpec, RuntimeConfig, record
from ..run.table import is_table_folder
from .options import add_output_argument, add_quiet_argument

DEMO_MODEL = "transformer_block"
REPO_MODELS = Path(__file__).resolve().parents[2] / "models"
EPILOG = """examples:
  opscope demo                          # writes opscope-demo/
  opscope demo -o demo-out --batches 8
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        help="run the whole loop on a bundled transformer block and show what it finds",
        description=f"Analyze the bundled `{DEMO_MODEL}` model's static cost, record sketches of every site on "
        "synthetic inputs with outlier channels, mine them for exploitable patterns and write an HTML report with "
        "the roofline. Writes everything into one folder.",
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
    feeds = FeedSpec(dist="outlier", batches=args.batches, dims=dims)
    # every sketch, opt-in ones included: the demo shows what each miner rule can find
    result = record(
        model, out=out_dir / "sketches.parquet", feeds=feeds, sketches=["all"], runtime=RuntimeConfig()
    )
    console.print(
        f"[bold]record[/]: {result.rows} rows from {len(result.manifest.sites)} sites over {result.batches} "
        f"batches in {result.seconds:.1f}s (inputs with outlier channels), parity ok"
    )
    findings = mine(result.table, costs=costs)
    with atomic_path(out_dir / "findings.json") as tmp:
        save_findings(findings, tmp, source=findings_source(result.table, findings))
    console.print("[bold]mine[/]: what the sketches say, best first")
    if not args.quiet:
        print_findings(findings, top=10)
    page = report(result.table, out_dir / "report.html", findings=findings, costs=costs)
    console.print(f"\n[bold]report[/]: {page}\ntable:  {result.table}\nsites:  {result.sites}")
    return 0
