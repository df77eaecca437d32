"""The report: self-contained HTML (checked in a real headless browser), Markdown, plots, CLI."""

from __future__ import annotations

import base64
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.analysis import analyze
from onnx_opscope.cli import _chosen, build_parser, main
from onnx_opscope.cli.options import feed_spec_from_args
from onnx_opscope.errors import OpscopeError
from onnx_opscope.findings import (
    Finding,
    MineConfig,
    Temporal,
    collect,
    feed_flags,
    load_costs,
    mine,
    next_step,
    next_steps,
    rank,
)
from onnx_opscope.findings.miner import run_record
from onnx_opscope.reporting import make_plots, report
from onnx_opscope.reporting.plots import Missing, Plot, Roofline, plot_ranking, roof_points, roofline_figure
from onnx_opscope.reporting.render import Actions, Context, Para, _md_block, roofline_costs, summary_blocks
from onnx_opscope.run import record
from onnx_opscope.run.feeds import FeedSpec
from onnx_opscope.sites import Selection


def matmul_model(b: int = 2, t: int = 64, c: int = 64):
    """x @ W with a fixed random weight (as in test_findings): the lhs carries the distribution."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((c, c)).astype(np.float32), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, t, c])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, t, c])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [x], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


DISTS = ("outlier", "sparse90", "coherent", "quantized")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATA_PAYLOAD = re.compile(r"data:image/png;base64,[A-Za-z0-9+/=]+")
DATA_IMG = re.compile(r'<img[^>]*\ssrc="data:image/png;base64,([A-Za-z0-9+/=]+)"')
# anything that could make a browser fetch: a URL with a scheme or protocol-relative, a src/href that is not a
# data URI or an in-page anchor, CSS url()/@import, <link>, <script src>, <iframe>, <object>, <embed>
EXTERNAL = re.compile(
    r"(?:[a-z][a-z0-9+.-]*:)?//[^\s\"'<>]+"
    r"|\b(?:src|href|srcset|poster|action)\s*=\s*(?![\"']?(?:data:|#))"
    r"|url\s*\(|@import|<link\b|<script\b[^>]*\bsrc|<iframe\b|<object\b|<embed\b",
    re.IGNORECASE,
)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """One table, four distributions (3 batches each) through x @ W, plus its .sites.csv sidecar."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from onnx_opscope.run import read_table

    root = tmp_path_factory.mktemp("report")
    parts = []
    for d in DISTS:
        res = record(matmul_model(), out=root / f"{d}.parquet", feeds=FeedSpec(dist=d, batches=3), sketches=["all"],
                     sites=Selection(op_types=("MatMul",)), run_id="rep")  # fmt: skip
        parts.append(read_table(res.table))
    out = root / "all.parquet"
    pq.write_table(pa.concat_tables(parts), out)
    shutil.copy(root / "outlier.sites.csv", root / "all.sites.csv")
    return out


@pytest.fixture(scope="module")
def html_report(table, tmp_path_factory):
    out = tmp_path_factory.mktemp("html") / "report.html"
    report(table, out, costs=analyze(matmul_model()))
    return out


def test_html_is_self_contained(html_report):
    text = html_report.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    outside_images = DATA_PAYLOAD.sub("data:", text)  # base64 may contain '//'
    hit = EXTERNAL.search(outside_images)
    assert hit is None, hit.group(0)[:200]
    images = DATA_IMG.findall(text)
    assert len(images) == 4 == text.count("<img")  # heatmap, channels, ranking, roofline
    for data in images:
        assert base64.b64decode(data).startswith(PNG_MAGIC)
    for title in ("Summary: what to do next", "Histogram per site", "Per-channel max|x|", "Findings by impact",
                  "Roofline"):  # fmt: skip
        assert title in text
    assert "sparse GEMM" in text and "per-channel int quant" in text and "delta-compute" in text
    assert str(html_report.parent) not in text  # no absolute path of this machine
    assert "all.parquet" in text


def test_external_url_regex_catches_fetches():
    for bad in ('<img src="http://x/y.png">', "<a href='https://x'>", "<img src=//cdn/x.png>",
                "<style>@import 'a.css'</style>", "body{background:url(x.png)}", '<link rel="icon" href="x">',
                '<script src="a.js"></script>', '<img src="y.png">'):  # fmt: skip
        assert EXTERNAL.search(bad), bad
    for fine in ('<img src="data:image/png;base64,iVBO">', '<a href="#roofline">', "a // b"):
        assert EXTERNAL.search(fine) is None or fine == "a // b", fine


def test_markdown_report_from_saved_findings_via_cli(table, tmp_path, capsys):
    """`opscope mine --json` then `opscope report --findings ... -o r.md`: PNGs beside it, linked relatively."""
    assert main(["mine", str(table), "-o", str(tmp_path / "f.json")]) == 0
    out = tmp_path / "r.md"
    assert main(["report", str(table), "--findings", str(tmp_path / "f.json"), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    text = out.read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    # no analyzer costs and no .run.json: the roofline comes from the sidecar's GEMM shapes
    assert links == [
        "r_files/histograms.png",
        "r_files/channels.png",
        "r_files/ranking.png",
        "r_files/roofline.png",
    ]
    assert "recorded GEMM shapes of the .sites.csv" in text
    for link in links:
        assert (tmp_path / link).read_bytes().startswith(PNG_MAGIC)
    assert "| # | site |" in text and "per-channel int quant" in text and str(tmp_path) not in text
    assert "FLOP share" in text and "100.0%" in text  # from the table's own .sites.csv


def test_no_findings_no_plots_and_each_says_why(table):
    drawn = make_plots([], collect(table), MineConfig())
    assert [type(p) for p in drawn] == [Missing] * 4
    assert all(p.reason for p in drawn)


def test_report_errors(table, tmp_path, capsys):
    with pytest.raises(OpscopeError, match=r"\.html or \.md"):
        report(table, tmp_path / "r.pdf")
    out = tmp_path / "cli.html"
    assert main(["report", str(tmp_path / "missing.parquet"), "-o", str(out)]) == 2
    assert "no such table" in capsys.readouterr().err
    assert main(["report", str(table), "--costs", str(tmp_path / "nope.json"), "-o", str(out)]) == 2
    assert "--costs" in capsys.readouterr().err
    assert main(["report", str(table), "--findings", str(tmp_path / "nope.json"), "-o", str(out)]) == 2
    assert "no such findings file" in capsys.readouterr().err
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# a real browser

PROBE = (
    '<script>window.addEventListener("load",()=>{const i=[...document.images];document.body.setAttribute('
    '"data-probe",i.length+":"+i.filter(x=>x.complete&&x.naturalWidth>0).length+":"+'
    'performance.getEntriesByType("resource").length)});</script>'
)


def _chromium() -> str:
    """The headless browser, or fail/skip with the reason: only a missing chromium may skip."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("OPSCOPE_BROWSER_TESTS") == "1":
        pytest.fail(
            "chromium not installed, and OPSCOPE_BROWSER_TESTS=1 requires it (apt-get install -y chromium)"
        )
    pytest.skip("chromium not installed")


def _browse(chrome: str, profile, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             "--host-resolver-rules=MAP * ~NOTFOUND"]  # fmt: skip
    return subprocess.run([chrome, *flags, *args], capture_output=True, text=True, timeout=90)


def test_html_renders_in_headless_chromium(html_report, tmp_path):
    """The page loads offline, every image decodes, nothing is fetched, and the screenshot is not blank."""
    from matplotlib.image import imread

    chrome = _chromium()
    probe = tmp_path / "probe.html"
    probe.write_text(html_report.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"))
    dom = _browse(chrome, tmp_path / "p1", "--dump-dom", probe.as_uri())
    found = re.search(r'data-probe="(\d+):(\d+):(\d+)"', dom.stdout)
    assert found, f"no probe in the DOM (rc {dom.returncode}): {dom.stderr[-500:]}"
    images, loaded, fetched = map(int, found.groups())
    assert (images, loaded, fetched) == (4, 4, 0)

    shot = tmp_path / "shot.png"
    res = _browse(
        chrome, tmp_path / "p2", "--window-size=1300,2600", f"--screenshot={shot}", html_report.as_uri()
    )
    assert shot.is_file(), res.stderr[-500:]
    pixels = imread(shot)
    assert pixels.shape[0] >= 2000 and pixels.shape[1] >= 1200
    assert float(np.std(pixels[..., :3])) > 0.05  # text, tables and plots, not a blank page
    keep = os.environ.get("OPSCOPE_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


def test_weights_section_in_the_report_and_alone(table, tmp_path, capsys):
    """`opscope report --weights PLAN` adds the frontier table and both weights plots, self-contained;
    `opscope weights --plan --report` draws them alone; a file that is not a plan is one line."""
    from onnx_opscope.cli import main

    model = tmp_path / "mm.onnx"
    onnx.save(matmul_model(c=128), model)
    plan, alone = tmp_path / "plan.json", tmp_path / "weights.html"
    assert (
        main(["weights", str(model), "--plan", str(plan), "--report", str(alone), "--batches", "2", "-q"])
        == 0
    )
    full = tmp_path / "report.html"
    assert main(["report", str(table), "--weights", str(plan), "-o", str(full), "-q"]) == 0
    doc = json.loads(plan.read_text())
    for page, images in ((alone, 2), (full, 6)):  # the report: 4 plots of the table (roofline: sidecar) + 2
        text = page.read_text()
        assert EXTERNAL.search(DATA_PAYLOAD.sub("data:", text)) is None
        assert len(DATA_IMG.findall(text)) == images
        assert "Weights: error against bytes per layer" in text and "allocators&#x27; frontier" in text
        for row in doc["frontier"]:  # every budget's row, with its checked cosine
            assert f'<td class="n">{row["budget"]:g}</td>' in text
            assert f"{row['quality']['cosine']:.5f}" in text
    md = tmp_path / "r.md"
    assert main(["report", str(table), "--weights", str(plan), "-o", str(md), "-q"]) == 0
    assert (tmp_path / "r_files" / "weights_frontier.png").read_bytes().startswith(PNG_MAGIC)
    assert "## Weights: plans per byte budget" in md.read_text()
    not_plan = tmp_path / "x.json"
    not_plan.write_text("{}")
    assert main(["report", str(table), "--weights", str(not_plan), "-o", str(tmp_path / "bad.html")]) == 2
    assert "not a plan written by" in capsys.readouterr().err and not (tmp_path / "bad.html").exists()


# --------------------------------------------------------------------------------------------
# the summary, the commands it names, the roofline


def made(site: str, rule: str, score: float, share: float | None, savings: float | None = None, *,
         temporal: str | None = None, t_savings: float | None = None, exploit: str | None = None,
         action: str = "", validation: dict | None = None, kind: str = "gemm", role: str = "lhs") -> Finding:  # fmt: skip
    """A finding with the given verdicts and worth (what `mine` would make of a real table)."""
    t = None
    if temporal is not None:
        t = Temporal(steps=4, l1_cv=0.1, stationary=temporal == "stationary", repeat_share=0.5, drift=0.1,
                     drift_sigma=None, rule=temporal, condition="", exploit=temporal, score=0.5, guard="",
                     savings=t_savings)  # fmt: skip
    return Finding(site=site, op_type="MatMul", role=role, run_id="r", provider="cpu", dist="gaussian", M=64, K=64,
                   N=64, numel=4096, steps=4, signals={"density": 1.0}, sigma={}, rule=rule, condition="c",
                   exploit=exploit or ("dense: no sketch-visible exploit" if rule == "dense" else rule), score=score,
                   guard="", guard_held=None, stability="stable", stability_sigma=None, flop_share=share,
                   savings=savings, temporal=t, kind=kind, action=action, validation=validation)  # fmt: skip


def _summary_titles(blocks) -> list[str]:
    return [a.title for b in blocks if isinstance(b, Actions) for a in b.items]


def test_summary_takes_the_largest_savings_then_impact():
    """The three actions with the largest saving, then impact (not the table's impact order); NaN/Inf
    first on their own; dense and drifting rows never; no action: the summary says so in words."""
    fs = rank([
        made("dense_big", "dense", 0.0, 0.9),
        made("quant_hi", "outlier", 0.9, 0.6),  # the largest impact, no FLOP saving
        made("sparse_mid", "sparse", 0.5, 0.2, savings=0.10),
        made("memo", "dense", 0.0, 0.4, temporal="memoize", t_savings=0.20),
        made("coherent_lo", "coherent", 0.4, 0.1, savings=0.05),
        made("quant_lo", "levels", 0.5, 0.1),
        made("nan", "nonfinite", 1.0, 0.01),
    ])  # fmt: skip
    blocks = summary_blocks(fs, Context("m.onnx", "t.parquet"), {})
    titles = _summary_titles(blocks)
    assert [t.split("`")[1] for t in titles] == ["nan", "memo", "sparse_mid", "coherent_lo"]
    text = "\n".join(line for b in blocks for line in _md_block(b, "files"))
    assert "Fix first: 1 tensor(s) hold NaN or Inf" in text
    assert "saves ~20.0% of the model's FLOPs" in text and "`opscope mine t.parquet --measure`" in text
    # without savings the impact decides: quant_hi (0.54) before quant_lo (0.05)
    fs = rank([made("quant_lo", "levels", 0.5, 0.1), made("quant_hi", "outlier", 0.9, 0.6)])
    assert [t.split("`")[1] for t in _summary_titles(summary_blocks(fs, Context(), {}))] == [
        "quant_hi",
        "quant_lo",
    ]
    idle = summary_blocks(rank([made("a", "dense", 0.0, 0.5), made("b", "small", 0.0, 0.1)]), Context(), {})
    assert not _summary_titles(idle)
    assert any(isinstance(b, Para) and b.text.startswith("Nothing to act on: none of the 2") for b in idle)


def _parse(command: str):
    """`command` through the real `opscope` parser: a bad flag or value fails (SystemExit), is left over,
    or (argparse takes abbreviations) is not spelt exactly as the command's parser defines it."""
    tokens = shlex.split(command)
    assert tokens[0] == "opscope", command
    parser = build_parser()
    args, extra = parser.parse_known_args(tokens[1:])
    assert not extra, f"{command}: unknown {extra}"
    flags = {s for a in _chosen(parser, args)._actions for s in a.option_strings}
    spelt = [t.split("=")[0] for t in tokens[1:] if t.startswith("-") and not t[1:2].isdigit()]
    assert set(spelt) <= flags, f"{command}: not exact: {set(spelt) - flags}"
    return args


FEEDS = {"dist": "outlier", "seed": 3, "shapes": {"ids:0": [2, 7]}, "dims": {"batch": 2, "seq": 32},
         "ranges": {"ids:0": [0, 100]}, "values": {"sr": 16000, "scales": [1.0, 2.5]}, "data": None, "batches": 8}  # fmt: skip


def test_every_emitted_command_parses_with_the_real_cli():
    """Each rule's commands parse with `opscope`'s own parser, say what the rule needs, and carry the
    recorded feeds exactly (their FeedSpec is the recorded one, batch count aside)."""
    model, table, site = "my models/m.onnx", "runs/t.parquet", "enc/layer[0]/mm"
    flags = feed_flags(FEEDS)
    skip = f"opscope rewrite skip {shlex.quote(model)} --blocks {shlex.quote(site)} -o skipped.onnx"
    cases = [made(site, r, 0.5, 0.2) for r in ("nonfinite", "sparse", "coherent", "outlier", "heavy_tail",
                                                "levels", "concentrated")]  # fmt: skip
    cases += [made(site, "dense", 0.0, 0.2, temporal=t) for t in ("memoize", "delta")]
    cases += [made(site, "weak_residual_branch", 0.9, 0.2, action=skip, kind="residual", role="residual",
                   validation=v) for v in (None, {"passed": True, "cosine": 0.9999})]  # fmt: skip
    seen = {}
    for f in cases:
        steps = next_steps(f, model, table, flags)
        assert steps and next_step(f, model, table, flags) == steps[0].command, f.rule
        for s in steps:
            seen[(f.rule, f.temporal.rule if f.temporal else "", s.what)] = args = _parse(s.command)
            if args.command in ("record", "calibrate") or getattr(args, "transform", "") == "fakequant":
                spec = feed_spec_from_args(args)
                assert spec == FeedSpec(**{**FEEDS, "ranges": {"ids:0": (0, 100)}, "batches": None}), (
                    s.command
                )
            if args.command == "mine":
                assert str(args.table) == (table if f.rule != "nonfinite" else "nonfinite.parquet")
            elif args.command != "calibrate":
                assert str(args.model) == model
    rec = seen[("nonfinite", "", "record")]
    assert rec.sketch == ["nan_count,inf_count,min,max"] and fnmatch.fnmatchcase(site, rec.name[0])
    assert str(rec.output) == "nonfinite.parquet" and seen[("nonfinite", "", "show")].show_all
    assert seen[("sparse", "", "check")].measure and seen[("dense", "delta", "check")].measure
    assert seen[("outlier", "", "check")].mode == "channel" and seen[("levels", "", "check")].mode == "token"
    assert seen[("outlier", "", "apply")].per_channel and seen[("outlier", "", "apply")].qdq is not None
    assert seen[("heavy_tail", "", "apply")].method == "percentile"
    assert seen[("weak_residual_branch", "", "check")].validate
    assert seen[("weak_residual_branch", "", "apply")].blocks == [site]
    failed = made(
        site, "weak_residual_branch", 0.9, 0.2, action=skip, validation={"passed": False}, kind="residual"
    )
    assert next_steps(failed, model, table) == []  # a skip that failed its validation: nothing to apply
    for rule in ("positional", "dense"):
        assert next_step(made(site, rule, 0.5, 0.2), model, table) == ""
    with pytest.raises((AssertionError, SystemExit)):  # the check itself can fail
        _parse("opscope mine t.parquet --measur")


def test_report_summary_and_commands_of_a_real_table(table, tmp_path):
    """The planted sparse90 lhs saves the most: it leads the summary; every command in the page parses;
    the non-actionable rows are counted, and listed with --all."""
    out = tmp_path / "r.md"
    assert main(["report", str(table), "-o", str(out), "-q"]) == 0
    text = out.read_text()
    summary = text.split("## Summary: what to do next")[1].split("\n## ")[0]
    items = re.findall(r"^\d\. \*\*`mm` \((\w+), dist (\w+)\): ([^*]+)\*\*", summary, re.M)
    assert items[0] == ("lhs", "sparse90", "sparse GEMM"), items
    mined = mine(table)
    fs = [f for f in mined if f.actionable and f.rule != "nonfinite"]
    top = [next(f for f in fs if (f.role, f.dist) == (r, d)) for r, d, _ in items]
    rest = [f for f in fs if f not in top]
    assert len(top) == 3 and all((f.saves or 0) <= min(t.saves or 0 for t in top) for f in rest)
    commands = re.findall(r"^\s+- \w+: `([^`]+)`$", summary, re.M)
    assert commands and f"opscope mine {table} --measure" in commands
    for cmd in commands + re.findall(r"^\| \w+ \| (opscope [^|]+) \|", text, re.M):
        _parse(cmd)
    hidden = sum(not f.actionable for f in mined)
    assert hidden and f"{hidden} finding(s) hidden" in text and "opscope report --all" in text

    def rows(page: str) -> int:
        return len(re.findall(r"^\| \d+ \| mm \|", page.split("## Findings")[1].split("\n## ")[0], re.M))

    assert rows(text) == len(mined) - hidden
    assert main(["report", str(table), "--all", "-o", str(out), "-q"]) == 0
    assert rows(out.read_text()) == len(mined) and "hidden" not in out.read_text().split("## Findings")[1]


def symbolic_model(c: int = 32):
    """x[batch, seq, c] @ W: the analyzer's costs stay symbolic without --dim."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((c, c)).astype(np.float32), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", c])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", c])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="act"),
    ]
    g = helper.make_graph(nodes, "g", [x], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_roofline_of_symbolic_costs_at_the_recorded_shapes(tmp_path):
    """Symbolic costs are priced at the shapes `record` used (its .run.json); every point sits at
    min(peak, bandwidth x intensity); the sidecar alone gives GEMM points; nothing at all is one line."""
    import pyarrow.parquet as pq

    from onnx_opscope.analysis.roofline import get_device

    model = tmp_path / "sym.onnx"
    onnx.save(symbolic_model(), model)
    res = record(model, out=tmp_path / "t.parquet", feeds=FeedSpec(dims={"batch": 3, "seq": 40}, batches=2))
    costs = analyze(model)
    assert costs.symbols and all(r["flops"] is None for r in costs.to_records() if r["node"] == "mm")
    roof = roofline_costs(costs, load_costs(costs, res.table), res.table, run_record(res.table), "h100")
    assert isinstance(roof, Roofline) and roof.shapes == "the recorded shapes (x 3x40x32)"
    dev = get_device("h100")
    truth = {r["node"]: r for r in analyze(model, dims={"batch": 3, "seq": 40}).to_records()}
    assert truth["mm"]["flops"] == 2 * 3 * 40 * 32 * 32
    fig = roofline_figure(roof, [])
    ax = fig.axes[0]
    xy = np.vstack([c.get_offsets() for c in ax.collections])
    want = np.array([[r["flops"] / r["bytes"], 0] for r in truth.values() if r["flops"] and r["bytes"]])
    want[:, 1] = np.minimum(dev.peak_flops, dev.bandwidth * want[:, 0])
    np.testing.assert_allclose(np.sort(xy, axis=0), np.sort(want, axis=0), rtol=1e-12)
    assert ax.get_xlabel() == "arithmetic intensity (FLOP / byte)" and "FLOP/s" in ax.get_ylabel()
    assert "h100" in ax.get_title() and "recorded shapes" in ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("memory roof") for t in legend) and any(
        t.startswith("compute roof") for t in legend
    )
    roofs = {ln.get_label().split(":")[0]: ln.get_xydata() for ln in ax.get_lines()}
    np.testing.assert_allclose(roofs["memory roof"][:, 1], dev.bandwidth * roofs["memory roof"][:, 0])
    np.testing.assert_allclose(roofs["compute roof"][:, 1], dev.peak_flops)
    # the page: drawn, and its caption names the shapes
    page = report(res.table, tmp_path / "r.html", costs=costs).read_text()
    assert '<h2 id="roofline">' in page and "priced at the recorded shapes (x 3x40x32)" in page
    # no run.json: the sidecar's GEMM shapes, fp32 operands read once
    res.run.unlink()
    roof = roofline_costs(costs, load_costs(costs, res.table), res.table, {})
    (mm,) = roof_points(roof.records, roof.device)
    assert (mm.node, mm.flops, mm.nbytes) == ("mm", 2 * 120 * 32 * 32, 4 * (120 * 32 + 32 * 32 + 120 * 32))
    # an in-memory table, no costs: the page says why in one line
    page = report(pq.read_table(res.table), tmp_path / "m.md")
    assert "Roofline: not drawn, no per-op costs were given" in page.read_text()


def test_density_panel_only_when_it_says_something():
    dense = rank([made("a", "outlier", 0.9, 0.5), made("b", "levels", 0.5, 0.5)])
    p = plot_ranking(dense)
    assert (
        isinstance(p, Plot) and "Density is not drawn: every finding shown has density >= 0.99" in p.caption
    )
    dense[1].signals["density"] = 0.2
    assert "Right: density" in plot_ranking(dense).caption
    assert isinstance(plot_ranking([]), Missing)
