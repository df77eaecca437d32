"""Parity: output metrics, model vs rewrite and provider vs provider with the first divergent site, CLI exits."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnx_opscope import zoo
from onnx_opscope.cli import main
from onnx_opscope.compare import compare_outputs, looks_like_logits
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run import parity_models, parity_providers
from onnx_opscope.run.feeds import FeedSpec
from onnx_opscope.sites import Selection
from onnx_opscope.transform import fake_quant, skip_blocks

LM_FEEDS = FeedSpec(dims={"batch": 2, "seq": 12}, batches=2)
LM_ARGS = ["--dim", "batch=2,seq=12", "--batches", "2"]


@pytest.fixture(scope="module")
def lm() -> onnx.ModelProto:
    return zoo.build("transformer_tiny_lm")


def test_compare_outputs_metrics():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 10)).astype(np.float32)
    b = a.copy()
    b[0, 0] += 0.5
    m = compare_outputs({"logits": a}, {"logits": b})["logits"]
    assert m["max_abs"] == pytest.approx(0.5) and m["max_rel"] == pytest.approx(0.5 / np.abs(a).max())
    assert 0.99 < m["cosine"] < 1 and m["top1"] in (0.75, 1.0)
    same = compare_outputs([a], [a])["output_0"]
    assert same["max_abs"] == 0 and same["cosine"] == pytest.approx(1.0) and same["top1"] is None
    c = a.copy()
    c[1, 1] = np.nan
    bad = compare_outputs({"y": a}, {"y": c})["y"]
    assert bad["nonfinite_mismatch"] == 1 and bad["max_rel"] == np.inf
    assert compare_outputs({"y": a}, {"z": a[:2]})["y|z"]["max_rel"] == np.inf  # shapes differ
    probs = np.full((3, 5), 0.2, np.float32)
    assert looks_like_logits("out", probs) and looks_like_logits("lm_logits", a)
    assert not looks_like_logits("hidden", a) and not looks_like_logits("ids", np.zeros((2, 3), np.int64))


def test_skip_near_identity_passes_strongest_fails(lm):
    near = skip_blocks(lm, ["block2/*"]).model
    rep = parity_models(lm, near, LM_FEEDS, tol=1e-2)
    assert rep.passed and rep.batches == 2 and rep.summary()["top1"] == 1.0
    assert "block2/attn/softmax" in rep.sites_only_in_a and rep.first_divergent is None
    strong = skip_blocks(lm, ["block1/*"]).model
    rep = parity_models(lm, strong, LM_FEEDS, tol=1e-2)
    assert not rep.passed and rep.summary()["cosine"] < 0.9
    # The first site downstream of the removed block 1 is where it shows
    assert rep.first_divergent["site"] == "block1/mlp_residual"
    assert "FAILED" in rep.format() and "first divergent site: block1/mlp_residual" in rep.format()


def test_fake_quant_first_divergent_site_is_first_matmul(lm):
    fq = fake_quant(lm).model
    rep = parity_models(lm, fq, LM_FEEDS, tol=1e-4)
    assert not rep.passed
    first = rep.first_divergent
    assert first["site"] == "block1/attn/q_proj/matmul" and first["role"] == "out"
    # its lhs (the un-quantized LayerNorm output, tapped in both) does not diverge
    lhs = [r for r in rep.layers if r["site"] == first["site"] and r["role"] == "lhs"]
    assert lhs and max(r["divergence"] for r in lhs) == 0
    assert rep.summary()["cosine"] > 0.999


def test_contrib_attention_parity_with_itself_includes_shadow():
    m = zoo.build("attention_contrib")
    rep = parity_models(
        m, m, FeedSpec(dims={"batch": 2, "seq": 6}, batches=1), selection=Selection(kinds=("attn",))
    )
    assert rep.passed and rep.first_divergent is None
    assert {(r["site"], r["stat"]) for r in rep.layers} == {
        ("attn/attention", "attn_qmax"),
        ("attn/attention", "attn_krecv"),
    }


def test_providers(lm):
    rep = parity_providers(lm, "cpu,cpu", LM_FEEDS)
    assert rep.passed and rep.layers and all(r["divergence"] == 0 for r in rep.layers)
    with pytest.raises(OpscopeError, match="CUDAExecutionProvider is not available") as err:
        parity_providers(lm, "cpu,cuda", LM_FEEDS)
    assert "onnxruntime-gpu" in err.value.hint
    with pytest.raises(OpscopeError, match="exactly two"):
        parity_providers(lm, "cpu", LM_FEEDS)
    with pytest.raises(OpscopeError, match="unknown execution provider 'cdua'"):
        parity_providers(lm, "cpu,cdua", LM_FEEDS)


def test_cli_exit_codes(tmp_path, capsys, lm):
    src = tmp_path / "lm.onnx"
    onnx.save(lm, str(src))
    assert main(["rewrite", "skip", str(src), "--list"]) == 0
    assert "block2/mlp_residual" in capsys.readouterr().out
    near, far, fq = tmp_path / "near.onnx", tmp_path / "far.onnx", tmp_path / "fq.onnx"
    assert main(["rewrite", "skip", str(src), "--blocks", "block2/*", "-o", str(near), *LM_ARGS]) == 0
    out = capsys.readouterr().out
    assert "removed 34 nodes" in out and "top-1 agreement 100.00%" in out
    assert main(["rewrite", "skip", str(src), "--blocks", "0,1", "-o", str(far), "--no-check"]) == 0
    assert main(["rewrite", "fakequant", str(src), "-o", str(fq), "--mode", "channel", *LM_ARGS]) == 0
    assert "cosine 0.99" in capsys.readouterr().out
    report = tmp_path / "p.json"
    assert main(["parity", str(src), str(near), "--tol", "0.01", "-o", str(report), *LM_ARGS]) == 0
    assert json.loads(report.read_text())["passed"] is True
    assert main(["parity", str(src), str(far), *LM_ARGS, "--no-layers"]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert main(["parity", str(src), "--providers", "cpu,cuda"]) == 2
    assert "CUDAExecutionProvider is not available" in capsys.readouterr().err
    assert main(["parity", str(src)]) == 2
    assert main(["rewrite", "skip", str(src), "--blocks", "block3/*", "-o", str(tmp_path / "x.onnx")]) == 2
    assert main(["rewrite", "fakequant", str(src), "-o", str(src)]) == 2


def test_class_metrics_against_a_direct_reference():
    """top-1, top-5 and KL of logits (softmaxed) and of rows that are already distributions."""
    from onnx_opscope.compare.outputs import class_metrics

    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 7, 10)).astype(np.float32)
    b = a + rng.standard_normal(a.shape).astype(np.float32)
    rows_a, rows_b = a.reshape(-1, 10).astype(np.float64), b.reshape(-1, 10).astype(np.float64)
    top1 = np.mean([np.argmax(x) == np.argmax(y) for x, y in zip(rows_a, rows_b)])
    top5 = np.mean([np.argmax(y) in np.argsort(-x)[:5] for x, y in zip(rows_a, rows_b)])

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    kl = np.mean([np.sum(softmax(x) * np.log(softmax(x) / softmax(y))) for x, y in zip(rows_a, rows_b)])
    got = class_metrics(a, b)
    assert got["top1"] == pytest.approx(top1) and got["top5"] == pytest.approx(top5)
    assert got["kl"] == pytest.approx(kl, rel=1e-6) and 0 < top1 < top5 < 1
    pa, pb = (np.stack([softmax(r) for r in x]) for x in (rows_a, rows_b))
    assert class_metrics(pa, pb)["kl"] == pytest.approx(kl, rel=1e-6)  # distributions taken as they are
    assert class_metrics(a, a)["kl"] == pytest.approx(0.0, abs=1e-12)
