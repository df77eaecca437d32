"""Parity over a sampled generation: A's sequence drawn as `generate(sample=True)` draws it, B fed A's tokens.

SmolLM2-135M's first 2 layers against itself, and against a copy with its final norm's weights scaled by
1.01 (built here: every logit scaled by 1.01, so the argmax holds and the KL cannot be 0). The per-step
figures are held against numpy on the kept logits, the same-seed draws against a Gumbel-max draw of B's
logits with noise from the seed's own generator.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import DECODER_PROMPT, decoder_path
from onnx import numpy_helper

from onnx_opscope import generate, parity_generation
from onnx_opscope.cli import main

PROMPT = DECODER_PROMPT
STEPS, SEED, T = 6, 3, 1.3


@pytest.fixture(scope="module")
def plain():
    return decoder_path()


@pytest.fixture(scope="module")
def scaled(plain, tmp_path_factory):
    m = onnx.load(str(plain))
    w = next(t for t in m.graph.initializer if t.name == "norm.weight")
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(1.01), w.name))
    dest = tmp_path_factory.mktemp("scaled") / "scaled.onnx"
    onnx.save(m, str(dest))
    return dest


@pytest.fixture(scope="module")
def drawn(plain):
    """generate's sampled sequence for the seed: what A's must be."""
    return generate(plain, PROMPT, steps=STEPS, sample=True, temperature=T, seed=SEED).tokens


def _kl(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    lpa, lpb = (z - np.log(np.exp(z).sum(-1, keepdims=True))
                for z in (x.astype(np.longdouble) - x.max(-1, keepdims=True) for x in (la, lb)))  # fmt: skip
    return np.sum(np.exp(lpa) * (lpa - lpb), axis=-1).astype(np.float64)


def test_sampled_against_itself(plain, drawn):
    r = parity_generation(
        plain, plain, PROMPT, steps=STEPS, sample=True, temperature=T, seed=SEED, layers=False
    )
    np.testing.assert_array_equal(r.tokens, drawn)  # A's sequence is generate's sampled one
    generated = r.tokens[:, len(PROMPT) :]
    assert (generated != r.picks_a.T).any()  # some draw is not the argmax: sampling is exercised
    assert r.agreement == 1.0 and r.first_disagreement is None and r.passed
    assert np.all(r.kl == 0.0) and np.all(r.max_abs == 0.0)
    assert r.same_draw is not None and r.same_draw_agreement == 1.0
    assert r.summary()["same_draw_agreement"] == 1.0 and "same-seed draws" in r.format()


def test_sampled_against_a_perturbed_copy_equals_numpy(plain, scaled, drawn):
    r = parity_generation(plain, scaled, PROMPT, steps=STEPS, sample=True, temperature=T, seed=SEED,
                          layers=False, keep_logits=True)  # fmt: skip
    np.testing.assert_array_equal(r.tokens, drawn)
    la, lb = r.logits_a, r.logits_b  # [steps, batch, vocab]
    assert (r.summary()["max_kl"]) > 0 and np.all(r.kl > 0)
    np.testing.assert_allclose(r.kl, _kl(la, lb), rtol=1e-3, atol=1e-16)
    np.testing.assert_array_equal(r.picks_a, la.argmax(-1))
    np.testing.assert_array_equal(r.top1, lb.argmax(-1) == la.argmax(-1))  # top-1 vs A's top-1, not its draw
    # the same-seed draw: generate's rng (seed, 1), one Gumbel draw of [batch, vocab] per step, on B's logits
    rng = np.random.default_rng([SEED, 1])
    ref = np.stack(
        [(lb[s].astype(np.float64) / T + rng.gumbel(size=lb[s].shape)).argmax(-1) for s in range(STEPS)]
    )
    np.testing.assert_array_equal(r.same_draw, ref == r.tokens[:, len(PROMPT) :].T)
    assert r.same_draw_agreement == float(np.mean(ref == r.tokens[:, len(PROMPT) :].T))


def test_cli_sample(plain, scaled, drawn, tmp_path, capsys):
    out = tmp_path / "gen.json"
    ids = ",".join(map(str, PROMPT))
    argv = ["parity", str(plain), str(scaled), "--generate", "--prompt-ids", ids, "--steps", "3", "--sample",
            "--temperature", str(T), "--seed", str(SEED), "--no-layers", "-o", str(out)]  # fmt: skip
    code = main(argv)
    doc = json.loads(out.read_text())
    assert code == (0 if doc["passed"] else 1) and doc["sample"] is True and doc["temperature"] == T
    assert "sampled at T=1.3" in capsys.readouterr().out
    assert doc["tokens"] == drawn[:, : len(PROMPT) + 3].tolist()  # the same rng: a prefix of the 6-step draw
    assert 0.0 <= doc["summary"]["same_draw_agreement"] <= 1.0
    assert [r["top1_a"] for r in doc["per_step"]] and all("same_draw" in r for r in doc["per_step"])
    assert main(["parity", str(plain), str(scaled), "--sample"]) == 2  # --sample without --generate
    assert "--sample goes with --generate" in capsys.readouterr().err
