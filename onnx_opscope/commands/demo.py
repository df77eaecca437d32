"""`opscope demo`: the whole loop on a bundled model, with no arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..data import FeedSpec
from ..mine import mine, print_findings, save_findings
from ..record import record
from ..report import write_report
from ..runtime import RuntimeConfig

DEMO_MODEL = "transformer_block"
REPO_MODELS = Path(__file__).resolve().parents[2] / "models"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        help="run the whole loop on a bundled transformer block and show what it finds",
        description=f"Record sketches of every site of the bundled `{DEMO_MODEL}` model on synthetic inputs "
        "with outlier channels, mine them for exploitable patterns and write an HTML report. Writes "
        "everything into --out-dir.",
    )
    p.add_argument(
        "--out-dir", type=Path, default=Path("opscope-demo"), help="where to write (default: opscope-demo/)"
    )
    p.add_argument("--batches", type=int, default=4, help="batches to record (default 4)")
    return p


def demo_model(out_dir: Path) -> Path:
    """The bundled model from a checkout's models/, else built from onnx_opscope.zoo into out_dir."""
    path = REPO_MODELS / f"{DEMO_MODEL}.onnx"
    if path.is_file():
        return path
    from ..model import save_model
    from ..zoo import build

    return save_model(build(DEMO_MODEL), out_dir / f"{DEMO_MODEL}.onnx")


def run(args: argparse.Namespace) -> int:
    console = Console()
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    model = demo_model(out_dir)
    console.rule(f"[bold]onnx-opscope demo[/] on {model.name}")
    feeds = FeedSpec(dist="outlier", batches=args.batches, dims={"batch": 2, "seq": 32})
    result = record(model, out=out_dir / "sketches.parquet", feeds=feeds, runtime=RuntimeConfig())
    console.print(
        f"[bold]record[/]: {result.rows} rows from {len(result.manifest.sites)} sites over {result.batches} "
        f"batches in {result.seconds:.1f}s (inputs with outlier channels), parity ok"
    )
    findings = mine(result.table)
    save_findings(findings, out_dir / "findings.json")
    console.print("[bold]mine[/]: what the sketches say, best first")
    print_findings(findings, top=10)
    report = write_report(result.table, findings, out_dir / "report.html")
    console.print(f"\n[bold]report[/]: {report}\ntable:  {result.table}\nsites:  {result.sites}")
    return 0
