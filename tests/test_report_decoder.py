"""The report's Decoder section (`reporting.decoder`) on a real `generate` table of SmolLM2's first 2 layers.

Every figure the section prints is held against `mine_decoder`'s findings on the same table, the stream
curve of its plot against pandas on the table's own rows; a table without phases gets no section, and a
planted attention sink gives its row (the 2 real layers have none).
"""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest import DECODER_PROMPT, decoder_path
from matplotlib.image import imread

from onnx_opscope import Selection, generate, mine_decoder, read_table, report
from onnx_opscope.findings import config_with
from onnx_opscope.findings.decoder import PHASES, decoder_findings, step_phases
from onnx_opscope.findings.series import collect
from onnx_opscope.reporting.decoder import decoder_section, stream_peaks

# what the decoder rules read (the residual Adds, fed by the o / down projections, attention, the caches):
# a fifth of the rows of every site, the same decoder findings
SITES = Selection(names=("*/o/*", "*/down/*", "*Add_*", "*Softmax*", "present.*"))
# short windows so the 2-layer run's 10..14 keys are judged and the window rule has rows to print
OVERRIDES = ["attn_window=2", "window_mass_min=0.2"]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "gen.parquet"
    generate(
        decoder_path(), DECODER_PROMPT, steps=6, out=out, sketches=["default", "chan_maxabs"], parity=False
    )
    return out


@pytest.fixture(scope="module")
def cfg():
    return config_with(overrides=OVERRIDES)


@pytest.fixture(scope="module")
def md(table, cfg, tmp_path_factory):
    path = report(table, tmp_path_factory.mktemp("md") / "r.md", config=cfg)
    return path, path.read_text()


def g(v) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.3g}"


def _tables(md_text: str) -> dict[str, list[dict[str, str]]]:
    """The Decoder section's tables, {level-3 heading: rows as {column: cell}}."""
    section = md_text.split("\n## Decoder\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for part in section.split("\n### ")[1:]:
        title, *lines = part.splitlines()
        rows = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines
                if ln.startswith("|")]  # fmt: skip
        if rows:
            out[title] = [dict(zip(rows[0], r)) for r in rows[2:]]
    return out


def _layer(f) -> str:
    return "-" if f.signals["layer"] is None else str(f.signals["layer"])


def test_decoder_section_prints_the_findings_own_numbers(table, cfg, md):
    path, text = md
    found = mine_decoder(table, cfg)
    rules = {f.rule for f in found}
    assert {
        "massive_activation",
        "windowed_attention",
        "kv_range",
        "kv_outlier_channels",
        "phase_drift",
    } <= rules
    tables = _tables(text)
    assert f"{len(found)} decoder finding(s) over 2 layer(s)" in text

    massive = {r["site"]: r for r in tables["Massive activations"]}
    for f in (f for f in found if f.rule == "massive_activation"):
        row, ph = massive[f.site], f.signals["phases"]
        assert row["layer"] == _layer(f) and row["basis"] == "chan_maxabs"
        assert [row[f"ratio {p}"] for p in PHASES] == [g(ph[p]["ratio"]) for p in PHASES]
        assert [row[f"max|x| {p}"] for p in PHASES] == [g(ph[p]["max"]) for p in PHASES]
        assert row["channels"].split(", ")[0] == str(f.signals["channels"][0]) and row["exploit"] == f.exploit

    attention = {(r["site"], r["verdict"]): r for r in tables["Attention sinks and windows"]}
    windows = [f for f in found if f.rule == "windowed_attention"]
    assert len(attention) == len([f for f in found if f.rule in ("attention_sink", "windowed_attention")])
    for f in windows:
        row = attention[(f.site, f.rule)]
        assert row["window share"] == g(f.signals["kept_share"]) and row["keys"] == "..".join(
            map(str, f.signals["keys"])
        )
        assert row["sink share (decode)"] == g(f.signals["sink_share"]["decode"])

    kv = {r["site"]: r for r in tables["KV cache"]}
    ranges = [f for f in found if f.rule == "kv_range"]
    assert sorted(kv) == sorted(f.site for f in ranges)
    for f in ranges:
        row, r = kv[f.site], f.signals["phases"]["all"]
        assert [row[k] for k in ("min", "max", "absmax", "RMS", "crest")] == [
            g(r[k]) for k in ("min", "max", "absmax", "rms", "crest")
        ]
        assert [row[f"absmax {p}"] for p in PHASES] == [g(f.signals["phases"][p]["absmax"]) for p in PHASES]
        assert (
            row["cache"] == f.role
            and row["int8"] == f.signals["verdict"]
            and f.exploit.startswith(row["int8"])
        )
        # per KV head, the same on the plain export as on the fused one (3 heads of 64 channels)
        assert r["heads"] == 3 and row["head absmax"] == " / ".join(g(v) for v in r["head_absmax"])
        assert row["head spread"] == g(r["head_spread"])
        assert row["dominant heads"] == (", ".join(map(str, r["dominant_heads"])) or "none")
        steps = r["int8_steps"]
        assert row["int8 steps tensor / head / channel"] == " / ".join(
            g(steps[k]) for k in ("tensor", "head", "channel")
        )
    for f in (f for f in found if f.rule == "kv_outlier_channels"):
        row = kv[f.site]
        assert row["outlier ratio"] == g(max(p["ratio"] for p in f.signals["phases"].values()))
        assert row["channels"].removesuffix(" ...") == ", ".join(f.signals["named"][:8])
        assert f.signals["named"][0] == f"h{f.signals['channels'][0] // 64}.{f.signals['channels'][0] % 64}"

    drift = {(r["site"], r["role"], r["figure"]): r for r in tables["Prefill to decode drift"]}
    moved = [(f, name) for f in found if f.rule == "phase_drift" for name in f.signals["moved"]]
    assert len(drift) == len(moved) > 0
    for f, name in moved:
        d, row = f.signals["drift"][name], drift[(f.site, f.role, name)]
        assert (row["prefill"], row["decode"], row["decode/prefill"]) == (
            g(d["prefill"]),
            g(d["decode"]),
            g(d["ratio"]),
        )

    png = path.with_name("r_files") / "decoder_layers.png"
    assert "![Decoder: max|x| per layer, prefill vs decode](r_files/decoder_layers.png)" in text
    img = imread(io.BytesIO(png.read_bytes()), format="png")
    assert img.shape[0] > 300 and img.shape[1] > 800
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 50  # lines, labels, two panels


def test_stream_curve_equals_pandas(table):
    """The plot's left panel: per layer and phase, max |x| over the residual Adds' block outputs."""
    t = read_table(table)
    df = t.filter(pc.equal(t.column("role"), "residual_b")).to_pandas()
    df = df[df.stat.isin(["min", "max"])]
    df = df.assign(layer=df.site.str.extract(r"/layers\.(\d+)/")[0].astype(int), a=df.value.abs())
    want = df.groupby(["phase", "layer"]).a.max()
    got = stream_peaks(collect(t), step_phases(t))
    assert {(p, layer): v for p, by in got.items() for layer, v in by.items()} == pytest.approx(
        want.to_dict()
    )


def test_html_has_the_section_and_its_plot(table, cfg, tmp_path):
    text = report(table, tmp_path / "r.html", config=cfg).read_text()
    assert '<h2 id="decoder">Decoder</h2>' in text and '<a href="#decoder">Decoder</a>' in text
    assert '<h3 id="decoder-kv">KV cache</h3>' in text and text.count('id="decoder"') == 1
    assert re.search(
        r'alt="Decoder: max\|x\| per layer, prefill vs decode" src="data:image/png;base64,', text
    )
    for f in (f for f in mine_decoder(table, cfg) if f.rule == "kv_range"):
        assert (
            f"<td>{f.site}</td>" in text
            and f'<td class="n">{g(f.signals["phases"]["all"]["absmax"])}</td>' in text
        )


def test_a_table_without_phases_has_no_decoder_section(table, tmp_path):
    t = read_table(table).drop_columns(["phase", "position"])
    t = t.filter(pc.starts_with(t.column("site"), "present."))  # a few sites: the report's plots stay quick
    text = report(t, tmp_path / "plain.md").read_text()
    assert "## Decoder" not in text and "decoder_layers.png" not in text
    assert "## Findings" in text  # the rest of the report is there


def test_planted_sink_gives_its_row_and_no_plot():
    """One attention site, key 0 taking 60% of decode attention: its sink row; no stream / KV tensor, no plot."""
    rows, prompt = [], 12
    for step in range(5):
        keys = prompt if step == 0 else prompt + step  # a decode step's queries see position + 1 keys
        mass = np.full(keys, 0.4 / (keys - 1)) if step else np.full(keys, float(prompt) / keys)
        if step:
            mass[0] = 0.6
        rows += [dict(run_id="r", step=step, provider="cpu", dist="prompt", M=None, K=None, N=None,
                      numel=keys * (keys if step == 0 else 1), site="/model/layers.4/self_attn/Softmax",
                      op_type="Softmax", role="attn", stat="attn_krecv", idx=i, value=float(v),
                      phase="prefill" if step == 0 else "decode", position=0 if step == 0 else prompt + step - 1)
                 for i, v in enumerate(mass)]  # fmt: skip
    t = pa.Table.from_pylist(rows)
    series, phases = collect(t), step_phases(t)
    found = decoder_findings(series, phases)
    sink = next(f for f in found if f.rule == "attention_sink")
    section = decoder_section(found, series, phases)
    (part,) = [p for p in section.parts if p.anchor == "decoder-attention"]
    row = dict(zip(part.head, next(r for r in part.rows if r[2] == "attention_sink")))
    assert row["layer"] == "4" and row["sink share (decode)"] == g(sink.signals["share"]["decode"]) == "0.6"
    assert row["keys"] == f"{prompt + 1}..{prompt + 4}" and row["exploit"] == sink.exploit
    assert section.plot.reason.startswith("the table has no residual-stream or KV-cache tensor")
    assert decoder_section(found, series, {}) is None
