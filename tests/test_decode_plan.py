"""The fast decoding of a batch (`decode`: a plan per manifest, a row layout per set of shapes, the hot
sketches finalized for many taps at once) against the plain one (`rows_of(decode_taps(...))`, one tap
and one chunk at a time): the same chunks in the same order and the same values, bit for bit, on real
and zoo models, copied, in-graph, If, Loop and Scan taps, weights, NaN and Inf, every sketch option
that changes a finalize; and the Parquet part `encode_part` writes reads back as the same table."""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import decoder_path, real_model_path

from onnx_opscope import generate, zoo
from onnx_opscope import sketch as sk
from onnx_opscope.instrument import Rows, decode, decode_many, decode_taps, host_values, inject
from onnx_opscope.instrument.decode import _plan_of, rows_of
from onnx_opscope.run.session import RuntimeConfig, make_session
from onnx_opscope.run.table import SCHEMA, batch_table, batches_table, encode_part
from onnx_opscope.sketch import batched as sk_batched

CPU = sk.SketchOptions(copy_out_max=4096)  # what for_providers picks on the CPU provider
IN_GRAPH = sk.SketchOptions(copy_out_max=0)


def _with_nonfinite(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in feeds.items():
        v = v.copy()
        if v.dtype.kind == "f" and v.size > 4:
            v.flat[1], v.flat[3] = np.nan, np.inf
        out[k] = v
    return out


def _zoo(name: str, dims: dict | None = None, nonfinite: bool = False):
    model = zoo.build(name)
    feeds = [zoo.example_feeds(name, model=model, seed=i, dims=dims) for i in range(3)]
    return model, [_with_nonfinite(f) for f in feeds] if nonfinite else feeds


def _real(name: str, shapes: dict, scale: float = 1.0, values: dict | None = None):
    rng = np.random.default_rng(0)
    feeds = [
        {k: (rng.uniform(-1, 1, s) * scale).astype(np.float32) for k, s in shapes.items()} | (values or {})
        for _ in range(3)
    ]
    return onnx.load(real_model_path(name)), feeds


SILERO = {"sr": np.array(16000, np.int64)}
CASES = {
    "captcha_crnn copied, weights": (
        lambda: _real("captcha_crnn", {"image": (1, 3, 60, 160)}, 255.0),
        None,
        CPU,
    ),
    "silero_vad_v6 If branches": (
        lambda: _real("silero_vad_v6", {"input": (1, 512), "state": (2, 1, 128)}, 0.5, SILERO),
        None,
        CPU,
    ),
    "transformer_block all, NaN, copied": (lambda: _zoo("transformer_block", nonfinite=True), ["all"], CPU),
    "transformer_block default, NaN, copied": (
        lambda: _zoo("transformer_block", nonfinite=True),
        list(sk.DEFAULT_SKETCHES),
        CPU,
    ),
    "transformer_block all, NaN, in graph": (
        lambda: _zoo("transformer_block", nonfinite=True),
        ["all"],
        IN_GRAPH,
    ),
    "transformer_block hist range": (
        lambda: _zoo("transformer_block", nonfinite=True),
        None,
        sk.SketchOptions(copy_out_max=0, hist_bins=10, hist_range=(-0.5, 2.0)),
    ),
    "cnn exact hist, host counts": (
        lambda: _zoo("cnn"),
        None,
        sk.SketchOptions(copy_out_max=0, hist_mode="exact", exact_counts="host"),
    ),
    "moe route_load": (lambda: _zoo("moe"), ["all"], IN_GRAPH),
    "if_model": (lambda: _zoo("if_model"), ["all"], CPU),
    "loop stacked": (lambda: _zoo("loop"), ["all"], CPU),
    "scan stacked": (lambda: _zoo("scan", {"batch": 2, "seq": 7}), ["all"], CPU),
}


def _bits(table: pa.Table) -> dict[str, object]:
    """Each column as something equal only when every value is, NaN payloads of the values included."""
    out: dict[str, object] = {"schema": table.schema.remove_metadata()}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        out[name] = (
            col.to_pylist() if pa.types.is_string(col.type) else col.to_numpy(zero_copy_only=False).tobytes()
        )
        out[name + " nulls"] = col.null_count and col.is_null().to_pylist()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_fast_decode_equals_the_plain_one(case, monkeypatch):
    make, sketches, options = CASES[case]
    model, feeds = make()
    shapes = {k: list(v.shape) for k, v in feeds[0].items()}
    inst, manifest = inject(model, None, sketches, options, input_shapes=shapes)
    host = host_values(manifest, inst)
    sess = make_session(inst, RuntimeConfig(graph_opt="disable"))
    names = [o.name for o in sess.get_outputs()]
    runs = [dict(zip(names, sess.run(None, f))) for f in feeds]
    wants = [rows_of(manifest, decode_taps(manifest, outputs, host)) for outputs in runs]
    for step, (outputs, want) in enumerate(zip(runs, wants)):  # the first batch makes the layout
        got = decode(manifest, outputs, host)
        assert len(got) == len(want) > 0
        assert got.chunks() == want.chunks(), f"{case}: chunks differ at batch {step}"
        assert _bits(got.to_arrow()) == _bits(want.to_arrow()), f"{case}: values differ at batch {step}"
        table = batch_table(got, "r", step, "CPUExecutionProvider", "d")
        back = pq.read_table(pa.BufferReader(encode_part(table, "parquet", first=step == 0)))
        assert _bits(back) == _bits(batch_table(want, "r", step, "CPUExecutionProvider", "d"))
    # the batches decoded together (their small copied tensors in segmented passes of at most 300 values,
    # so that real batches are cut between passes): the same rows, and as one part the same table
    monkeypatch.setattr(sk_batched, "SEGMENT_VALUES", 300)
    together = decode_many(manifest, runs[::-1], host)[::-1]
    for step, (got, want) in enumerate(zip(together, wants, strict=True)):
        assert got.chunks() == want.chunks(), f"{case}: chunks differ at batch {step}, decoded together"
        assert _bits(got.to_arrow()) == _bits(want.to_arrow()), (
            f"{case}: values differ at batch {step}, together"
        )
    steps = [5, 6, 7]
    part = encode_part(
        batches_table(together, "r", steps, "CPUExecutionProvider", "d"), "parquet", first=False
    )
    each = [batch_table(want, "r", step, "CPUExecutionProvider", "d") for step, want in zip(steps, wants)]
    assert _bits(pq.read_table(pa.BufferReader(part))) == _bits(pa.concat_tables(each)), case
    kinds = {_kind(t) for t in manifest.taps}
    assert kinds >= KINDS.get(case, {"graph"}), f"{case} covers {kinds}"
    blocks = _plan_of(manifest).blocks.values()  # copied packs sketched whole, never cut apart
    assert any(block[2] is not None for block in blocks) == (case in WHOLE), case


WHOLE = {
    "captcha_crnn copied, weights",
    "transformer_block default, NaN, copied",
    "transformer_block all, NaN, copied",
    "silero_vad_v6 If branches",
    "if_model",
}
"""The cases whose copied tensors (of a pack, or of an `If` stream) go to the segmented pass as one block
(`_Plan._copied`): the others have none, or one too big for it."""


def _kind(tap) -> str:
    return "weight" if tap.constant else "copied" if tap.copied else "stacked" if tap.stacked else "graph"


KINDS = {  # what each case must hold, so that every kind of tap goes through both paths
    "captcha_crnn copied, weights": {"copied", "weight"},
    "silero_vad_v6 If branches": {"copied", "graph", "weight"},
    "transformer_block all, NaN, copied": {"copied", "weight"},
    "transformer_block default, NaN, copied": {"copied", "weight"},
    "if_model": {"copied", "weight"},
    "loop stacked": {"stacked"},
    "scan stacked": {"stacked"},
}


def test_parquet_part_reads_back_as_strings_everywhere():
    """The part carries no Arrow schema: pyarrow (and pandas, polars, DuckDB through it or on their own)
    read the labels as strings, not as the dictionary columns the writer was given."""
    model, feeds = _zoo("mlp")
    inst, manifest = inject(model, None, None, CPU)
    sess = make_session(inst, RuntimeConfig())
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds[0])))
    table = batch_table(decode(manifest, outputs, host_values(manifest, inst)), "r", 0, "CPU", "d")
    part = encode_part(table, "parquet", first=True)
    assert pq.read_schema(pa.BufferReader(part)).remove_metadata() == SCHEMA
    assert pq.read_table(pa.BufferReader(part)).equals(table)
    assert pq.ParquetFile(pa.BufferReader(part)).metadata.metadata is None  # no ARROW:schema


def test_parquet_part_is_written_as_measured_fastest(tmp_path):
    """The part's encoding (`run.table._write_parquet`): LZ4_RAW, a dictionary for labels and sizes
    only, min/max statistics for the step alone; DuckDB and polars read it as the same rows."""
    model, feeds = _zoo("mlp")
    inst, manifest = inject(model, None, None, CPU)
    sess = make_session(inst, RuntimeConfig())
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds[0])))
    table = batch_table(decode(manifest, outputs, host_values(manifest, inst)), "r", 3, "CPU", "d")
    path = tmp_path / "part.parquet"
    path.write_bytes(encode_part(table, "parquet", first=False))
    group = pq.ParquetFile(path).metadata.row_group(0)
    columns = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
    dictionary = {n for n, c in columns.items() if c.has_dictionary_page}
    assert dictionary == {
        "run_id",
        "provider",
        "dist",
        "site",
        "op_type",
        "role",
        "stat",
        "M",
        "K",
        "N",
        "numel",
    }
    assert {n for n, c in columns.items() if c.is_stats_set and c.statistics.has_min_max} == {"step"}
    assert (columns["step"].statistics.min, columns["step"].statistics.max) == (3, 3)
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    codecs = duckdb.sql(f"select distinct compression from parquet_metadata('{path}')").fetchall()
    assert codecs == [("LZ4_RAW",)]
    back = pa.table(duckdb.sql(f"select * from read_parquet('{path}')").arrow())  # a Table or a reader
    assert back.cast(SCHEMA).equals(table)
    assert pl.read_parquet(path).to_arrow().cast(SCHEMA).equals(table)


def test_rows_of_a_layout_take_added_chunks():
    """Rows made from a layout answer like rows made chunk by chunk, also after a chunk is added."""
    model, feeds = _zoo("mlp")
    inst, manifest = inject(model, None, None, CPU)
    sess = make_session(inst, RuntimeConfig())
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds[0])))
    host = host_values(manifest, inst)
    fast, plain = decode(manifest, outputs, host), rows_of(manifest, decode_taps(manifest, outputs, host))
    assert fast.to_pydict() == plain.to_pydict()
    extra = (("s", "MatMul", "out", "min", 4, 1, 2, 3), np.array([1.5, -2.0]))
    fast.add(*extra)
    plain.add(*extra)
    assert fast.to_pydict() == plain.to_pydict() and len(fast) == len(plain)
    assert fast.to_arrow().equals(plain.to_arrow())
    assert fast.chunks() == plain.chunks()
    assert len(Rows()) == 0 and Rows().to_arrow().num_rows == 0


def test_copied_taps_equal_their_numpy_references():
    """The segmented pass over every copied tensor of a batch (shared by both paths) against each
    tensor's `references`: counts and picked values exactly, sums to rounding."""
    model, feeds = _real("captcha_crnn", {"image": (1, 3, 60, 160)}, 255.0)
    inst, manifest = inject(model, None, None, CPU, input_shapes={"image": [1, 3, 60, 160]})
    copied = [t for t in manifest.taps if t.copied]
    assert len(copied) > 100
    exposed = onnx.ModelProto()  # the copied tensors as outputs of their own too: the references' inputs
    exposed.CopyFrom(inst)
    exposed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(t.outputs["tensor"]) for t in copied)
    sess = make_session(exposed, RuntimeConfig(graph_opt="disable"))
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds[0])))
    own = {t.outputs["tensor"] for t in copied}  # decoded from the run's outputs as they come, packed
    decoded = decode_taps(
        manifest, {k: v for k, v in outputs.items() if k not in own}, host_values(manifest, inst)
    )
    opts = manifest.sketch_options()
    for t in copied:
        want = sk.references(t.sketches, np.asarray(outputs[t.outputs["tensor"]]), t.info(), opts)
        got = decoded[t.id][0]
        for name in t.sketches:
            if name in ("mean", "sumsq", "l1"):
                np.testing.assert_allclose(got[name], want[name], rtol=1e-12, err_msg=f"{t.tensor} {name}")
            else:
                assert np.array_equal(got[name], want[name], equal_nan=True), f"{t.tensor} {name}"


def test_a_generation_whose_shapes_change_every_step(monkeypatch, tmp_path):
    """generate's decode steps: the attention taps grow by one position a step, so each step makes a new
    layout in which only their sites' chunks are made anew (the other sites' are kept): the same rows."""
    loop = importlib.import_module("onnx_opscope.run.generate")
    real, attn, kinds = loop.decode_many, [], set()

    def checked(manifest, batches, host=None):
        many = real(manifest, batches, host)
        for outputs, got in zip(batches, many, strict=True):
            want = rows_of(manifest, decode_taps(manifest, outputs, host))
            assert got.chunks() == want.chunks()
            assert _bits(got.to_arrow()) == _bits(want.to_arrow())
            attn.append(max(c[4] for c in got.chunks() if c[1] == "Softmax"))
        kinds.update(_kind(t) for t in manifest.taps)
        return many

    monkeypatch.setattr(loop, "decode_many", checked)
    r = generate(decoder_path(), tokens=18, steps=6, out=tmp_path / "gen.parquet", parity=False)
    assert r.steps == 6 and len(attn) == 6
    # 9 heads: the prefill's 18 x 18 scores, then one row over the 19, 20, ... positions of each decode step
    assert attn == [9 * 18 * 18] + [9 * (19 + k) for k in range(5)]
    assert kinds >= {"copied", "graph", "weight"}
