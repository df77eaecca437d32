"""The package's shape: layers that follow the pipeline, imports that only go down, no cycles.

Read from the source with `ast` (function-level imports included), so an import that
crosses a layer fails here before it tangles the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import onnx_opscope

PACKAGE = Path(onnx_opscope.__file__).parent
LAYERS = [
    "errors",
    "files",
    "graph",
    "shapes",
    "sites",
    "weights",
    "sketch",
    "instrument",
    "transform",
    "compare",
    "run",
    "calibration",
    "analysis",
    "findings",
    "reporting",
    "zoo",
    "cli",
    "__init__",
    "__main__",
]
"""Lowest first: a module may import from its own layer and the layers before it, never after."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(["onnx_opscope", *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The onnx_opscope modules `name` imports (`from x import y` counts y when y is a module)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("onnx_opscope"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            if not base.startswith("onnx_opscope"):
                continue
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            out.update(subs or [base])
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 else "__init__")


def test_every_module_is_in_a_layer():
    for module in MODULES:
        assert _layer(module) >= 0, module


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down(module):
    up = [m for m in GRAPH[module] if _layer(m) > _layer(module)]
    assert not up, f"{module} (layer {LAYERS[_layer(module)]}) imports from a layer above it: {up}"


def test_no_import_cycle():
    """Tarjan's strongly connected components: every one must be a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_argparse_only_in_the_cli():
    for module, path in MODULES.items():
        if module.startswith("onnx_opscope.cli"):
            continue
        tree = ast.parse(path.read_text())
        names = {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names
        }
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "argparse" not in names | mods, module


def test_the_checker_sees_a_violation():
    """The layer test can fail: a module of a low layer that imported a higher one would be reported."""
    assert _layer("onnx_opscope.graph.index") < _layer("onnx_opscope.run.session")
    fake = _imports(
        "onnx_opscope.graph.fake", PACKAGE / "cli" / "options.py"
    )  # a file full of upward imports
    assert any(_layer(m) > _layer("onnx_opscope.graph.fake") for m in fake)
    # and one walk of the model: the node-id fallback lives in the model index alone
    spelled = [
        m
        for m, p in MODULES.items()
        if 'f"{node.op_type}_{' in p.read_text() or 'f"{n.op_type}_{' in p.read_text()
    ]
    assert spelled == ["onnx_opscope.graph.index"], spelled


def test_public_api_is_complete_and_lazy():
    for name in (
        "analyze",
        "inject",
        "record",
        "read_table",
        "mine",
        "report",
        "parity",
        "fake_quant",
        "skip_blocks",
    ):
        assert name in onnx_opscope.__all__, name
        assert callable(getattr(onnx_opscope, name)), name
    assert onnx_opscope.mine.__module__ == "onnx_opscope.findings.miner"
    with pytest.raises(AttributeError):
        onnx_opscope.no_such_name  # noqa: B018


def test_every_declared_dependency_is_imported():
    """A declared dependency that nothing imports is a defect; sympy is imported by onnxruntime's symbolic
    shape inference, which `shapes.infer_shapes` runs, and ml_dtypes (declared for its version cap) by onnx
    itself (both checked in a fresh process)."""
    import re
    import subprocess
    import sys

    text = (PACKAGE.parent / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    declared = {
        re.match(r"[A-Za-z0-9_.-]+", line.strip().strip('"')).group(0)
        for line in block.splitlines()
        if line.strip().startswith('"')
    }
    imported = set()
    for path in MODULES.values():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                imported.update(a.name.split(".")[0] for a in n.names)
            elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
                imported.add(n.module.split(".")[0])
    indirect = {"sympy", "ml_dtypes"}
    assert declared - imported == indirect, declared - imported
    probe = (
        "import sys, onnx\nfrom onnx import helper, TensorProto as T\n"
        "from onnx_opscope.shapes import infer_shapes\n"
        "g = helper.make_graph([helper.make_node('Relu', ['x'], ['y'])], 'g', "
        "[helper.make_tensor_value_info('x', T.FLOAT, ['n'])], [helper.make_tensor_value_info('y', T.FLOAT, None)])\n"
        "infer_shapes(helper.make_model(g), symbolic=True)\nprint('sympy' in sys.modules, 'ml_dtypes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True True"
