"""The import graph points one way: ``sim`` <- ``executor`` <- ``calibrate``, command lines on top.

Every module's imports are read from its source (AST), the ones inside functions included, so a lazy
import counts as much as one at the top. Two rules:

- nothing under ``sim/`` imports torch, ``executor`` or ``calibrate``, except the command-line
  modules (``sim/*cli.py``), which are the composition root that wires the three parts together;
- no import cycle between the project's modules, lazy imports included.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "executor", "calibrate")
FORBIDDEN_IN_SIM = ("torch", "executor", "calibrate")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imported_names(path: pathlib.Path, modules: dict[str, pathlib.Path], top_level: bool = False) -> set[str]:
    """Every module ``path`` imports, anywhere in its body (``top_level``: only when it is imported,
    its body's and its top-level ``if``/``try`` blocks' statements, not those inside functions or
    classes); ``from a import b`` names ``a.b`` when that is a module of the project, else ``a``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in (top_level_statements(tree) if top_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
    return found


def top_level_statements(tree: ast.Module) -> list[ast.stmt]:
    """The statements a module runs when imported: its body's, and its top-level ``if``/``try`` blocks'."""
    todo, found = list(tree.body), []
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", [])
                        + [s for handler in getattr(node, "handlers", []) for s in handler.body])
    return found


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (lazily or not)."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imported_names(path, modules) if m in modules and m != name}
    return graph


def is_composition_root(name: str) -> bool:
    return name.rpartition(".")[2].endswith("cli")


def simulator_violations() -> list[str]:
    modules = project_modules()
    bad = []
    for name, path in modules.items():
        if not name.startswith("sim") or is_composition_root(name):
            continue
        for imported in sorted(imported_names(path, modules)):
            top = imported.partition(".")[0]
            if top in FORBIDDEN_IN_SIM:
                bad.append(f"{name} imports {imported}")
    return bad


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_simulator_imports_neither_torch_nor_the_executor_nor_calibration():
    assert simulator_violations() == []


def test_no_import_cycle_between_project_modules():
    assert find_cycles(import_graph()) == []


def test_layers_point_one_way():
    """The executor never reaches calibration; calibration may use both lower layers."""
    upward = [f"{name} imports {other}" for name, others in import_graph().items()
              if name.startswith("executor") and not is_composition_root(name)
              for other in sorted(others) if other.startswith("calibrate")]
    assert upward == []


# what a rank need not import unless its run is tensor-parallel or shards its optimizer: 0.8 s and 1.6 s
# of a core on top of torch's 2 s, in every rank of every launch (executor.models.loaded_types)
HEAVY_AT_START = ("torch.distributed.tensor", "torch.distributed.optim", "executor.parallel.tensor_parallel",
                  "executor.parallel.tp_styles")


def test_a_rank_starts_without_importing_dtensor_or_zero():
    """Following module-level imports from the worker (what every rank imports at start), none of
    :data:`HEAVY_AT_START` is reached: tensor-parallel and ZeRO code imports them where it runs."""
    modules = project_modules()
    seen, todo, reached = set(), ["executor.launch.worker"], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in imported_names(modules[name], modules, top_level=True):
            if imported.startswith(HEAVY_AT_START):
                reached.append(f"{name} imports {imported}")
            elif imported in modules:
                todo.append(imported)
    assert "executor.runtime.stage" in seen and reached == []


# ----------------------------------------------------------------------------- the checker itself


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path, monkeypatch):
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "__init__.py").write_text("")
    (tmp_path / "sim" / "a.py").write_text("def f():\n    import torch\n    from sim import b\n")
    (tmp_path / "sim" / "b.py").write_text("from .a import f\n")
    (tmp_path / "sim" / "run_cli.py").write_text("def g():\n    from calibrate.x import y\n")
    for package in ("executor", "calibrate"):
        (tmp_path / package).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert simulator_violations() == ["sim.a imports torch"]
    assert find_cycles(import_graph()) == [["sim.a", "sim.b"]]


@pytest.mark.parametrize("name,root", [("sim.plan_cli", True), ("sim.cli", True), ("sim.cli_options", False),
                                       ("sim.planner.max_layers", False)])
def test_composition_roots_are_the_cli_modules(name, root):
    assert is_composition_root(name) is root
