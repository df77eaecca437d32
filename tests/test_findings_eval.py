"""The fast subset of scripts/eval_findings.py: planted patterns at known sites of a real model and of
zoo models, scored per rule against the ground truth the script derives from the graph.

The full set (every real model, every plant) runs as `python scripts/eval_findings.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import real_model_path

from onnx_opscope import MineConfig, make_session
from onnx_opscope.findings import Finding

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "eval_findings.py"
# every rule the quick subset plants or derives a truth for
QUICK_RULES = ("sparse", "outlier", "levels", "heavy_tail", "concentrated", "coherent", "positional", "small",
               "weak_residual_branch", "stationary", "memoize", "delta")  # fmt: skip


def _script():
    spec = importlib.util.spec_from_file_location("opscope_eval_findings", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ev():
    return _script()


@pytest.fixture(scope="module")
def quick(ev):
    real_model_path("ppocrv4_rec")  # fails (never skips) when it has not been fetched
    return ev.evaluate(ev.QUICK_MODELS, quick=True, log=lambda line: None)


def test_quick_subset_meets_the_goal(quick):
    scores = quick["scores"]
    for rule in QUICK_RULES:
        s = scores[rule]
        assert s["positives"] > 0, f"{rule}: nothing planted"
        assert s["precision"] >= 0.9 and s["recall"] >= 0.9, (rule, s, quick["misses"])
    assert quick["size_violations"] == [] and quick["goal"]
    assert "| sparse |" in quick["table"] and quick["scored"] > 50


def test_a_broken_rule_misses_the_goal(ev, tmp_path):
    """Scored the same way, a sparse threshold no tensor can pass loses every sparse plant."""
    graph = ev.load_graph("transformer_block")
    plants = [p for p in ev.PLANTS if p.name.startswith("sparse:")]
    cases = ev.plant_cases(graph, tmp_path, plants, 1, MineConfig(density_max=0.0), 0, lambda line: None)
    scores, misses = ev.score(cases)
    assert scores["sparse"].positives == 9 and scores["sparse"].recall == 0.0  # 3 plants x q, k, v
    assert not ev.goal_holds(scores, []) and all("wants sparse, got" in m for m in misses)


def test_targets_follow_layout_only_ops_and_their_axes(ev):
    graph = ev.load_graph("transformer_block")
    operands = ev._operands(graph, ev.find_sites(graph.model))
    qkv = ev.targets_of(graph, "block/ln1_output_0", operands)
    assert {(t.site, t.role) for t in qkv} == {(f"block/attn/{p}_proj/matmul", "lhs") for p in "qkv"}
    assert {(t.channel, t.seq, t.channels, t.rows) for t in qkv} == {(2, 1, 64, 2 * 32)}
    # [b, h, s, d] -> Transpose -> [b, s, h, d] -> Reshape -> [b, s, h * d]: the rows (s) survive, the
    # channels are h and d merged, so no single axis of the cut tensor lands on them
    (ctx,) = ev.targets_of(graph, "block/attn/av_matmul_output_0", operands)
    assert (ctx.site, ctx.role, ctx.seq, ctx.channel) == ("block/attn/o_proj/matmul", "lhs", 2, None)


def test_a_cut_keeps_the_real_weights(ev):
    graph = ev.load_graph("transformer_block")
    tensor, out = "block/attn/softmax_output_0", "block/attn/av_matmul_output_0"
    sub, context = ev.cut(graph, tensor, [out])
    assert set(context) == {"block/attn/v_transpose_output_0"}  # V comes from the other branch
    (got,) = make_session(sub).run(None, {tensor: graph.values[tensor], **context})
    np.testing.assert_allclose(got, graph.values[out], rtol=1e-5, atol=1e-6)


def test_plants_land_on_the_axes_asked_for(ev):
    plant = next(p for p in ev.PLANTS if p.name == "outlier:1%x30")
    (x, *_) = ev.draw_batches(plant, (2, 120, 7, 5), ch=1, seq=3, seed=0)
    per_channel = np.abs(x).max(axis=(0, 2, 3))
    assert x.shape == (2, 120, 7, 5) and (per_channel > 20).sum() == 1  # 1 % of 120 channels, axis 1
    walk = next(p for p in ev.PLANTS if p.name == "coherent:walk0.15")
    (y, *_) = ev.draw_batches(walk, (4, 64, 16), ch=1, seq=2, seed=0)
    along, across = np.diff(y, axis=2).std(), np.diff(y, axis=1).std()
    assert along == pytest.approx(0.15, rel=0.1) and across > 1.0


def _finding(rule: str, temporal: str | None = None) -> Finding:
    f = Finding("s", "MatMul", "lhs", "r", "cpu", "data", 1, 1, 1, 4096, 3, {}, {}, rule, "", "", 0.0, "", None,
                "n/a", None)  # fmt: skip
    if temporal is not None:
        f.temporal = type("T", (), {"rule": temporal})()
    return f


def test_scores_count_false_positives_and_misses(ev):
    def case(want, got, want_steps=None, got_steps=None):
        return ev.Case(
            "m", "plant", "x", {("s", "lhs"): (want, want_steps)}, findings=[_finding(got, got_steps)]
        )

    scores, misses = ev.score([
        case("sparse", "sparse"), case("sparse", "dense"), case(None, "sparse"),  # TP, FN, FP
        case(None, "dense", "memoize", "memoize"), case(None, "dense", None, "delta"),
    ])  # fmt: skip
    assert (scores["sparse"].positives, scores["sparse"].tp, scores["sparse"].fp) == (2, 1, 1)
    assert scores["sparse"].precision == 0.5 and scores["sparse"].recall == 0.5
    assert (scores["memoize"].tp, scores["delta"].fp) == (1, 1) and len(misses) == 3
    assert not ev.goal_holds(scores, [])
