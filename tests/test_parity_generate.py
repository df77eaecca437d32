"""Parity of two decoders over one generated sequence, and calibration over a generation.

SmolLM2-135M's first 2 layers, plain (scripts/make_decoder.py), int4 (MatMulNBits on the GGUF's own
Q4_1 blocks, so its weights equal the plain export's to float32 rounding) and fused (onnxruntime's
contrib attention and normalization ops). The per-step metrics are held against numpy on the kept
logits, B's teacher-forced logits against onnxruntime running A's whole sequence without a cache, and
the calibrated ranges against numpy min / max of the tapped tensors over the prefill and decode steps.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import DECODER_PROMPT, decoder_path
from onnx import numpy_helper

from onnx_opscope import calibrate_generation, generate, parity_generation
from onnx_opscope.cli import main
from onnx_opscope.run.parity_generate import layer_of

PROMPT = DECODER_PROMPT
STEPS = 5
LAYERS = 2


@pytest.fixture(scope="session")
def decoders():
    """(plain, int4, fused) 2-layer decoders, built once and cached beside the real models."""
    return tuple(decoder_path(variant, LAYERS) for variant in ("", "int4", "fused"))


@pytest.fixture(scope="session")
def vs_self(decoders):
    return parity_generation(decoders[0], decoders[0], PROMPT, steps=STEPS)


@pytest.fixture(scope="session")
def vs_int4(decoders):
    # the int4 weights equal the plain ones to float32 rounding: a tolerance that small finds where they part
    return parity_generation(decoders[0], decoders[1], PROMPT, steps=STEPS, layer_tol=1e-9, keep_logits=True)


def _full_sequence_logits(model, ids: np.ndarray) -> np.ndarray:
    """Next-token logits of every position of `ids` in one run on an empty cache: no loop, no forcing."""
    s = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    empty = {
        i.name: np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32) for i in s.get_inputs()[2:]
    }
    return s.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids), **empty})[0]


def _kl_reference(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    """KL(softmax(a) || softmax(b)) per row in long double (19 digits): float64's own rounding shows."""
    lpa, lpb = (z - np.log(np.exp(z).sum(-1, keepdims=True))
                for z in (x.astype(np.longdouble) - x.max(-1, keepdims=True) for x in (la, lb)))  # fmt: skip
    return np.sum(np.exp(lpa) * (lpa - lpb), axis=-1).astype(np.float64)


def test_a_decoder_against_itself(decoders, vs_self):
    r = vs_self
    plain = generate(decoders[0], PROMPT, steps=STEPS)
    np.testing.assert_array_equal(r.tokens, plain.tokens)  # A's sequence is generate's greedy one
    assert r.agreement == 1.0 and r.first_disagreement is None and r.passed
    assert np.all(r.kl == 0.0) and np.all(r.max_abs == 0.0)
    assert r.layer_step == r.worst_step and r.sites_compared > 0 and r.layers
    assert r.first_divergent is None and all(row["divergence"] == 0.0 for row in r.layers)
    assert {row["layer"] for row in r.layers} == {0, 1, None}  # the blocks, and the lm head outside them


def test_int4_per_step_metrics_equal_numpy(decoders, vs_int4):
    r, prompt_len = vs_int4, len(PROMPT)
    la, lb = r.logits_a[:, 0], r.logits_b[:, 0]  # [steps, vocab], batch row 0
    a_tokens = r.tokens[0, prompt_len:]
    np.testing.assert_array_equal(a_tokens, la.argmax(-1))  # A is greedy
    np.testing.assert_array_equal(r.top1[:, 0], lb.argmax(-1) == a_tokens)
    # KLs of 1e-13..1e-11 nats: float64's log-softmax is good to ~1e-16 nats
    np.testing.assert_allclose(r.kl[:, 0], _kl_reference(la, lb), rtol=1e-3, atol=1e-16)
    np.testing.assert_allclose(r.max_abs[:, 0], np.abs(la.astype(np.float64) - lb).max(-1), rtol=1e-12)
    assert r.agreement == float(np.mean(lb.argmax(-1) == a_tokens))
    assert 0 < r.summary()["max_kl"] < 1e-6 and r.summary()["mean_kl"] > 0


def test_int4_first_diverging_layer_is_its_first_int4_matmul(decoders, vs_int4):
    r = vs_int4
    f = r.first_divergent
    assert f is not None and f["divergence"] > r.layer_tol
    assert f["op_type"] == "MatMul" and f["op_type_b"] == "MatMulNBits"
    nodes = {n.name: n.op_type for n in onnx.load(str(decoders[1]), load_external_data=False).graph.node}
    assert nodes.get(f["site"]) == "MatMulNBits"  # a real node of the int4 model ...
    assert f["layer"] in range(LAYERS) and f["layer"] == layer_of(f["site"])  # ... in a real block
    # everything A and B compute before the first MatMulNBits is the same floats, bit for bit
    before = r.layers[: r.layers.index(f)]
    assert before and all(row["divergence"] == 0.0 for row in before)
    assert r.layer_step == r.worst_step and r.passed  # tokens agree, logits within 1e-3


def test_fused_decoder_agrees_token_by_token(decoders):
    r = parity_generation(decoders[0], decoders[2], PROMPT, steps=STEPS, layers=False)
    assert r.agreement == 1.0 and r.summary()["max_kl"] < 1e-6 and r.passed
    assert r.layer_step is None and not r.layers
    assert "top-1 agreement 100.0%" in r.format()


def test_layer_of_block_names():
    assert layer_of("/layers.12/self_attn/q_proj/MatMul") == 12
    assert layer_of("/model/layers.3/mlp/down_proj/MatMul") == 3
    assert layer_of("/transformer/h.7/attn/c_attn/MatMul") == 7
    assert layer_of("/lm_head/MatMul") is None and layer_of("/MatMul") is None


def _perturbed(plain, dest) -> str:
    """The plain decoder with its final norm's weights scaled by seeded factors in [0.4, 1.6]: its top-1
    parts from A's at step 2 of PROMPT (and agrees again after), so B's own picks differ from A's tokens."""
    m = onnx.load(str(plain))
    w = next(t for t in m.graph.initializer if t.name == "norm.weight")
    scaled = numpy_helper.to_array(w) * np.random.default_rng(0).uniform(0.4, 1.6, w.dims).astype(np.float32)
    w.CopyFrom(numpy_helper.from_array(scaled, w.name))
    onnx.save(m, str(dest))
    return str(dest)


def test_cli_teacher_forcing_past_a_disagreement(decoders, tmp_path, capsys):
    plain = str(decoders[0])
    other = _perturbed(plain, tmp_path / "perturbed.onnx")
    out = tmp_path / "gen.json"
    argv = [
        "parity",
        plain,
        other,
        "--generate",
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--steps",
        str(STEPS),
    ]
    assert main([*argv, "-o", str(out)]) == 1  # B's top-1 differs from A's token at a step: FAILED
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows, first = doc["per_step"], doc["summary"]["first_disagreement"]
    assert "FAILED" in printed and f"first disagreement: step {first} " in printed
    assert first is not None and first < STEPS - 1  # steps after it test that B is fed A's tokens
    a_tokens = np.asarray(doc["tokens"])[0, len(PROMPT) :]
    np.testing.assert_array_equal(a_tokens, generate(plain, PROMPT, steps=STEPS).generated[0])
    # teacher forcing: B's top-1 at every step is its argmax on A's sequence, run whole without a cache
    full = _full_sequence_logits(other, np.asarray(doc["tokens"])[:, : len(PROMPT) + STEPS - 1])
    b_picks = full[0, len(PROMPT) - 1 :].argmax(-1)
    assert [r["token_b"][0] for r in rows] == b_picks.tolist()
    assert [r["agree"] for r in rows] == (b_picks == a_tokens).astype(int).tolist()
    assert doc["summary"]["agreement"] == float(np.mean(b_picks == a_tokens)) < 1.0
    # the layers at the first disagreement: the blocks are untouched, the lm head reads the scaled norm
    assert doc["layer_step"] == first
    f = doc["first_divergent"]
    assert f["layer"] is None and f["site"] == "/MatMul" and f["role"] == "lhs"
    assert all(r["divergence"] == 0.0 for r in doc["layers"] if r["layer"] is not None)
    assert main(["parity", plain, other, "--tokens", "4"]) == 2  # a prompt without --generate
    assert main(["parity", plain, other, "--generate", "--steps", "2"]) == 2  # --generate without a prompt
    err = capsys.readouterr().err
    assert "--tokens goes with --generate" in err and "--generate needs a prompt" in err


# --------------------------------------------------------------------------------------------
# calibration over a generation


def _exposed(model_path, names: list[str]) -> ort.InferenceSession:
    """The decoder with `names` as extra outputs, graph optimizations off (what calibrate runs)."""
    m = onnx.load(str(model_path))
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def test_calibrate_over_a_generation_covers_prefill_and_decode(decoders):
    plain, steps = decoders[0], 4
    got = calibrate_generation(plain, PROMPT, steps=steps)
    assert got.batches == steps and got.method == "minmax"
    produced = {o for n in onnx.load(str(plain), load_external_data=False).graph.node for o in n.output}
    names = [n for n in got.minmax if n in produced]
    assert len(names) > 100
    # numpy reference: the plain loop run by hand, every tapped tensor's min / max per step
    sess = _exposed(plain, names)
    pasts = [i.name for i in sess.get_inputs()[2:]]
    cache = {p: np.zeros((1, 3, 0, 64), np.float32) for p in pasts}
    ids, per_step = np.asarray([PROMPT]), []
    for _ in range(steps):
        total = ids.shape[1] + cache[pasts[0]].shape[2]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **cache}
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        per_step.append({n: (out[n].min(), out[n].max()) for n in names})
        cache = {p: out[p.replace("past_key_values", "present")] for p in pasts}
        ids = out["logits"][:, -1:].argmax(-1)
    prefill, decode = per_step[0], per_step[1:]
    for n in names:
        lo_p, hi_p = prefill[n]
        lo_d, hi_d = min(s[n][0] for s in decode), max(s[n][1] for s in decode)
        lo, hi = got.minmax[n]
        assert lo <= min(lo_p, lo_d) and hi >= max(hi_p, hi_d), n  # contains both phases ...
        assert (lo, hi) == (min(lo_p, lo_d), max(hi_p, hi_d)), n  # ... and is exactly their union
    # the decode steps widen some ranges beyond the prefill's: a prefill-only calibration misses them
    assert any(min(s[n][0] for s in decode) < prefill[n][0] or max(s[n][1] for s in decode) > prefill[n][1]
               for n in names)  # fmt: skip


def test_calibrate_cli_generate(decoders, tmp_path, capsys):
    out = tmp_path / "ranges.json"
    assert (
        main(["calibrate", str(decoders[0]), "--generate", "--tokens", "5", "--steps", "2", "-o", str(out)])
        == 0
    )
    assert "over 2 steps" in capsys.readouterr().out
    assert json.loads(out.read_text())
    assert main(["calibrate", str(decoders[0]), "--generate", "--tokens", "5", "--check", "fp16"]) == 2
