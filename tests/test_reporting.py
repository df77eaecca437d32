"""The report: self-contained HTML (checked in a real headless browser), Markdown, plots, CLI."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope.analysis import analyze
from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.findings import MineConfig, collect
from onnx_opscope.findings.plan import load_costs
from onnx_opscope.reporting import make_plots, report
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
    assert len(images) == 4 == text.count("<img")  # heatmap, channels, density/score, roofline
    for data in images:
        assert base64.b64decode(data).startswith(PNG_MAGIC)
    for title in ("Histogram per site", "Per-channel max|x|", "Density and score per site", "Roofline"):
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
    # the sidecar has FLOPs but no bytes: no roofline
    assert links == ["r_files/histograms.png", "r_files/channels.png", "r_files/density_score.png"]
    for link in links:
        assert (tmp_path / link).read_bytes().startswith(PNG_MAGIC)
    assert "| # | site |" in text and "per-channel int quant" in text and str(tmp_path) not in text
    assert "FLOP share" in text and "100.0%" in text  # from the table's own .sites.csv


def test_no_findings_no_plots(table):
    assert make_plots([], collect(table), load_costs(None), MineConfig()) == []


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
    for page, images in ((alone, 2), (full, 5)):  # the report: 3 plots of the table (no costs given) + 2
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
