"""Repeated chains and cones (`find_motifs`, `opscope analyze --motifs`): counts on graphs built here with
known answers, hints, shares, subgraphs, outputs, and every real and zoo model."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import duckdb
import numpy as np
import onnx
import pandas as pd
import polars as pl
import pyarrow.parquet as pq
import pytest
from conftest import REAL_NAMES, real_model_path
from onnx import TensorProto, helper, numpy_helper

from onnx_opscope import find_motifs as top_level_find_motifs
from onnx_opscope import zoo
from onnx_opscope.analysis import Motifs, find_motifs
from onnx_opscope.analysis.motifs import HINTS, print_motifs
from onnx_opscope.cli import analyze as analyze_cmd
from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph import ModelIndex

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _w(name: str, *shape: int) -> TensorProto:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _io(name: str, dims) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, F, dims)


def lba_chain(blocks: int, rows=2, width: int = 4, swap: bool = False, also_out: str | None = None):
    """x -> blocks x (MatMul W_i -> Add b_i -> Relu) -> y; `swap` puts the bias first in the Adds."""
    nodes, inits, prev = [], [], "x"
    for i in range(blocks):
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"))
        add_in = [f"b{i}", f"m{i}"] if swap else [f"m{i}", f"b{i}"]
        nodes.append(helper.make_node("Add", add_in, [f"a{i}"], name=f"add{i}"))
        prev = f"r{i}" if i < blocks - 1 else "y"
        nodes.append(helper.make_node("Relu", [f"a{i}"], [prev], name=f"relu{i}"))
        inits += [_w(f"W{i}", width, width), _w(f"b{i}", width)]
    outs = [_io("y", [rows, width])] + ([_io(also_out, [rows, width])] if also_out else [])
    return _model(nodes, [_io("x", [rows, width])], outs, inits)


def chains_of(m: Motifs) -> dict[str, int]:
    return {p.pattern: p.count for p in m.chains}


def cones_of(m: Motifs, depth: int) -> dict[str, int]:
    return {p.pattern: p.count for p in m.cones if p.size == depth}


# -- chains ----------------------------------------------------------------------------------------


def test_chain_counts_on_three_blocks():
    # kinds along the one path: M A R M A R M A R, the last Relu a graph output
    m = find_motifs(lba_chain(3))
    assert chains_of(m) == {
        "MatMul→Add": 3, "Add→Relu": 3, "Relu→MatMul": 2,
        "MatMul→Add→Relu": 3, "Add→Relu→MatMul": 2, "Relu→MatMul→Add": 2,
        "MatMul→Add→Relu→MatMul": 2, "Add→Relu→MatMul→Add": 2, "Relu→MatMul→Add→Relu": 2,
        "MatMul→Add→Relu→MatMul→Add": 2, "Add→Relu→MatMul→Add→Relu": 2,
        "MatMul→Add→Relu→MatMul→Add→Relu": 2,
    }  # fmt: skip
    best = m.chains[0]
    assert (best.pattern, best.score, best.ops, best.size) == ("MatMul→Add→Relu→MatMul→Add→Relu", 12, 6, 6)
    assert [p.score for p in m.chains] == sorted((p.score for p in m.chains), reverse=True)
    mar = next(p for p in m.chains if p.pattern == "MatMul→Add→Relu")
    assert mar.examples == ("mm0", "mm1", "mm2") and mar.score == 9


def test_chain_lengths_and_min_count_knobs():
    m = find_motifs(lba_chain(3), min_len=3, max_len=3, min_count=3)
    assert chains_of(m) == {"MatMul→Add→Relu": 3}
    m = find_motifs(lba_chain(3), min_len=2, max_len=2, min_count=1)
    assert chains_of(m) == {"MatMul→Add": 3, "Add→Relu": 3, "Relu→MatMul": 2}
    assert len(find_motifs(lba_chain(6), min_count=2).chains[0].examples) == 4  # at most 4 example sites


def test_fan_out_ends_a_chain():
    # per block: r = Relu(h); Tanh(r) and Sigmoid(r) fan out and meet in an Add
    nodes, prev = [], "x"
    for i in range(3):
        nodes += [
            helper.make_node("Relu", [prev], [f"r{i}"], name=f"relu{i}"),
            helper.make_node("Tanh", [f"r{i}"], [f"t{i}"], name=f"tanh{i}"),
            helper.make_node("Sigmoid", [f"r{i}"], [f"s{i}"], name=f"sig{i}"),
        ]
        prev = f"h{i}" if i < 2 else "y"
        nodes.append(helper.make_node("Add", [f"t{i}", f"s{i}"], [prev], name=f"add{i}"))
    m = find_motifs(_model(nodes, [_io("x", [2, 4])], [_io("y", [2, 4])]))
    assert chains_of(m) == {
        "Tanh→Add": 3, "Sigmoid→Add": 3, "Add→Relu": 2, "Tanh→Add→Relu": 2, "Sigmoid→Add→Relu": 2
    }  # fmt: skip


def test_graph_output_ends_a_chain():
    model = lba_chain(3)
    model.graph.output.append(_io("r0", [2, 4]))  # the first block's Relu is also a graph output
    # r0 ends the walks through it: of the n-grams across r0 only those through r1 are left, seen once each
    assert chains_of(find_motifs(model)) == {"MatMul→Add": 3, "Add→Relu": 3, "MatMul→Add→Relu": 3}


def test_shape_arithmetic_is_no_compute_and_no_fan_out():
    # h -> Relu -> Reshape(Relu, Concat(Gather(Shape(Relu)), [-1])) -> ..., three times
    nodes, inits, prev = [], [helper.make_tensor("idx", TensorProto.INT64, [1], [0]),
                              helper.make_tensor("rest", TensorProto.INT64, [1], [-1])], "x"  # fmt: skip
    for i in range(3):
        nodes += [
            helper.make_node("Relu", [prev], [f"r{i}"], name=f"relu{i}"),
            helper.make_node("Shape", [f"r{i}"], [f"s{i}"], name=f"shape{i}"),
            helper.make_node("Gather", [f"s{i}", "idx"], [f"g{i}"], name=f"gather{i}"),
            helper.make_node("Concat", [f"g{i}", "rest"], [f"c{i}"], axis=0, name=f"concat{i}"),
        ]
        prev = f"y{i}" if i < 2 else "y"
        nodes.append(helper.make_node("Reshape", [f"r{i}", f"c{i}"], [prev], name=f"reshape{i}"))
    m = find_motifs(_model(nodes, [_io("x", [2, 4])], [_io("y", [2, 4])], inits))
    assert chains_of(m)["Relu→Reshape"] == 3  # the Shape read is no second consumer
    assert not any(k in p.pattern for p in m.patterns for k in ("Shape", "Gather", "Concat"))
    assert cones_of(m, 2)["Reshape(Relu(*), constant)"] == 2  # the computed shape is a constant leaf


def test_values_computed_from_constants_only_are_folded():
    # per block: W_i dequantized from int8 (DequantizeLinear of constants only) feeds MatMul -> Add -> Relu
    nodes, inits, prev = [], [helper.make_tensor("scale", F, [], [0.1])], "x"
    for i in range(3):
        q = numpy_helper.from_array(RNG.integers(-8, 8, (4, 4)).astype(np.int8), f"Wq{i}")
        inits += [q, _w(f"b{i}", 4)]
        nodes += [
            helper.make_node("DequantizeLinear", [f"Wq{i}", "scale"], [f"W{i}"], name=f"dq{i}"),
            helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
        ]
        prev = f"r{i}" if i < 2 else "y"
        nodes.append(helper.make_node("Relu", [f"a{i}"], [prev], name=f"relu{i}"))
    m = find_motifs(_model(nodes, [_io("x", [2, 4])], [_io("y", [2, 4])], inits))
    assert not any("DequantizeLinear" in p.pattern for p in m.patterns)
    assert cones_of(m, 2)["Add(weight, MatMul(*, weight))"] == 2
    assert {p.pattern: p.hint for p in m.chains}["MatMul→Add→Relu"] == "linear+bias+activation"


# -- cones -----------------------------------------------------------------------------------------


def test_cone_counts_depth_two_and_new_trees_only():
    m = find_motifs(lba_chain(3))
    # Relu(Add) roots: relu0..2; MatMul(Relu) roots: mm1, mm2; Add(MatMul(*)) roots: add1, add2
    # (add0's tree, Add(weight, MatMul(input, weight)), is seen once)
    assert cones_of(m, 2) == {
        "Relu(Add(weight, *))": 3, "MatMul(Relu(*), weight)": 2, "Add(weight, MatMul(*, weight))": 2
    }  # fmt: skip
    # depth 3 counts only nodes whose depth-2 tree was cut: not add0, whose tree ended at depth 2
    assert cones_of(m, 3) == {
        "Relu(Add(weight, MatMul(*, weight)))": 2,  # relu1, relu2 (relu0's reads the input: seen once)
        "MatMul(Relu(Add(weight, *)), weight)": 2,
        "Add(weight, MatMul(Relu(*), weight))": 2,
    }
    relu = next(p for p in m.cones if p.pattern == "Relu(Add(weight, *))")
    assert (relu.ops, relu.score, relu.examples) == (2, 6, ("relu0", "relu1", "relu2"))


def test_a_tree_that_ends_is_counted_at_its_depth_only():
    # two independent Relu(Add(MatMul(input, W), b)): their trees end at depth 3
    nodes, inits = [], []
    for i in range(2):
        nodes += [
            helper.make_node("MatMul", [f"x{i}", f"W{i}"], [f"m{i}"], name=f"mm{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
            helper.make_node("Relu", [f"a{i}"], [f"y{i}"], name=f"relu{i}"),
        ]
        inits += [_w(f"W{i}", 4, 4), _w(f"b{i}", 4)]
    model = _model(
        nodes, [_io("x0", [2, 4]), _io("x1", [2, 4])], [_io("y0", [2, 4]), _io("y1", [2, 4])], inits
    )
    m = find_motifs(model)
    assert [(p.pattern, p.size, p.count) for p in m.cones] == [
        ("Relu(Add(weight, MatMul(input, weight)))", 3, 2),
        ("Add(weight, MatMul(input, weight))", 2, 2),
        ("Relu(Add(weight, *))", 2, 2),
    ]


def test_cone_signature_sorts_commutative_operands():
    assert cones_of(find_motifs(lba_chain(3, swap=True)), 2) == cones_of(find_motifs(lba_chain(3)), 2)


def test_cone_depth_knob_and_internal_nodes():
    m = find_motifs(lba_chain(4), max_depth=4)
    assert {p.size for p in m.cones} == {2, 3, 4}
    deep = next(p for p in m.cones if p.pattern == "Relu(Add(weight, MatMul(Relu(*), weight)))")
    assert (deep.ops, deep.count, deep.score) == (4, 3, 12)  # 3 internal nodes + 1, roots relu1..relu3


def test_cone_leaves_input_weight_constant():
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["a"], name="mul0"),  # scale: a scalar, so a constant
        helper.make_node("Add", ["a", "bias"], ["b"], name="add0"),
        helper.make_node("Mul", ["b", "scale"], ["c"], name="mul1"),
        helper.make_node("Add", ["c", "bias"], ["y"], name="add1"),
    ]
    inits = [_w("scale", 1), _w("bias", 4)]
    m = find_motifs(_model(nodes, [_io("x", [2, 4])], [_io("y", [2, 4])], inits), min_count=1)
    assert (
        cones_of(m, 2)["Add(weight, Mul(input, constant))"] == 1
    )  # leaves sorted: input < weight < constant


# -- hints, shares ---------------------------------------------------------------------------------


def test_hint_linear_bias_activation_needs_the_whole_chain():
    hints = {p.pattern: p.hint for p in find_motifs(lba_chain(3)).chains}
    assert hints["MatMul→Add→Relu"] == "linear+bias+activation"
    assert hints["Add→Relu→MatMul"] == "decompose once, reuse"  # the MatMul under that Relu is not in it
    assert hints["MatMul→Add"] == "decompose once, reuse"


def test_hint_residual_attention_moe_shared():
    def residual_blocks(kind: str):
        nodes, inits, prev = [], [], "x"
        for i in range(2):
            nodes += [
                helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"),
                helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"bias{i}"),
            ]
            last = f"y{i}" if i == 0 else "y"
            if kind == "after":  # x + relu(Wx + b)
                nodes.append(helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"))
                nodes.append(helper.make_node("Add", [f"r{i}", prev], [last], name=f"res{i}"))
            else:  # relu(Wx + b + x)
                nodes.append(helper.make_node("Add", [f"a{i}", prev], [f"s{i}"], name=f"res{i}"))
                nodes.append(helper.make_node("Relu", [f"s{i}"], [last], name=f"relu{i}"))
            inits += [_w(f"W{i}", 4, 4), _w(f"b{i}", 4)]
            prev = last
        return _model(nodes, [_io("x", [2, 4])], [_io("y", [2, 4])], inits)

    after = {p.pattern: p.hint for p in find_motifs(residual_blocks("after")).chains}
    assert after["MatMul→Add→Relu→Add"] == "linear+bias+activation+residual"
    assert after["MatMul→Add→Relu"] == "linear+bias+activation"
    before = {p.pattern: p.hint for p in find_motifs(residual_blocks("before")).chains}
    assert before["MatMul→Add→Add→Relu"] == "linear+bias+activation+residual"

    nodes = []
    for i in range(2):  # two attention heads: Softmax(MatMul(q, k)) -> MatMul(v)
        nodes += [
            helper.make_node("MatMul", ["q", f"k{i}"], [f"s{i}"], name=f"qk{i}"),
            helper.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1, name=f"softmax{i}"),
            helper.make_node("MatMul", [f"p{i}", "v"], [f"o{i}"], name=f"pv{i}"),
        ]
    nodes.append(helper.make_node("Add", ["o0", "o1"], ["y"], name="sum"))
    ins = [_io("q", [2, 4]), _io("k0", [4, 4]), _io("k1", [4, 4]), _io("v", [4, 4])]
    attn = find_motifs(_model(nodes, ins, [_io("y", [2, 4])]))
    assert {p.pattern: p.hint for p in attn.chains}["MatMul→Softmax→MatMul"] == "attention block"

    nodes = []
    for i in range(2):  # two routers: TopK over the logits, the expert ids cast
        nodes += [
            helper.make_node("MatMul", ["x", f"R{i}"], [f"l{i}"], name=f"router{i}"),
            helper.make_node("TopK", [f"l{i}", "k"], [f"v{i}", f"e{i}"], axis=-1, name=f"topk{i}"),
            helper.make_node("Cast", [f"e{i}"], [f"c{i}"], to=F, name=f"cast{i}"),
        ]
    inits = [_w("R0", 4, 4), _w("R1", 4, 4), helper.make_tensor("k", TensorProto.INT64, [1], [2])]
    moe = find_motifs(_model(nodes, [_io("x", [2, 4])], [_io(f"c{i}", [2, 2]) for i in range(2)], inits))
    assert {p.pattern: p.hint for p in moe.chains} == {"MatMul→TopK": "MoE block", "TopK→Cast": "MoE block",
                                                       "MatMul→TopK→Cast": "MoE block"}  # fmt: skip

    nodes, prev = [], "x"
    for i in range(2):  # expert weights gathered from a stack [experts, in, out] by routed ids
        nodes.append(helper.make_node("Gather", [f"E{i}", "ids"], [f"w{i}"], axis=0, name=f"gather{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"], name=f"expert{i}"))
        prev = f"h{i}"
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [])
    experts = find_motifs(
        _model(nodes, [_io("x", [2, 4]), ids], [_io("h1", [2, 4])], [_w("E0", 3, 4, 4), _w("E1", 3, 4, 4)])
    )
    assert {p.pattern: p.hint for p in experts.chains} == {"Gather→MatMul": "MoE block"}

    nodes, prev = [], "x"
    for i in range(3):  # one weight, three projections
        prev_out = f"t{i}" if i < 2 else "y"
        nodes.append(helper.make_node("MatMul", [prev, "W"], [f"m{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [prev_out], name=f"tanh{i}"))
        prev = prev_out
    shared = find_motifs(_model(nodes, [_io("x", [2, 4])], [_io("y", [2, 4])], [_w("W", 4, 4)]))
    hints = {p.pattern: p.hint for p in shared.chains}
    assert hints["MatMul→Tanh"] == hints["MatMul→Tanh→MatMul"] == "shared projection"
    assert "shared projection" not in {p.hint for p in find_motifs(lba_chain(3)).patterns}  # own weights


def test_shares_cover_each_node_once():
    # static shapes: MatMul 2*2*4*4 = 64 FLOPs, Add 8, Relu 8; three blocks: 240
    m = find_motifs(lba_chain(3))
    assert m.totals["flops"] == 240
    by = {p.pattern: p for p in m.chains}
    assert by["MatMul→Add"].flops == 216 and by["MatMul→Add"].flops_share == pytest.approx(0.9)
    four = by["MatMul→Add→Relu→MatMul"]  # sites mm0.. and mm1..: they share mm1
    assert four.nodes == 7 and four.flops == 3 * 64 + 2 * 8 + 2 * 8
    assert all(0 <= p.flops_share <= 1 and 0 <= p.bytes_share <= 1 for p in m.patterns)
    assert by["MatMul→Add→Relu"].bytes_share == pytest.approx(1.0)


def test_symbolic_costs_give_expressions_and_shares_at_feed_sizes():
    m = find_motifs(lba_chain(3, rows="batch"))
    assert m.settings["share_dims"] == {"batch": 1}  # on axis 0: the size `record` feeds
    mar = next(p for p in m.chains if p.pattern == "MatMul→Add")
    assert mar.flops is None and mar.flops_expr == "108*batch" and mar.flops_share == pytest.approx(0.9)
    given = find_motifs(lba_chain(3, rows="batch"), dims={"batch": 8})
    assert given.settings["share_dims"] == {} and given.totals["flops"] == 8 * 120


# -- subgraphs -------------------------------------------------------------------------------------


def _if_model(outer_read: bool) -> onnx.ModelProto:
    """Main: Relu -> Tanh -> Sigmoid, and an If whose branches hold the same Relu -> Tanh -> Sigmoid
    (the then-branch reading the main graph's Relu output when `outer_read`)."""

    def branch(tag: str, src: str) -> onnx.GraphProto:
        nodes = [
            helper.make_node("Relu", [src], [f"{tag}_r"], name="relu"),
            helper.make_node("Tanh", [f"{tag}_r"], [f"{tag}_t"], name="tanh"),
            helper.make_node("Sigmoid", [f"{tag}_t"], [f"{tag}_y"], name="sigmoid"),
        ]
        return helper.make_graph(nodes, tag, [], [_io(f"{tag}_y", [2, 4])])

    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Tanh", ["r"], ["t"], name="tanh"),
        helper.make_node("Sigmoid", ["t"], ["s"], name="sigmoid"),
        helper.make_node(
            "If",
            ["cond"],
            ["y"],
            name="if",
            then_branch=branch("then", "r" if outer_read else "x"),
            else_branch=branch("else", "x"),
        ),  # fmt: skip
    ]
    return _model(nodes, [_io("x", [2, 4]), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                  [_io("y", [2, 4]), _io("s", [2, 4])])  # fmt: skip


def test_subgraph_patterns_are_counted_with_their_ids():
    m = find_motifs(_if_model(outer_read=False))
    assert chains_of(m) == {"Relu→Tanh": 3, "Tanh→Sigmoid": 3, "Relu→Tanh→Sigmoid": 3}
    three = next(p for p in m.chains if p.pattern == "Relu→Tanh→Sigmoid")
    assert three.examples[0] == "relu" and set(three.examples[1:]) == {
        "if/then_branch/relu",
        "if/else_branch/relu",
    }
    ids = {nid for e in ModelIndex(_if_model(False)).graphs.values() for nid in e.ids}
    assert all(set(p.examples) <= ids for p in m.patterns)
    assert m.totals["graphs"] == 3


def test_a_read_from_inside_a_subgraph_is_a_consumer():
    # the main Relu has two consumers: its Tanh, and the If (whose then-branch reads it)
    counts = chains_of(find_motifs(_if_model(outer_read=True)))
    assert counts == {"Relu→Tanh": 2, "Tanh→Sigmoid": 3, "Relu→Tanh→Sigmoid": 2}


def test_loop_body_costs_scale_with_the_trip_count():
    body_nodes = [
        helper.make_node("MatMul", ["h", "W"], ["m"], name="mm"),
        helper.make_node("Relu", ["m"], ["h_out"], name="relu"),
        helper.make_node("Identity", ["c"], ["c_out"], name="id"),
    ]
    body = helper.make_graph(
        body_nodes, "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         _io("h", [2, 4])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _io("h_out", [2, 4])],
    )  # fmt: skip
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m0"], name="mm"),
        helper.make_node("Relu", ["m0"], ["h0"], name="relu"),
        helper.make_node("Loop", ["n", "t", "h0"], ["y"], body=body, name="loop"),
    ]
    inits = [_w("W", 4, 4), helper.make_tensor("n", TensorProto.INT64, [], [5]),
             helper.make_tensor("t", TensorProto.BOOL, [], [True])]  # fmt: skip
    m = find_motifs(_model(nodes, [_io("x", [2, 4])], [_io("y", [2, 4])], inits))
    mr = next(p for p in m.chains if p.pattern == "MatMul→Relu")
    assert mr.count == 2 and mr.examples == ("mm", "loop/body/mm")
    assert mr.flops == (64 + 8) * (1 + 5)  # the body's pair counted five times, as `analyze` prices it
    assert mr.hint == "shared projection"  # the body reads the main graph's W


# -- scale, order, errors, outputs -------------------------------------------------------------------


def test_counts_at_scale_and_deterministic_order():
    blocks = 4000  # 12 000 nodes
    model = lba_chain(blocks)
    a, b = find_motifs(model), find_motifs(model)
    assert chains_of(a)["MatMul→Add→Relu"] == blocks
    assert chains_of(a)["MatMul→Add→Relu→MatMul→Add→Relu"] == blocks - 1
    assert (
        cones_of(a, 6)["Relu(Add(weight, MatMul(Relu(Add(weight, MatMul(*, weight))), weight)))"]
        == blocks - 2
    )
    assert a.to_json() == b.to_json()
    assert [(-p.score, -p.count, p.pattern) for p in a.cones] == sorted(
        (-p.score, -p.count, p.pattern) for p in a.cones
    )


def test_bad_settings_are_one_clear_error():
    for kwargs in ({"min_len": 3, "max_len": 2}, {"min_len": 0}, {"min_count": 0}, {"max_depth": 1}):
        with pytest.raises(OpscopeError):
            find_motifs(lba_chain(2), **kwargs)


def _cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="opscope")
    analyze_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = analyze_cmd.run(args)
    return rc, out.getvalue()


def test_cli_formats_and_readers(tmp_path):
    path = tmp_path / "chain.onnx"
    onnx.save(lba_chain(3), str(path))
    rc, text = _cli([str(path), "--motifs", "--top", "3"])
    assert rc == 0 and "repeated chains" in text and "MatMul→Add→Relu" in text and "repeated cones" in text
    rc, text = _cli([str(path), "--motifs", "--format", "json", "--motif-max-len", "3", "--cone-depth", "2"])
    doc = json.loads(text)
    assert doc["settings"]["max_len"] == 3 and {c["size"] for c in doc["cones"]} == {2}
    assert {c["pattern"]: c["count"] for c in doc["chains"]}["MatMul→Add→Relu"] == 3
    rc, text = _cli([str(path), "--motifs", "--format", "csv", "--motif-min-count", "3"])
    csv = pd.read_csv(io.StringIO(text))
    assert set(csv["count"]) == {3} and csv["examples"].iloc[0].count("; ") == 2
    out = tmp_path / "motifs.parquet"
    rc, _ = _cli([str(path), "--motifs", "--format", "parquet", "-o", str(out), "-q"])
    table = pq.read_table(out)
    assert table.num_rows == len(find_motifs(path).patterns)
    assert pl.read_parquet(out)["kind"].to_list().count("chain") == 12
    assert duckdb.sql(f"select max(score) from read_parquet('{out}')").fetchall() == [(12,)]
    assert table.column("model_sha256")[0].as_py() == find_motifs(path).model_sha256
    with pytest.raises(OpscopeError):
        _cli([str(path), "--motifs", "--profile"])


def test_top_level_name_and_printing():
    assert top_level_find_motifs is find_motifs
    buf = io.StringIO()
    print_motifs(find_motifs(lba_chain(3)), top=2, file=buf)
    text = buf.getvalue()
    assert "top 2 of 12" in text and "linear+bias+activation" in text


# -- every real and zoo model ----------------------------------------------------------------------


def _check_invariants(m: Motifs, model: onnx.ModelProto) -> None:
    ids = {nid for e in ModelIndex(model).graphs.values() for nid in e.ids}
    for p in m.patterns:
        assert p.count >= 2 and 1 <= len(p.examples) <= 4 and set(p.examples) <= ids
        assert p.score == p.count * p.ops and p.hint in HINTS
        assert p.flops_share is None or -1e-9 <= p.flops_share <= 1 + 1e-9
        assert p.bytes_share is None or -1e-9 <= p.bytes_share <= 1 + 1e-9
    for pats in (m.chains, m.cones):
        assert [p.score for p in pats] == sorted((p.score for p in pats), reverse=True)


@pytest.mark.parametrize("name", REAL_NAMES)
def test_real_models(name):
    path = real_model_path(name)
    m = find_motifs(path)
    _check_invariants(m, onnx.load(str(path), load_external_data=False))
    assert m.chains and m.cones  # every one of them repeats itself
    if name == "silero_vad_v6":  # its work sits in If branches: their patterns carry subgraph ids
        assert m.totals["graphs"] > 1 and any("_branch/" in e for p in m.patterns for e in p.examples)


def test_zoo_models():
    for name in zoo.MODELS:
        model = zoo.build(name)
        _check_invariants(find_motifs(model), model)
    tiny = find_motifs(zoo.build("transformer_tiny_lm"))
    assert "attention block" in {p.hint for p in tiny.patterns}
