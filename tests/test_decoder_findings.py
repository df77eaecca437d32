"""Decoder findings (`findings.decoder`) and KV-cache sites (`sites.kv`).

On a real generation (SmolLM2-135M's first 2 layers, scripts/make_decoder.py) every finding is held
against numpy on the real tensors: the same cached loop run with onnxruntime, the tapped tensors
made graph outputs, each figure recomputed from its definition. Constructed tables then check
precision: a planted sink / outlier channel / window / drift gives exactly that finding, a clean
table none.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import DECODER_PROMPT, decoder_path, decoder_steps

from onnx_opscope import MineConfig, find_sites, generate, mine, read_table
from onnx_opscope.cli import main
from onnx_opscope.findings import config_with
from onnx_opscope.findings.decoder import causal_uniform, decoder_findings, layer_of, step_phases
from onnx_opscope.findings.series import collect
from onnx_opscope.sites.kv import kv_role

PROMPT = DECODER_PROMPT
STEPS = 5
CFG = MineConfig()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(model, generate result, table path, the tapped tensors of every step from a plain onnxruntime loop)."""
    model = decoder_path()
    out = tmp_path_factory.mktemp("gen") / "gen.parquet"
    rec = generate(model, PROMPT, steps=STEPS, out=out, sketches=["default", "chan_maxabs"])
    taps = {t.id: t.tensor for t in rec.manifest.taps}
    tensors = {(s.id, r): taps[t] for s in rec.manifest.sites for r, t in s.roles.items()}
    presents = [s.id for s in rec.manifest.sites if s.kind == "kv"]
    return (
        model,
        rec,
        out,
        tensors,
        decoder_steps(model, rec.tokens, sorted({*tensors.values(), *presents}), STEPS, np.float64),
    )


@pytest.fixture(scope="module")
def mined(run):
    """The decoder findings `mine` makes of the generation, at the default thresholds."""
    return _decoder(mine(run[2]))


@pytest.fixture(scope="module")
def table(run) -> pa.Table:
    return read_table(run[2])


def _phases() -> dict[str, list[int]]:
    return {"prefill": [0], "decode": list(range(1, STEPS))}


def _decoder(findings, rule=None):
    return [f for f in findings if f.kind == "decoder" and (rule is None or f.rule == rule)]


def _chan(x: np.ndarray) -> np.ndarray:
    return np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)


def _head_chan(x: np.ndarray) -> np.ndarray:
    """max|x| per (head, head_dim channel) of a plain export's new cache entries [batch, heads, seq, head_dim]."""
    return np.abs(x).max(axis=(0, 2)).ravel()


def _spread(cm: np.ndarray) -> tuple[float, np.ndarray]:
    med = np.median(cm)
    return float(cm.max() / med), med


def test_kv_sites_and_the_table(run):
    model, rec, out, _, _ = run
    kv = [s for s in find_sites(onnx.load(str(model), load_external_data=False)) if s.kind == "kv"]
    assert [(s.id, s.taps[0].role, s.op_type) for s in kv] == [
        (f"present.{i}.{r}", r, "Concat") for i in range(2) for r in ("key", "value")
    ]
    assert rec.parity is not None and rec.parity.ok  # the taps on the model's own outputs keep them
    phases = step_phases(read_table(out))
    run_id = next(iter(phases))[0]
    assert phases == {(run_id, 0): ("prefill", 0), **{(run_id, k): ("decode", len(PROMPT) + k - 1)
                                                       for k in range(1, STEPS)}}  # fmt: skip


def test_kv_sites_of_the_fused_decoder_tap_what_group_query_attention_appends():
    fused = onnx.load(str(decoder_path("fused")), load_external_data=False)
    gqa = {
        n.output[i]: n.input[i]
        for n in fused.graph.node
        if n.op_type == "GroupQueryAttention"
        for i in (1, 2)
    }
    kv = {s.id: s.taps[0].tensor for s in find_sites(fused) if s.kind == "kv"}
    assert kv == gqa and len(kv) == 4


def test_findings_match_numpy_on_the_real_tensors(run, mined):
    _, _, _, tensors, steps = run
    found = mined
    assert found and all(f.signals["layer"] in (0, 1, None) for f in found)
    by = {(f.site, f.role, f.rule): f for f in found}
    phases = _phases()
    # massive activations: the block outputs a residual Add adds (the plain export's skip input carries sumsq only)
    expect = set()
    for (site, role), name in tensors.items():
        if role != "residual_b":
            continue
        ratios = {}
        for ph, idx in phases.items():
            cm = np.max([_chan(steps[i][name]) for i in idx], axis=0)
            ratios[ph], med = _spread(cm)
            f = by.get((site, role, "massive_activation"))
            if f is not None and ph in f.signals["phases"]:
                got = f.signals["phases"][ph]
                np.testing.assert_allclose(got["ratio"], ratios[ph], rtol=1e-4)
                strong = np.flatnonzero(cm >= CFG.massive_ratio_min * med)
                assert sorted(got["channels"]) == sorted(strong.tolist())
        if max(ratios.values()) > CFG.massive_ratio_min:
            expect.add(site)
    assert {f.site for f in _decoder(found, "massive_activation")} == expect and expect
    # KV caches: the entries each step writes (the present's last S positions), their range and outlier
    # (head, channel)s; the per-head figures are held to numpy in tests/test_kv_heads.py
    for (site, role), name in tensors.items():
        if role not in ("key", "value"):
            continue
        for i, x in enumerate(steps):
            fed = len(PROMPT) if i == 0 else 1
            np.testing.assert_array_equal(x[name], x[site][:, :, -fed:, :])
        r = by[(site, role, "kv_range")].signals["phases"]
        ratios = {}
        for ph, idx in {**phases, "all": list(range(STEPS))}.items():
            xs = [steps[i][name] for i in idx]
            absmax = max(np.abs(x).max() for x in xs)
            rms = math.sqrt(sum((x**2).sum() for x in xs) / sum(x.size for x in xs))
            np.testing.assert_allclose([r[ph]["min"], r[ph]["max"], r[ph]["absmax"], r[ph]["rms"]],
                                       [min(x.min() for x in xs), max(x.max() for x in xs), absmax, rms], rtol=1e-5)  # fmt: skip
            ratios[ph] = _spread(np.max([_head_chan(x) for x in xs], axis=0))[0]  # per (head, channel)
        del ratios["all"]
        outlier = by.get((site, role, "kv_outlier_channels"))
        assert (outlier is not None) == (max(ratios.values()) > CFG.kv_outlier_min), site
        if outlier is not None:
            for ph, g in outlier.signals["phases"].items():
                np.testing.assert_allclose(g["ratio"], ratios[ph], rtol=1e-4)


def test_attention_figures_match_numpy(run, mined, table):
    _, _, _, tensors, steps = run
    # a 2-key window judged on every decode step (10..13 keys), whatever its share
    found = _mined(table, config_with(overrides=["attn_window=2", "window_mass_min=0"]))
    by = {(f.site, f.rule): f for f in found}
    attn = [(site, name) for (site, role), name in tensors.items() if role == "attn"]
    assert len(attn) == 2
    sinks = set()
    for site, name in attn:
        shares, kept, keys = [], [], []
        for k in range(STEPS):
            x = steps[k][name]  # [1, heads, P, P] at the prefill, [1, heads, 1, P + k] after
            shares.append(x[..., 0].sum() / x.sum())
            kept.append((x[..., 0].sum() + x[..., -2:].sum()) / x.sum())
            keys.append(x.shape[-1])
        got = by[(site, "windowed_attention")].signals
        np.testing.assert_allclose([got["sink_share"]["prefill"], got["sink_share"]["decode"], got["kept_share"]],
                                   [shares[0], np.mean(shares[1:]), np.mean(kept[1:])], rtol=1e-4)  # fmt: skip
        if np.mean(shares[1:]) > max(CFG.sink_share_min, 4 / np.mean(keys[1:])):
            sinks.add(site)
    # at the default thresholds: a sink where numpy says so (these two layers have none), no 32-key window
    assert {f.site for f in _decoder(mined, "attention_sink")} == sinks
    assert not _decoder(mined, "windowed_attention")


def test_without_chan_maxabs_the_rule_reads_max_over_rms(run, table):
    _, _, _, tensors, steps = run
    default_set = table.filter(pc.not_equal(table.column("stat"), "chan_maxabs"))
    found = _decoder(_mined(default_set), "massive_activation")
    expect = {}
    for (site, role), name in tensors.items():
        if role != "residual_b":
            continue
        ratios = []
        for x in steps:
            v = np.abs(x[name]).ravel()
            peak = v.max()
            ratios.append(peak / math.sqrt((np.sum(v**2) - peak**2) / (v.size - 1)))
        if max(ratios) > CFG.massive_rest_min:
            expect[site] = ratios
    assert {f.site for f in found} == set(expect) and expect
    for f in found:
        assert f.signals["basis"] == "max/rms" and f.signals["channels"] == [] and "chan_maxabs" in f.note
        worst = max(g["ratio"] for g in f.signals["phases"].values())
        np.testing.assert_allclose(worst, max(expect[f.site]), rtol=1e-4)


def test_cli_decoder_filter(run, mined, tmp_path, capsys):
    _, _, out, _, _ = run
    saved = tmp_path / "f.json"
    assert main(["mine", str(out), "--decoder", "-o", str(saved)]) == 0
    printed = capsys.readouterr().out
    assert "present.0.key" in printed and "/layers.0/q/MatMul" not in printed  # the decoder findings only
    rules = {f["rule"] for f in json.loads(saved.read_text())["findings"]}
    assert "kv_range" in rules and rules <= {"massive_activation", "attention_sink", "windowed_attention",
                                             "kv_outlier_channels", "kv_range", "phase_drift"}  # fmt: skip
    # `mine_decoder` (what --decoder runs) keeps only the roles the rules read: the same findings as `mine`
    key = sorted((f.site, f.role, f.rule, f.condition) for f in mined)
    assert (
        sorted(
            (f["site"], f["role"], f["rule"], f["condition"])
            for f in json.loads(saved.read_text())["findings"]
        )
        == key
    )
    plain = tmp_path / "plain.parquet"
    pq.write_table(read_table(out).drop_columns(["phase", "position"]), plain)
    assert main(["mine", str(plain), "--decoder"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "no phase column" in err


# --------------------------------------------------------------------------------------------
# constructed tables: precision


def _rows(site: str, op: str, role: str, step: int, numel: int, stats: dict[str, np.ndarray]) -> list[dict]:
    phase = "prefill" if step == 0 else "decode"
    position = 0 if step == 0 else P_LEN + step - 1
    return [dict(run_id="r", step=step, provider="cpu", dist="prompt", M=None, K=None, N=None, numel=numel,
                 site=site, op_type=op, role=role, stat=name, idx=i, value=float(v), phase=phase, position=position)
            for name, vals in stats.items() for i, v in enumerate(np.atleast_1d(vals))]  # fmt: skip


P_LEN, DECODE = 40, 6


def _table(stream_chan=None, stream_decode_scale=1.0, sink=0.0, window=0.0, kv_chan=None) -> pa.Table:
    """A generate table: a norm input (576 channels), an attention site, a key cache (64 channels).

    Planted: `stream_chan` (channel at 100x), the stream's decode values scaled by `stream_decode_scale`,
    `sink` (key 0's share of decode attention), `window` (the last 4 keys' share), `kv_chan` (at 10x)."""
    rng = np.random.default_rng(0)
    rows = []
    for step in range(DECODE + 1):
        scale = 1.0 if step == 0 else stream_decode_scale
        x = rng.uniform(1.0, 2.0, 576) * scale
        if stream_chan is not None:
            x[stream_chan] *= 100.0
        stats = {"min": -x.max(), "max": x.max(), "sumsq": (x**2).sum() / 2, "chan_maxabs": x}
        rows += _rows("/model/layers.3/post_attention_layernorm/SkipSimplifiedLayerNormalization",
                      "SkipSimplifiedLayerNormalization", "in", step, 576 * 9, stats)  # fmt: skip
        keys = P_LEN if step == 0 else P_LEN + step
        heads = 4
        if step == 0:
            mass = np.array([causal_uniform(1, keys)] + [0.0] * (keys - 1)) * keys * heads
            mass[1:] = (keys * heads - mass[0]) / (keys - 1)
        else:
            rest = 1.0 - sink - window
            mass = np.full(keys, rest / (keys - 5))
            mass[0], mass[-4:] = sink, window / 4
            mass[1 : keys - 4] = rest / (keys - 5)
            mass *= heads
        numel = heads * keys * (keys if step == 0 else 1)
        rows += _rows(
            "/model/layers.3/self_attn/Softmax", "Softmax", "attn", step, numel, {"attn_krecv": mass}
        )
        k = rng.uniform(1.0, 1.5, 64)
        if kv_chan is not None:
            k[kv_chan] *= 10.0
        n = 3 * keys * 64
        rows += _rows("present.3.key", "Concat", "key", step, n,
                      {"min": -k.max(), "max": k.max(), "sumsq": n * 1.0, "chan_maxabs": k})  # fmt: skip
    return pa.Table.from_pylist(rows)


def _mined(table: pa.Table, cfg: MineConfig | None = None):
    """The decoder findings of a table, straight from the series (what `mine` adds to its own)."""
    return decoder_findings(collect(table), step_phases(table), cfg or CFG)


def test_clean_table_gives_no_finding_but_the_kv_range():
    found = _mined(_table(sink=1 / 43, window=4 / 43))
    assert [(f.rule, f.site) for f in found] == [("kv_range", "present.3.key")]
    assert found[0].exploit.startswith("per-tensor int8") and found[0].signals["layer"] == 3


def test_planted_patterns_give_exactly_their_findings():
    found = _mined(_table(stream_chan=7, sink=0.6, kv_chan=3))
    rules = sorted((f.rule, f.site) for f in found)
    assert rules == [("attention_sink", "/model/layers.3/self_attn/Softmax"),
                     ("kv_outlier_channels", "present.3.key"), ("kv_range", "present.3.key"),
                     ("massive_activation", "/model/layers.3/post_attention_layernorm/SkipSimplifiedLayerNormalization"),
                     ("phase_drift", "/model/layers.3/self_attn/Softmax")]  # fmt: skip
    by = {f.rule: f for f in found}
    assert (
        by["massive_activation"].signals["channels"] == [7]
        and "channel(s) 7 " in by["massive_activation"].exploit
    )
    assert by["kv_outlier_channels"].signals["channels"] == [3]
    assert by["attention_sink"].signals["share"]["decode"] == pytest.approx(0.6)
    # the prefill's key 0 gets what uniform causal attention gives it (excess 0), the decode steps 60%: drift
    assert by["phase_drift"].signals["moved"] == ["sink_excess"]
    assert by["phase_drift"].signals["drift"]["sink_excess"]["prefill"] == pytest.approx(0.0, abs=1e-9)
    assert all(f.signals["layer"] == 3 for f in found)


def test_planted_window_and_stream_drift():
    cfg = config_with(overrides=["attn_window=4"])
    found = _mined(_table(window=0.95, stream_decode_scale=0.1), cfg)
    assert sorted((f.rule, f.role) for f in found) == [("kv_range", "key"), ("phase_drift", "in"),
                                                       ("windowed_attention", "attn")]  # fmt: skip
    by = {f.rule: f for f in found}
    assert by["windowed_attention"].signals["kept_share"] == pytest.approx(0.95)
    drift = by["phase_drift"].signals["drift"]
    assert by["phase_drift"].signals["moved"] == ["max|x|"] and drift["max|x|"]["ratio"] == pytest.approx(
        0.1, rel=0.01
    )
    # a window of 32 keys needs at least 66 keys to be judged: these steps have 41..46
    assert "windowed_attention" not in {f.rule for f in _mined(_table(window=0.95))}


def test_names():
    assert [layer_of(s) for s in ("/model/layers.12/mlp/down_proj/MatMul", "/layers.0/Add_3", "/h.3/attn/Softmax",
                                  "present.7.value", "present_key_5", "/norm/SkipSimplifiedLayerNormalization",
                                  "blocks_2/ffn")] == [12, 0, 3, 7, 5, None, 2]  # fmt: skip
    assert [kv_role(n) for n in ("present.0.key", "present_value_3", "present.2")] == ["key", "value", "kv"]
    for k, s in ((1, 1), (1, 9), (3, 20)):  # brute force: query i spreads 1/(i+1) over keys 0..i
        m = np.tril(np.ones((s, s))) / np.arange(1, s + 1)[:, None]
        assert causal_uniform(k, s) == pytest.approx(m[:, :k].sum() / s)
