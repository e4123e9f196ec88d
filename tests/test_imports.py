"""The package's import graph, read with ast: no cycles, no reaching into another module's private names, and
dependencies that point one way (cli -> daemon -> model and swarm -> the base modules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "spes_node"
LAYERS = {"cli": 3, "daemon": 2, "model": 1, "swarm": 1}
"""A module may import from its own part, from a lower layer and from the base (layer 0); model and swarm are
side by side and import neither each other."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "_pb2" in path.name:
            continue
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, name: str) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every import outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")[: -node.level + (1 if path.name == "__init__.py" else 0) or None]
                module = ".".join(base + ([module] if module else []))
            out.append((module, [alias.name for alias in node.names], node.lineno))
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for module, names, line in _imports(path, name):
            targets = [module, *(f"{module}.{n}" for n in names)]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target != "spes_node":
                    edges[name].add(target)
            if module.startswith("spes_node") and module != name:
                private += [
                    f"{name}:{line} imports {module}.{n}"
                    for n in names
                    if n.startswith("_") and n != "__version__"
                ]
    return edges, private


def _layer(module: str) -> tuple[str, int]:
    part = module.split(".")[1] if module.count(".") >= 1 else ""
    return part, LAYERS.get(part, 0)


def test_no_import_cycles():
    edges, _ = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_module_imports_another_modules_private_names():
    _, private = _graph()
    assert not private, private


def test_dependencies_point_down():
    edges, _ = _graph()
    wrong = []
    for module, targets in edges.items():
        part, level = _layer(module)
        for target in targets:
            target_part, target_level = _layer(target)
            if target_part == part:
                continue
            if target_level >= level and not (level == 0 and target_level == 0):
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_the_check_sees_a_cycle(tmp_path, monkeypatch):
    # the checks can fail: a package with a cycle and an upward import is caught
    package = tmp_path / "spes_node"
    (package / "model").mkdir(parents=True)
    (package / "cli").mkdir()
    for path, text in {
        "__init__.py": "",
        "model/__init__.py": "",
        "model/a.py": "from spes_node.model import b\nfrom spes_node.cli.c import _hidden\n",
        "model/b.py": "def f():\n    from spes_node.model import a\n",
        "cli/__init__.py": "",
        "cli/c.py": "_hidden = 1\n",
    }.items():
        (package / path).write_text(text)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", package)
    with pytest.raises(AssertionError, match="spes_node.model.a"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="_hidden"):
        test_no_module_imports_another_modules_private_names()
    with pytest.raises(AssertionError, match="spes_node.model.a -> spes_node.cli.c"):
        test_dependencies_point_down()
