"""The int4 weight-only decoder (scripts/make_decoder_int4.py) and MatMulNBits as a site and a probed weight.

SmolLM2-135M's first 2 layers with every projection a MatMulNBits on the GGUF's own Q4_1 blocks, held
against the plain fp32 export they were dequantized from: the same weights (to float32 rounding),
the same greedy tokens, logits within 1e-5 relative (measured 4e-7). The instrumented int4 loop is
held against the plain int4 loop; the weight dequantization against onnxruntime's own kernel.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import DECODER_PROMPT, decoder_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope import find_sites, generate, probe_weights, read_table
from onnx_opscope.cli import main
from onnx_opscope.weights.matrix import find_weights
from onnx_opscope.weights.nbits import find_weights_packed, nbits_matrix
from onnx_opscope.weights.probes import probe

PROMPT = DECODER_PROMPT
STEPS = 6
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="session")
def decoders():
    """(plain, int4) paths of the 2-layer decoder, built once and cached beside the real models."""
    return decoder_path(), decoder_path("int4")


@pytest.fixture(scope="session")
def protos(decoders):
    return tuple(onnx.load(str(p)) for p in decoders)


@pytest.fixture(scope="session")
def int4_plain_run(decoders):
    return generate(decoders[1], PROMPT, steps=STEPS, keep_logits=True)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _projections(plain: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """The plain export's projection MatMuls (those reading a weight, the tied lm head aside), by name."""
    inits = {t.name for t in plain.graph.initializer}
    return {
        n.name: n for n in plain.graph.node if n.op_type == "MatMul" and n.input[1] in inits - {"embed_t"}
    }


def _reference_matrix(node: onnx.NodeProto, inits: dict[str, np.ndarray]) -> np.ndarray:
    """W [N, K] of a 4-bit MatMulNBits with float zero points, unpacked code by code: byte b of a block
    holds codes 2b (low nibble) and 2b + 1 (high)."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    packed, scale, zp = (inits[i] for i in node.input[1:4])
    n, blocks, blob = packed.shape
    codes = np.empty((n, blocks, 2 * blob), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 15, packed >> 4
    w = (codes.astype(np.float32) - zp.reshape(n, blocks, 1)) * scale.reshape(n, blocks, 1)
    return w.reshape(n, -1)[:, : a["K"]]


def test_every_projection_became_matmulnbits(protos):
    plain, int4 = protos
    nbits = {n.name: n for n in int4.graph.node if n.op_type == "MatMulNBits"}
    expected = _projections(plain)
    assert sorted(expected) == sorted(nbits) and len(nbits) == 2 * len(PROJECTIONS)
    left = {t.name for t in int4.graph.initializer}
    for name, node in nbits.items():
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        assert node.domain == "com.microsoft" and (a["bits"], a["block_size"]) == (4, 32)
        assert len(node.input) == 4 and node.input[3]  # with zero points
        assert node.input[0] == expected[name].input[0] and list(node.output) == list(expected[name].output)
        assert expected[name].input[1] not in left  # the fp32 weight is gone
    assert [n.op_type for n in int4.graph.node if n.op_type == "MatMul" and n.input[1] == "embed_t"] == [
        "MatMul"
    ]


def test_packed_weights_are_the_fp32_weights(protos):
    """The GGUF blocks dequantize to the plain export's fp32 weights (to float32 rounding of -m/d)."""
    plain, int4 = protos
    fp32 = {t.name: numpy_helper.to_array(t) for t in plain.graph.initializer}
    inits = {t.name: numpy_helper.to_array(t) for t in int4.graph.initializer}
    worst = 0.0
    for name, ref in _projections(plain).items():
        node = next(n for n in int4.graph.node if n.name == name)
        w = fp32[ref.input[1]].T  # [N, K]
        mine = _reference_matrix(node, inits)
        assert mine.shape == w.shape
        worst = max(worst, float(np.abs(mine - w).max()))
    assert worst < 1e-6  # measured 2.4e-7 on weights up to ~2


def test_int4_generates_the_plain_decoders_tokens(decoders, int4_plain_run):
    fp32 = generate(decoders[0], PROMPT, steps=STEPS, keep_logits=True)
    assert int4_plain_run.tokens.tolist() == fp32.tokens.tolist()  # all 6 greedy tokens
    assert _rel(int4_plain_run.logits, fp32.logits) < 1e-5  # measured 4e-7


def test_instrumented_int4_keeps_outputs_and_taps_matmulnbits(decoders, protos, int4_plain_run, tmp_path):
    plain, int4 = protos
    rec = generate(decoders[1], PROMPT, steps=STEPS, out=tmp_path / "gen.parquet", keep_logits=True)
    assert rec.tokens.tolist() == int4_plain_run.tokens.tolist()
    assert _rel(rec.logits, int4_plain_run.logits) < 1e-4
    assert (
        rec.parity is not None and rec.parity.ok and rec.parity.max_rel < 1e-4
    )  # logits + presents, prefill
    table = read_table(tmp_path / "gen.parquet").to_pandas()
    nb = table[table.op_type == "MatMulNBits"]
    fp32 = {t.name: list(t.dims) for t in plain.graph.initializer}
    projections = _projections(plain)
    assert sorted(nb.site.unique()) == sorted(projections)
    assert sorted(nb.role.unique()) == ["lhs", "out"]  # the packed weight is not tapped
    dims = nb.groupby(["site", "step"])[["M", "K", "N"]].first()
    for (site, step), (m, k, n) in dims.iterrows():
        assert [k, n] == fp32[projections[site].input[1]]  # the fp32 weight was [K, N]
        assert m == (len(PROMPT) if step == 0 else 1)
    assert sorted(dims.index.get_level_values("step").unique()) == list(range(STEPS))


def test_sites_tap_the_activation_and_output(protos):
    plain, int4 = protos
    expected = _projections(plain)
    sites = [s for s in find_sites(int4) if s.op_type == "MatMulNBits"]
    assert len(sites) == len(expected)
    for s in sites:
        assert s.kind == "gemm" and [t.role for t in s.taps] == ["lhs", "out"]
        assert (
            s.role("lhs").tensor == expected[s.id].input[0]
            and s.role("out").tensor == expected[s.id].output[0]
        )


def test_weight_probes_of_packed_weights_are_the_dequantized_matrices(decoders, protos):
    plain, int4 = protos
    inits = {t.name: numpy_helper.to_array(t) for t in int4.graph.initializer}
    nodes = {n.input[1]: n for n in int4.graph.node if n.op_type == "MatMulNBits"}
    found = {v.name: (v, load) for v, load in find_weights_packed(decoders[1]) if v.op == "MatMulNBits"}
    assert sorted(found) == sorted(nodes)
    assert not any(v.op == "MatMulNBits" for v, _ in find_weights(decoders[1]))  # the planner's view
    for name in sorted(found)[:2]:  # k and o of layer 0 (the probes cost ~0.3 s a matrix)
        view, load = found[name]
        ref = _reference_matrix(nodes[name], inits)
        assert (view.rows, view.cols, view.shape, view.node) == (*ref.shape, ref.shape, nodes[name].name)
        w = load()
        assert np.array_equal(w, ref)
        assert probe(view, w) == probe(view, ref)


def _nbits_model(path, bits: int, zero_points: str) -> tuple[str, int, int]:
    """One MatMulNBits on random codes, K = 80 (not whole blocks of 16), uint8 or no zero points."""
    k, n, block = 80, 24, 16
    blocks = -(-k // block)
    rng = np.random.default_rng(bits)
    inits = [
        numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8), "w"),
        numpy_helper.from_array((rng.random(n * blocks) + 0.1).astype(np.float32), "w_scale"),
    ]
    inputs = ["a", "w", "w_scale"]
    if zero_points == "uint8":
        zp = rng.integers(0, 256, n * -(-blocks * bits // 8), dtype=np.uint8)
        inits.append(numpy_helper.from_array(zp, "w_zp"))
        inputs.append("w_zp")
    node = helper.make_node("MatMulNBits", inputs, ["y"], "nb", domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block)  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return str(path), k, n


@pytest.mark.parametrize(("bits", "zero_points"), [(4, "uint8"), (4, "none"), (2, "uint8"), (8, "none")])
def test_dequantization_equals_onnxruntimes_kernel(tmp_path, bits, zero_points):
    """onnxruntime's MatMulNBits on an identity input returns Wᵀ: the reference for the host dequantization."""
    path, k, n = _nbits_model(tmp_path / "nb.onnx", bits, zero_points)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    expected = session.run(None, {"a": np.eye(k, dtype=np.float32)})[0].T
    model = onnx.load(path)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    w = nbits_matrix(arrays["w"], arrays["w_scale"], arrays.get("w_zp"), k=k, n=n, bits=bits, block_size=16)
    assert np.array_equal(w, expected)
    (p,) = probe_weights(path)
    assert (p.name, p.op, p.shape, p.rows, p.cols) == ("w", "MatMulNBits", (n, k), n, k)
    assert p == probe(p.view, expected)


def test_weights_command_lists_the_packed_weight(tmp_path, capsys):
    path, k, n = _nbits_model(tmp_path / "nb.onnx", 4, "uint8")
    assert main(["weights", path]) == 0
    out = capsys.readouterr().out
    assert "MatMulNBit" in out and f"{n}x{k}" in out  # the op column holds 10 characters
