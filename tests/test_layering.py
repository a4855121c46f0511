"""The package's import graph, read from the source (nothing is imported): no cycles, and the library never
imports the recipe (train), the launcher or the entry point (run), so each layer can be read and tested alone."""

from __future__ import annotations

import ast
from pathlib import Path

import lychee_exp

PACKAGE = Path(lychee_exp.__file__).resolve().parent
# the recipe, the launcher (and the rank side it starts) and the entry points above them; everything else is library
TOP = {
    "lychee_exp.train",
    "lychee_exp.launcher",
    "lychee_exp.ranks",
    "lychee_exp.run",
    "lychee_exp.jobs",
    "lychee_exp.bench",
}
FORBIDDEN_TO_LIBRARY = {"lychee_exp.train", "lychee_exp.launcher", "lychee_exp.ranks", "lychee_exp.run"}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules that a file imports anywhere (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from lychee_exp import evaluate` imports the submodule; `from lychee_exp.x import f`, module x
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "lychee_exp":
                found.add(name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert {"lychee_exp.train", "lychee_exp.config", "lychee_exp.sweep.pruning"} <= set(graph)
    assert "lychee_exp.launcher" in graph["lychee_exp.run"] and "lychee_exp.train" in graph["lychee_exp.launcher"]
    assert "lychee_exp.evaluate" in graph["lychee_exp.train"]  # `from lychee_exp import evaluate as ev`


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_library_never_imports_the_recipe_the_launcher_or_the_entry_point():
    wrong = {
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module not in TOP
        for target in targets & FORBIDDEN_TO_LIBRARY
    }
    assert not wrong, sorted(wrong)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The same walk over a made-up package: a cycle hidden in a function-level import is found."""
    pkg = tmp_path / "lychee_exp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "speedup.py").write_text("def calibrate():\n    from lychee_exp.train import run_training\n")
    (pkg / "train.py").write_text("from lychee_exp.speedup import calibrate\n")
    graph = import_graph(pkg)
    assert graph["lychee_exp.speedup"] == {"lychee_exp.train"}
    assert find_cycle(graph) == ["lychee_exp.speedup", "lychee_exp.train", "lychee_exp.speedup"]
