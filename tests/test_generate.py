"""`generate` on a real decoder: SmolLM2-135M's first 2 layers, exported with a KV cache by scripts/make_decoder.py.

The loop's logits are held against onnxruntime running the whole sequence without a cache (numpy),
the instrumented loop against the plain one, and the table's phase / position columns against
the steps that ran.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import DECODER_PROMPT, ROOT, decoder_path
from onnx import TensorProto, helper

from onnx_opscope import OpscopeError, generate, read_table
from onnx_opscope.cli import main
from onnx_opscope.run import cache_layout
from onnx_opscope.run.feeds import InputSpec

PROMPT = DECODER_PROMPT
STEPS = 6


@pytest.fixture(scope="session")
def decoder():
    """The 2-layer decoder, built once and cached beside the real models."""
    return decoder_path()


@pytest.fixture(scope="session")
def plain(decoder):
    return generate(decoder, PROMPT, steps=STEPS, keep_logits=True)


def _full_sequence_logits(model, ids: np.ndarray) -> np.ndarray:
    """Logits of every position of `ids`, the whole sequence in one run and an empty cache: no loop."""
    s = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    empty = {
        i.name: np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32) for i in s.get_inputs()[2:]
    }
    return s.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids), **empty})[0]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_cache_loop_equals_the_full_sequence(decoder, plain):
    assert plain.tokens.shape == (1, len(PROMPT) + STEPS) and plain.steps == STEPS
    assert plain.tokens[0, : len(PROMPT)].tolist() == PROMPT
    ref = _full_sequence_logits(decoder, plain.tokens[:, :-1])  # the last token is never fed
    expected = ref[0, len(PROMPT) - 1 :]  # the next-token logits of the prefill, then of each decode step
    assert plain.logits.shape == (STEPS, 1, expected.shape[-1])
    assert _rel(plain.logits[:, 0], expected) < 1e-4
    assert plain.generated[0].tolist() == expected.argmax(-1).tolist()  # greedy


def test_batched_rows_are_independent(decoder, plain):
    other = PROMPT[::-1]
    both = generate(decoder, [PROMPT, other], steps=3)
    alone = generate(decoder, other, steps=3)
    assert both.tokens[0].tolist() == plain.tokens[0, : len(PROMPT) + 3].tolist()
    assert both.tokens[1].tolist() == alone.tokens[0].tolist()


def test_sampling_is_seeded(decoder, plain):
    a = generate(decoder, PROMPT, steps=4, sample=True, seed=5)
    b = generate(decoder, PROMPT, steps=4, sample=True, seed=5)
    cold = generate(decoder, PROMPT, steps=4, sample=True, temperature=1e-6, seed=1)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert cold.generated.tolist() == plain.generated[:, :4].tolist()  # T -> 0 is greedy


def test_instrumented_loop_keeps_outputs_and_records_phases(decoder, plain, tmp_path):
    out = tmp_path / "gen.parquet"
    rec = generate(decoder, PROMPT, steps=STEPS, out=out, keep_logits=True)
    assert rec.tokens.tolist() == plain.tokens.tolist()
    assert _rel(rec.logits, plain.logits) < 1e-4
    assert rec.parity is not None and rec.parity.ok
    table = read_table(out).to_pandas()
    assert len(table) == rec.rows > 0
    steps = table.groupby("step").agg(phase=("phase", "unique"), position=("position", "unique"))
    assert steps.index.tolist() == list(range(STEPS))
    assert [p.tolist() for p in steps.phase] == [["prefill"]] + [["decode"]] * (STEPS - 1)
    assert [p.tolist() for p in steps.position] == [[0]] + [[len(PROMPT) + k] for k in range(STEPS - 1)]
    # every site recorded at every step; the attention probabilities' last dim grows by one a step
    per_step = table.groupby("step").site.nunique()
    assert per_step.nunique() == 1 and per_step.iloc[0] == len(rec.manifest.sites)
    numel = table[table.op_type == "Softmax"].groupby("step").numel.first()
    heads = 9
    assert numel.tolist() == [heads * len(PROMPT) ** 2] + [
        heads * (len(PROMPT) + k + 1) for k in range(STEPS - 1)
    ]
    assert (tmp_path / "gen.run.json").is_file() and (tmp_path / "gen.sites.csv").is_file()


def test_the_cache_s_own_views_are_left_to_the_kv_taps(decoder, tmp_path):
    """The attention MatMuls' K and V operands are the cache rearranged (Concat with the past, Transpose,
    the grouped-query Expand): generate keeps only their shape (M, K, N) and leaves their values to the kv
    taps of each step's new entries, unless the caller lists the sites."""
    from onnx_opscope.graph import load_model
    from onnx_opscope.sites import find_sites
    from onnx_opscope.sites.kv import cache_views

    model = load_model(decoder)
    pasts = [i.name for i in model.graph.input if i.name.startswith("past_key_values")]
    views = cache_views(model, pasts)
    producers = {o: n for n in model.graph.node for o in n.output}
    assert views and all(producers[v].op_type in ("Concat", "Transpose", "Reshape", "Expand", "Unsqueeze")
                         for v in views)  # fmt: skip
    operands = {
        t.tensor for s in find_sites(model) if s.op_type == "MatMul" for t in s.taps if t.role == "rhs"
    }
    assert len(operands & views) == 4  # K^T and V of both layers' attention
    rec = generate(decoder, PROMPT, steps=3, out=tmp_path / "gen.parquet")
    tapped = {t.tensor for t in rec.manifest.taps if t.sketches}
    assert not tapped & views and any(s.kind == "kv" for s in rec.manifest.sites)
    table = read_table(tmp_path / "gen.parquet").to_pandas()
    qk = table[table.site.isin([s.id for s in rec.manifest.sites if s.op_type == "MatMul"])]
    assert qk.N.notna().all()  # the dims of a site whose operand is a view are still there
    listed = generate(decoder, PROMPT, steps=2, out=tmp_path / "all.parquet", sites=find_sites(model))
    assert {t.tensor for t in listed.manifest.taps if t.sketches} >= operands & views


def _fake_decoder(tmp_path, present: str) -> str:
    """A one-node model with input_ids and one past, whose only output is `present`."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    past = helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["b", 2, "p", 4])
    out = helper.make_tensor_value_info(present, TensorProto.FLOAT, ["b", 2, "p", 4])
    graph = helper.make_graph([helper.make_node("Identity", ["past_key_values.0.key"], [present])], "g", [ids, past],
                              [out])  # fmt: skip
    path = tmp_path / "fake.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_unrecognised_cache_layout_is_one_line(tmp_path):
    with pytest.raises(OpscopeError) as err:
        generate(_fake_decoder(tmp_path, "cache_out"), tokens=2, steps=2)
    message = str(err.value)
    assert "\n" not in message
    assert "'past_key_values.0.key' has no output 'present.0.key'" in message and "input_ids" in message


def test_cache_layouts_of_the_common_exporters():
    def spec(name, dims):
        return InputSpec(name, np.dtype(np.float32 if "past" in name else np.int64), dims)

    inputs = [spec("input_ids", ["b", "s"]), spec("position_ids", ["b", "s"])]
    inputs += [spec(f"past_{kv}_{i}", ["b", 4, "past", 8]) for i in range(2) for kv in ("key", "value")]
    layout = cache_layout(
        inputs, ["logits", *(f"present_{kv}_{i}" for i in range(2) for kv in ("key", "value"))]
    )
    assert layout.cache[0] == ("past_key_0", "present_key_0") and layout.attention_mask is None
    assert layout.empty_cache(3)["past_value_1"].shape == (3, 4, 0, 8)
    fed = layout.feeds(np.array([[7]]), total=5)
    assert fed["position_ids"].tolist() == [[4]]
    with pytest.raises(OpscopeError, match="one symbolic sequence axis"):
        cache_layout(
            [inputs[0], spec("past_key_values.0.key", ["b", "h", "p", 8])], ["logits", "present.0.key"]
        )


def test_prompt_longer_than_the_model_allows(decoder):
    with pytest.raises(OpscopeError, match="the model has 8192"):
        generate(decoder, tokens=8, steps=8190)


def test_cli(decoder, tmp_path, capsys):
    out = tmp_path / "cli.parquet"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, PROMPT)) + "\n")
    assert main(["generate", str(decoder), "--prompt-file", str(prompt), "--steps", "4", "--every", "2",
                 "--op", "Softmax", "-o", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "parity ok" in printed and "generated:" in printed
    table = read_table(out).to_pandas()
    assert set(table.op_type) == {"Softmax"}
    # --every 2: the prefill, then decode steps 1 and 3 (positions P and P + 2)
    assert sorted(set(zip(table.step, table.phase, table.position))) == [
        (0, "prefill", 0), (1, "decode", len(PROMPT)), (3, "decode", len(PROMPT) + 2)]  # fmt: skip
    assert main(["generate", str(decoder), "--tokens", "4", "--steps", "2", "--plain"]) == 0
    assert main(["generate", str(decoder), "--prompt-ids", "1,x", "--steps", "2", "--plain"]) == 2
    assert main(["generate", str(ROOT / "models" / "mlp.onnx"), "--tokens", "4", "--plain"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 2 and "not a decoder with a KV cache" in err
