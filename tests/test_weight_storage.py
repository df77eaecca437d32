"""`transform.weight_plan.storage` says, without reading a weight, what `apply_weight_plan` then does."""

from __future__ import annotations

import onnx
import pytest
from conftest import generated_model_path, real_model_path

from onnx_opscope.transform.weight_plan import apply_weight_plan, storage
from onnx_opscope.weights.matrix import iter_weights
from onnx_opscope.weights.menu import Option

OPTIONS = [
    Option("int8_channel", "int8", 0.0, 0, 0, {"bits": 8}),
    Option("int4_channel", "int4", 0.0, 0, 0, {"bits": 4}),
    Option("int4_group", "int4 g32", 0.0, 0, 0, {"bits": 4, "group": 32}),
    Option("int8_group", "int8 g128", 0.0, 0, 0, {"bits": 8, "group": 128}),
    Option("lowrank", "r=4", 0.0, 0, 0, {"rank": 4}),
    Option("ternary", "ternary", 0.0, 0, 0, {}),
]


@pytest.mark.parametrize("path", [real_model_path("captcha_crnn"), generated_model_path("opset21_mlp"),
                                  generated_model_path("cnn"), generated_model_path("transformer_block")])  # fmt: skip
def test_storage_predicts_what_the_rewrite_stores(path):
    model = onnx.load(path)
    views = [v for v, _ in iter_weights(path)][:12]
    stored = storage(model)
    for option in OPTIONS:
        layers = [{"weight": v.name, "graph": v.graph, "option": option.to_dict()} for v in views]
        _, applied = apply_weight_plan(path, {"layers": layers})
        for view, got in zip(views, applied.layers):
            how, nbytes = stored(view, option)
            assert got.how.startswith(how.split(" int")[0]) and got.how.startswith(how[:12]), (
                view.name,
                how,
                got.how,
            )
            assert nbytes == got.bytes_after, (view.name, option.kind, how, nbytes, got.bytes_after)
