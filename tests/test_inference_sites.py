"""Inference taps: attention (Softmax and fused-op shadows), MoE routing load, residual sums, findings.

Every tap is held against a numpy reference computed on the same tensors, read back from the
original model with those tensors made graph outputs.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pyarrow as pa
import pytest
from conftest import real_model_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope import sketch as sk
from onnx_opscope import zoo
from onnx_opscope.errors import OpscopeError
from onnx_opscope.findings import MineConfig, mine
from onnx_opscope.graph.build import Builder
from onnx_opscope.graph.index import Names
from onnx_opscope.graph.io import load_model
from onnx_opscope.instrument import decode, decode_tap, host_values, inject, unpacked
from onnx_opscope.run.session import RuntimeConfig, make_session
from onnx_opscope.sites import SHADOW_SUFFIX, Selection, find_sites, select
from onnx_opscope.sketch.context import TapContext

CFG = RuntimeConfig(graph_opt="disable")


def run_instrumented(model, feeds, sel=None, sketches=None, options=None):
    inst, manifest = inject(model, sel, sketches, options)
    sess = make_session(inst, CFG)
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return manifest, unpacked(manifest, outs)


def intermediates(model: onnx.ModelProto, names: list[str], feeds) -> dict[str, np.ndarray]:
    """The values of tensors `names` of `model` on `feeds` (made graph outputs of a copy)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    m.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    sess = make_session(m, CFG)
    return dict(zip(names, sess.run(names, feeds)))


def tap_values(manifest, outs, site_id: str, role: str) -> tuple[dict[str, np.ndarray], str, sk.TapInfo]:
    site = next(s for s in manifest.sites if s.id == site_id)
    tap = next(t for t in manifest.taps if t.id == site.roles[role])
    values, _ = decode_tap(tap, outs, manifest.sketch_options())
    return values, tap.tensor, tap.info()


def assert_matches(name: str, got: np.ndarray, x: np.ndarray, info: sk.TapInfo, opts=None) -> None:
    opts = opts or sk.SketchOptions()
    ref = sk.reference(name, x, info, opts)
    rtol, atol = sk.REGISTRY[name].tol
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * scale, err_msg=name)


# --------------------------------------------------------------------------------------------
# sites


def test_tiny_lm_sites_by_kind():
    sites = find_sites(zoo.build("transformer_tiny_lm"))
    kinds = {s.id: s.kind for s in sites if s.kind != "gemm"}
    assert kinds == {
        "block1/attn/softmax": "attn",
        "block2/attn/softmax": "attn",
        "block1/attn_residual": "residual",
        "block1/mlp_residual": "residual",
        "block2/attn_residual": "residual",
        "block2/mlp_residual": "residual",
    }
    res = next(s for s in sites if s.id == "block2/mlp_residual")
    assert [t.role for t in res.taps] == ["residual_a", "residual_b"]
    assert res.attrs["skip"] == 0  # input 0 is the residual stream
    orders = [s.order for s in sites]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    # score-bias Adds broadcast a mask: not residuals; GEMM sites keep their node-name ids
    assert not any("score_bias" in s.id for s in sites)
    assert "block1/attn/qk_matmul" in {s.id for s in sites}


def test_moe_and_contrib_sites():
    route = [s for s in find_sites(zoo.build("moe")) if s.kind == "route"]
    assert [(s.id, s.taps[0].role, s.taps[0].bins) for s in route] == [("router/topk", "route", 8)]
    router = next(s for s in find_sites(zoo.build("moe")) if s.op_type == "Softmax")
    assert router.kind == "attn" and router.taps[0].role == "probs"  # not attention: no probs @ V
    attn = [s for s in find_sites(zoo.build("attention_contrib")) if s.kind == "attn"]
    assert [s.id for s in attn] == ["attn/attention"]
    assert attn[0].taps[0].tensor.endswith(SHADOW_SUFFIX)


def test_selection_by_kind_and_op():
    sites = find_sites(zoo.build("transformer_tiny_lm"))
    assert {s.kind for s in select(sites, Selection(kinds=("attn",)))} == {"attn"}
    assert {s.op_type for s in select(sites, Selection(op_types=("softmax",)))} == {"Softmax"}
    assert len(select(sites, Selection(kinds=("residual", "attn")))) == 6
    with pytest.raises(OpscopeError, match="not a site kind.*did you mean 'route'"):
        select(sites, Selection(kinds=("rout",)))
    with pytest.raises(OpscopeError, match="matches no site"):
        select(sites, Selection(kinds=("route",)))


# --------------------------------------------------------------------------------------------
# sketch values against numpy


def test_tiny_lm_attention_and_residual_taps_match_numpy():
    model = zoo.build("transformer_tiny_lm")
    feeds = zoo.example_feeds("transformer_tiny_lm", dims={"batch": 2, "seq": 12})
    manifest, outs = run_instrumented(model, feeds, Selection(kinds=("attn", "residual")))
    want = {}
    for s in manifest.sites:
        for role in s.roles:
            want[(s.id, role)] = tap_values(manifest, outs, s.id, role)
    x = intermediates(model, sorted({t for _, t, _ in want.values()}), feeds)
    for (_site, role), (values, tensor, info) in want.items():
        if role == "attn":
            assert set(values) >= {"attn_qmax", "attn_krecv"}
            assert values["attn_qmax"].shape == (12,) and values["attn_krecv"].shape == (12,)
        for name in ("attn_qmax", "attn_krecv", "sumsq") if role == "attn" else ("sumsq",):
            if name in values:
                assert_matches(name, values[name], x[tensor], info)
    # key 0 is a sink: it takes most of the mass in both blocks
    for site in ("block1/attn/softmax", "block2/attn/softmax"):
        krecv = want[(site, "attn")][0]["attn_krecv"]
        assert krecv.argmax() == 0 and krecv[0] / krecv.sum() > 0.5
        assert math.isclose(krecv.sum(), 2 * 2 * 12, rel_tol=1e-5)  # batch x heads x queries rows of 1


def test_moe_route_load_matches_bincount():
    model = zoo.build("moe")
    feeds = zoo.example_feeds("moe", dims={"tokens": 64})
    manifest, outs = run_instrumented(model, feeds, Selection(kinds=("route",)))
    values, tensor, info = tap_values(manifest, outs, "router/topk", "route")
    ids = intermediates(model, [tensor], feeds)[tensor]
    np.testing.assert_array_equal(values["route_load"], np.bincount(ids.ravel(), minlength=8))
    assert_matches("route_load", values["route_load"], ids, info)
    load = values["route_load"]
    assert load.sum() == 64 * 2 and load[7] == 0 and set(np.argsort(load)[-2:]) == {0, 1}


def test_route_load_without_static_experts_uses_max_id():
    b = Builder(17, Names(), "t_")
    info, opts = sk.TapInfo(None, TensorProto.FLOAT), sk.SketchOptions()
    out = sk.REGISTRY["route_load"].build(TapContext.for_tensor(b, "ids_f", info, opts))["route_load"]
    g = helper.make_graph(
        [helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT), *b.nodes],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, 2])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [None])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    ids = np.array([[0, 3], [3, 5], [1, 3]], np.int64)
    got = make_session(m, CFG).run(None, {"ids": ids})[0]
    np.testing.assert_array_equal(got, np.bincount(ids.ravel()))
    np.testing.assert_array_equal(got, sk.reference("route_load", ids, sk.TapInfo(None), opts))


def test_ppocrv4_rec_softmax_attention_matches_numpy():
    path = real_model_path("ppocrv4_rec")
    model = load_model(path)
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 48, 320)).astype(np.float32)
    opts = sk.SketchOptions(max_rows=64)
    manifest, outs = run_instrumented(path, {"x": x}, Selection(op_types=("Softmax",)), options=opts)
    assert [s.id for s in manifest.sites] == ["p2o.Softmax.0", "p2o.Softmax.1", "p2o.Softmax.2"]
    assert [next(iter(s.roles)) for s in manifest.sites] == ["attn", "attn", "probs"]  # the CTC head
    got = {s.id: tap_values(manifest, outs, s.id, next(iter(s.roles))) for s in manifest.sites}
    ref = intermediates(model, [t for _, t, _ in got.values()], {"x": x})
    for values, tensor, info in got.values():
        assert_matches("attn_qmax", values["attn_qmax"], ref[tensor], info, opts)
        assert_matches("attn_krecv", values["attn_krecv"], ref[tensor], info, opts)
        assert values["attn_krecv"].size <= 64


# --------------------------------------------------------------------------------------------
# fused attention: shadow softmax from the op's own inputs, the op untouched


def _np_softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _contrib_probs(x, w, bias, heads, mask=None, causal=False, fill=-10000.0):
    qkv = x @ w + bias
    h = w.shape[1] // 3
    b, s, _ = x.shape
    q = qkv[..., :h].reshape(b, s, heads, -1).transpose(0, 2, 1, 3)
    k = qkv[..., h : 2 * h].reshape(b, s, heads, -1).transpose(0, 2, 1, 3)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + np.where(mask > 0, 0.0, fill)[:, None, None, :]
    if causal:
        scores = scores + np.where(np.triu(np.ones((s, s)), 1) > 0, fill, 0.0)
    return _np_softmax(scores)


def _check_shadow(model, feeds, probs):
    """Shadow taps equal numpy on `probs`, and the fused op's outputs are unchanged by the taps."""
    manifest, outs = run_instrumented(model, feeds, Selection(kinds=("attn",)))
    site = next(s for s in manifest.sites if s.attrs.get("shadow_of"))
    values, _, info = tap_values(manifest, outs, site.id, "attn")
    assert_matches("attn_qmax", values["attn_qmax"], probs, info)
    assert_matches("attn_krecv", values["attn_krecv"], probs, info)
    plain = make_session(model, CFG)
    for o, ref in zip(plain.get_outputs(), plain.run(None, feeds)):
        np.testing.assert_array_equal(outs[o.name], ref)


def test_contrib_attention_shadow_matches_numpy():
    model = zoo.build("attention_contrib")
    feeds = zoo.example_feeds("attention_contrib", dims={"batch": 2, "seq": 7})
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    probs = _contrib_probs(feeds["x"].astype(np.float64), w["attn.weight"], w["attn.bias"], 2)
    _check_shadow(model, feeds, probs)


def _attention_model(op: str, domain: str, inputs, attrs, opset: int):
    nodes = [helper.make_node(op, [i for i, _, _ in inputs], ["y"], "fused", domain=domain, **attrs)]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs if t is not None],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def test_contrib_attention_shadow_with_raw_mask_and_causal():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    w = (rng.standard_normal((8, 24)) / 3).astype(np.float32)
    bias = (rng.standard_normal(24) / 10).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    F, I32 = TensorProto.FLOAT, TensorProto.INT32
    for causal in (0, 1):
        model = _attention_model(
            "Attention",
            "com.microsoft",
            [("x", F, [2, 5, 8]), ("w", F, [8, 24]), ("b", F, [24]), ("mask", I32, [2, 5])],
            {"num_heads": 2, "unidirectional": causal},
            17,
        )
        model.graph.input.pop(1)
        model.graph.input.pop(1)
        model.graph.initializer.extend([numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")])
        probs = _contrib_probs(x.astype(np.float64), w, bias, 2, mask, bool(causal))
        _check_shadow(model, {"x": x, "mask": mask}, probs)


def test_multi_head_attention_shadow():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 6, 8)).astype(np.float32)
    v = rng.standard_normal((1, 6, 8)).astype(np.float32)
    F = TensorProto.FLOAT
    model = _attention_model(
        "MultiHeadAttention",
        "com.microsoft",
        [("q", F, [1, 4, 8]), ("k", F, [1, 6, 8]), ("v", F, [1, 6, 8])],
        {"num_heads": 2},
        17,
    )
    qh = q.reshape(1, 4, 2, 4).transpose(0, 2, 1, 3).astype(np.float64)
    kh = k.reshape(1, 6, 2, 4).transpose(0, 2, 1, 3).astype(np.float64)
    probs = _np_softmax(qh @ kh.transpose(0, 1, 3, 2) / 2.0)
    _check_shadow(model, {"q": q, "k": k, "v": v}, probs)


def test_onnx_attention_shadow_grouped_causal():
    """Opset-23 Attention, 3-D inputs, 4 query heads over 2 kv heads, is_causal."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 5, 16)).astype(np.float32)
    k = rng.standard_normal((2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((2, 5, 8)).astype(np.float32)
    F = TensorProto.FLOAT
    model = _attention_model(
        "Attention",
        "",
        [("q", F, [2, 5, 16]), ("k", F, [2, 5, 8]), ("v", F, [2, 5, 8])],
        {"q_num_heads": 4, "kv_num_heads": 2, "is_causal": 1},
        23,
    )
    qh = q.reshape(2, 5, 4, 4).transpose(0, 2, 1, 3).astype(np.float64)
    kh = np.repeat(k.reshape(2, 5, 2, 4).transpose(0, 2, 1, 3), 2, axis=1).astype(np.float64)
    scores = qh @ kh.transpose(0, 1, 3, 2) / 2.0 + np.where(np.triu(np.ones((5, 5)), 1) > 0, -np.inf, 0.0)
    _check_shadow(model, {"q": q, "k": k, "v": v}, _np_softmax(scores))


def test_group_query_attention_shadow():
    """com.microsoft GroupQueryAttention, 4 query heads over 2 kv heads, always causal, no past."""
    b, s, h, kv, d = 2, 5, 4, 2, 8
    rng = np.random.default_rng(4)
    feeds = {
        "q": rng.standard_normal((b, s, h * d)).astype(np.float32),
        "k": rng.standard_normal((b, s, kv * d)).astype(np.float32),
        "v": rng.standard_normal((b, s, kv * d)).astype(np.float32),
        "seqlens_k": np.full(b, s - 1, np.int32),
        "total": np.array(s, np.int32),
    }
    F, I32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [("q", F, [b, s, h * d]), ("k", F, [b, s, kv * d]), ("v", F, [b, s, kv * d]), ("", None, None),
              ("", None, None), ("seqlens_k", I32, [b]), ("total", I32, [])]  # fmt: skip
    model = _attention_model(
        "GroupQueryAttention", "com.microsoft", inputs, {"num_heads": h, "kv_num_heads": kv}, 17
    )
    qh = feeds["q"].reshape(b, s, h, d).transpose(0, 2, 1, 3).astype(np.float64)
    kh = np.repeat(feeds["k"].reshape(b, s, kv, d).transpose(0, 2, 1, 3), h // kv, axis=1).astype(np.float64)
    causal = np.where(np.triu(np.ones((s, s)), 1) > 0, -np.inf, 0.0)
    _check_shadow(model, feeds, _np_softmax(qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(d) + causal))


# --------------------------------------------------------------------------------------------
# findings


def _table(model_name: str, dims: dict, steps: int = 2):
    model = zoo.build(model_name)
    inst, manifest = inject(model)  # every site: attn stats also land on the av MatMul lhs role
    sess = make_session(inst, CFG)
    host = host_values(manifest, model)
    cols: dict[str, list] = {}
    for step in range(steps):
        feeds = zoo.example_feeds(model_name, seed=step, dims=dims)
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        rows = decode(manifest, outs, host)
        for k, v in rows.to_pydict().items():
            cols.setdefault(k, []).extend(v)
        cols.setdefault("step", []).extend([step] * len(rows))
    return cols


def test_findings_on_tiny_lm():
    """The miner names the attention sinks and the near-identity block, with the command that skips it."""
    findings = mine(pa.table(_table("transformer_tiny_lm", {"batch": 2, "seq": 16})), model="tiny.onnx")
    attn = [f for f in findings if f.kind == "attn"]
    assert sorted(f.site for f in attn) == ["block1/attn/softmax", "block2/attn/softmax"]
    for f in attn:
        assert f.rule == "concentrated_attention" and f.signals["sink_key"] == 0 and f.role == "attn"
        assert f.signals["mean_peak"] > 0.3 and "sink" in f.exploit and f.score == f.signals["mean_peak"]
    residual = {f.site: f for f in findings if f.kind == "residual"}
    assert sorted(residual) == [
        "block1/attn_residual",
        "block1/mlp_residual",
        "block2/attn_residual",
        "block2/mlp_residual",
    ]
    gaps = {site: f.signals["gap"] for site, f in residual.items()}
    assert gaps["block1/attn_residual"] > 0.3 and gaps["block2/mlp_residual"] < 0.01
    weak = sorted(s for s, f in residual.items() if f.rule == "weak_residual_branch")
    assert weak == ["block2/attn_residual", "block2/mlp_residual"]
    f = residual["block2/mlp_residual"]
    assert (
        0.9 < f.score <= 1
        and f.action == "opscope rewrite skip tiny.onnx --blocks block2/mlp_residual -o skipped.onnx"
    )
    assert (
        residual["block1/attn_residual"].rule == "strong_residual_branch"
        and not residual["block1/attn_residual"].action
    )
    # a candidate with quality numbers is validated, the others are not
    quality = {
        "block2/attn_residual": {"cosine": 0.99999, "top1": 1.0},
        "block2/mlp_residual": {"cosine": 0.9, "top1": 0.5},
    }
    checked = {
        f.site: f
        for f in mine(pa.table(_table("transformer_tiny_lm", {"batch": 2, "seq": 16})), skip_quality=quality)
    }
    assert (
        checked["block2/attn_residual"].validation["passed"]
        and not checked["block2/mlp_residual"].validation["passed"]
    )
    assert checked["block1/attn_residual"].validation is None


def test_routing_findings_on_moe():
    findings = mine(pa.table(_table("moe", {"tokens": 64})))
    route = [f for f in findings if f.kind == "route"]
    assert len(route) == 1  # one finding per (site, role)
    f = route[0]
    assert f.site == "router/topk" and f.rule == "cold_experts"
    assert 7 in f.signals["cold"] and 0 not in f.signals["cold"] and f.signals["hot"] in (0, 1)
    assert "prefetch" in f.note and math.isclose(sum(f.signals["load_share"]), 1.0)
    balanced = mine(
        pa.table(_table("moe", {"tokens": 64})), config=MineConfig(cold_share_max=0.0, hot_imbalance_min=10)
    )
    assert next(f for f in balanced if f.kind == "route").rule == "balanced_experts"


def test_mine_names_and_validates_skip_candidates(tmp_path, capsys):
    """`opscope mine --validate` skips each candidate on the recorded feeds; mine and report show the command."""
    from onnx_opscope.cli import main
    from onnx_opscope.findings import load_findings
    from onnx_opscope.graph import save_model

    model = save_model(zoo.build("transformer_tiny_lm"), tmp_path / "tiny.onnx")
    table = tmp_path / "t.parquet"
    assert (
        main(["record", str(model), "--dim", "batch=2,seq=16", "--batches", "2", "-o", str(table), "-q"]) == 0
    )
    assert main(["mine", str(table), "--validate", "-o", str(tmp_path / "f.json")]) == 0
    printed = capsys.readouterr().out
    assert f"opscope rewrite skip {model} --blocks block2/mlp_residual -o skipped.onnx" in printed
    findings = load_findings(tmp_path / "f.json")
    weak = {f.site: f for f in findings if f.rule == "weak_residual_branch"}
    assert set(weak) == {"block2/attn_residual", "block2/mlp_residual"}
    for f in weak.values():  # the skip rewrite's own quality on the recorded feeds
        v = f.validation
        assert v["cosine"] > 0.999 and v["top1"] > 0.99 and v["passed"], (f.site, v)
    assert all(f.validation is None for f in findings if f.rule == "strong_residual_branch")
    assert (
        main(["report", str(table), "--findings", str(tmp_path / "f.json"), "-o", str(tmp_path / "r.html")])
        == 0
    )
    page = (tmp_path / "r.html").read_text()
    assert "What to do about it" in page and "opscope rewrite skip" in page and "passed: cosine" in page


def test_mine_validate_needs_the_recorded_model(tmp_path, capsys):
    from onnx_opscope.cli import main

    table = pa.table(_table("transformer_tiny_lm", {"batch": 2, "seq": 16}))
    path = tmp_path / "t.parquet"
    import pyarrow.parquet as pq

    pq.write_table(table, path)
    assert main(["mine", str(path), "--validate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot validate skip candidates") and "Traceback" not in err
