"""The import graph points one way, by directory: ``sim`` <- ``executor`` <- ``calibrate`` <- ``gpipe``.

Every module's imports are read from its source (AST), the ones inside functions included, so a lazy
import counts as much as one at the top. The rules:

- a module imports only from its own package and the ones below it (:data:`LAYERS`): nothing under
  ``sim/`` imports ``executor``, ``calibrate`` or ``gpipe``, nothing under ``executor/`` imports
  ``calibrate`` or ``gpipe``, nothing under ``calibrate/`` imports ``gpipe``; only the commands
  (``gpipe/``, the composition root) wire all three together. What a module is follows from the
  folder it sits in, not from its name;
- nothing under ``sim/`` imports torch, lazily or not;
- the commands live in ``gpipe/``: a module that declares command-line flags (defines
  ``add_arguments(parser)``, the subcommand protocol :mod:`gpipe.main` calls, or builds an
  argparse parser or adds arguments to one) sits nowhere else;
- no import cycle between the project's modules, lazy imports included.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# each package and the packages it may import from (besides itself): lower layers only
LAYERS = {"sim": (), "executor": ("sim",), "calibrate": ("sim", "executor"),
          "gpipe": ("sim", "executor", "calibrate")}
PACKAGES = tuple(LAYERS)
COMMANDS = "gpipe"
FORBIDDEN_IN_SIM = ("torch",)
# what declaring command-line flags looks like: the subcommand protocol, or argparse's parser calls
FLAG_FUNCTIONS = ("add_arguments",)
FLAG_CALLS = ("ArgumentParser", "add_argument", "add_argument_group", "add_mutually_exclusive_group",
              "add_parser", "add_subparsers")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def package_of(name: str) -> str:
    """The top folder a module sits in: its layer."""
    return name.partition(".")[0]


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


def layer_violations() -> list[str]:
    """Each import that points up or across (``module imports other``), and torch imported under sim/."""
    modules = project_modules()
    bad = []
    for name, path in modules.items():
        own = package_of(name)
        for imported in sorted(imported_names(path, modules)):
            top = package_of(imported)
            if (top in LAYERS and top != own and top not in LAYERS[own]) or (own == "sim" and top in FORBIDDEN_IN_SIM):
                bad.append(f"{name} imports {imported}")
    return bad


def declares_flags(path: pathlib.Path) -> bool:
    """Whether the module defines ``add_arguments`` at its top or calls argparse's parser builders."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if any(isinstance(node, ast.FunctionDef) and node.name in FLAG_FUNCTIONS for node in tree.body):
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in FLAG_CALLS:
                return True
    return False


def commands_outside_the_commands_package() -> list[str]:
    return [name for name, path in project_modules().items()
            if package_of(name) != COMMANDS and declares_flags(path)]


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


def test_layers_point_one_way_and_the_simulator_imports_no_torch():
    assert layer_violations() == []


def test_the_commands_live_in_the_commands_package():
    assert commands_outside_the_commands_package() == []


def test_every_subcommand_is_a_module_of_the_commands_package():
    from gpipe.main import SUBCOMMANDS

    modules = project_modules()
    for name, (module, _) in SUBCOMMANDS.items():
        assert package_of(module) == COMMANDS and module in modules, (name, module)
        assert declares_flags(modules[module]), module


def test_no_import_cycle_between_project_modules():
    assert find_cycles(import_graph()) == []


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


def plant(root: pathlib.Path, files: dict[str, str]) -> None:
    """A tree of the four packages under ``root``, with ``files`` (path -> source) in it."""
    for package in PACKAGES:
        (root / package).mkdir(exist_ok=True)
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path, monkeypatch):
    plant(tmp_path, {"sim/__init__.py": "",
                     "sim/a.py": "def f():\n    import torch\n    from sim import b\n",
                     "sim/b.py": "from .a import f\n"})
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert layer_violations() == ["sim.a imports torch"]
    assert find_cycles(import_graph()) == [["sim.a", "sim.b"]]


def test_the_checker_refuses_an_import_up_the_layers_by_directory(tmp_path, monkeypatch):
    """A planted import from sim/ into executor/ fails, lazy and deep in a room; so does calibrate
    reaching the commands, and a module named like the old command modules (``*cli``) outside
    gpipe/ is no exception. The commands importing all three is the one way across."""
    plant(tmp_path, {"sim/engine/step.py": "def f():\n    from executor.runtime import stage\n",
                     "sim/run_cli.py": "from calibrate.fit import x\n",
                     "executor/runtime/stage.py": "import sim.engine.step\n",
                     "executor/launch.py": "from calibrate.fit import x\n",
                     "calibrate/fit/x.py": "import executor.runtime.stage\nfrom gpipe import main\n",
                     "gpipe/main.py": "import sim.engine.step, executor.runtime.stage, calibrate.fit.x\n"})
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert layer_violations() == ["sim.engine.step imports executor.runtime.stage",
                                  "sim.run_cli imports calibrate.fit.x",
                                  "executor.launch imports calibrate.fit.x",
                                  "calibrate.fit.x imports gpipe.main"]


def test_the_checker_refuses_a_command_outside_the_commands_package(tmp_path, monkeypatch):
    """A module defining the subcommand protocol, or adding flags to a parser, is a command and must
    sit in gpipe/; reading a parsed namespace (as the launcher does) is not declaring flags."""
    plant(tmp_path, {"sim/planner/plan_cli.py":
                         "def add_arguments(parser):\n    pass\n\n\ndef run(args):\n    return 0\n",
                     "executor/launch/flags.py": "def options(group):\n    group.add_argument('--nodes')\n",
                     "calibrate/fit/x.py": "import argparse\n\n\ndef f(args: argparse.Namespace):\n    return args\n",
                     "gpipe/plan.py": "def add_arguments(parser):\n    parser.add_argument('--top')\n"})
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert commands_outside_the_commands_package() == ["sim.planner.plan_cli", "executor.launch.flags"]
