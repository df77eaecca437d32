"""`opscope demo`: the whole loop on a bundled model, with no arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..data import FeedSpec
from ..record import read_table, record
from ..runtime import RuntimeConfig

DEMO_MODEL = "transformer_block"
REPO_MODELS = Path(__file__).resolve().parents[2] / "models"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        help="run the whole loop on a bundled transformer block and show what it finds",
        description=f"Record sketches of every GEMM site of the bundled `{DEMO_MODEL}` model on synthetic "
        "inputs with outlier channels, then summarise them. Writes everything into --out-dir.",
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
        f"recorded {result.rows} rows from {len(result.manifest.sites)} sites over {result.batches} "
        f"batches in {result.seconds:.1f}s, parity {'ok' if result.parity.ok else 'FAILED'}"
    )
    _summary(console, result.table)
    console.print(f"\ntable: {result.table}\nsites: {result.sites}\nrun:   {result.run}")
    return 0


def _summary(console: Console, table_path: Path) -> None:
    t = read_table(table_path).to_pylist()
    scalars: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in t:
        if r["stat"] in ("max", "nnz", "chan_outlier", "kurtosis") and r["idx"] == 0:
            d = scalars.setdefault((r["site"], r["role"]), {"numel": [r["numel"]]})
            d.setdefault(r["stat"], []).append(r["value"])
    view = Table(title="per site and role, mean over batches")
    for col in ("site", "role", "density", "max", "chan outlier", "kurtosis"):
        view.add_column(col, justify="left" if col in ("site", "role") else "right")
    for (site, role), d in scalars.items():
        mean = lambda k, d=d: sum(d.get(k, [float("nan")])) / max(len(d.get(k, [])), 1)  # noqa: E731
        view.add_row(
            site,
            role,
            f"{mean('nnz') / d['numel'][0]:.2f}",
            f"{mean('max'):.3g}",
            f"{mean('chan_outlier'):.1f}",
            f"{mean('kurtosis'):.1f}",
        )
    console.print(view)
