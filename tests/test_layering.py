"""The package's import graph, read from the source (nothing is imported): no cycles, and no module reaches a
higher layer, directly or through others, so each layer can be read and tested alone."""

from __future__ import annotations

import ast
from pathlib import Path

import lychee_exp

PACKAGE = Path(lychee_exp.__file__).resolve().parent
# Lower to higher: a module may import its own layer and lower ones (lychee_exp/__init__.py and each
# subpackage's docstring say the same). The entry points are the top-level modules users run.
LAYERS = ["core", "tracking", "recipe", "launch", "job", "sweep", "entry", "testing", "bench"]
ENTRY_POINTS = {"run", "report", "dashboard", "mine", "rerank", "plan"}
SUBPACKAGE_DOCS = [
    "core",
    "data",
    "ir",
    "tracking",
    "tracking.report",
    "sweep",
    "recipe",
    "launch",
    "job",
    "testing",
    "bench",
]


def layer_of(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    if part in ENTRY_POINTS:
        return LAYERS.index("entry")
    if part in ("assets",):  # data-building scripts and shipped files: library level
        return LAYERS.index("core")
    return LAYERS.index(part)


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


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every module that reaches, directly or through others, a module of a higher layer."""
    return sorted(
        f"{module} reaches {target}"
        for module in graph
        for target in reachable(graph, module)
        if layer_of(target) > layer_of(module)
    )


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert {"lychee_exp.train.trainer", "lychee_exp.config.schema", "lychee_exp.sweep.sweeper"} <= set(graph)
    assert "lychee_exp.tracking.trial" in graph["lychee_exp.train.rank_training"]  # pruning, below the recipe
    assert "lychee_exp.launch.processes" in graph["lychee_exp.sweep.slots"]  # the sweeper starts processes
    assert "lychee_exp.launch.launcher" in reachable(graph, "lychee_exp.run")
    assert "lychee_exp.train.rank_training" in graph["lychee_exp.launch.launcher"]
    assert "lychee_exp.ir.evaluate" in graph["lychee_exp.train.trainer"]  # `from lychee_exp import evaluate`


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_module_reaches_a_higher_layer():
    wrong = upward_imports(import_graph())
    assert not wrong, wrong


def test_at_most_eight_modules_at_the_top_and_every_subpackage_says_what_it_may_import():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    for name in SUBPACKAGE_DOCS:
        doc = (PACKAGE / name.replace(".", "/") / "__init__.py").read_text()
        assert doc.startswith('"""') and ("May import" in doc or "may import" in doc), name


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The same walk over a made-up package: a cycle hidden in a function-level import is found, and a library
    module that reaches the recipe only through another module is caught (a direct-import check would pass)."""
    pkg = tmp_path / "lychee_exp"
    for sub in ("core", "tracking", "recipe"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "speedup.py").write_text("def calibrate():\n    from lychee_exp.timing import clock\n")
    (pkg / "core" / "timing.py").write_text("from lychee_exp.tracking.lines import say\n")
    (pkg / "tracking" / "lines.py").write_text("from lychee_exp.train.train import run\n")
    (pkg / "recipe" / "train.py").write_text("from lychee_exp.speedup import calibrate\n")
    graph = import_graph(pkg)
    assert graph["lychee_exp.speedup"] == {"lychee_exp.timing"}  # no direct upward import
    assert find_cycle(graph) == [
        "lychee_exp.speedup",
        "lychee_exp.timing",
        "lychee_exp.tracking.lines",
        "lychee_exp.train.train",
        "lychee_exp.speedup",
    ]
    wrong = upward_imports(graph)
    assert "lychee_exp.speedup reaches lychee_exp.train.train" in wrong
    assert "lychee_exp.speedup reaches lychee_exp.tracking.lines" in wrong
    assert not any(line.startswith("lychee_exp.train.train reaches") for line in wrong)  # downward is fine
