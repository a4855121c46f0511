"""The package's import graph, read from the source (nothing is imported): packages by concern in one dependency
order, no cycles between modules or between packages, no module reaching a higher package directly or through
others, entry points that never import each other, and a product that never imports the repository's benchmarks,
tools or tests, so each package can be read and tested alone."""

from __future__ import annotations

import ast
from pathlib import Path

import lychee_exp

PACKAGE = Path(lychee_exp.__file__).resolve().parent
# The packages by concern, lower to higher: a module may import its own package and lower ones only
# (lychee_exp/__init__.py and docs/architecture.md say the same). errors and cli are top-level modules: the
# exceptions every package raises, and the helpers the entry points share. The entry points are the top-level
# modules users run; none imports another.
PACKAGES = [
    "assets",  # shipped files (sample data, tiny models): no code
    "errors",
    "io",
    "config",
    "data",
    "model",
    "parallel",
    "ir",
    "tracking",
    "train",
    "launch",
    "job",
    "sweep",
    "cli",
    "entry",
]
ENTRY_POINTS = {"run", "report", "dashboard", "mine", "rerank", "plan"}
# every package (a folder) opens with what it does and what it may import
SUBPACKAGE_DOCS = [p for p in PACKAGES if (PACKAGE / p).is_dir() and p != "assets"] + ["tracking.report"]
# What lives outside the installed package and the product never imports: the repository's benchmarks and tools,
# and the tests with their support modules (the fault injector is named by LYCHEE_STEP_HOOK, never imported)
NOT_PRODUCT = {"benchmarks", "tools", "tests", "conftest", "faults", "equivalence", "baselines"}


def package_of(module: str) -> str:
    part = module.split(".")[1] if "." in module else ""
    return "entry" if part in ENTRY_POINTS else part


def layer_of(module: str) -> int:
    return PACKAGES.index(package_of(module))


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


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to packages (the entry points are one: test_no_entry_point_imports_another)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        own = package_of(module)
        packages.setdefault(own, set()).update(package_of(t) for t in targets if package_of(t) != own)
    return packages


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert {"lychee_exp.train.trainer", "lychee_exp.config.schema", "lychee_exp.sweep.sweeper"} <= set(graph)
    assert "lychee_exp.tracking.trial" in graph["lychee_exp.train.trainer"]  # pruning, below the recipe
    assert "lychee_exp.launch.processes" in graph["lychee_exp.sweep.placement"]  # the sweeper starts processes
    assert "lychee_exp.launch.launcher" in reachable(graph, "lychee_exp.run")
    assert "lychee_exp.train.trainer" in graph["lychee_exp.launch.launcher"]
    assert "lychee_exp.ir.evaluate" in graph["lychee_exp.train.trainer"]  # `from lychee_exp.ir import evaluate`


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_cycle_between_packages():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, " -> ".join(cycle)


def test_no_module_reaches_a_higher_package():
    wrong = upward_imports(import_graph())
    assert not wrong, wrong


def test_every_module_is_in_a_named_package_and_the_old_layers_are_gone():
    graph = import_graph()
    unplaced = sorted(m for m in graph if m != "lychee_exp" and package_of(m) not in PACKAGES)
    assert not unplaced, unplaced
    for gone in ("core", "recipe", "bench", "testing"):
        assert not (PACKAGE / gone).exists(), gone


def test_no_entry_point_imports_another():
    graph = import_graph()
    entries = {f"lychee_exp.{name}" for name in ENTRY_POINTS}
    wrong = sorted(f"{e} reaches {t}" for e in entries for t in reachable(graph, e) if t in entries)
    assert not wrong, wrong


def test_the_product_never_imports_benchmarks_tools_or_tests():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            wrong += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] in NOT_PRODUCT]
    assert not wrong, wrong


def test_autocast_is_entered_in_one_module():
    """Precision has one home (model.precision): its dtype maps, and every autocast region of the product."""
    entered = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "autocast" and getattr(node.value, "id", "") == "torch":
                entered.add(str(path.relative_to(PACKAGE)))
    assert entered == {"model/precision.py"}, entered


def test_only_the_entry_points_and_the_shared_modules_sit_at_the_top_and_every_package_says_what_it_may_import():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == {"__init__", "errors", "cli"} | ENTRY_POINTS, top
    for name in SUBPACKAGE_DOCS:
        doc = (PACKAGE / name.replace(".", "/") / "__init__.py").read_text()
        assert doc.startswith('"""') and ("May import" in doc or "may import" in doc), name


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The same walk over a made-up package: a cycle hidden in a function-level import is found, a module that
    reaches a higher package only through another module is caught (a direct-import check would pass), and a cycle
    between two packages is found even where no two modules import each other."""
    pkg = tmp_path / "lychee_exp"
    for sub in ("data", "tracking", "train", "model"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "speedup.py").write_text("def calibrate():\n    from lychee_exp.data.timing import clock\n")
    (pkg / "data" / "timing.py").write_text("from lychee_exp.tracking.lines import say\n")
    (pkg / "tracking" / "lines.py").write_text("from lychee_exp.train.train import run\n")
    (pkg / "train" / "train.py").write_text("from lychee_exp.data.speedup import calibrate\n")
    (pkg / "model" / "a.py").write_text("from lychee_exp.train.b import x\n")
    (pkg / "train" / "b.py").write_text("x = 1\n")
    (pkg / "train" / "c.py").write_text("from lychee_exp.model.d import y\n")
    (pkg / "model" / "d.py").write_text("y = 1\n")
    graph = import_graph(pkg)
    assert graph["lychee_exp.data.speedup"] == {"lychee_exp.data.timing"}  # no direct upward import
    assert find_cycle(graph) == [
        "lychee_exp.data.speedup",
        "lychee_exp.data.timing",
        "lychee_exp.tracking.lines",
        "lychee_exp.train.train",
        "lychee_exp.data.speedup",
    ]
    wrong = upward_imports(graph)
    assert "lychee_exp.data.speedup reaches lychee_exp.train.train" in wrong
    assert "lychee_exp.data.speedup reaches lychee_exp.tracking.lines" in wrong
    assert "lychee_exp.model.a reaches lychee_exp.train.b" in wrong
    assert not any(line.startswith("lychee_exp.train.train reaches") for line in wrong)  # downward is fine
    # model.a -> train.b and train.c -> model.d: no module cycle, but the packages import each other
    acyclic = {k: v for k, v in graph.items() if not k.startswith(("lychee_exp.data", "lychee_exp.tracking"))}
    acyclic["lychee_exp.train.train"] = set()
    assert find_cycle(acyclic) is None
    assert find_cycle(package_graph(acyclic)) in (["model", "train", "model"], ["train", "model", "train"])


def test_the_wheel_holds_the_product_only():
    """setuptools packages lychee_exp and the Hydra plugins; the repository's benchmarks, tools and tests stay out
    (and no folder of theirs hides inside the package)."""
    import tomllib
    from setuptools import find_namespace_packages

    repo = PACKAGE.parent
    find = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = find_namespace_packages(str(repo), include=find["include"])
    assert shipped and all(p.split(".")[0] in ("lychee_exp", "hydra_plugins") for p in shipped), shipped
    assert {"benchmarks", "tools", "tests"}.isdisjoint(p.split(".")[0] for p in shipped)
    assert not {p for p in shipped if p.split(".")[-1] in ("bench", "testing", "core", "recipe", "tests")}, shipped
