"""Per-head KV-cache sketches (`sketch.heads`) and the per-head figures of the decoder findings.

The head sketches on constructed tensors at several opsets, plain [batch, heads, seq, head_dim] and
fused [batch, seq, heads·head_dim] layouts, non-finite values included, against their numpy
reference; then on a real generation (SmolLM2-135M's first 2 layers, plain and fused exports): the
table's per-head values against numpy on the tensors each step wrote into the cache, the same values
whether the taps are copied out (CPU's default) or sketched in the graph, and the findings'
per-head figures (`kv_range`, `kv_outlier_channels`) recomputed from their definition.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import DECODER_PROMPT, decoder_path, decoder_steps
from onnx import TensorProto, helper

from onnx_opscope import MineConfig, generate, mine, read_table
from onnx_opscope import sketch as sk
from onnx_opscope.graph import Builder, Names
from onnx_opscope.sketch.heads import head_views
from onnx_opscope.sketch.tap import raw_dtype, raw_rank

HEADS = ("head_min", "head_max", "head_sumsq", "head_chan_maxabs")
PROMPT = DECODER_PROMPT
STEPS = 4
CFG = MineConfig()


def _tap(x: np.ndarray, info: sk.TapInfo, opset: int) -> dict[str, np.ndarray]:
    """finalize of the head sketches built in a graph at `opset` on x."""
    b = Builder(opset, Names({"x"}), "t_")
    opts = sk.SketchOptions()
    chosen = [sk.REGISTRY[n] for n in HEADS]
    raws = sk.build_tap(b, "x", info, chosen, opts).outputs
    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))
    outs = [
        helper.make_tensor_value_info(n, raw_dtype(r, opts), [None] * raw_rank(r, chosen))
        for r, n in raws.items()
    ]
    m = helper.make_model(
        helper.make_graph(b.nodes, "g", [vi], outs), opset_imports=[helper.make_opsetid("", opset)]
    )
    m.ir_version = 8 if opset >= 13 else 7 if opset >= 12 else 6 if opset >= 11 else 5
    onnx.checker.check_model(m, full_check=True)
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip(raws, s.run(list(raws.values()), {"x": x})))
    raw = {r: np.asarray(v, np.float64).ravel() for r, v in got.items()}
    return {n: sk.finalize(n, raw, opts) for n in HEADS}


def _numpy(hd: np.ndarray) -> dict[str, np.ndarray]:
    """The definitions on x viewed as [positions, heads, head_dim] (finite values only)."""
    fin = np.isfinite(hd)
    lo = np.where(fin, hd, np.inf).min(axis=0)
    hi = np.where(fin, hd, -np.inf).max(axis=0)
    nan = lambda v: np.where(np.isfinite(v), v, np.nan)  # noqa: E731
    return {
        "head_min": nan(lo.min(axis=1)),
        "head_max": nan(hi.max(axis=1)),
        "head_sumsq": (np.where(fin, hd, 0.0) ** 2).sum(axis=(0, 2)),
        "head_chan_maxabs": nan(np.maximum(np.abs(lo), np.abs(hi))).ravel(),
    }


@pytest.mark.parametrize("opset", [7, 11, 13, 17, 18])
@pytest.mark.parametrize("dirty", [False, True], ids=["finite", "nonfinite"])
def test_head_sketches_plain_and_fused_layouts(opset, dirty):
    rng = np.random.default_rng(opset)
    b, h, s, d = 2, 3, 5, 8
    x = (rng.standard_normal((b, h, s, d)) * np.array([1.0, 30.0, 0.2])[None, :, None, None]).astype(
        np.float32
    )
    if dirty:
        x[0, 1, 2, 3] = np.nan
        x[1, 2, 0, 0] = np.inf
        x[:, 0, :, 5] = -np.inf  # head 0, channel 5: no finite value
    expect = _numpy(np.moveaxis(x.astype(np.float64), 2, 1).reshape(b * s, h, d))
    plain = sk.TapInfo(4, TensorProto.FLOAT, -1, 2)
    fused_x = np.ascontiguousarray(np.moveaxis(x, 1, 2).reshape(b, s, h * d))  # heads packed head-major
    fused = sk.TapInfo(3, TensorProto.FLOAT, -1, 1, h)
    for what, xx, info in (("plain", x, plain), ("fused", fused_x, fused)):
        got, ref = _tap(xx, info, opset), sk.references(list(HEADS), xx, info, sk.SketchOptions())
        for n in HEADS:
            rtol = sk.REGISTRY[n].tol.rtol
            np.testing.assert_allclose(
                ref[n], expect[n], rtol=1e-12, equal_nan=True, err_msg=f"{what} ref {n}"
            )
            np.testing.assert_allclose(got[n], expect[n], rtol=rtol, equal_nan=True, err_msg=f"{what} {n}")
            if n != "head_sumsq":  # min / max are exact: the graph and the copied-out path agree bit for bit
                np.testing.assert_array_equal(got[n], ref[n], err_msg=f"{what} {n}")
    # the fused tap without a head count: one head, head_chan_maxabs is chan_maxabs
    one = sk.TapInfo(3, TensorProto.FLOAT, -1, 1)
    ref = sk.references(["head_min", "head_chan_maxabs", "chan_maxabs"], fused_x, one, sk.SketchOptions())
    assert ref["head_min"].size == 1
    np.testing.assert_array_equal(ref["head_chan_maxabs"], ref["chan_maxabs"])


def test_head_views_of_the_present_itself():
    """The fallback tap, a present [batch, heads, total, head_dim] with seq axis -2: the same layout."""
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    lo, hi, ss = head_views(x, sk.TapInfo(4, TensorProto.FLOAT, -1, -2))
    assert lo.shape == (3, 5)
    np.testing.assert_array_equal(hi, x.max(axis=(0, 2)))
    np.testing.assert_array_equal(ss, (x.astype(np.float64) ** 2).sum(axis=(0, 2)))


# --------------------------------------------------------------------------------------------
# a real generation, plain and fused


@pytest.fixture(scope="module", params=["", "fused"], ids=["plain", "fused"])
def gen(request, tmp_path_factory):
    """(variant, {site: tapped tensor}, the copied-out table, the in-graph table, each step's tensors)."""
    model = decoder_path(request.param)
    d = tmp_path_factory.mktemp("kvheads")
    rec = generate(model, PROMPT, steps=STEPS, out=d / "copied.parquet")
    generate(model, PROMPT, steps=STEPS, out=d / "graph.parquet", options=sk.SketchOptions(copy_out_max=0))
    taps = {t.id: t for t in rec.manifest.taps}
    kv = {s.id: taps[next(iter(s.roles.values()))] for s in rec.manifest.sites if s.kind == "kv"}
    assert len(kv) == 4 and all(t.copied for t in kv.values())
    tensors = decoder_steps(model, rec.tokens, sorted({t.tensor for t in kv.values()}), STEPS, np.float32)
    return (
        request.param,
        {s: t.tensor for s, t in kv.items()},
        d / "copied.parquet",
        d / "graph.parquet",
        tensors,
    )


def _values(path) -> dict[tuple[str, int, str], np.ndarray]:
    t = read_table(path).to_pandas()
    t = t[t["stat"].isin(HEADS)].sort_values(["site", "step", "stat", "idx"])
    return {k: g["value"].to_numpy() for k, g in t.groupby(["site", "step", "stat"])}


def _as_heads(x: np.ndarray, fused: bool, heads: int = 3) -> np.ndarray:
    """A step's new entries as [positions, heads, head_dim]: [1, H, S, D] (plain) or [1, S, H·D] (fused)."""
    if fused:
        return x.reshape(x.shape[1], heads, -1).astype(np.float64)
    return np.moveaxis(x[0], 1, 0).astype(np.float64)


def test_table_matches_numpy_and_copied_out_equals_in_graph(gen):
    variant, kv, copied, graph, steps = gen
    got, ingraph = _values(copied), _values(graph)
    assert set(got) == set(ingraph) == {(s, k, n) for s in kv for k in range(STEPS) for n in HEADS}
    for (site, step, stat), v in got.items():
        expect = _numpy(_as_heads(steps[step][kv[site]], variant == "fused"))[stat]
        assert v.size == (3 if stat != "head_chan_maxabs" else 192)
        # our loop's session rounds apart from generate's at ~1e-7 of the tensor's scale
        atol = 1e-6 * np.nanmax(np.abs(expect))
        np.testing.assert_allclose(v, expect, rtol=1e-5, atol=atol, err_msg=f"{site} {step} {stat}")
        if stat == "head_sumsq":
            np.testing.assert_allclose(ingraph[(site, step, stat)], v, rtol=1e-5)
        else:  # min / max of float32 values: the graph and the copied-out path agree bit for bit
            np.testing.assert_array_equal(ingraph[(site, step, stat)], v, err_msg=f"{site} {step} {stat}")


def _expected_heads(xs: list[np.ndarray]) -> dict:
    """The kv_range per-head figures of the entries `xs` ([positions, heads, head_dim] each) wrote."""
    v = np.concatenate(xs, axis=0)
    rms = math.sqrt(float((v**2).mean()))
    head_abs = np.abs(v).max(axis=(0, 2))
    chan = np.abs(v).max(axis=0).ravel()
    med = float(np.median(head_abs))
    st = {"tensor": 127 * rms / np.abs(v).max(), "head": 127 * rms / math.sqrt((head_abs**2).mean()),
          "channel": 127 * rms / math.sqrt((chan**2).mean())}  # fmt: skip
    return {"head_min": v.min(axis=(0, 2)), "head_max": v.max(axis=(0, 2)), "head_absmax": head_abs,
            "head_rms": np.sqrt((v**2).mean(axis=(0, 2))), "head_spread": head_abs.max() / med,
            "dominant_heads": [int(h) for h in np.argsort(-head_abs) if head_abs[h] >= 2 * med],
            "int8_steps": st, "head_recovers": math.log2(st["head"] / st["tensor"]) / math.log2(st["channel"] / st["tensor"]),
            "chan": chan}  # fmt: skip


def test_findings_per_head_figures_match_numpy(gen):
    variant, kv, copied, _, steps = gen
    found = [f for f in mine(copied) if f.kind == "decoder"]
    by = {(f.site, f.rule): f for f in found}
    phases = {"prefill": [0], "decode": list(range(1, STEPS)), "all": list(range(STEPS))}
    for site, name in kv.items():
        r = by[(site, "kv_range")]
        outlier = by.get((site, "kv_outlier_channels"))
        ratios = {}
        for ph, idx in phases.items():
            e = _expected_heads([_as_heads(steps[i][name], variant == "fused") for i in idx])
            g = r.signals["phases"][ph]
            assert g["heads"] == 3 and g["head_dim"] == 64
            for k in ("head_min", "head_max", "head_absmax", "head_rms", "head_spread"):
                np.testing.assert_allclose(g[k], e[k], rtol=1e-5, atol=1e-7, err_msg=f"{site} {ph} {k}")
            for k in ("tensor", "head", "channel"):
                np.testing.assert_allclose(g["int8_steps"][k], e["int8_steps"][k], rtol=1e-5)
            np.testing.assert_allclose(g["head_recovers"], e["head_recovers"], rtol=1e-4)
            assert g["dominant_heads"] == e["dominant_heads"]
            med = np.median(e["chan"])
            ratios[ph] = (
                e["chan"].max() / med,
                sorted(np.flatnonzero(e["chan"] >= CFG.kv_outlier_min * med).tolist()),
            )
        assert r.signals["verdict"] in ("per-tensor", "per-head", "per-channel")
        assert "per-head scales" in r.exploit and "dominant" in r.exploit
        del ratios["all"]
        # kv_outlier_channels: per (head, channel) on both exports
        assert (outlier is not None) == (max(x for x, _ in ratios.values()) > CFG.kv_outlier_min), site
        if outlier is not None:
            assert outlier.signals["basis"] == "head_chan_maxabs" and outlier.signals["head_dim"] == 64
            for ph, g in outlier.signals["phases"].items():
                np.testing.assert_allclose(g["ratio"], ratios[ph][0], rtol=1e-5)
                assert sorted(g["channels"]) == ratios[ph][1]
            first = outlier.signals["channels"][0]
            assert outlier.signals["named"][0] == f"h{first // 64}.{first % 64}"
